"""Launchers of the selected-id and top-k kernels (select_kernels.py, candidate_kernels.py) for the Triton
backend: the backend contract's optional `gather_logits`, `segment_logits`, `rank_segments` and
`candidate_topk` (base.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import triton

from ... import exact
from ...exact import PAD_KEY
from ...types import LCEParams
from ..base import alloc, head_transform
from . import configs
from .runtime import INTERPRET, cap_args, device_ctx, dot_precision, sm_slots
from .candidate_kernels import (candidate_topk_kernel, listed_candidates_kernel, overflow_topk_kernel,
                                segment_candidates_kernel)
from .select_kernels import (gather_logits_kernel, pair_logits_kernel, segment_best_kernel, segment_logits_kernel,
                             selected_plan_kernel, sparse_dl_kernel)

GATHER_R, GATHER_J, GATHER_H = 16, 8, 64


def gather_logits(hidden: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 [N, J] h_n · W[cols[n, j]] (cols local and in range), bits independent of N, J and position."""
    n, j = cols.shape
    out = alloc((n, j), torch.float32, hidden.device)
    if n and j:
        with device_ctx(hidden.device):
            gather_logits_kernel[(triton.cdiv(n, GATHER_R), triton.cdiv(j, GATHER_J))](
                hidden, weight, cols.contiguous(), out, n, j, hidden.shape[1],
                BLOCK_R=GATHER_R, BLOCK_J=GATHER_J, BLOCK_H=GATHER_H, num_warps=4)
    return out


PICK_MAX_K = 32767 // exact.SEG  # a pick's code (slot · SEG + column) is an int16
PLAN_ROWS = 4 if INTERPRET else 2
# the forward takes selected ids from its tiles when K · H >= PICK_KH_PER_ID · vocab_size: what that costs (the
# plan, the plane's loads and a store per segment) does not grow with K, while the gather it spares reads K·H·2
# bytes per row, so the break-even K grows as V / H; on an H100 it lies between K·H/V = 0.4 and 0.9
# (results/archive/h100_select_picks/route.log: both routes at K = 8 to 64 and the four benchmark shapes)
PICK_KH_PER_ID = 0.75
PAIR_P, PAIR_H, PAIR_PROGRAMS_PER_SM = 16, 64, 4


def takes_picks(k: int, h: int, params: LCEParams) -> bool:
    """Whether the invariant forward takes K selected ids per row from its tiles (else they are gathered).
    K, H and the vocabulary only: every rank and every batch decide alike."""
    return 0 < k <= PICK_MAX_K and k * h >= PICK_KH_PER_ID * params.vocab_size


