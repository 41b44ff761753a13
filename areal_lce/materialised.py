"""The materialised route: per-token logprobs/entropy/stats from logits that already exist.

This is what a model that runs its LM-head GEMM (Megatron's output layer, an HF lm_head) feeds into:
vocab-parallel logits [..., V_shard] in, the same `LCEOutput` as the fused op out, differentiated by
torch autograd (so memory holds the fp32 logits and softmax of every token). The fused op must match
it; the Megatron engine uses it when `use_fused_linear_ce` is off.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import comms
from .checks import inv_temperature
from .types import LCEOutput


def logprobs_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
    tp_group=None,
) -> LCEOutput:
    """logits [..., V_shard] (this rank's vocab shard under tp_group), labels [...] global ids.

    Returns fp32 logprobs, entropy (differentiable w.r.t. logits) and max_logit, min_logit (raw), lse
    (tempered), all 0 at ignore_index rows. Collectives under tp_group: MAX of the per-token max/min
    (no gradient), SUM of exp-sums, weighted logit sums and the label logit (identity backward).
    """
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits leading shape {tuple(logits.shape[:-1])} must equal labels {tuple(labels.shape)}")
    tp = comms.group_size(tp_group)
    v_shard = logits.shape[-1]
    vocab_size = v_shard * tp if vocab_size is None else vocab_size
    start = comms.group_rank(tp_group) * v_shard
    valid_cols = max(0, min(v_shard, vocab_size - start))
    raw = logits.float()[..., :valid_cols]
    inv_t_scalar, inv_t = inv_temperature(temperature, labels)
    it = inv_t_scalar if inv_t is None else inv_t.to(raw.device).view(labels.shape)[..., None]
    z = raw * it
    with torch.no_grad():
        # MAX over the group of the raw [max, -min]: global max and min logit, no gradient needed.
        if valid_cols:
            mm = torch.stack([raw.max(-1).values, -raw.min(-1).values])
        else:
            mm = torch.full((2,) + tuple(z.shape[:-1]), float("-inf"), device=z.device)
        comms.all_reduce_max_(mm, tp_group)
        big_mx, mn = mm[0], -mm[1]
        big_m = big_mx * (it[..., 0] if torch.is_tensor(it) else it)  # softmax shift: the max of z, exactly
    e = torch.exp(z - big_m[..., None])
    # SUM: full-vocab exp-sum; its gradient is summed too (every rank's own log-probs use lse)
    s = comms.all_reduce_sum_partial_grad(e.sum(-1), tp_group)
    lse = big_m + torch.log(s)
    logp = z - lse[..., None]
    p = torch.exp(logp)
    plogp = comms.all_reduce_sum_replicated_grad((p * logp).sum(-1), tp_group)  # SUM: Σ p log p
    y = labels.to(torch.int64)
    valid = y != ignore_index
    local = y - start
    own = (local >= 0) & (local < valid_cols) & valid
    if valid_cols:
        picked = logp.gather(-1, local.clamp(0, valid_cols - 1)[..., None]).squeeze(-1)
    else:
        # A shard of padding only owns no label; its 0 is still taken through lse, so that this rank's
        # backward reaches the exp-sum's SUM collective exactly as the other ranks' backward does.
        picked = logp.sum(-1)
    lp = comms.all_reduce_sum_replicated_grad(torch.where(own, picked, torch.zeros_like(picked)), tp_group)
    zero = torch.zeros_like(lse)
    return LCEOutput(
        torch.where(valid, lp, zero), torch.where(valid, -plogp, zero),
        torch.where(valid, big_mx, zero).detach(), torch.where(valid, mn, zero).detach(),
        torch.where(valid, lse, zero).detach())
