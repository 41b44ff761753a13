"""Selected-id and top-k logprobs of the fused op, and the sparse part of their gradient.

selected_ids [N, K] (global ids, ignore_index entries allowed) and top_k give per-row logprobs at K (k)
chosen columns: logprob_j = z_j - lse with z_j = cap(r_j) · inv_t, r_j = h · W_j (the op's lse, so
they are consistent with its logprobs and entropy to fp32 rounding). Nothing [N, V] is built.

Selected logits. Each rank computes r_j for the ids in its shard (0 elsewhere); the TP group SUMs them,
which is exact because exactly one rank contributes a nonzero. By default the backend's `gather_logits`
computes them (a fixed-order dot product per (row, id): its bits depend on the row and the id only, not
on N, K, the row's position or the TP degree); the torch version (backends/base.py) computes fixed-shape
blocks of GATHER_ROWS rows x GATHER_IDS ids. The gather reads K weight rows per token, so for many ids a backend
with `extracts_selected` (triton, invariant mode, where K·H is large against V) takes them from its
forward's own logit tiles instead: one column per row and 128-id segment, in the same one-hot reduction
that takes the label's logit (the label's own id included), and only the ids left over (a second id in a
segment, an id beside the label in its segment: about K²/2G per row) are computed apart (`pair_logits`,
fixed order). Which route a slot takes depends on the row's own ids and label only, so the values stay
batch- and TP-invariant; a taken value is bitwise the forward's logit (so a selected id at a top-k id
gives its top-k logprob bitwise).

Top-k, exact with ties broken by the lower id, from the invariant forward's segment maxima (exact.py:
the raw max of every 128-id segment). If a column x is among a row's k largest then x's segment is among
the row's k segments with the largest maxima (ordered by tempered max, ties to the lower segment): each
segment ranked ahead holds an element that beats x. So each rank (1) picks its k best segments per row,
(2) recomputes just those segments' logits with the backend's `segment_logits` — the same GEMM blocks
as its forward, so the same bits — and takes the k best of them, (3) the TP group all-gathers the
[N, k] candidates and keeps the k best. Candidates travel as one int64 key per (value, id) whose order is
(value descending, id ascending), so every step is an exact integer top-k. Memory: the recomputed
segments of a row chunk, O(chunk · k · 128), never [N, V]. Cost: a GEMM of N·k·128 columns (about
k·128/V of the forward's) and, under TP, one all-gather of N·k int64.

A backend with its own top-k kernels (triton) does less. Let T be the k-th largest of the k chosen
segments' max keys: every one of the row's k largest keys is >= T (k keys reach it), so only logits >= T
are candidates (about k of them). The ranking kernel lists, per segment, the rows that recompute it, and
each listed segment's rows are recomputed together. Where k·H is large against V, the forward of a top-k
call also keeps each segment's max column and second largest value (base.ShardStats.seg_top), which gives
each chosen segment's max key without a recompute; a segment can hold a candidate besides its max only if
its second value reaches T, and only those segments (about 2 per row for k = 64, almost none for k = 8 on
the benchmark's rows) are listed. Elsewhere that per-logit epilogue costs more than recomputing all k
(segment_launch.keeps_top); the keys are the same bits either way. The row's k best candidates are then
found by bisection on the keys (no sort). A flat row recomputes all k segments; its list may then outgrow
the fixed per-row list (kk + a spill), and such rows are redone one program per row (exact, slower).

Their gradients: select_grad.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import comms, exact
from .backends.base import head_transform
from .types import LCEParams

_ID_BITS = exact.KEY_ID_BITS
_ID_MASK = (1 << _ID_BITS) - 1
CHUNK_ELEMS = 1 << 24  # recomputed logits per row chunk (64 MiB fp32)


def sort_key(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (z descending, id ascending) under a descending sort: the fp32 bits of z
    mapped to an order-preserving 32-bit integer, above 31 bits of (2^31 - 1 - id). -0.0 counts as +0.0."""
    bits = (z.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)
    u = bits & 0xFFFFFFFF
    mono = torch.where(bits >= 0, u + (1 << 31), (1 << 32) - 1 - u)
    return (mono << _ID_BITS) | (_ID_MASK - ids.to(torch.int64))


