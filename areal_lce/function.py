"""The fused op's forward and backward: row partition, one backend call per pass, TP communication.

`lce_forward` / `lce_backward` are shared by two front ends: `LinearLogprobsEntropy` below (an
autograd.Function: the tensor-parallel path, whose process group cannot be an operator argument) and
the `areal_lce::lce_forward` / `lce_backward` torch.library ops of library.py (every call without TP,
eager or under torch.compile). Neither reads a device value on the host unless params.check_labels
is "sync".

Ignored rows (label == ignore_index), with params.compact_ignored: the rows are partitioned on the
device, valid rows first in their original order, into a buffer of the full size N, with the number of
valid rows n_valid kept as a device tensor. The ignored tail is zero-filled (hidden 0, 1/T = 1,
upstream gradient 0), so any backend computes exactly zero gradient for it, and backends that take
`n_valid` (triton) skip its GEMM work. Every shape, and so every collective, is the same on every rank
and every step: nothing is counted on the host.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import checks, comms
from .backends import get_backend
from .backends.base import ShardStats
from .types import LCEParams


def merge_shard_stats(st: ShardStats, group) -> ShardStats:
    """Merge per-shard (m, s, a, zy, mn) into full-vocabulary values. Pure math + two collectives."""
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
    # 1 collective: SUM of the packed [s, a, zy] (zy is nonzero only on the rank owning the label).
    packed = torch.stack([s, a, st.zy])
    comms.all_reduce_sum_(packed, group)
    return ShardStats(m=big_m, s=packed[0], a=packed[1], zy=packed[2], mn=mn)


def finish_stats(st: ShardStats):
    """(logprob, entropy, lse) of the tempered logits from merged statistics."""
    log_s = torch.log(st.s)
    lse = st.m + log_s
    ent = log_s - st.a / st.s
    return st.zy - lse, ent, lse


class RowPartition(NamedTuple):
    """Valid rows first, on the device. Position j of the partitioned buffer holds original row order[j];
    original row i sits at position dest[i]; positions >= n_valid ([1] int64) hold the ignored rows."""

    order: torch.Tensor
    dest: torch.Tensor
    n_valid: torch.Tensor
    live: torch.Tensor  # [N] bool: position j < n_valid


def partition_rows(labels: torch.Tensor, ignore_index: int) -> RowPartition:
    """Stable partition of the rows by label != ignore_index: a cumulative count, no sort, no sync."""
    n = labels.shape[0]
    valid = labels != ignore_index
    count = torch.cumsum(valid, 0)  # int64: valid rows up to and including row i
    n_valid = count[-1:] if n else count.new_zeros(1)
    pos = torch.arange(n, device=labels.device)
    dest = torch.where(valid, count - 1, n_valid + pos - count)  # ignored row i: after the valid ones
    order = torch.empty_like(dest).scatter_(0, dest, pos)
    return RowPartition(order, dest, n_valid, pos < n_valid)


def _partitioned(part: RowPartition, labels, inv_t, hidden=None):
    """(hidden, labels, 1/T) in partition order, the ignored tail zero-filled (hidden 0, 1/T 1)."""
    h_c = None
    if hidden is not None:
        h_c = hidden.index_select(0, part.order).masked_fill_(~part.live[:, None], 0)
    y_c = labels.index_select(0, part.order)
    t_c = None if inv_t is None else inv_t.index_select(0, part.order).masked_fill_(~part.live, 1.0)
    return h_c, y_c, t_c


class Forward(NamedTuple):
    diff: torch.Tensor  # [2, N]: logprobs, entropy (differentiable), 0 at ignored rows
    stats: torch.Tensor  # [3, N]: max_logit, min_logit, lse (not differentiable), 0 at ignored rows
    h_c: torch.Tensor  # hidden as the backend saw it (full sequence under SP; partitioned)
    lse_ent: torch.Tensor  # [2, N] (lse, entropy) in the backend's row order, for the backward
    cache: object  # the backend's logits cache, or None


def lce_forward(hidden, weight, labels, inv_t, params: LCEParams, keep_cache: bool) -> Forward:
    """hidden [N, H] (this rank's [N/tp, H] shard under SP), weight [V_shard, H], labels [N] int64,
    inv_t [N] fp32 or None. Collectives: an all-gather of hidden under SP, then merge_shard_stats."""
    if params.sequence_parallel:
        hidden = comms.all_gather_rows(hidden, params.tp_group)  # sequence shards -> full sequence
    bad = None
    if params.check_labels == "sync":
        checks.check_now(labels, inv_t, params.vocab_size, params.ignore_index)
    elif params.check_labels == "deferred":
        bad = checks.record(labels, inv_t, params.vocab_size, params.ignore_index)
    part = partition_rows(labels, params.ignore_index) if params.compact_ignored else None
    if part is None:
        h_c, y_c, t_c = hidden, labels, inv_t
    else:
        h_c, y_c, t_c = _partitioned(part, labels, inv_t, hidden)
    st = get_backend(params.backend).forward(h_c, weight, y_c, t_c, params, keep_cache=keep_cache,
                                             n_valid=None if part is None else part.n_valid)
    merged = merge_shard_stats(st, params.tp_group)
    lp, ent, lse = finish_stats(merged)
    t_raw = (1.0 / t_c) if t_c is not None else float(params.temperature)
    valid = labels != params.ignore_index
    outs = []
    for group in ((lp, ent), (merged.m * t_raw, merged.mn * t_raw, lse)):
        o = torch.stack(group)
        if part is not None:
            o = o.index_select(1, part.dest)  # back to the caller's row order
        outs.append(torch.where(valid, o, 0.0))
    diff, stats = outs
    if bad is not None:
        diff[0].masked_fill_(bad, float("nan"))  # deferred check: rows with a bad label show at once
    lse_ent = torch.stack([lse, ent])
    if part is not None:
        lse_ent = torch.where(part.live, lse_ent, 0.0)  # the tail's stats are unspecified (skipped rows)
    return Forward(diff, stats, h_c, lse_ent, st.cache)


def lce_backward(h_c, weight, labels, inv_t, lse_ent, cache, g_diff: torch.Tensor, params: LCEParams,
                 need_dh: bool, need_dw: bool, hidden_dtype: torch.dtype):
    """(d_hidden in hidden_dtype or None, d_weight or None) for upstream g_diff [2, N] of (logprobs,
    entropy). h_c, lse_ent and cache as lce_forward returned them. Collectives: under SP a
    reduce-scatter of d_hidden, else (reduce_d_hidden) an all-reduce SUM of it."""
    acc = torch.float64 if h_c.dtype == torch.float64 else torch.float32
    g = g_diff.to(acc)
    part = partition_rows(labels, params.ignore_index) if params.compact_ignored else None
    if part is None:
        y_c, t_c = labels, inv_t
        g = torch.where(labels != params.ignore_index, g, 0.0)  # ignored rows get exactly zero gradient
    else:
        _, y_c, t_c = _partitioned(part, labels, inv_t)
        g = torch.where(part.live, g.index_select(1, part.order), 0.0)
    dh, dw = get_backend(params.backend).backward(
        h_c, weight, y_c, t_c, params, cache, lse_ent[0], lse_ent[1], g[0].contiguous(), g[1].contiguous(),
        need_dh, need_dw, n_valid=None if part is None else part.n_valid)
    if need_dh:
        if part is not None:
            dh = dh.index_select(0, part.dest)
        if params.sequence_parallel:
            # reduce-scatter: vocab-partial full-sequence grads -> this rank's shard of the total
            dh = comms.reduce_scatter_rows(dh, params.tp_group)
        elif params.reduce_d_hidden:
            # all-reduce: vocab-partial grads of the replicated hidden -> the total on every rank
            dh = comms.all_reduce_sum_(dh, params.tp_group)
        dh = dh.to(hidden_dtype)
    return dh, dw


class LinearLogprobsEntropy(torch.autograd.Function):
    """Per-token logprobs and entropy of softmax(h·Wᵀ/T) without materialising logits (TP path).

    Inputs: hidden [N, H] (or this rank's [N/tp, H] sequence shard under sequence parallel), weight
    [V_shard, H] (this rank's vocab shard), labels [N] int64 global ids with ignore_index rows, inv_t
    [N] fp32 or None, params (LCEParams). Outputs: [2, N] logprobs and entropy (differentiable), [3, N]
    max_logit, min_logit (raw logits, before temperature) and lse (tempered; not differentiable).

    Collectives (group = params.tp_group; none when tp_size == 1), each of the same size on every rank:
      forward : sequence_parallel -> all-gather of hidden rows (sequence shards -> full sequence);
                MAX of [max, -min] per token; SUM of packed [s, a, z_label] per token. Nothing N×V or V×H.
      backward: sequence_parallel -> reduce-scatter of d_hidden (vocab-partial full-sequence grads ->
                this rank's shard of the total); else, if reduce_d_hidden, all-reduce SUM of d_hidden
                (vocab-partial -> total on every rank); reduce_d_hidden=False leaves d_hidden partial for a
                caller whose own mapping reduces it (Megatron's copy_to_tensor_model_parallel_region).
                d_hidden is reduced in fp32, exactly once. d_weight is local to the shard: never reduced.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, params: LCEParams):
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        f = lce_forward(hidden, weight, labels, inv_t, params, keep_cache=keep)
        ctx.save_for_backward(f.h_c, weight, labels, inv_t, f.lse_ent)
        ctx.params, ctx.cache, ctx.hidden_dtype = params, f.cache, hidden.dtype
        ctx.mark_non_differentiable(f.stats)
        return f.diff, f.stats

    @staticmethod
    def backward(ctx, g_diff, _g_stats):
        h_c, weight, labels, inv_t, lse_ent = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return None, None, None, None, None
        dh, dw = lce_backward(h_c, weight, labels, inv_t, lse_ent, ctx.cache, g_diff, ctx.params,
                              need_dh, need_dw, ctx.hidden_dtype)
        ctx.cache = None
        return dh, dw, None, None, None
