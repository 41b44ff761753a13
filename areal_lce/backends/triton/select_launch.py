"""Launchers of the selected-id and top-k kernels (select_kernels.py) for the Triton backend: the backend
contract's optional `gather_logits` and `segment_logits` (base.py)."""
from __future__ import annotations

from dataclasses import replace

import torch
import triton

from ... import exact
from ...types import LCEParams
from ..base import head_transform
from . import configs
from .launch import INTERPRET, _alloc, _cap_args, _device_ctx, _dot_precision, _slots
from .select_kernels import (candidate_topk_kernel, gather_logits_kernel, overflow_topk_kernel, segment_best_kernel,
                             segment_candidates_kernel, segment_logits_kernel, sparse_dl_kernel)

GATHER_R, GATHER_J, GATHER_H = 16, 8, 64


def gather_logits(hidden: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 [N, J] h_n · W[cols[n, j]] (cols local and in range), bits independent of N, J and position."""
    n, j = cols.shape
    out = _alloc((n, j), torch.float32, hidden.device)
    if n and j:
        with _device_ctx(hidden.device):
            gather_logits_kernel[(triton.cdiv(n, GATHER_R), triton.cdiv(j, GATHER_J))](
                hidden, weight, cols.contiguous(), out, n, j, hidden.shape[1],
                BLOCK_R=GATHER_R, BLOCK_J=GATHER_J, BLOCK_H=GATHER_H, num_warps=4)
    return out


def _tasks(rows: torch.Tensor, segs: torch.Tensor, G: int, block: int):
    """(task_rows [T, block] with -1 padding, task_seg [T] with -1 for unused tasks, flat position of each
    pair in the [T·block] output): the pairs grouped by segment (< G) into tasks of up to `block` rows, on
    the device, no host sync (T = ceil(P / block) + G bounds the task count)."""
    p = rows.shape[0]
    dev = rows.device
    s_sorted, order = torch.sort(segs.to(torch.int32), stable=True)
    bounds = torch.arange(G + 1, dtype=torch.int32, device=dev)
    edges = torch.searchsorted(s_sorted, bounds)  # pairs before each segment: no atomics, no sync
    first = edges[:-1]
    counts = edges[1:] - first
    blocks = (counts + block - 1) // block
    block0 = torch.cumsum(blocks, 0) - blocks
    s_sorted = s_sorted.long()
    rank = torch.arange(p, device=dev) - first[s_sorted]
    task = block0[s_sorted] + rank // block
    slot = rank % block
    t_max = -(-p // block) + G
    task_rows = torch.full((t_max, block), -1, dtype=torch.int64, device=dev)
    task_rows[task, slot] = rows[order]
    task_seg = torch.full((t_max,), -1, dtype=torch.int64, device=dev)
    task_seg[task] = s_sorted
    pos = torch.empty_like(order)
    pos[order] = task * block + slot
    return task_rows, task_seg, pos


def segment_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor,
                   params: LCEParams) -> torch.Tensor:
    """[P, 128] head-transformed raw logits of segment segs[p] (local index) for row rows[p], bitwise the
    invariant forward's (its tile config and operand types); -inf past the shard's valid columns."""
    n, h = hidden.shape
    valid = params.shard_valid
    G = exact.segments(valid)
    cfg = configs.tile("fwd", fp32=hidden.dtype == torch.float32, interpret=INTERPRET, H=h)
    block = cfg.block_n
    task_rows, task_seg, pos = _tasks(rows, segs, G, block)
    out = _alloc((task_seg.shape[0] * block, exact.SEG), torch.float32, hidden.device)
    if rows.shape[0]:
        with _device_ctx(hidden.device):
            segment_logits_kernel[(task_seg.shape[0],)](
                hidden, weight, task_rows, task_seg, out, n, h, valid,
                SEG=exact.SEG, BLOCK_N=block, BLOCK_K=cfg.block_k, EVEN_K=h % cfg.block_k == 0, UPCAST=INTERPRET,
                DOT_PRECISION=_dot_precision(hidden.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    r = out[pos]
    if params.bf16_logits or params.softcap:  # elementwise, as the forward does after the accumulation
        real = (segs[:, None] * exact.SEG + torch.arange(exact.SEG, device=r.device)) < valid
        r = torch.where(real, head_transform(r, params), float("-inf"))
    return r


SPARSE_BLOCK_N = 64


def add_sparse_columns(dl: torch.Tensor, sparse, c0: int, width: int) -> None:
    """The backward chunk's d_logits dl [N, width] (columns [c0, c0 + width)) += sparse=(cols, coef)'s
    coefficients that fall in it (base.py's takes_sparse)."""
    cols, coef = sparse
    n, j = cols.shape
    if n and j:
        sparse_dl_kernel[(triton.cdiv(n, SPARSE_BLOCK_N),)](
            dl, cols.contiguous(), coef.contiguous(), n, j, c0, width, dl.stride(0), BLOCK_N=SPARSE_BLOCK_N,
            num_warps=4)


def _inv_t_args(inv_t, like: torch.Tensor):
    if torch.is_tensor(inv_t):
        return inv_t.to(torch.float32).contiguous(), 1.0, True
    return like, float(inv_t), False


BEST_CHUNK = 256  # maxima segment_best_kernel compares per row and step
BEST_ROWS = 16 if INTERPRET else 1  # rows per segment_best_kernel program (GPU: one row on one warp)
PAD_KEY = 0x7FFFFF << 31  # select.sort_key(-inf, 2^31 - 1): below every logit's key
TOPK_CHUNK = 128  # candidates candidate_topk_kernel counts at a time (a row has about k of them)
TOPK_ROWS = 64 if INTERPRET else 4  # rows per candidate_topk_kernel program (4 rows on one warp: the fastest,
#                                      results/archive/h100_select_topk_profiles)
TOPK_SPILL = 128  # candidate slots per row beyond its kk stored maxima (a row needs about 2 more for k = 64)
OVERFLOW_PROGRAMS_PER_SM = 2  # overflow_topk_kernel: programs per SM striding over the rows


def rank_segments(seg_rows: torch.Tensor, inv_t, kk: int, top=None, vocab_start: int = 0):
    """([N, kk] local segment indices of each row's kk largest tempered segment maxima (seg_rows [N, G] raw),
    ties to the lower segment (select.topk_keys), in segment order, [N] fp32 the kk-th largest tempered
    maximum, and with top = (the forward's max columns int8 [G, N], second values fp32 [G, N]) the chosen
    segments' max keys [N, kk] and bool [N, kk] True where the segment must be recomputed, else None, None):
    segment_best_kernel."""
    N, G = seg_rows.shape
    seg_rows = seg_rows.contiguous()
    dev = seg_rows.device
    it, scalar, has = _inv_t_args(inv_t, seg_rows)
    best = torch.zeros((N, kk), dtype=torch.int64, device=dev)  # a NaN row's untaken slots: 0
    thr = _alloc((N,), torch.float32, dev)
    stored = flags = None
    if top is not None:
        stored = _alloc((N, kk), torch.int64, dev)
        flags = torch.ones((N, kk), dtype=torch.int8, device=dev)
    if N and G and kk:
        with _device_ctx(dev):
            segment_best_kernel[(triton.cdiv(N, BEST_ROWS),)](
                seg_rows, it, best, thr, top[0] if top is not None else best, top[1] if top is not None else thr,
                stored if top is not None else best, flags if top is not None else best, N, G, kk, scalar,
                vocab_start, HAS_INV_T=has, HAS_TOP=top is not None, BLOCK_N=BEST_ROWS, CHUNK=BEST_CHUNK,
                num_warps=4 if INTERPRET else 1)
    return best, thr, stored, flags.bool() if flags is not None else None


def _recompute_tile(h: int, dtype: torch.dtype):
    """The forward's tile, with 64-row tasks (one warpgroup) where it has 128 rows in two: the same
    tensor-core accumulation per row (tests/backends/test_triton_select_rank.py checks the bits on a GPU),
    half the work for the few rows a segment's recompute usually has."""
    cfg = configs.tile("fwd", fp32=dtype == torch.float32, interpret=INTERPRET, H=h)
    if cfg.block_n == 128 and cfg.num_warps == 8:
        cfg = replace(cfg, block_n=64, num_warps=4)
    return cfg


def candidate_topk(hidden: torch.Tensor, weight: torch.Tensor, row0: int, segs: torch.Tensor, thr: torch.Tensor,
                   inv_t, params: LCEParams, vocab_start: int, k: int, stored: torch.Tensor = None,
                   recompute: torch.Tensor = None) -> torch.Tensor:
    """[c, k] select.sort_key keys of the k largest tempered logits of rows [row0, row0 + c) within their
    segments segs [c, kk], descending (keys below every logit where a row has fewer than k columns).
    Candidates: `stored` [c, kk] keys where `recompute` [c, kk] is False (select.topk_keys: each segment's
    max, from the forward), and the logits >= thr[row] of the segments recomputed with the forward's bits
    (all of them without `stored`); then the k best of those. With `stored` a row's list holds kk +
    TOPK_SPILL keys; the rows that need more (overflow_topk_kernel) are redone one program per row."""
    c, kk = segs.shape
    n, h = hidden.shape
    dev = hidden.device
    out = _alloc((c, k), torch.int64, dev)
    if not (c and kk):
        return out.fill_(PAD_KEY)
    valid = params.shard_valid
    G = exact.segments(valid)
    cfg = _recompute_tile(h, hidden.dtype)
    rows = torch.arange(row0, row0 + c, device=dev).repeat_interleave(kk)
    if stored is None:
        cap = kk * exact.SEG  # every column of the row's segments: the list cannot overflow
        cand = _alloc((c, cap), torch.int64, dev)
        count = torch.zeros(c, dtype=torch.int32, device=dev)
        pair_segs = segs.reshape(-1)
    else:
        cap = kk + TOPK_SPILL
        cand = _alloc((c, cap), torch.int64, dev)
        cand[:, :kk] = torch.where(recompute, PAD_KEY, stored)
        count = torch.full((c,), kk, dtype=torch.int32, device=dev)
        pair_segs = torch.where(recompute, segs, G).reshape(-1)  # segment G: a task with nothing to do
    task_rows, task_seg, _ = _tasks(rows, pair_segs, G + 1, cfg.block_n)
    it, scalar, has = _inv_t_args(inv_t, cand)
    thr = thr.contiguous()
    common = dict(SEG=exact.SEG, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=h % cfg.block_k == 0,
                  UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(hidden.dtype), HAS_INV_T=has,
                  BF16_LOGITS=params.bf16_logits, SOFTCAP=bool(params.softcap))
    with _device_ctx(dev):
        segment_candidates_kernel[(task_seg.shape[0],)](
            hidden, weight, task_rows, task_seg, it, thr, count, cand, row0, cap, h, valid, G, vocab_start, scalar,
            *_cap_args(params), **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        candidate_topk_kernel[(triton.cdiv(c, TOPK_ROWS),)](
            cand, count, out, c, cap, k, PAD_KEY, BLOCK_R=TOPK_ROWS, CHUNK=TOPK_CHUNK, K2=triton.next_power_of_2(k),
            num_warps=1)
        if stored is not None:
            n_prog = min(c, _slots(dev) * OVERFLOW_PROGRAMS_PER_SM)
            scratch = _alloc((n_prog, kk * exact.SEG), torch.int64, dev)
            overflow_topk_kernel[(n_prog,)](
                hidden, weight, segs.contiguous(), recompute.to(torch.int8).contiguous(), stored.contiguous(), it,
                thr, count, out, scratch, c, kk, cap, row0, h, valid, vocab_start, scalar, *_cap_args(params), k,
                PAD_KEY, n_prog, **common, CHUNK=TOPK_CHUNK, K2=triton.next_power_of_2(k), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    return out
