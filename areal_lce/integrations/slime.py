"""slime adapter: the fused form of slime's `slime.utils.ppo_utils.calculate_log_probs_and_entropy`
(snapshot 624b824), computed by areal_lce's fused op from the hidden states and the LM-head weight shard
instead of the [T, V/tp] fp32 logits.

    from areal_lce.integrations.slime import calculate_log_probs_and_entropy
    log_prob, entropy = calculate_log_probs_and_entropy(hidden, weight, tokens, tp_group,
                                                        with_entropy=True, temperature=args.rollout_temperature)

is, outputs and gradients, slime's
    logits = (hidden @ weight.T).float() / temperature
    log_prob, entropy = slime.utils.ppo_utils.calculate_log_probs_and_entropy(logits, tokens, tp_group,
                                                                              with_entropy=True)
  hidden [T, H] (or [T, 1, H]): the full sequence, the same on every rank of tp_group; with
      sequence_parallel=True this rank's sequence shard [T/tp, H] instead (rank order; tokens stay [T]),
      all-gathered inside, its gradient reduce-scattered back (this rank's shard of the full gradient).
  weight [V/tp, H]: this rank's vocab shard, rank r owning global ids [r·V/tp, (r+1)·V/tp) (slime's layout).
  tokens [T]: global target ids.
  tp_group: the tensor-parallel group (None: an unsharded weight; slime would use the default group).
  Returns (log_prob [T, 1], entropy [T] or None), fp32; for T = 0, (an empty [0] tensor, [0] or None), as
  slime. entropy is differentiable only with with_entropy_grad=True (slime marks it non-differentiable
  otherwise). d_hidden is the full gradient on every rank (reduced over tp_group inside the op: slime's
  logits gradient is vocab-partial and its caller's mapping reduces it), d_weight this rank's shard.

Semantics. Default (slime's for a bf16 model): the softmax over every column of the shard (megatron's
vocabulary padding included) of logits that come out of the GEMM in the input dtype: logits_precision="bf16"
for bf16 inputs, "fp32" for fp32 inputs (fp16 inputs need an explicit logits_precision). Exact mode:
`vocab_size=` the true vocabulary (the HF config's `vocab_size`, what vLLM and SGLang normalise over; not the
tokenizer's size) and `logits_precision="fp32"`. invariant and check_labels go to the op.
Refused: `log_prob_keep_mask` (slime's top-p replay, `--rollout-top-p != 1`): it is a [T, V/tp] mask, the
very size the fused op avoids; a token outside [0, tp·V/tp) (slime scores -lse for it silently).

The log-prob step: `log_probs_step(loss_module, weight_fn)` is slime's `get_log_probs_and_entropy` on the
last stage's hidden states instead of its logits, built on slime's own token shift and per-sample slicing
(zigzag or all-gather CP, as slime); `apply(weight_fn)` puts it in place of slime's in the loss module and
the actor. `hidden_states_provider(provider)` wraps a model provider so that the last stage returns its
final hidden states in place of the logits, and `output_weight()` is that stage's LM-head weight shard.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..op import comms
from .. import patching
from ..op.api import linear_logprobs_entropy
from ..op.types import VocabParallel
from ._common import (BLOCK_OPTIONS, NO_IGNORE_INDEX, check_no_negative_labels, check_op_options,
                      consistency_options, op_value, patch_all, restore_all, token_rows)
from .nemo_rl import default_precision

_NAME = "areal_lce.integrations.slime.calculate_log_probs_and_entropy"
_STEP = "areal_lce.integrations.slime.log_probs_step"
LOSS_MODULE = "slime.backends.megatron_utils.loss"
# slime's loss module looks the step up as a global in policy_loss_function; the actor imported its own name
# for compute_log_prob (forward_only). Both are replaced.
STEP_TARGETS = (LOSS_MODULE, "slime.backends.megatron_utils.actor")
_LAST_STAGE: list = []  # the GPTModel built by hidden_states_provider on this process's last pipeline stage
_OUTPUT_LAYERS: list = []  # areal_lce.patching handles of the output layers hidden_states_provider changed


def calculate_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    temperature: float = 1.0,
    with_entropy_grad: bool = True,
    *,
    vocab_size: Optional[int] = None,
    logits_precision: Optional[str] = None,
    invariant: Optional[bool] = None,
    check_labels=True,
    log_prob_keep_mask=None,
    sequence_parallel: bool = False,
    **op_options,
):
    """slime's `calculate_log_probs_and_entropy` on `(hidden @ weight.T).float() / temperature` -> (log_prob
    [T, 1], entropy [T] or None); contract in the module docstring. `op_options` go to
    `areal_lce.linear_logprobs_entropy` (backend, cache_bytes, compact_ignored)."""
    check_op_options(op_options, _NAME)
    if log_prob_keep_mask is not None:
        raise NotImplementedError(f"{_NAME}: log_prob_keep_mask (slime's top-p replay, --rollout-top-p != 1) is a "
                                  "[T, V/tp] mask over the logits, the tensor the fused op never builds; run "
                                  "slime's own calculate_log_probs_and_entropy for top-p replay")
    opts = op_value(op_options, _NAME, temperature)
    tp = comms.checked_group_size(tp_group, f"{_NAME}: tp_group")
    h2, y = token_rows(hidden, tokens, _NAME, seq_factor=tp if sequence_parallel else 1)
    if y.numel() == 0:  # slime returns [0] tensors (no [T, 1]) and runs no collective
        empty = h2.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    consistency = consistency_options(invariant, default_precision(h2.dtype, logits_precision, _NAME), _NAME)
    check_no_negative_labels(y, check_labels, tp, _NAME)
    vp = VocabParallel(tp_group, d_hidden="reduce_scatter" if sequence_parallel else "all_reduce")
    out = linear_logprobs_entropy(h2, weight, y, opts, vocab_parallel=vp,
                                  vocab_size=vocab_size, ignore_index=NO_IGNORE_INDEX, check_labels=check_labels,
                                  **consistency)
    entropy = None
    if with_entropy:
        entropy = out.entropy if with_entropy_grad else out.entropy.detach()
    return out.logprobs.unsqueeze(-1), entropy


def log_probs_step(loss_module, weight_fn, *, sequence_parallel: bool = False, **options):
    """slime's `get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
    with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None)`, taking the last
    stage's hidden states [T, 1, H] or [1, T, H] (with sequence_parallel: this rank's [T/tp, 1, H] shard) in
    place of the logits and `weight_fn()` (the LM-head weight shard at call time) for the head. Returns
    slime's `(empty, {"log_probs": [R_i], "entropy": [R_i]})`: shifted tokens, per-sample slicing and the
    all-gather-CP redistribution are slime's own helpers in `loss_module`; the temperature is
    args.rollout_temperature; the entropy carries gradient only when args.entropy_coef != 0, as in slime.
    `options`: the building block's (vocab_size, logits_precision, invariant, check_labels) and the op's
    tuning options. Refused: top-p replay (top_p_token_ids: a [T, V/tp] keep-mask)."""
    check_op_options(options, _STEP, block=BLOCK_OPTIONS)
    if not callable(weight_fn):
        raise TypeError(f"{_STEP}: weight_fn must be a callable returning the LM-head weight shard, got {weight_fn!r}")

    def get_log_probs_and_entropy(hidden, *, args, unconcat_tokens, total_lengths, response_lengths,
                                  with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                                  top_p_token_offsets=None):
        if not non_loss_data:
            raise ValueError(f"{_STEP}: non_loss_data=False is not a mode of slime's step either")
        if top_p_token_ids is not None or top_p_token_offsets is not None:
            raise NotImplementedError(f"{_STEP}: rollout top-p replay (--rollout-top-p != 1) masks the logits with a "
                                      "[T, V/tp] keep-mask, the tensor the fused op never builds; run slime's own step")
        if not torch.is_tensor(hidden) or hidden.dim() != 3 or 1 not in tuple(hidden.shape[:2]):
            raise ValueError(f"{_STEP}: hidden must be the last stage's [T, 1, H] or [1, T, H], got "
                             f"{tuple(getattr(hidden, 'shape', ()))}")
        weight = weight_fn()
        h = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)  # Float16Module hands fp32: back, exactly
        tp_group = loss_module.mpu.get_tensor_model_parallel_group()
        rows = h.shape[0] * (comms.group_size(tp_group) if sequence_parallel else 1)
        tokens = loss_module._build_shifted_tokens(rows, h.device, unconcat_tokens, total_lengths, response_lengths,
                                                   args.allgather_cp)
        log_prob, entropy = calculate_log_probs_and_entropy(
            h, weight, tokens, tp_group, with_entropy, getattr(args, "rollout_temperature", 1.0),
            with_entropy and getattr(args, "entropy_coef", 0.0) != 0, sequence_parallel=sequence_parallel,
            **options)
        log_probs, entropies = loss_module._extract_per_sample(log_prob.squeeze(-1), entropy, total_lengths,
                                                               response_lengths, args.allgather_cp)
        res = {"log_probs": log_probs}
        if with_entropy:
            res["entropy"] = entropies
        if args.allgather_cp:
            loss_module._allgather_cp_redistribute(res, logits_local_len=rows, total_lengths=total_lengths,
                                                   response_lengths=response_lengths)
        return torch.empty((0,), device=h.device), res

    return get_log_probs_and_entropy


def apply(weight_fn, *, sequence_parallel: bool = False, **options) -> list:
    """Put `log_probs_step(slime's loss module, weight_fn, ...)` in place of slime's
    `get_log_probs_and_entropy` in STEP_TARGETS; returns the patched names, `remove()` undoes it. Run it in
    every training process, with a model whose last stage returns hidden states (docs/integrations.md)."""
    import importlib

    step = log_probs_step(importlib.import_module(LOSS_MODULE), weight_fn, sequence_parallel=sequence_parallel,
                          **options)
    return patch_all(STEP_TARGETS, "get_log_probs_and_entropy", step)


def remove() -> list:
    """Restore slime's own step where `apply()` replaced it; returns the restored names."""
    return restore_all(STEP_TARGETS, "get_log_probs_and_entropy")


def _hidden_out(input_, weight=None, runtime_gather_output=None):
    return input_, None  # the output layer's (output, bias), the output being its input: [T(/tp), 1, H]


def hidden_states_provider(provider):
    """Wrap a slime model provider `(pre_process, post_process, vp_stage=None) -> GPTModel` (what
    `--custom-model-provider-path` names): on the last stage the output layer hands back its input, so the
    GPTModel returns the final hidden states [1, T, H] (this rank's [1, T/tp, H] under sequence parallel:
    apply(..., sequence_parallel=True)) instead of the logits, and `output_weight()` returns its weight
    shard. Refused: MuP logit scaling and multi-token prediction, which use the logits past the output
    layer. `restore_output_layers()` gives the output layers their own forward back."""
    def model_provider(pre_process, post_process, vp_stage=None):
        model = provider(pre_process, post_process, vp_stage) if vp_stage is not None else \
            provider(pre_process, post_process)
        if post_process:
            config = getattr(model, "config", None)
            if getattr(config, "use_mup", False) or getattr(model, "mtp_process", False):
                raise NotImplementedError("areal_lce.integrations.slime.hidden_states_provider: MuP logit scaling "
                                          "and multi-token prediction use the logits past the output layer, which "
                                          "this route never builds")
            _OUTPUT_LAYERS.append(patching.apply(patching.Patch(model.output_layer, "forward", _hidden_out)))
            _LAST_STAGE[:] = [model]
        return model
    return model_provider


def restore_output_layers() -> int:
    """Undo what hidden_states_provider did to the output layers it changed (their models return logits
    again); returns how many were restored."""
    n = 0
    while _OUTPUT_LAYERS:
        n += patching.restore(_OUTPUT_LAYERS.pop())
    _LAST_STAGE.clear()
    return n


def output_weight():
    """The LM-head weight shard of the model built by `hidden_states_provider` (the shared embedding when
    tied): `apply(output_weight)`."""
    if not _LAST_STAGE:
        raise RuntimeError("areal_lce.integrations.slime.output_weight: no last-stage model was built by "
                           "hidden_states_provider in this process")
    model = _LAST_STAGE[0]
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def megatron_init(args) -> list:
    """A `--custom-megatron-init-path areal_lce.integrations.slime.megatron_init` hook (slime calls it with
    its args in each training process): `apply(output_weight, sequence_parallel=args.sequence_parallel)`
    with the default semantics. For other options, a hook of one's own calls `apply` with them."""
    return apply(output_weight, sequence_parallel=bool(getattr(args, "sequence_parallel", False)))
