"""The materialised route as it was before `materialised_lean`: torch autograd over fp32 copies of the logits.

The "before" row of benchmark/op/bench_materialised.py and a second oracle of tests/op/test_materialised_lean.py
(it is differentiated by torch autograd, so memory holds the fp32 logits and softmax of every token); it lives
beside them, outside the package, which calls none of it. Same signature and outputs as `materialised.logprobs_entropy_from_logits`.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from areal_lce.op import comms
from areal_lce.op.materialised import _exact_values, checked_call, vocab_parallel_group
from areal_lce.op.types import LCEOutput, VocabParallel


def logprobs_entropy_autograd(logits: torch.Tensor, labels: torch.Tensor, *,
                              temperature: Union[float, torch.Tensor] = 1.0, ignore_index: int = -100,
                              vocab_size: Optional[int] = None, vocab_parallel: Optional[VocabParallel] = None,
                              invariant: Optional[bool] = None, logits_precision: str = "fp32",
                              check_labels: Union[bool, str] = True) -> LCEOutput:
    """logits [..., V_shard] (this rank's vocab shard under vocab_parallel = VocabParallel(group), as
    `logprobs_entropy_from_logits` takes it), labels [...] global ids.

    logits_precision: "fp32" takes the logits as given (upcast to fp32); "bf16" rounds each to bf16 first,
    as the fused op's option does (the rounding's gradient is identity). invariant=True: each row's values
    do not depend on the other rows or on the TP degree (exact.py's segment sums, three more passes over
    the logits; the gradient is the ordinary one, through torch autograd); None (default): off. The contract
    covers these reductions given the logits: logits a model computes for a whole batch carry the batch
    dependence of that GEMM. check_labels as the op's (a label outside [0, vocab_size) that is not
    ignore_index raises, or with "deferred" gives NaN and check_deferred() raises).

    Returns fp32 logprobs, entropy (differentiable w.r.t. logits) and max_logit, min_logit (raw), lse
    (tempered), all 0 at ignore_index rows. Collectives over the group: MAX of the per-token max/min
    (no gradient), SUM of exp-sums, weighted logit sums and the label logit (identity backward).
    """
    tp_group = vocab_parallel_group(vocab_parallel, "logprobs_entropy_autograd")
    c = checked_call(logits, labels, temperature, ignore_index, vocab_size, tp_group, invariant, logits_precision,
                     check_labels)
    invariant, start, valid_cols, inv_t_scalar, inv_t, bad = (c.invariant, c.start, c.valid_cols, c.inv_t_scalar,
                                                               c.inv_t, c.bad)
    raw = logits.float()[..., :valid_cols]
    if logits_precision == "bf16":  # straight through: the values are the rounded ones, the gradient identity
        raw = raw + (raw.to(torch.bfloat16).float() - raw).detach()
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
