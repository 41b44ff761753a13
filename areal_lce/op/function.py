"""The fused op's forward and backward: row partition, one backend call per pass, TP communication.

`lce_forward` / `lce_backward` are the real implementations of the `areal_lce::lce_forward` /
`lce_backward` torch.library ops of library.py, the op's one entry at every TP degree (eager or under
torch.compile). Neither reads a device value on the host unless params.check_labels is "sync".

Collectives (group = params.tp_group, carried by name; none when tp_size == 1), each of the same size on
every rank; d_hidden modes as defined in VocabParallel's docstring (types.py):
  forward : check_labels "sync" / "deferred" -> MAX of 2 int64 (the ranks' label fingerprints);
            "reduce_scatter" -> all-gather of hidden rows (sequence shards -> full sequence);
            MAX of the raw [max, -min] per token; SUM of packed [s, a, z_label(, Σr, Σr²)] per token.
            Nothing N×V or V×H.
  backward: "reduce_scatter" -> reduce-scatter of d_hidden (vocab-partial full-sequence grads ->
            this rank's shard of the total); "all_reduce" -> all-reduce SUM of d_hidden
            (vocab-partial -> total on every rank); "caller" -> none (d_hidden left vocab-partial).
            d_hidden is reduced in fp32. d_weight is local to the shard: never reduced.

Context parallelism: no CP collective, by design. Each CP rank passes its CP-local tokens (megatron's
load-balanced zigzag: every sequence cut into 2·cp chunks, rank r keeps chunks r and 2·cp−1−r; per
batch row for BSHD, per packed sequence for THD) with their labels. Every per-token output depends on
its own row only, so the CP-local outputs are the full-sequence values at those tokens. d_hidden stays
local (each token's gradient lives where the token lives). d_weight is this rank's partial sum over
its own tokens; the full-sequence gradient is its SUM over the CP group, which megatron's DDP does
when it reduces every parameter over the data-parallel × context-parallel group. Reducing it here
too would count it twice.

Ignored rows (label == ignore_index) always get zero upstream gradient. With params.compact_ignored
(the API's default for backends that do not skip ignored rows themselves) the rows are partitioned on
the device, valid rows first in their original order, into a buffer of the full size N; the ignored tail
is zero-filled (hidden 0, 1/T = 1), so any backend computes exactly zero gradient for it. Without it the
rows reach the backend in place: the triton backend (skips_ignored_rows) runs no GEMM for row blocks
that hold only ignored rows and zeroes the d_logits of every ignored row itself, so it needs neither the
partition nor the copies of hidden and d_hidden it costs. Every shape, and so every collective, is the
same on every rank and every step: nothing is counted on the host.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch

from . import checks, comms, exact, select, select_grad
from .backends.base import ShardStats
from .types import LCEParams


def merge_shard_stats(st: ShardStats, group, inv_t) -> ShardStats:
    """Merge per-shard (m, s, a, zy, mn, mx[, lsum, lsq]) into full-vocabulary values. Pure math + two
    collectives. inv_t: this call's [N] inverse temperatures, or the scalar."""
    # 1 collective: MAX of the raw [mx, -mn] gives the global max and min logit at once.
    mm = torch.stack([st.mx, -st.mn])
    comms.all_reduce_max_(mm, group)
    big_mx, mn = mm[0], -mm[1]
    big_m = big_mx * inv_t  # the global tempered max, exactly (backends/base.py: m = mx · inv_t)
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
    return ShardStats(m=big_m, s=packed[0], a=packed[1], zy=packed[2], mn=mn, mx=big_mx,
                      lsum=packed[3] if sums else None, lsq=packed[4] if sums else None)


def finish_stats(st: ShardStats):
    """(logprob, entropy, lse) of the tempered logits from merged statistics."""
    log_s = torch.log(st.s)
    lse = st.m + log_s
    ent = log_s - st.a / st.s
    return st.zy - lse, ent, lse


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


class RowPartition(NamedTuple):
    """Valid rows first, on the device. Position j of the partitioned buffer holds original row order[j];
    original row i sits at position dest[i]; positions >= n_valid ([1] int64) hold the ignored rows (their
    labels stay ignore_index, so a backend that skips ignored rows skips the tail's blocks)."""

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
    dstats: torch.Tensor  # [R, N]: params.dstat_rows (lse[, sum_logit]), differentiable, 0 at ignored rows
    stats: torch.Tensor  # [S, N]: params.stat_rows (max_logit, min_logit[, sums]), not differentiable
    h_c: torch.Tensor  # hidden as the backend saw it (full sequence under SP; partitioned)
    lse_ent: torch.Tensor  # [2, N] (lse, entropy) in the backend's row order, for the backward
    cache: object  # the backend's logits cache, or None
    sel: Optional[torch.Tensor] = None  # [N, K] logprobs at selected_ids (differentiable)
    topk_lp: Optional[torch.Tensor] = None  # [N, k] logprobs of the top-k ids (differentiable)
    topk_ids: Optional[torch.Tensor] = None  # [N, k] int64


