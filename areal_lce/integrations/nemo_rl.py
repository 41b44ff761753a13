"""NeMo-RL adapter: `from_parallel_hidden_states_to_logprobs` with the signature and contract of NeMo-RL's
`nemo_rl.distributed.model_utils.from_parallel_hidden_states_to_logprobs` (its fused linear-logprobs path,
`policy.megatron_cfg.use_fused_linear_logprobs: true`), computed by areal_lce's fused op.

    from areal_lce.integrations import nemo_rl as lce_nemo
    lce_nemo.apply()                                         # NeMo-RL's semantics (below)
    lce_nemo.apply(vocab_size=151936, logits_precision="fp32")  # exact mode: true vocabulary, fp32 logits

NeMo-RL's patched `GPTModel.forward` looks the function up as a module global at call time, so `apply()`
(run in every policy worker, after NeMo-RL is imported) replaces it there; `remove()` puts NeMo-RL's back.

NeMo-RL's contract (snapshot 7ea279a), kept here:
  tensor_parallel_hidden_states [S/tp, B, H]: this rank's sequence-parallel shard (the function all-gathers
      it over `tp_group` when tp > 1, so tp > 1 means sequence parallel); [S, B, H] at tp = 1.
  output_weight_layer [V/tp, H]: this rank's vocab shard, owning global ids [vocab_start_index,
      vocab_end_index) (refused if the range is not rank·V/tp .. (rank+1)·V/tp: another layout).
  target [B, S]: global token ids (the input ids); rolled by -1 inside, the last position dropped.
  runtime_gather_output, chunk_size: unused (as in NeMo-RL for the first; the op never materialises logits).
  inference_only: no autograd graph (NeMo-RL saves nothing for backward then).
  Returns fp32 logprobs [B, S-1]. Gradients: d_hidden is this rank's sequence shard of the full
  gradient (reduced over TP: NeMo-RL's reduce-scatter), d_weight this rank's shard gradient.

Semantics. Default (NeMo-RL's own): the softmax runs over every column of the shard — megatron's vocabulary
padding included, as NeMo-RL's signature carries no vocabulary size — and the logits are the GEMM's output
in the input dtype (bf16 for a bf16 model) before the fp32 softmax: `logits_precision="bf16"` for bf16
inputs, "fp32" for fp32 inputs. fp16 inputs are refused unless logits_precision is given (the op has no
fp16 rounding). Exact mode: `vocab_size=` the true vocabulary (the HF config's `vocab_size`, what vLLM and
SGLang normalise over; not the tokenizer's size; padding rows out of the softmax) and `logits_precision="fp32"`.
Tolerance against NeMo-RL's own function (tests/integrations/zero_mismatch_worker.py `bounds`, relative to max(1, |ref|)):
logprobs 1e-5 for fp32 inputs (fp32 reductions in another order) and 2⁻⁷ for bf16 (both round the same
logits, and may round one differently at a tie); gradients 1e-4 (fp32), and for bf16 2⁻⁸ per rounding on
either side (NeMo-RL rounds d_weight to the weight's dtype once per chunk, the op once). Exact mode against
an fp64 reference of the true-vocabulary softmax: the same bounds.
Labels: NO ignore_index (as NeMo-RL); check_labels=True raises at the call on CPU and, on GPUs, makes a bad
token's logprob NaN without a host sync ("deferred": only areal_lce.check_deferred() raises).

Differences, refused or stated:
  - context parallelism (cp_group of > 1 rank): refused, as NeMo-RL refuses it (its config check and assert):
    its signature has no cu_seqlens or CP layout to undo. Packed sequences: NeMo-RL's config refuses them with
    the fused path; this drop-in would treat a packed [1, T] row as one sequence (targets rolled across
    sequence boundaries, as NeMo-RL's own function does). Both go through the second seam,
    `areal_lce.integrations.nemo_rl_packed` (NeMo-RL's packed signature with cu_seqlens and cp_group), which
    `areal_lce.integrations.nemo_rl_worker.apply()` wires into NeMo-RL's Megatron worker.
  - a target outside [0, tp·V/tp): NeMo-RL silently scores 0; here it is a bad label (`check_labels`).
  - tp_group=None: unsharded weight (NeMo-RL would use the default world group).
Entropy: `from_parallel_hidden_states_to_logprobs_and_entropy` (same arguments) returns (logprobs, entropy),
both [B, S-1] and differentiable, for a loss of one's own; NeMo-RL's forward does not ask for it.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..op import comms
from ..op.api import linear_logprobs_entropy
from ..op.types import VocabParallel
from ._common import (NO_IGNORE_INDEX, check_no_negative_labels, check_op_options, consistency_options, op_value,
                      patch, restore)

_NAME = "areal_lce.integrations.nemo_rl.from_parallel_hidden_states_to_logprobs"
PATCH_TARGET = ("nemo_rl.distributed.model_utils", "from_parallel_hidden_states_to_logprobs")


def default_precision(dtype: torch.dtype, logits_precision: Optional[str], adapter: str = _NAME) -> str:
    """NeMo-RL's logits precision for inputs of `dtype` (the GEMM's output dtype) unless given."""
    if logits_precision is not None:
        return logits_precision
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype in (torch.float32, torch.float64):
        return "fp32"
    raise TypeError(f"{adapter}: the framework rounds the logits to {dtype} for {dtype} inputs and the op has no such "
                    "rounding: pass logits_precision='fp32' (exact logits) or run the model in bf16")


def check_vocab_range(weight, vocab_start_index: int, vocab_end_index: int, tp_group, adapter: str) -> None:
    """NeMo-RL's [V/tp, H] weight shard and its vocab range must be megatron's equal split (the op's layout)."""
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"{adapter}: output_weight_layer must be [V/tp, H], got {tuple(getattr(weight, 'shape', ()))}")
    v_shard, rank = weight.shape[0], comms.group_rank(tp_group)
    if (vocab_start_index, vocab_end_index) != (rank * v_shard, (rank + 1) * v_shard):
        raise ValueError(f"{adapter}: vocab range [{vocab_start_index}, {vocab_end_index}) on tp rank {rank} is not "
                         f"this rank's equal shard [{rank * v_shard}, {(rank + 1) * v_shard}) of the "
                         f"{v_shard}-row weight: the op shards the vocabulary as megatron does (pad the "
                         "vocabulary to a multiple of tp)")


