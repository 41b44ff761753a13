"""areal_lce: fused linear logprobs + entropy for LLM training with Megatron-LM.

    from areal_lce import linear_logprobs_entropy
    out = linear_logprobs_entropy(hidden, lm_head_weight, labels, temperature=1.0, return_stats=True)
    out = linear_logprobs_entropy(hidden, lm_head_weight, labels, LCEOptions(backend="torch", top_k=4))
    out.logprobs, out.entropy, out.max_logit, out.min_logit, out.lse
    # tensor parallel: weight is this rank's vocab shard; VocabParallel says who reduces d_hidden
    out = linear_logprobs_entropy(hidden, weight_shard, labels, vocab_parallel=VocabParallel(tp_group))
    areal_lce.check_deferred()   # raise on bad labels seen by deferred (accelerator default) checks
"""
from .op import (LCEOptions, LCEOutput, LCEParams, VocabParallel, check_deferred, linear_logprobs_entropy,
                 logprobs_entropy_from_logits)

__version__ = "0.2.0"
__all__ = ["linear_logprobs_entropy", "check_deferred", "logprobs_entropy_from_logits", "LCEOptions", "LCEOutput",
           "LCEParams", "VocabParallel", "__version__"]