def _check_values(labels, inv_t, v_shard: int, params: LCEParams) -> Optional[torch.Tensor]:
    """params.check_labels on this call's labels and 1/T (checks.py); under TP also the agreement of
    the ranks' labels and shard sizes: one all-reduce of 2 int64 on the device, read in the one host
    sync of "sync" mode, folded into the device-side record in "deferred" mode. Returns the [N] mask
    of rows whose logprob is set to NaN ("deferred"), or None."""
    if params.check_labels == "off":
        return None
    votes = None
    if params.tp_size > 1:
        votes = comms.agreement_votes(checks.tp_key(labels, params.ignore_index, v_shard), params.tp_group)
    if params.check_labels == "deferred":
        return checks.record(labels, inv_t, params.vocab_size, params.ignore_index, votes=votes,
                             fold=params.backend.record_labels)

    def disagreement():  # collective, entered by every rank together (they all read the same votes)
        comms.raise_disagreement(
            {"weight's vocab shard size (weight.shape[0])": v_shard, "labels.numel()": labels.numel(),
             "the number of ignore_index labels": int((labels == params.ignore_index).sum())}, params.tp_group,
            "labels differ across the tensor-parallel group (same count and ignore_index rows, other ids)",
            "every rank must pass an equal-sized vocab shard and the same global labels")

    checks.check_now(labels, inv_t, params.vocab_size, params.ignore_index, votes=votes,
                     on_disagreement=disagreement)
    return None


def lce_forward(hidden, weight, labels, inv_t, params: LCEParams, keep_cache: bool,
                selected_ids: Optional[torch.Tensor] = None) -> Forward:
    """hidden [N, H] (this rank's [N/tp, H] shard under SP), weight [V_shard, H], labels [N] int64,
    inv_t [N] fp32 or None, selected_ids [N, K] int64 or None. Collectives: the label agreement votes under
    TP with checks on, an all-gather of hidden under SP, then the merge (and select.py's under TP)."""
    bad = _check_values(labels, inv_t, weight.shape[0], params)
    if params.d_hidden == "reduce_scatter":
        hidden = comms.all_gather_rows(hidden, params.tp_group)  # sequence shards -> full sequence
    part = partition_rows(labels, params.ignore_index) if params.compact_ignored else None
    if part is None:
        h_c, y_c, t_c = hidden, labels, inv_t
    else:
        h_c, y_c, t_c = _partitioned(part, labels, inv_t, hidden)
    backend = params.backend
    extra = {}
    if selected_ids is not None and params.invariant and backend.extracts_selected:
        extra["selected"] = selected_ids if part is None else selected_ids.index_select(0, part.order)
    st = backend.forward(h_c, weight, y_c, t_c, params, keep_cache=keep_cache, **extra)
    if params.invariant:
        fin = exact.merge(st, params, params.inv_t if t_c is None else t_c)
        if st.seg_top is not None:  # merged: the top-k reads the maxima from seg_top, the partials can go
            st = dataclasses.replace(st, seg=None)
        vals = dict(logprobs=fin.lp, entropy=fin.ent, lse=fin.lse, max_logit=fin.mx, min_logit=fin.mn,
                    sum_logit=fin.lsum, sumsq_logit=fin.lsq)
    else:
        # one shard holds the whole vocabulary: its statistics are already the merged ones (m = mx · inv_t
        # exactly, base.py), so the merge, an identity then, is skipped with its dozen [N] kernels
        merged = st if params.tp_size == 1 else merge_shard_stats(st, params.tp_group,
                                                                  params.inv_t if t_c is None else t_c)
        lp, ent, lse = finish_stats(merged)
        vals = dict(logprobs=lp, entropy=ent, lse=lse, max_logit=merged.mx, min_logit=merged.mn,
                    sum_logit=merged.lsum, sumsq_logit=merged.lsq)
    valid = labels != params.ignore_index
    outs = []
    for rows in (("logprobs", "entropy"), params.dstat_rows, params.stat_rows):
        o = torch.stack([vals[r] for r in rows])
        if part is not None:
            o = o.index_select(1, part.dest)  # back to the caller's row order
        outs.append(torch.where(valid, o, 0.0))
    diff, dstats, stats = outs
    if bad is not None:
        # deferred check: rows with a bad label (all rows when the TP ranks disagree) show at once
        diff[0].masked_fill_(bad, float("nan"))
    lse_ent = torch.stack([vals["lse"], vals["entropy"]])
    if part is not None:
        lse_ent = torch.where(part.live, lse_ent, 0.0)  # the tail's stats are unspecified (skipped rows)
    sel, topk_lp, topk_ids = select.forward_outputs(hidden, weight, labels, inv_t, params, st, part, dstats[0],
                                                    selected_ids)
    return Forward(diff, dstats, stats, h_c, lse_ent, st.cache, sel, topk_lp, topk_ids)