def _run(hidden, weight, target, vocab_start_index, vocab_end_index, tp_group, inference_only, cp_group,
         vocab_size, logits_precision, invariant, check_labels, op_options, temperature=1.0):
    """The op's LCEOutput for NeMo-RL's arguments, [S, B] per output (positions in the sequence order)."""
    check_op_options(op_options, _NAME)
    cp = comms.checked_group_size(cp_group, f"{_NAME}: cp_group")
    if cp > 1:
        raise NotImplementedError(f"{_NAME}: context parallelism (cp_group of {cp} ranks) "
                                  "is not supported by NeMo-RL's fused linear-logprobs seam: its signature has no "
                                  "CP layout or cu_seqlens to undo the load-balanced split (NeMo-RL asserts the same); "
                                  "use areal_lce.integrations.nemo_rl_packed, which takes cu_seqlens_padded and cp_group")
    if not torch.is_tensor(hidden) or hidden.dim() != 3:
        raise ValueError(f"{_NAME}: tensor_parallel_hidden_states must be [S/tp, B, H], got "
                         f"{tuple(getattr(hidden, 'shape', ()))}")
    tp = comms.checked_group_size(tp_group, f"{_NAME}: tp_group")
    if not torch.is_tensor(target) or target.dim() != 2:
        raise ValueError(f"{_NAME}: target must be [B, S] token ids, got {tuple(getattr(target, 'shape', ()))}")
    if tuple(target.shape) != (hidden.shape[1], hidden.shape[0] * tp):
        raise ValueError(f"{_NAME}: target {tuple(target.shape)} must be [B, S] = [{hidden.shape[1]}, "
                         f"{hidden.shape[0]} × tp {tp}] for hidden {tuple(hidden.shape)} (the sequence-parallel "
                         "shard [S/tp, B, H] at tp > 1)")
    check_vocab_range(weight, vocab_start_index, vocab_end_index, tp_group, _NAME)
    opts = op_value(op_options, _NAME, temperature)
    consistency = consistency_options(invariant, default_precision(hidden.dtype, logits_precision), _NAME)
    labels = target.roll(shifts=-1, dims=-1).t().contiguous()  # [S, B]: hidden's row order
    check_no_negative_labels(labels, check_labels, tp, _NAME)
    vp = VocabParallel(tp_group, d_hidden="reduce_scatter" if tp > 1 else "all_reduce")
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        return linear_logprobs_entropy(hidden, weight, labels, opts, vocab_parallel=vp, vocab_size=vocab_size,
                                       ignore_index=NO_IGNORE_INDEX, check_labels=check_labels,
                                       **consistency)


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: bool,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    inference_only: bool = False,
    cp_group=None,
    chunk_size: Optional[int] = None,
    *,
    vocab_size: Optional[int] = None,
    logits_precision: Optional[str] = None,
    invariant: Optional[bool] = None,
    check_labels=True,
    **op_options,
) -> torch.Tensor:
    """NeMo-RL's function -> fp32 logprobs [B, S-1]; contract, semantics and options in the module docstring.
    `op_options` go to `areal_lce.linear_logprobs_entropy` (backend, cache_bytes, compact_ignored)."""
    out = _run(tensor_parallel_hidden_states, output_weight_layer, target, vocab_start_index, vocab_end_index,
               tp_group, inference_only, cp_group, vocab_size, logits_precision, invariant, check_labels, op_options)
    return out.logprobs.t()[:, :-1]


