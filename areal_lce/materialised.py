"""The materialised route: per-token logprobs/entropy/stats from logits that already exist.

This is what a model that runs its LM-head GEMM (Megatron's output layer, an HF lm_head) feeds into:
vocab-parallel logits [..., V_shard] in, the same `LCEOutput` as the fused op out, differentiated by
torch autograd (so memory holds the fp32 logits and softmax of every token). The fused op must match
it; the Megatron engine uses it when `use_fused_linear_ce` is off.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import checks, comms, exact
from .checks import inv_temperature
from .types import LCEOutput, LCEParams, VocabParallel


def _exact_values(raw, y, it, start: int, valid_cols: int, ignore_index: int, tp_group):
    """(logprob, entropy, max, min, lse) of the invariant mode (exact.py) from this shard's raw fp32 logits
    [N, valid_cols] (the shard starts at global id `start`), merged over tp_group. No gradient."""
    n = raw.shape[0]
    width = exact.segments(valid_cols) * exact.SEG
    r = torch.nn.functional.pad(raw, (0, width - valid_cols)) if width > valid_cols else raw
    inv = it.reshape(-1) if torch.is_tensor(it) else it
    seg = exact.segment_stats_torch(r, inv, valid_cols, False) if valid_cols else raw.new_zeros(3, 0, n)
    if valid_cols:
        mx, mn = raw.amax(-1), raw.amin(-1)
        local = y - start
        own = (local >= 0) & (local < valid_cols)
        zy = torch.where(own, raw.gather(1, local.clamp(0, valid_cols - 1)[:, None]).squeeze(1), 0.0) * inv
    else:
        mx = raw.new_full((n,), float("-inf"))
        mn = raw.new_full((n,), float("inf"))
        zy = raw.new_zeros(n)
    tp = comms.group_size(tp_group)
    params = LCEParams(vocab_parallel=VocabParallel(tp_group) if tp > 1 else None, tp_size=tp, backend="torch",
                       ignore_index=ignore_index, invariant=True)
    from .backends.base import ShardStats
    fin = exact.merge(ShardStats(m=None, s=None, a=None, zy=zy, mn=mn, mx=mx, seg=seg), params, inv)
    return fin.lp, fin.ent, fin.mx, fin.mn, fin.lse


def logprobs_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
    tp_group=None,
    invariant: Optional[bool] = None,
    logits_precision: str = "fp32",
    check_labels: Union[bool, str] = True,
) -> LCEOutput:
    """logits [..., V_shard] (this rank's vocab shard under tp_group), labels [...] global ids.

    logits_precision: "fp32" takes the logits as given (upcast to fp32); "bf16" rounds each to bf16 first,
    as the fused op's option does (the rounding's gradient is identity). invariant=True: each row's values
    do not depend on the other rows or on the TP degree (exact.py's segment sums, three more passes over
    the logits; the gradient is the ordinary one, through torch autograd); None (default): off. The contract
    covers these reductions given the logits: logits a model computes for a whole batch carry the batch
    dependence of that GEMM. check_labels as the op's (a label outside [0, vocab_size) that is not
    ignore_index raises, or with "deferred" gives NaN and check_deferred() raises).

    Returns fp32 logprobs, entropy (differentiable w.r.t. logits) and max_logit, min_logit (raw), lse
    (tempered), all 0 at ignore_index rows. Collectives under tp_group: MAX of the per-token max/min
    (no gradient), SUM of exp-sums, weighted logit sums and the label logit (identity backward).
    """
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits leading shape {tuple(logits.shape[:-1])} must equal labels {tuple(labels.shape)}")
    from .checks import check_invariant_layout, check_logits_precision, resolve_invariant

    check_logits_precision(logits_precision)
    tp = comms.group_size(tp_group)
    v_shard = logits.shape[-1]
    vocab_size = v_shard * tp if vocab_size is None else vocab_size
    asked = invariant is not None
    invariant = resolve_invariant(invariant, "reference", logits.dtype)  # None: off (docs/op.md, Consistency)
    if invariant:
        invariant = check_invariant_layout(v_shard, tp, vocab_size, asked)
    start = comms.group_rank(tp_group) * v_shard
    valid_cols = max(0, min(v_shard, vocab_size - start))
    raw = logits.float()[..., :valid_cols]
    if logits_precision == "bf16":  # straight through: the values are the rounded ones, the gradient identity
        raw = raw + (raw.to(torch.bfloat16).float() - raw).detach()
    inv_t_scalar, inv_t = inv_temperature(temperature, labels)
    bad = None
    mode = checks.resolve_mode(check_labels, logits.device)
    if mode == "sync":
        checks.check_now(labels.reshape(-1), None if inv_t is None else inv_t.reshape(-1), vocab_size, ignore_index)
    elif mode == "deferred":
        bad = checks.record(labels.reshape(-1), None if inv_t is None else inv_t.reshape(-1), vocab_size,
                            ignore_index).view(labels.shape)
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
    ent = -plogp
    if invariant:
        with torch.no_grad():
            shape = labels.shape
            ex = _exact_values(raw.detach().reshape(y.numel(), valid_cols), y.reshape(-1),
                               it.reshape(-1) if torch.is_tensor(it) else it, start, valid_cols, ignore_index,
                               tp_group)
            ex = [t.view(shape) for t in ex]
        # the exact values, with the ordinary graph's gradient (x - x.detach() adds exactly 0)
        lp = ex[0] + (lp - lp.detach())
        ent = ex[1] + (ent - ent.detach())
        big_mx, mn, lse = ex[2], ex[3], ex[4]
    if bad is not None:
        lp = lp.masked_fill(bad, float("nan"))
    zero = torch.zeros_like(lse)
    return LCEOutput(
        torch.where(valid, lp, zero), torch.where(valid, ent, zero),
        torch.where(valid, big_mx, zero).detach(), torch.where(valid, mn, zero).detach(),
        torch.where(valid, lse, zero).detach())
