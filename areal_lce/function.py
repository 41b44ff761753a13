"""The autograd Function of the fused op: one backend call per pass plus the TP communication."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import comms
from .backends import get_backend
from .backends.base import ShardStats
from .types import LCEParams


def merge_shard_stats(st: ShardStats, group) -> ShardStats:
    """Merge per-shard (m, s, a, zy, mn[, lsum, lsq]) into full-vocabulary values. Pure math + two
    collectives."""
    # 1 collective: MAX of [m, -mn] gives the global max logit and the global min logit at once.
    mm = torch.stack([st.m, -st.mn])
    comms.all_reduce_max_(mm, group)
    big_m, mn = mm[0], -mm[1]
    # Rescale this shard's sums to the global max; a shard with no valid column (s == 0, m == -inf)
    # contributes exactly 0 (avoid (-inf)·0 = NaN). NaN in s or m propagates, as it must.
    empty = st.s == 0
    shift = torch.where(empty, torch.zeros_like(st.m), st.m - big_m)
    scale = torch.exp(shift)
    s = st.s * scale
    a = torch.where(empty, torch.zeros_like(st.a), (st.a + shift * st.s) * scale)
    # 1 collective: SUM of the packed [s, a, zy(, lsum, lsq)] (zy is nonzero only on the rank owning the
    # label; the raw-logit sums of the shards add up to the full-vocabulary sums).
    sums = st.lsum is not None
    packed = torch.stack([s, a, st.zy] + ([st.lsum, st.lsq] if sums else []))
    comms.all_reduce_sum_(packed, group)
    return ShardStats(m=big_m, s=packed[0], a=packed[1], zy=packed[2], mn=mn,
                      lsum=packed[3] if sums else None, lsq=packed[4] if sums else None)


def finish_stats(st: ShardStats):
    """(logprob, entropy, lse) of the tempered logits from merged statistics."""
    log_s = torch.log(st.s)
    lse = st.m + log_s
    ent = log_s - st.a / st.s
    return st.zy - lse, ent, lse


def _empty_stats(n: int, device, sums: bool) -> ShardStats:
    inf = torch.full((n,), float("inf"), device=device)
    zero = torch.zeros(n, device=device)
    return ShardStats(m=-inf, s=zero, a=zero.clone(), zy=zero.clone(), mn=inf,
                      lsum=zero.clone() if sums else None, lsq=zero.clone() if sums else None)


class _SecondOrderRefused(torch.autograd.Function):
    """forward: identity on the first `n` tensors (gradients built under create_graph=True); the rest
    only connect it to the graph. backward: raises (the op's backward is not differentiable)."""

    @staticmethod
    def forward(ctx, n: int, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("linear_logprobs_entropy does not support second-order gradients (its backward is "
                           "not differentiable): a gradient taken with create_graph=True cannot be "
                           "differentiated again")


def once_differentiable(backward):
    """Run `backward` without recording a graph. Under create_graph=True its gradients are tied to the
    saved tensors and incoming gradients that require grad, through a node that raises when
    differentiated, so a second-order gradient errors instead of reading as zero (torch's
    once_differentiable ties them to the incoming gradients only, missing d/dh through the saved h)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        anchors = []
        if torch.is_grad_enabled():
            anchors = [t for t in (*ctx.saved_tensors, *grad_outputs) if torch.is_tensor(t) and t.requires_grad]
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not anchors:
            return grads
        slots = [i for i, g in enumerate(grads) if g is not None]
        tied = _SecondOrderRefused.apply(len(slots), *(grads[i] for i in slots), *anchors)
        out = list(grads)
        for i, g in zip(slots, tied):
            out[i] = g
        return tuple(out)

    return wrapper


class LinearLogprobsEntropy(torch.autograd.Function):
    """Per-token logprobs and entropy of softmax(h·Wᵀ/T) without materialising logits.

    Inputs: hidden [N, H] (or this rank's [N/tp, H] sequence shard under sequence parallel), weight
    [V_shard, H] (this rank's vocab shard), labels [N] global ids with ignore_index rows, inv_t [N] fp32
    or None, params (LCEParams). Outputs [N] fp32: logprobs, entropy (differentiable), max_logit,
    min_logit (raw logits, before temperature), lse (tempered), and with params.logit_sums the raw
    logits' Σ r and Σ r² (else None) — all but the first two not differentiable.

    Collectives (group = params.tp_group; none when tp_size == 1):
      forward : sequence_parallel -> all-gather of hidden rows (sequence shards -> full sequence);
                MAX of [max, -min] per token; SUM of packed [s, a, z_label(, Σr, Σr²)] per token.
                Nothing N×V or V×H.
      backward: sequence_parallel -> reduce-scatter of d_hidden (vocab-partial full-sequence grads ->
                this rank's shard of the total); else, if reduce_d_hidden, all-reduce SUM of d_hidden
                (vocab-partial -> total on every rank); reduce_d_hidden=False leaves d_hidden partial for a
                caller whose own mapping reduces it (Megatron's copy_to_tensor_model_parallel_region).
                d_hidden is reduced in fp32, exactly once. d_weight is local to the shard: never reduced.

    Context parallelism: no CP collective, by design. Each CP rank passes its CP-local tokens (megatron's
    load-balanced zigzag: every sequence cut into 2·cp chunks, rank r keeps chunks r and 2·cp−1−r; per
    batch row for BSHD, per packed sequence for THD) with their labels. Every per-token output depends on
    its own row only, so the CP-local outputs are the full-sequence values at those tokens. d_hidden stays
    local (each token's gradient lives where the token lives). d_weight is this rank's partial sum over
    its own tokens; the full-sequence gradient is its SUM over the CP group, which megatron's DDP does
    when it reduces every parameter over the data-parallel × context-parallel group. Reducing it here
    too would count it twice.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, params: LCEParams):
        backend = get_backend(params.backend)
        group = params.tp_group
        n_local = hidden.shape[0]
        if params.sequence_parallel:
            hidden = comms.all_gather_rows(hidden, group)
        n = hidden.shape[0]
        valid = labels != params.ignore_index
        idx: Optional[torch.Tensor] = None
        if params.compact_ignored:
            n_valid = int(valid.sum())  # host sync: ignored rows then cost nothing downstream
            if n_valid < n:
                idx = valid.nonzero().squeeze(1)
        h_c = hidden if idx is None else hidden.index_select(0, idx)
        y_c = labels if idx is None else labels.index_select(0, idx)
        t_c = inv_t if (idx is None or inv_t is None) else inv_t.index_select(0, idx)
        if h_c.shape[0] == 0:  # every row ignored (same on all ranks: labels are replicated)
            st = _empty_stats(0, hidden.device, params.logit_sums)
        else:
            keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            st = backend.forward(h_c, weight, y_c, t_c, params, keep_cache=keep)
        cache = st.cache
        merged = merge_shard_stats(st, group)
        lp, ent, lse = finish_stats(merged)
        t_raw = (1.0 / t_c) if t_c is not None else float(params.temperature)
        mx, mn = merged.m * t_raw, merged.mn * t_raw
        outs = []
        for v in (lp, ent, mx, mn, lse, merged.lsum, merged.lsq):
            if v is None:  # logit sums not asked for
                outs.append(None)
                continue
            full = v.new_zeros(n) if idx is not None else v
            if idx is not None:
                full.index_copy_(0, idx, v)
            if not params.compact_ignored:
                full = torch.where(valid, full, torch.zeros_like(full))
            outs.append(full)
        ctx.save_for_backward(h_c, weight, y_c, t_c, lse, ent, idx, valid, outs[0])  # outs[0]: see once_differentiable
        ctx.params, ctx.cache, ctx.n, ctx.n_local, ctx.hidden_dtype = params, cache, n, n_local, hidden.dtype
        ctx.mark_non_differentiable(*(o for o in outs[2:] if o is not None))
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent, *_g_stats):
        h_c, weight, y_c, t_c, lse, ent, idx, valid, _ = ctx.saved_tensors
        params: LCEParams = ctx.params
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return None, None, None, None, None
        n_c = h_c.shape[0]
        acc = torch.float64 if h_c.dtype == torch.float64 else torch.float32

        def upstream(g):
            if g is None:
                return torch.zeros(n_c, dtype=acc, device=h_c.device)
            g = g.to(acc)
            g = torch.where(valid, g, torch.zeros_like(g))  # ignored rows get exactly zero gradient
            return (g if idx is None else g.index_select(0, idx)).contiguous()

        if n_c == 0:
            dh_c = torch.zeros_like(h_c, dtype=torch.float32) if need_dh else None
            dw = torch.zeros_like(weight) if need_dw else None
        else:
            dh_c, dw = get_backend(params.backend).backward(
                h_c, weight, y_c, t_c, params, ctx.cache, lse, ent, upstream(g_lp), upstream(g_ent),
                need_dh, need_dw)
        ctx.cache = None
        dh = None
        if need_dh:
            dh = dh_c if idx is None else dh_c.new_zeros(ctx.n, dh_c.shape[1]).index_copy_(0, idx, dh_c)
            if params.sequence_parallel:
                # reduce-scatter: vocab-partial full-sequence grads -> this rank's shard of the total
                dh = comms.reduce_scatter_rows(dh, params.tp_group)
            elif params.reduce_d_hidden:
                # all-reduce: vocab-partial grads of the replicated hidden -> the total on every rank
                dh = comms.all_reduce_sum_(dh, params.tp_group)
            dh = dh.to(ctx.hidden_dtype)
        return dh, dw, None, None, None