def from_parallel_hidden_states_to_logprobs_and_entropy(
    tensor_parallel_hidden_states, output_weight_layer, runtime_gather_output, target, vocab_start_index,
    vocab_end_index, tp_group, inference_only=False, cp_group=None, chunk_size=None, *, vocab_size=None,
    logits_precision=None, invariant=None, check_labels=True, **op_options,
):
    """The same call -> (logprobs, entropy), fp32 [B, S-1] each, both differentiable: entropy[b, s] is the
    entropy of the next-token distribution at position s, over the same softmax as the logprobs (padding
    columns included unless vocab_size is given)."""
    out = _run(tensor_parallel_hidden_states, output_weight_layer, target, vocab_start_index, vocab_end_index,
               tp_group, inference_only, cp_group, vocab_size, logits_precision, invariant, check_labels, op_options)
    return out.logprobs.t()[:, :-1], out.entropy.t()[:, :-1]


def from_parallel_hidden_states_to_logprobs_at_temperature(
    temperature: float, tensor_parallel_hidden_states, output_weight_layer, runtime_gather_output, target,
    vocab_start_index, vocab_end_index, tp_group, inference_only=False, cp_group=None, chunk_size=None, *,
    vocab_size=None, logits_precision=None, invariant=None, check_labels=True, **op_options,
) -> torch.Tensor:
    """The same call with the logits divided by `temperature` before the softmax, as NeMo-RL's
    `apply_temperature_scaling` divides them on its logits route (its signature has no temperature: its own
    fused route divides the returned logprobs instead; areal_lce.integrations.nemo_rl_worker calls this)."""
    out = _run(tensor_parallel_hidden_states, output_weight_layer, target, vocab_start_index, vocab_end_index,
               tp_group, inference_only, cp_group, vocab_size, logits_precision, invariant, check_labels, op_options,
               temperature)
    return out.logprobs.t()[:, :-1]


def apply(*, vocab_size: Optional[int] = None, logits_precision: Optional[str] = None,
          invariant: Optional[bool] = None, check_labels=True, **op_options) -> list:
    """Make NeMo-RL's fused forward call `from_parallel_hidden_states_to_logprobs` above with these options.
    Returns the patched name; `remove()` undoes it. Needs nemo_rl importable; run it in every policy worker
    (NeMo-RL's Ray actors) before the first step."""
    check_op_options(op_options, _NAME)
    consistency_options(invariant, logits_precision or "fp32", _NAME)
    options = dict(vocab_size=vocab_size, logits_precision=logits_precision, invariant=invariant,
                   check_labels=check_labels, **op_options)

    def fn(tensor_parallel_hidden_states, output_weight_layer, runtime_gather_output, target, vocab_start_index,
           vocab_end_index, tp_group, inference_only=False, cp_group=None, chunk_size=None):
        return from_parallel_hidden_states_to_logprobs(
            tensor_parallel_hidden_states, output_weight_layer, runtime_gather_output, target, vocab_start_index,
            vocab_end_index, tp_group, inference_only, cp_group, chunk_size, **options)
    return [patch(*PATCH_TARGET, fn)]


def remove() -> list:
    """Restore NeMo-RL's own function where `apply()` replaced it; returns the restored name."""
    return [".".join(PATCH_TARGET)] if restore(*PATCH_TARGET) else []