def pick_selected(ids: torch.Tensor, y: torch.Tensor, params: LCEParams, G: int):
    """(plane int16 [G, N], label slots int32 [N], src int64 [N, K]) of selected_plan_kernel for global ids
    [N, K] and local labels y [N] (launch._local_labels), both in the forward's row order."""
    n, k = ids.shape
    plane = torch.full((G, n), -1, dtype=torch.int16, device=ids.device)
    lslot = alloc((n,), torch.int32, ids.device)
    src = alloc((n, k), torch.int64, ids.device)
    kp = triton.next_power_of_2(k)
    rows = max(1, min(PLAN_ROWS, 8192 // (kp * kp)))
    if n:
        with device_ctx(ids.device):
            selected_plan_kernel[(triton.cdiv(n, rows),)](
                ids.contiguous(), y, plane, lslot, src, n, k, params.vocab_start, params.shard_valid,
                params.ignore_index, SEG=exact.SEG, BLOCK_R=rows, KP=kp, num_warps=4)
    return plane, lslot, src


def pair_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, need: torch.Tensor,
                vocab_start: int) -> torch.Tensor:
    """fp32 [N, K]: h_n · W[ids[n, j] - vocab_start] where need[n, j] (unspecified elsewhere), only those
    pairs computed (listed on the device: no host sync)."""
    n, k = ids.shape
    out = alloc((n, k), torch.float32, hidden.device)
    flat = need.reshape(-1)
    if flat.numel():
        pos = torch.cumsum(flat, 0)
        pairs = torch.empty(flat.numel() + 1, dtype=torch.int64, device=flat.device)
        pairs.scatter_(0, torch.where(flat, pos - 1, flat.numel()), torch.arange(flat.numel(), device=flat.device))
        n_prog = PAIR_PROGRAMS_PER_SM * sm_slots(hidden.device) if not INTERPRET else 2
        with device_ctx(hidden.device):
            pair_logits_kernel[(n_prog,)](
                hidden.contiguous(), weight.contiguous(), ids.contiguous(), pairs, pos[-1:], out, k, hidden.shape[1],
                vocab_start, n_prog, BLOCK_P=PAIR_P, BLOCK_H=PAIR_H, num_warps=4)
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
    out = alloc((task_seg.shape[0] * block, exact.SEG), torch.float32, hidden.device)
    if rows.shape[0]:
        with device_ctx(hidden.device):
            segment_logits_kernel[(task_seg.shape[0],)](
                hidden, weight, task_rows, task_seg, out, n, h, valid,
                SEG=exact.SEG, BLOCK_N=block, BLOCK_K=cfg.block_k, EVEN_K=h % cfg.block_k == 0, UPCAST=INTERPRET,
                DOT_PRECISION=dot_precision(hidden.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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


# segment_best_kernel: maxima compared per row and step, rows per program (GPU: one row on one warp, 72 registers;
# 512 maxima per step or 2 warps were no faster, results/archive/h100_select_topk_lists/profiles.log)
BEST_CHUNK = 256
BEST_ROWS = 16 if INTERPRET else 1
TOPK_CHUNK = 128  # candidates candidate_topk_kernel counts at a time (a row has about k of them)
TOPK_ROWS = 64 if INTERPRET else 4  # rows per candidate_topk_kernel program (4 rows on one warp: the fastest,
#                                      results/archive/h100_select_topk_profiles)
TOPK_SPILL = 128  # candidate slots per row beyond its kk stored maxima (a row needs about 2 more for k = 64)
OVERFLOW_PROGRAMS_PER_SM = 2  # overflow_topk_kernel: programs per SM striding over the rows
# listed_candidates_kernel: programs per SM striding over the tasks, warps of a 64-row recompute task (2 and 4:
# the fastest of the variants in results/archive/h100_select_topk_lists/profiles.log)
LISTED_PROGRAMS_PER_SM = 2
RECOMPUTE_WARPS = 4


class TopkPlan(NamedTuple):
    """What segment_best_kernel prepares for candidate_topk when the forward kept its maxima (rank_segments)."""
    cand: torch.Tensor  # int64 [N, kk + TOPK_SPILL]: the chosen segments' max keys (PAD_KEY where recomputed)
    flags: torch.Tensor  # int8 [N, kk]: 1 where chosen segment j is recomputed
    seg_count: torch.Tensor  # int32 [G]: rows listed per segment
    seg_list: torch.Tensor  # int32 [G, N]: the rows that recompute each segment


def rank_segments(seg_rows: torch.Tensor, inv_t, kk: int, top=None, vocab_start: int = 0, lists: bool = False):
    """([N, kk] local segment indices of each row's kk largest tempered segment maxima (seg_rows [N, G] raw),
    ties to the lower segment (select.topk_keys), in segment order, [N] fp32 the kk-th largest tempered
    maximum, and with lists a TopkPlan for candidate_topk (the chosen segments to recompute, listed per
    segment: with top = (the forward's max columns int8 [G, N], second values fp32 [G, N]) only those whose
    second value reaches the threshold, the others' max keys taken from the forward; without it every one),
    else None): segment_best_kernel."""
    if top is not None and not lists:
        raise ValueError("rank_segments: top (the forward's max columns and second values) serves only the plan: "
                         "pass lists=True")
    N, G = seg_rows.shape
    seg_rows = seg_rows.contiguous()
    dev = seg_rows.device
    it, scalar, has = _inv_t_args(inv_t, seg_rows)
    best = torch.zeros((N, kk), dtype=torch.int64, device=dev)  # a NaN row's untaken slots: 0
    thr = alloc((N,), torch.float32, dev)
    plan = None
    if lists:
        plan = TopkPlan(torch.full((N, kk + TOPK_SPILL), PAD_KEY, dtype=torch.int64, device=dev),  # the kernel
                        torch.ones((N, kk), dtype=torch.int8, device=dev),  # relies on both fills
                        torch.zeros(G, dtype=torch.int32, device=dev), alloc((G, N), torch.int32, dev))
    if N and G and kk:
        out_lists = plan if plan is not None else (best,) * 4
        with device_ctx(dev):
            segment_best_kernel[(triton.cdiv(N, BEST_ROWS),)](
                seg_rows, it, best, thr, top[0] if top is not None else best, top[1] if top is not None else thr,
                *out_lists, N, G, kk, kk + TOPK_SPILL, scalar, vocab_start, PAD_KEY, HAS_INV_T=has, PLAN=lists,
                HAS_TOP=top is not None, BLOCK_N=BEST_ROWS, CHUNK=BEST_CHUNK, KK2=triton.next_power_of_2(kk),
                num_warps=4 if INTERPRET else 1)
    return best, thr, plan


def _recompute_tile(h: int, dtype: torch.dtype):
    """The forward's tile, with 64-row tasks (one warpgroup) where it has 128 rows in two: the same
    tensor-core accumulation per row (tests/op/backends/test_triton_select_rank.py checks the bits on a GPU),
    half the work for the few rows a segment's recompute usually has (128-row tasks were no faster when
    every chosen segment is recomputed either: results/archive/h100_select_topk_route)."""
    cfg = configs.tile("fwd", fp32=dtype == torch.float32, interpret=INTERPRET, H=h)
    if cfg.block_n == 128 and cfg.num_warps == 8:
        cfg = replace(cfg, block_n=64, num_warps=RECOMPUTE_WARPS)
    return cfg


def _listed_tasks(plan: TopkPlan, block: int):
    """(segment of each task [T], first task of each segment [G], the task count [1]) for
    listed_candidates_kernel: segment g's listed rows in tasks of `block`, on the device (T = ceil(P /
    block) + G bounds the count for P listed pairs, P <= N·kk)."""
    G, n = plan.seg_list.shape
    blocks = torch.div(plan.seg_count + (block - 1), block, rounding_mode="floor")
    ends = torch.cumsum(blocks, 0, dtype=torch.int32)
    t_max = -(-n * plan.flags.shape[1] // block) + G
    tasks = torch.arange(t_max, dtype=torch.int32, device=blocks.device)
    # task t is segment g's when ends[g - 1] <= t < ends[g]: g = the number of ends <= t
    return torch.searchsorted(ends, tasks, right=True, out_int32=True), ends - blocks, ends[-1:]


def candidate_topk(hidden: torch.Tensor, weight: torch.Tensor, row0: int, segs: torch.Tensor, thr: torch.Tensor,
                   inv_t, params: LCEParams, vocab_start: int, k: int, plan: TopkPlan = None) -> torch.Tensor:
    """[c, k] select.sort_key keys of the k largest tempered logits of rows [row0, row0 + c) within their
    segments segs [c, kk], descending (keys below every logit where a row has fewer than k columns).
    Candidates: without a plan, the logits >= thr[row] of every chosen segment, recomputed with the forward's
    bits; with rank_segments' plan (rows 0..N, row0 = 0), each chosen segment's max key from the forward and
    the logits >= thr of the listed segments only, a row's list holding kk + TOPK_SPILL keys (the rows that
    need more, overflow_topk_kernel redoes one program per row); then the k best of those."""
    c, kk = segs.shape
    n, h = hidden.shape
    dev = hidden.device
    out = alloc((c, k), torch.int64, dev)
    if not (c and kk):
        return out.fill_(PAD_KEY)
    valid = params.shard_valid
    G = exact.segments(valid)
    cfg = _recompute_tile(h, hidden.dtype)
    it, scalar, has = _inv_t_args(inv_t, thr)
    thr = thr.contiguous()
    common = dict(SEG=exact.SEG, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=h % cfg.block_k == 0,
                  UPCAST=INTERPRET, DOT_PRECISION=dot_precision(hidden.dtype), HAS_INV_T=has,
                  BF16_LOGITS=params.bf16_logits, SOFTCAP=bool(params.softcap))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan is None:
        cap = kk * exact.SEG  # every column of the row's segments: the list cannot overflow
        cand = alloc((c, cap), torch.int64, dev)
        count = torch.zeros(c, dtype=torch.int32, device=dev)
        rows = torch.arange(row0, row0 + c, device=dev).repeat_interleave(kk)
        task_rows, task_seg, _ = _tasks(rows, segs.reshape(-1), G, cfg.block_n)
        with device_ctx(dev):
            segment_candidates_kernel[(task_seg.shape[0],)](
                hidden, weight, task_rows, task_seg, it, thr, count, cand, row0, cap, h, valid, G, vocab_start,
                scalar, *cap_args(params), **common, **launch)
    else:
        cand, cap = plan.cand, plan.cand.shape[1]
        count = torch.full((c,), kk, dtype=torch.int32, device=dev)
        task_seg, task_first, n_tasks = _listed_tasks(plan, cfg.block_n)
        n_prog = min(task_seg.shape[0], sm_slots(dev) * LISTED_PROGRAMS_PER_SM)
        with device_ctx(dev):
            listed_candidates_kernel[(n_prog,)](
                hidden, weight, plan.seg_list, plan.seg_count, task_seg, task_first, n_tasks, it, thr, count, cand,
                n, cap, h, valid, vocab_start, scalar, *cap_args(params), n_prog, **common, **launch)
    with device_ctx(dev):
        candidate_topk_kernel[(triton.cdiv(c, TOPK_ROWS),)](
            cand, count, out, c, cap, k, PAD_KEY, BLOCK_R=TOPK_ROWS, CHUNK=TOPK_CHUNK, K2=triton.next_power_of_2(k),
            num_warps=1)
        if plan is not None:
            n_prog = min(c, sm_slots(dev) * OVERFLOW_PROGRAMS_PER_SM)
            scratch = alloc((n_prog, kk * exact.SEG), torch.int64, dev)
            overflow_topk_kernel[(n_prog,)](
                hidden, weight, segs.contiguous(), plan.flags, cand, it, thr, count, out, scratch, c, kk, cap, row0,
                h, valid, vocab_start, scalar, *cap_args(params), k, PAD_KEY, n_prog, **common,
                CHUNK=TOPK_CHUNK, K2=triton.next_power_of_2(k), **launch)
    return out
