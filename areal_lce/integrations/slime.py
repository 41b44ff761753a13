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
  hidden [T, H] (or [T, 1, H]): the full sequence, the same on every rank of tp_group.
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
`vocab_size=` the true vocabulary and `logits_precision="fp32"`. invariant and check_labels go to the op.
Refused: `log_prob_keep_mask` (slime's top-p replay, `--rollout-top-p != 1`): it is a [T, V/tp] mask, the
very size the fused op avoids; a token outside [0, tp·V/tp) (slime scores -lse for it silently).

The job wiring (a `--custom-model-provider-path` whose last stage returns hidden states, and a replacement of
`slime.backends.megatron_utils.loss.get_log_probs_and_entropy` that slices per-sample spans) is not provided
here: docs/integrations.md says what a user writes around this function.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import comms
from ..api import check_temperature, linear_logprobs_entropy
from ..types import VocabParallel
from ._common import NO_IGNORE_INDEX, check_no_negative_labels, check_op_options, consistency_options, token_rows
from .nemo_rl import default_precision

_NAME = "areal_lce.integrations.slime.calculate_log_probs_and_entropy"


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
    t = check_temperature(temperature, f"{_NAME}: temperature", allow_tensor=False)
    h2, y = token_rows(hidden, tokens, _NAME)
    if y.numel() == 0:  # slime returns [0] tensors (no [T, 1]) and runs no collective
        empty = h2.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    tp = comms.checked_group_size(tp_group, f"{_NAME}: tp_group")
    consistency = consistency_options(invariant, default_precision(h2.dtype, logits_precision, _NAME), _NAME)
    check_no_negative_labels(y, check_labels, tp, _NAME)
    out = linear_logprobs_entropy(h2, weight, y, temperature=t, vocab_parallel=VocabParallel(tp_group),
                                  vocab_size=vocab_size, ignore_index=NO_IGNORE_INDEX, check_labels=check_labels,
                                  **consistency, **op_options)
    entropy = None
    if with_entropy:
        entropy = out.entropy if with_entropy_grad else out.entropy.detach()
    return out.logprobs.unsqueeze(-1), entropy