def lce_backward(h_c, weight, labels, inv_t, lse_ent, cache, g_diff: Optional[torch.Tensor], params: LCEParams,
                 need_dh: bool, need_dw: bool, hidden_dtype: torch.dtype, g_dstats: Optional[torch.Tensor] = None,
                 selected_ids=None, g_sel=None, topk_ids=None, g_topk=None):
    """(d_hidden in hidden_dtype or None, d_weight or None) for upstream g_diff [2, N] of (logprobs,
    entropy) (None: zero), g_dstats [R, N] of (lse[, sum_logit]), g_sel [N, K] of the selected logprobs at
    selected_ids and g_topk [N, k] at topk_ids (each None when unused). h_c, lse_ent and cache as lce_forward
    returned them. Collectives: under SP a reduce-scatter or an all-reduce SUM of d_hidden, as
    params.d_hidden says (VocabParallel)."""
    acc = torch.float64 if h_c.dtype == torch.float64 else torch.float32
    g = g_diff.to(acc) if g_diff is not None else h_c.new_zeros((2, labels.shape[0]), dtype=acc)
    sparse = select_grad.SparseGrad.of(labels, inv_t, params, g, g_dstats, selected_ids, g_sel, topk_ids, g_topk, acc)
    dw_dtype = params.d_weight_dtype(weight.dtype)
    backend = params.backend
    takes = backend.takes_sparse
    if sparse is not None:
        g = sparse.g  # g_lp carries the dense part of the lse / selected / top-k gradients
        if not takes:
            params = dataclasses.replace(params, d_weight_fp32=True)  # sparse_grad adds in fp32, then one cast
    part = partition_rows(labels, params.ignore_index) if params.compact_ignored else None
    h_caller = None
    if sparse is not None:
        h_caller = h_c if part is None else h_c.index_select(0, part.dest)
    extra = {}
    if sparse is not None and takes:
        cols, coef = sparse.columns(h_caller, weight, params)
        if part is not None:  # the backend's rows are the partitioned ones
            cols, coef = cols.index_select(0, part.order), coef.index_select(0, part.order)
        extra["sparse"] = (cols, coef)
    if part is None:
        y_c, t_c = labels, inv_t
        g = torch.where(labels != params.ignore_index, g, 0.0)  # ignored rows get exactly zero gradient
    else:
        _, y_c, t_c = _partitioned(part, labels, inv_t)
        g = torch.where(part.live, g.index_select(1, part.order), 0.0)
    dh, dw = backend.backward(
        h_c, weight, y_c, t_c, params, cache, lse_ent[0], lse_ent[1], g[0].contiguous(), g[1].contiguous(),
        need_dh, need_dw, **extra)
    if need_dh:
        if part is not None:
            dh = dh.index_select(0, part.dest)
        elif not backend.skips_ignored_rows:
            # rows in place on a backend that computes them: an ignored row's 0 · NaN (a NaN hidden) must
            # not reach its d_hidden (the contract of api.py), so select rather than trust the zero grad
            dh = torch.where((labels != params.ignore_index)[:, None], dh, 0.0)
    if sparse is not None:
        sparse.apply(h_caller, weight, params, dh if need_dh else None, dw if need_dw else None,
                     columns_done=takes)
        if need_dw:
            dw = dw.to(dw_dtype)
    if need_dh:
        if params.d_hidden == "reduce_scatter":
            # reduce-scatter: vocab-partial full-sequence grads -> this rank's shard of the total
            dh = comms.reduce_scatter_rows(dh, params.tp_group)
        elif params.d_hidden == "all_reduce":
            # all-reduce: vocab-partial grads of the replicated hidden -> the total on every rank
            dh = comms.all_reduce_sum_(dh, params.tp_group)
        dh = dh.to(hidden_dtype)
    return dh, dw


def empty_extras(f: Forward, n: int, device):
    """The selected / top-k outputs of a forward with empty [N, 0] tensors where not asked (op outputs
    must be tensors)."""
    def e(t, dtype):
        return t if t is not None else torch.empty((n, 0), dtype=dtype, device=device)
    return e(f.sel, torch.float32), e(f.topk_lp, torch.float32), e(f.topk_ids, torch.int64)
