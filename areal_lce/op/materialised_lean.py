"""The materialised route's autograd Function: per-token statistics of logits that already exist, lean.

The logits stay in the dtype their GEMM produced (bf16 for a bf16 model, as Megatron keeps them). Every
reduction runs over blocks of `rows_per_block` rows, each upcast to fp32 on its own, so no fp32 copy of the
[N, V] logits (nor of their softmax) is ever held: the largest fp32 temporaries are two [rows, V] blocks
(CHUNK_ELEMENTS elements each, 128 MiB). Forward reads the logits once for logprob, entropy, max/min logit,
lse and (asked) the logit sums; backward reads them once more and writes d_logits once, in the logits' dtype,
from the saved logits and the per-row (lse, entropy).

Per row, z = x · inv_T (x rounded to bf16 first under logits_precision="bf16"), m = max_j z_j:
    s = Σ_j exp(z_j − m),  a = Σ_j exp(z_j − m) (z_j − m)
    lse = m + log s,  logprob = z_y − lse,  entropy = log s − a / s
    d z_j = g_lp (1[j=y] − p_j) − g_ent p_j (log p_j + entropy) + g_lse p_j,  d x_j = inv_T · d z_j + g_sum
With vocab-parallel logits each rank folds its shard around its own max m_r and rescales by exp(m_r − m)
once the global max is known, so one pass suffices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import comms

CHUNK_ELEMENTS = 1 << 25  # fp32 elements of one row block (128 MiB): big enough that the per-block launches
                          # (~10 of them) stay far below the block's memory time on a GPU, small next to [N, V]


@dataclass(frozen=True)
class LeanParams:
    """One call's options *resolved* against its logits, built by `materialised.logprobs_entropy_from_logits`
    from its checked arguments: this shard's column range, the row block, the TP group. Not the user's
    options value (`LCEOptions`, options.py, whose fields that function takes by the same names and
    meanings), as `LCEParams` is not for the fused op: what it holds depends on the logits' shape and the
    group, and the Function's backward needs no other."""
    inv_t: float  # scalar 1/T (unused where a per-token inv_t tensor is passed)
    start: int  # global id of this shard's first column
    valid_cols: int  # columns of this shard below vocab_size (the rest are padding)
    ignore_index: int
    tp_group: Optional[object]
    round_bf16: bool  # logits_precision == "bf16": each logit rounded to bf16 before anything else
    logit_sums: bool
    rows_per_block: int  # `block_rows(valid_cols)` when the call began: backward uses forward's blocks