def key_value(key: torch.Tensor) -> torch.Tensor:
    """fp32 value of `sort_key` keys (exact)."""
    mono = key >> _ID_BITS
    u = torch.where(mono >= (1 << 31), mono - (1 << 31), (1 << 32) - 1 - mono)
    return torch.where(u >= (1 << 31), u - (1 << 32), u).to(torch.int32).view(torch.float32)


def key_id(key: torch.Tensor) -> torch.Tensor:
    return _ID_MASK - (key & _ID_MASK)


def local_columns(ids: torch.Tensor, params: LCEParams):
    """(local column clamped into the shard, mask of real ids this shard owns) of global ids [N, J]."""
    loc = ids - params.vocab_start
    own = (ids != params.ignore_index) & (loc >= 0) & (loc < params.shard_valid)
    return torch.where(own, loc, torch.zeros_like(loc)), own


def fused_rows(params: LCEParams) -> bool:
    """Whether the backend's one-launch per-row steps (base.Backend.fused_rows) serve this call: not under
    softcap (torch's tanh)."""
    return params.backend.fused_rows and not params.softcap


def selected_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, params: LCEParams,
                    picked=None, part=None) -> torch.Tensor:
    """Raw (rounded, capped) logits at global ids [N, K], summed over the TP group; 0 where no rank owns
    the id (ignore_index entries). picked: ShardStats.sel (in the forward's row order, `part`), the values
    the forward took from its tiles; the backend's pair_logits computes only the slots it left (-1), and
    -2 (not this shard's id, or a row without a label, which the caller zeroes anyway) gives 0."""
    if ids.shape[1] == 0 or params.shard_valid == 0:
        r = torch.zeros(ids.shape, dtype=torch.float32, device=hidden.device)
    elif picked is not None:
        raw, src = picked
        if part is not None:
            raw, src = raw.index_select(0, part.dest), src.index_select(0, part.dest)
        rest = head_transform(params.backend.pair_logits(hidden, weight, ids, src == -1, params.vocab_start),
                              params)
        r = torch.where(src >= 0, raw.gather(1, src.clamp(min=0)), torch.where(src == -1, rest, 0.0))
    elif fused_rows(params):
        r = params.backend.selected_raw(hidden, weight, ids, params)
    else:
        loc, own = local_columns(ids, params)
        r = head_transform(params.backend.gather_logits(hidden, weight, loc), params)
        r = torch.where(own, r, 0.0)
    if params.tp_size > 1:
        # one rank owns each id: the SUM adds zeros to it, exactly
        comms.all_reduce_sum_(r, params.tp_group)
    return r


