"""The fused op: per-token logprobs, entropy and statistics of softmax(hidden · weightᵀ / T) without the
logits (docs/op.md), and its materialised counterparts. docs/architecture.md draws the path of a call.

    api          the front end: validate once, resolve the backend once, call the custom op
    library      the torch.library custom ops (forward, backward) every call runs through
    function     the op's forward and backward: row partition, one backend call per pass, collectives
    main_grad    the weight gradient added in fp32 into Megatron's main_grad
    select, select_grad   logprobs at selected ids and the top-k
    exact        the invariant mode's segment fold and bitwise-portable exp2 / log
    checks       label / temperature checks, sync and deferred
    comms        the op's collectives, named in their errors
    materialised, materialised_lean   the routes that take logits (the lean one: one fp32 copy)
    reference    the fp64 materialised oracle
    options      LCEOptions: the op's options, declared once (fields, defaults, checks, help)
    types        VocabParallel, LCEParams, LCEOutput
    backends     the kernels: triton, triton_ascend, torch, reference (backends/base.py: the contract)
"""
from .api import linear_logprobs_entropy
from .checks import check_deferred
from .materialised import logprobs_entropy_from_logits
from .options import LCEOptions
from .types import LCEOutput, LCEParams, VocabParallel

__all__ = ["linear_logprobs_entropy", "check_deferred", "logprobs_entropy_from_logits", "LCEOptions", "LCEOutput",
           "LCEParams", "VocabParallel"]