def block_rows(valid_cols: int) -> int:
    """Rows per block so that one fp32 block holds about CHUNK_ELEMENTS elements."""
    return max(1, CHUNK_ELEMENTS // max(1, valid_cols))


def _block(x: torch.Tensor, r0: int, r1: int, p: LeanParams) -> torch.Tensor:
    """Rows [r0, r1) of the valid columns as a fresh fp32 tensor (bf16-rounded under "bf16")."""
    c = x[r0:r1, :p.valid_cols].to(torch.float32, copy=True)  # a copy: the callers work in place on it
    return c.to(torch.bfloat16).float() if p.round_bf16 and x.dtype != torch.bfloat16 else c


def _inv_t_rows(inv_t: Optional[torch.Tensor], r0: int, r1: int, p: LeanParams):
    return p.inv_t if inv_t is None else inv_t[r0:r1, None]


def _scaled_(c: torch.Tensor, it) -> torch.Tensor:
    """c · inv_T in place; at T = 1 nothing to do (x · 1 = x exactly), one pass over the block saved."""
    return c if not torch.is_tensor(it) and it == 1.0 else c.mul_(it)


def forward_stats(x: torch.Tensor, y: torch.Tensor, inv_t: Optional[torch.Tensor], p: LeanParams):
    """x [N, V_shard] logits (any float dtype), y [N] global ids, inv_t [N] fp32 or None -> fp32 [N] tensors
    (logprob, entropy, max, min, lse, sum, sumsq; the last two None unless p.logit_sums), over the TP group.
    Ignored rows carry whatever their logits give; the caller zeroes them."""
    n = x.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    mx = torch.full((n,), float("-inf"), **f32)
    neg_mn = torch.full((n,), float("-inf"), **f32)
    m_loc, s_loc, a_loc = torch.zeros(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
    sums = torch.zeros(2, n, **f32) if p.logit_sums else None
    step = p.rows_per_block
    for r0 in range(0, n if p.valid_cols else 0, step):
        r1 = min(n, r0 + step)
        c = _block(x, r0, r1, p)
        lo, hi = torch.aminmax(c, dim=-1)  # one read for both
        mx[r0:r1], neg_mn[r0:r1] = hi, -lo
        if sums is not None:
            sums[0, r0:r1] = c.sum(-1)
            sums[1, r0:r1] = (c * c).sum(-1)
        it = _inv_t_rows(inv_t, r0, r1, p)
        m = mx[r0:r1] * (it[:, 0] if torch.is_tensor(it) else it)  # max of z = x·inv_T (monotone rounding)
        z = _scaled_(c, it).sub_(m[:, None])
        e = torch.exp(z)
        s_loc[r0:r1] = e.sum(-1)
        a_loc[r0:r1] = e.mul_(z).sum(-1)
        m_loc[r0:r1] = m
        del c, z, e
    # label logit from this shard (0 where another shard owns it), read without touching the rest
    local = y - p.start
    own = (local >= 0) & (local < p.valid_cols)
    if p.valid_cols:
        zy = x.gather(1, local.clamp(0, p.valid_cols - 1)[:, None]).squeeze(1).float()
        if p.round_bf16:
            zy = zy.to(torch.bfloat16).float()
        zy = torch.where(own, zy, 0.0)
    else:
        zy = torch.zeros(n, **f32)
    if p.tp_group is not None:
        mm = torch.stack([mx, neg_mn])
        comms.all_reduce_max_(mm, p.tp_group)  # MAX of [max, -min]: global max (softmax shift) and min logit
        mx, neg_mn = mm[0], mm[1]
        it_all = p.inv_t if inv_t is None else inv_t
        m = mx * it_all
        scale = torch.exp(m_loc - m)  # this shard's fold around its own max, moved to the global one
        has = s_loc > 0  # a shard of padding only contributes nothing (and no 0 · inf)
        a_loc = torch.where(has, scale * (a_loc + s_loc * (m_loc - m)), 0.0)
        s_loc = torch.where(has, scale * s_loc, 0.0)
        packed = torch.stack([s_loc, a_loc, zy] + ([sums[0], sums[1]] if sums is not None else []))
        comms.all_reduce_sum_(packed, p.tp_group)  # SUM of shard partials: exp-sum, Σ e·(z−m), label logit, sums
        s_loc, a_loc, zy = packed[0], packed[1], packed[2]
        sums = packed[3:] if sums is not None else None
        m_loc = m
    it_all = p.inv_t if inv_t is None else inv_t
    log_s = torch.log(s_loc)
    lse = m_loc + log_s
    lp = zy * it_all - lse
    ent = log_s - a_loc / s_loc
    return lp, ent, mx, -neg_mn, lse, (None if sums is None else sums[0]), (None if sums is None else sums[1])


def backward_logits(x: torch.Tensor, y: torch.Tensor, inv_t: Optional[torch.Tensor], lse: torch.Tensor,
                    ent: torch.Tensor, valid: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
                    g_lse: Optional[torch.Tensor], g_sum: Optional[torch.Tensor], p: LeanParams) -> torch.Tensor:
    """d_logits [N, V_shard] in x's dtype, written once, block by block: exactly 0 in padding columns and
    in rows not `valid` (whatever their logits hold). The g_* are [N] fp32. Each rank's gradient is complete
    from the replicated per-row values: no collective."""
    n = x.shape[0]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if p.valid_cols < x.shape[1]:
        dx[:, p.valid_cols:] = 0
    local = y - p.start
    own = (local >= 0) & (local < p.valid_cols)
    cols = local.clamp(0, max(0, p.valid_cols - 1))
    step = p.rows_per_block
    for r0 in range(0, n if p.valid_cols else 0, step):
        r1 = min(n, r0 + step)
        it = _inv_t_rows(inv_t, r0, r1, p)
        logp = _scaled_(_block(x, r0, r1, p), it).sub_(lse[r0:r1, None])
        prob = torch.exp(logp)
        # per-row factors carry 1/T and the sign, so the block sees two passes: (log p + ent)·a + b, then ·p
        gl, ge = g_lp[r0:r1, None] * it, g_ent[r0:r1, None] * it
        b = gl if g_lse is None else gl - g_lse[r0:r1, None] * it
        coef = logp.add_(ent[r0:r1, None]).mul_(-ge).sub_(b)  # −(g_lp + g_ent (log p + ent) − g_lse) / T
        d = prob.mul_(coef)
        # + g_lp / T at the label (0 added where another shard owns it: no host sync, no data-dependent shape)
        d.scatter_add_(1, cols[r0:r1, None], torch.where(own[r0:r1, None], gl, 0.0))
        if g_sum is not None:
            d.add_(g_sum[r0:r1, None])
        d.masked_fill_(~valid[r0:r1, None], 0.0)  # ignored rows: exact 0, even from inf / NaN logits
        dx[r0:r1, :p.valid_cols] = d
        del logp, prob, coef, d
    return dx


class _SecondOrderRefused(torch.autograd.Function):
    """forward: identity on d_logits, tied to the tensors it was computed from; backward: raises."""

    @staticmethod
    def forward(ctx, dx, *anchors):
        return dx.view_as(dx)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("logprobs_entropy_from_logits does not support second-order gradients (its backward "
                           "is not differentiable): a gradient taken with create_graph=True cannot be "
                           "differentiated again")


class LeanLogprobsEntropy(torch.autograd.Function):
    """(logits [N, V_shard], labels [N], inv_t [N] or None, LeanParams) -> fp32 [N] logprob, entropy, lse
    (differentiable), max, min (not), and with p.logit_sums sum (differentiable), sumsq (not).

    Collectives under p.tp_group, forward only: MAX of [max, -min] (2·N), then one SUM of the packed shard
    partials (3·N, 5·N with the logit sums). Backward: none (each rank's d_logits follows from the
    replicated per-row lse and entropy and the replicated upstream gradients, Megatron's convention)."""

    @staticmethod
    def forward(ctx, x, y, inv_t, p: LeanParams):
        lp, ent, mx, mn, lse, s1, s2 = forward_stats(x, y, inv_t, p)
        valid = y != p.ignore_index
        zero = torch.zeros_like(lse)
        outs = [torch.where(valid, t, zero) for t in (lp, ent, mx, mn, lse)]
        if p.logit_sums:
            outs += [torch.where(valid, s1, zero), torch.where(valid, s2, zero)]
        ctx.save_for_backward(x, y, inv_t, lse, ent, valid)
        ctx.p = p
        ctx.mark_non_differentiable(outs[2], outs[3], *outs[6:])
        return tuple(outs)

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_mx, _g_mn, g_lse, *g_sums):
        x, y, inv_t, lse, ent, valid = ctx.saved_tensors
        p = ctx.p

        def live(g):  # None (unused output) -> None; ignored rows' upstream gradients are not used
            return None if g is None else torch.where(valid, g.float(), 0.0)

        anchors = [t for t in (x, g_lp, g_ent, g_lse, *g_sums) if t is not None and t.requires_grad]
        with torch.no_grad():
            zeros = torch.zeros_like(lse)
            g_sum = live(g_sums[0]) if g_sums else None
            dx = backward_logits(x, y, inv_t, lse, ent, valid, live(g_lp) if g_lp is not None else zeros,
                                 live(g_ent) if g_ent is not None else zeros, live(g_lse), g_sum, p)
        if torch.is_grad_enabled() and anchors:  # create_graph=True: differentiating dx again raises
            dx = _SecondOrderRefused.apply(dx, *anchors)
        return dx, None, None, None