def topk_keys(hidden: torch.Tensor, weight: torch.Tensor, seg_max: torch.Tensor, inv_t, params: LCEParams,
              k: int, seg_params: Optional[LCEParams] = None, seg_top: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sort_key of each row's k largest tempered logits over the whole vocabulary, [N, k] descending.
    seg_max [G, N]: this shard's raw segment maxima (exact.py layout, caller row order); seg_params: the
    params the segments were cut with (their vocab_start may be this shard's own start, see function.py);
    seg_top: (int8 [G, N] each segment's max column, fp32 [G, N] its second largest raw value, fp32 [N, G] the
    maxima with each row's segments contiguous), in caller row order, where the forward kept them (then only the chosen
    segments whose second value reaches the threshold are recomputed)."""
    sp = seg_params or params
    n = hidden.shape[0]
    G = seg_max.shape[0]
    dev = hidden.device
    it = inv_t[:, None].float() if torch.is_tensor(inv_t) else float(inv_t)
    kk = min(k, G)
    own = sp.backend
    native = own if own.ranks_topk else None  # ranks, recomputes and selects in its own kernels
    one_pass = native is not None and seg_top is not None and kk == k
    if kk and native is not None:
        rows_major = seg_top[2] if seg_top is not None else seg_max.t()
        # with the forward's maxima (and k segments: else every column is a candidate) the ranking lists per
        # segment the rows that recompute it; with their max columns and second values it also gives each
        # chosen segment's max key and whether the segment must be recomputed: a row's k largest keys are all
        # >= T, the k-th largest of its segments' max keys (k keys reach T); one that is not its segment's max
        # is at most the segment's second value, so only segments whose tempered second value reaches T's
        # value (thr) can hold one beyond their max
        top = seg_top[:2] if one_pass and seg_top[0] is not None else None
        segs, thr, plan = native.rank_segments(rows_major, inv_t if torch.is_tensor(inv_t) else it, kk, top,
                                               params.vocab_start, one_pass)
        if kk < k:  # fewer segments than k: every column of the shard is a candidate
            thr = torch.full_like(thr, float("-inf"))
    elif kk:
        seg_of = torch.arange(G, device=dev)
        seg_rank = sort_key(seg_max.t() * it, seg_of[None, :].expand(n, G)).topk(kk, dim=1).values
        segs = key_id(seg_rank)  # [N, kk] local segment indices, best first
    if one_pass:  # with the forward's maxima the per-row lists are kk + a fixed spill: every row in one call
        out = native.candidate_topk(hidden, weight, 0, segs, thr, inv_t if torch.is_tensor(inv_t) else it, sp,
                                    params.vocab_start, k, plan)
    else:  # in row chunks: the recompute's [rows · kk, 128] logits bound them
        out = torch.full((n, k), exact.PAD_KEY, dtype=torch.int64, device=dev)  # what a shard without columns offers
        chunk = max(1, CHUNK_ELEMS // (max(kk, 1) * exact.SEG))
        for t0 in range(0, n if kk else 0, chunk):
            t1 = min(n, t0 + chunk)
            out[t0:t1] = _chunk_keys(hidden, weight, t0, t1, segs, thr if native is not None else None, inv_t, it,
                                     params, sp, k, native, own)
    if params.tp_size > 1:
        # the ranks' candidates side by side, then the k best: an exact integer top-k
        allk = comms.all_gather_rows(out.t().contiguous(), params.tp_group)  # [tp·k, N]
        out = allk.t().topk(k, dim=1).values
    return out


def _chunk_keys(hidden, weight, t0, t1, segs, thr, inv_t, it, params: LCEParams, sp: LCEParams, k, native, own):
    """[t1 - t0, k] keys of rows [t0, t1): the native backend's kernels, else its (or torch's) recompute of
    the rows' chosen segments and an integer top-k of their keys."""
    if native is not None:
        return native.candidate_topk(hidden, weight, t0, segs[t0:t1], thr, inv_t if torch.is_tensor(inv_t) else it,
                                     sp, params.vocab_start, k)
    dev = hidden.device
    kk = segs.shape[1]
    rows = torch.arange(t0, t1, device=dev).repeat_interleave(kk)
    r = own.segment_logits(hidden, weight, rows, segs[t0:t1].reshape(-1), sp)  # [(t1-t0)·kk, SEG], -inf past the shard
    z = r.view(t1 - t0, kk * exact.SEG) * (it[t0:t1] if torch.is_tensor(it) else it)
    cols = torch.arange(exact.SEG, device=dev)
    gid = (segs[t0:t1, :, None] * exact.SEG + cols + params.vocab_start).view(t1 - t0, -1)
    keys = sort_key(z, gid)
    if keys.shape[1] < k:  # a shard narrower than k columns: pad with keys below every logit
        keys = torch.cat([keys, torch.full((t1 - t0, k - keys.shape[1]), exact.PAD_KEY, device=dev)], 1)
    return keys.topk(k, dim=1).values


def _segment_maxima(hidden, weight, inv_t, params: LCEParams, st, part):
    """(raw segment maxima [G, N] in caller row order, the params they were cut with, the forward's seg_top
    in caller row order or None): the invariant forward's own, else one pass of the torch backend's segment
    blocks over this shard (ids relative to the shard start; the top-k then recomputes with the torch
    blocks too)."""
    if st.seg_top is not None:  # the maxima from seg_top's rows-contiguous plane (the partials are gone)
        top = st.seg_top
        if part is not None:
            col, second, rows_major = top
            top = (col.index_select(1, part.dest) if col is not None else None,
                   second.index_select(1, part.dest) if second is not None else None,
                   rows_major.index_select(0, part.dest))
        return top[2].t(), params, top
    if st.seg is not None:
        seg = st.seg[0]
        return (seg if part is None else seg.index_select(1, part.dest)), params, None
    import dataclasses

    from .backends.torch_chunked import TorchChunkedBackend, invariant_forward
    sp = dataclasses.replace(params, vocab_start=0, invariant=True, logit_sums=False, backend=TorchChunkedBackend(),
                             tp_size=1, group_name=None, d_hidden="all_reduce")
    labels = torch.full((hidden.shape[0],), -1, dtype=torch.int64, device=hidden.device)
    return invariant_forward(hidden, weight, labels, inv_t, sp).seg[0], sp, None


def check_selected_ids(ids: torch.Tensor, params: LCEParams) -> Optional[torch.Tensor]:
    """check_labels on selected_ids' values ([0, vocab_size) or ignore_index): "sync" raises, "deferred"
    returns the mask of bad entries (their logprob becomes NaN), "off" returns None."""
    if params.check_labels == "off":
        return None
    bad = (ids != params.ignore_index) & ((ids < 0) | (ids >= params.vocab_size))
    if params.check_labels == "sync":
        if bool(bad.any()):
            first = ids[bad][:4].tolist()
            raise ValueError(f"selected_ids holds ids outside [0, vocab_size={params.vocab_size}) that are not "
                             f"ignore_index={params.ignore_index}: e.g. {first}")
        return None
    return bad


def forward_outputs(hidden, weight, labels, inv_t, params: LCEParams, st, part, lse, selected_ids):
    """(selected logprobs [N, K], top-k logprobs [N, k], top-k ids [N, k]) in caller row order, None where
    not asked. hidden: the full sequence in caller order; lse: [N] fp32 (0 at ignored rows)."""
    if selected_ids is None and not params.top_k:
        return None, None, None
    it = inv_t.float() if inv_t is not None else params.inv_t

    def row_terms():  # the torch route's (row holds a label, fp64 lse), [N, 1] each
        return (labels != params.ignore_index)[:, None], lse.double()[:, None]
    sel = topk_lp = topk_ids = None
    if selected_ids is not None:
        finish = params.backend.selected_logprobs if fused_rows(params) else None  # it takes the "deferred" NaN itself
        bad = check_selected_ids(selected_ids, params) if finish is None or params.check_labels == "sync" else None
        r = selected_logits(hidden, weight, selected_ids, params, st.sel, part)
        if finish is not None:
            sel = finish(r, selected_ids, labels, lse, it, params)
        else:
            valid, lse2 = row_terms()
            z = r * (it[:, None] if torch.is_tensor(it) else it)
            sel = torch.where(valid & (selected_ids != params.ignore_index), (z.double() - lse2).float(), 0.0)
        if bad is not None:
            sel = sel.masked_fill(bad, float("nan"))
    if params.top_k:
        seg_max, sp, seg_top = _segment_maxima(hidden, weight, inv_t, params, st, part)
        keys = topk_keys(hidden, weight, seg_max, it, params, params.top_k, sp, seg_top)
        finish = params.backend.topk_logprobs if fused_rows(params) else None
        if finish is not None:
            topk_lp, topk_ids = finish(keys, labels, lse, params)
        else:
            valid, lse2 = row_terms()
            topk_lp = torch.where(valid, (key_value(keys).double() - lse2).float(), 0.0)
            topk_ids = torch.where(valid, key_id(keys), params.ignore_index)
    return sel, topk_lp, topk_ids
