"""verl adapter: `linear_cross_entropy` with the signature and contract of verl's
`verl.utils.kernel.linear_cross_entropy` (verl 0.9.1), computed by areal_lce's fused op; and
`linear_topk_log_probs`, the signature of verl's fused top-k distillation op (PR #7809, not in a release).

    from areal_lce.integrations import verl as lce_verl
    lce_verl.apply()            # verl's Megatron fused forward now calls areal_lce
    # or by hand, the one-line patch:
    # verl.models.mcore.model_forward_fused.linear_cross_entropy = lce_verl.linear_cross_entropy

verl's contract, as its Megatron fused forward uses it (`fused_output_processor` on megatron-core
>= 0.18, the patched `GPTModel.forward` before; its transformers models call it the same way, unsharded):
  hidden [T, 1, H] (or [N, H], [B, S, H]): the FULL sequence of this TP rank — verl gathers the sequence-
      parallel shards itself (`gather_from_sequence_parallel_region`) before the call; under context
      parallelism, this CP rank's tokens.
  weight [V/tp, H]: this rank's vocab shard (vocabulary padding rows are part of the softmax, as in verl).
  labels: global token ids in hidden's leading shape, size-1 dimensions aside ([1, T] for [T, 1, H] on the
      THD path, [B, S] for [B, S, H] in the transformers models): another layout of the same count
      ([S, B] for [B, S, H]) is refused, as it would pair labels with the wrong rows. No ignore_index:
      a negative label (-100 included) is refused like an id >= vocab (see `check_labels` below).
  temperature: float; logits are h·Wᵀ / temperature.
  reduction: "none" -> per-token logprobs [T]; "sum" / "mean" -> their sum / mean over tokens (scalar).
  dist_process_group: the TP group (None: unsharded weight).
Returns (logprobs, entropy), fp32, flat [T] (logprobs a scalar under "sum"/"mean"); both differentiable.
d_hidden is this rank's vocab-partial gradient, NOT reduced over TP: the backward of verl's SP gather
(a reduce-scatter) reduces it. verl forces sequence parallel when TP > 1; TP > 1 without it leaves
d_hidden partial here exactly as verl's kernel does. d_weight is this rank's shard gradient, in the
weight's dtype (verl's kernel returns the hidden's dtype; in verl the two are the same).

check_labels (this adapter's option, passed to the op): True (default) checks label values at the call on
CPU tensors ("sync": ValueError) and, on accelerators, without a host sync ("deferred": the bad token's
logprob is NaN and only `areal_lce.check_deferred()` raises, which verl does not call); "sync" raises at
the call on every device (one host sync per call); False checks nothing.
invariant, logits_precision (passed to the op, which validates them; docs/op.md "Consistency"): None
(the backend's default) / True / False: each token's outputs bitwise independent of the rest of the call
and of the TP degree; "fp32" (default: fp32 logits, as an fp32-head rollout engine computes them) or
"bf16" (each logit rounded to bf16 before the temperature, as a bf16-head engine: vLLM's and SGLang's
defaults).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..op import comms
from ..op.api import linear_logprobs_entropy
from ..op.types import VocabParallel
from ._common import (NO_IGNORE_INDEX, check_no_negative_labels, check_op_options, consistency_options, op_value,
                      patch, restore, token_rows)

_NAME = "areal_lce.integrations.verl.linear_cross_entropy"
# Where verl 0.9.1 looks `linear_cross_entropy` up at call time: the Megatron fused forward (its
# output_processor and legacy forward paths) and the 1F1B-overlap forward bind it at import; the
# transformers (FSDP) models import it from its defining module inside their triton-backend forward.
PATCH_TARGETS = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap",
                 "verl.utils.kernel.linear_cross_entropy")
_OPTIONAL_TARGETS = ("verl.models.mcore.model_forward_1f1b_overlap",)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: Optional[float] = 1.0,
    reduction: Optional[str] = "none",
    dist_process_group=None,
    *,
    check_labels=True,
    invariant: Optional[bool] = None,
    logits_precision: str = "fp32",
    **op_options,
):
    """verl's `linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`
    -> (logprobs, entropy); contract and the keyword options in the module docstring. `op_options` go to
    `areal_lce.linear_logprobs_entropy` (backend, cache_bytes, compact_ignored)."""
    check_op_options(op_options, _NAME)
    consistency = consistency_options(invariant, logits_precision, _NAME)
    opts = op_value(op_options, _NAME, temperature)
    if not isinstance(reduction, str) or reduction.lower() not in ("none", "sum", "mean"):
        raise ValueError(f"{_NAME}: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    h2, y = token_rows(hidden, labels, _NAME)
    check_no_negative_labels(y, check_labels, comms.group_size(dist_process_group), _NAME)
    if h2.dtype != weight.dtype:  # e.g. an fp32 residual stream: compute in the weight's dtype
        h2 = h2.to(weight.dtype)
    # verl's SP gather (or, without SP, its caller) reduces d_hidden: the op leaves it vocab-partial
    vp = VocabParallel(dist_process_group, d_hidden="caller")
    out = linear_logprobs_entropy(h2, weight, y, opts, vocab_parallel=vp, ignore_index=NO_IGNORE_INDEX,
                                  check_labels=check_labels, **consistency)
    logprobs = out.logprobs
    if reduction.lower() == "sum":
        logprobs = logprobs.sum()
    elif reduction.lower() == "mean":
        logprobs = logprobs.mean()
    return logprobs, out.entropy


_TOPK_NAME = "areal_lce.integrations.verl.linear_topk_log_probs"


def linear_topk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    temperature: float = 1.0,
    dist_process_group=None,
    chunk_size: Optional[int] = None,
    *,
    check_labels=True,
    invariant: Optional[bool] = None,
    logits_precision: str = "fp32",
    **op_options,
) -> torch.Tensor:
    """The signature and contract of verl's fused top-k distillation op (`linear_topk_log_probs` of
    verl/utils/kernel/linear_topk_log_probs.py, verl PR #7809, read at commit c8bb9d4): fp32 student
    logprobs at the teacher's ids, normalised over the whole (TP-sharded) vocabulary, shaped like topk_ids.

    hidden [..., H] (the full sequence of this TP rank), weight [V/tp, H] (this rank's shard; every row is
    part of the softmax, as there), topk_ids [..., K] global ids in [0, V) (checked like labels: see
    `linear_cross_entropy`), temperature a float > 0, dist_process_group the TP group or None. d_hidden is
    left vocab-partial for the caller's TP mapping to reduce, as verl's op does. chunk_size (the token chunk
    of verl's non-Triton fallback) is accepted and unused: nothing here is chunked by rows. Computed by
    `linear_logprobs_entropy(selected_ids=...)`: the logsumexp is the op's (batch / TP invariant in
    invariant mode), the selected logits a fixed-order dot product per id."""
    check_op_options(op_options, _TOPK_NAME)
    consistency = consistency_options(invariant, logits_precision, _TOPK_NAME)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"{_TOPK_NAME}: chunk_size must be None or a positive int, got {chunk_size!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{_TOPK_NAME}: temperature must be a float, got {type(temperature).__name__}")
    opts = op_value(op_options, _TOPK_NAME, temperature)
    if not torch.is_tensor(topk_ids) or topk_ids.dim() < 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{_TOPK_NAME}: topk_ids must be an int32 / int64 tensor [..., K], got "
                        f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
    if not torch.is_tensor(hidden) or hidden.dim() < 2 or hidden.shape[:-1].numel() != topk_ids.shape[:-1].numel():
        raise ValueError(f"{_TOPK_NAME}: hidden [..., H] and topk_ids [..., K] must cover the same tokens, got "
                         f"{tuple(getattr(hidden, 'shape', ()))} and {tuple(topk_ids.shape)}")
    ids = topk_ids.reshape(-1, topk_ids.shape[-1]).to(torch.int64)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if h2.dtype != weight.dtype:
        h2 = h2.to(weight.dtype)
    check_no_negative_labels(ids.reshape(-1), check_labels, comms.group_size(dist_process_group), _TOPK_NAME)
    vp = VocabParallel(dist_process_group, d_hidden="caller")
    out = linear_logprobs_entropy(h2, weight, ids[:, 0], opts, vocab_parallel=vp,
                                  ignore_index=NO_IGNORE_INDEX, check_labels=check_labels, selected_ids=ids,
                                  **consistency)
    return out.selected_logprobs.view(topk_ids.shape)


def apply(**op_options) -> list:
    """Make verl's fused forwards call `linear_cross_entropy` above (with `op_options`): every name in
    PATCH_TARGETS. Returns the patched names; `remove()` undoes it. Needs verl importable (megatron-core,
    ray, ...), and must run in the processes that run the model (verl's Ray workers)."""
    check_op_options(op_options, _NAME)
    fn = linear_cross_entropy
    if op_options:
        def fn(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
            return linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group,
                                        **op_options)
    patched = []
    for name in PATCH_TARGETS:
        try:
            patched.append(patch(name, "linear_cross_entropy", fn))
        except ModuleNotFoundError as e:
            if name not in _OPTIONAL_TARGETS or e.name != name:  # a missing dependency is an error
                raise
    return patched


def remove() -> list:
    """Restore verl's own kernels where `apply()` replaced them; returns the restored names."""
    return [f"{name}.linear_cross_entropy" for name in PATCH_TARGETS if restore(name, "linear_cross_entropy")]
