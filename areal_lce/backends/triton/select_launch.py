"""Launchers of the selected-id and top-k kernels (select_kernels.py) for the Triton backend: the backend
contract's optional `gather_logits` and `segment_logits` (base.py)."""
from __future__ import annotations

import torch
import triton

from ... import exact
from ...types import LCEParams
from ..base import head_transform
from . import configs
from .launch import INTERPRET, _alloc, _cap_args, _device_ctx, _dot_precision
from .select_kernels import (gather_logits_kernel, segment_best_kernel, segment_keys_kernel, segment_logits_kernel,
                             segment_rank_kernel, sparse_dl_kernel)

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


def _tasks(rows: torch.Tensor, segs: torch.Tensor, G: int, block: int, dest=None):
    """(task_rows [T, block] with -1 padding, task_seg [T] with -1 for unused tasks, flat position of each
    pair in the [T·block] output, and with `dest` [P] the pairs' destinations laid out like task_rows): the
    pairs grouped by segment into tasks of up to `block` rows, on the device, no host sync
    (T = ceil(P / block) + G bounds the task count)."""
    p = rows.shape[0]
    dev = rows.device
    order = torch.sort(segs, stable=True).indices
    s_sorted = segs[order]
    counts = torch.zeros(G, dtype=torch.int64, device=dev).index_add_(0, segs, torch.ones_like(segs))  # no sync
    first = torch.cumsum(counts, 0) - counts
    blocks = (counts + block - 1) // block
    block0 = torch.cumsum(blocks, 0) - blocks
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
    task_dest = None
    if dest is not None:
        task_dest = torch.zeros((t_max, block), dtype=torch.int64, device=dev)
        task_dest[task, slot] = dest[order]
    return task_rows, task_seg, pos, task_dest


def segment_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor,
                   params: LCEParams) -> torch.Tensor:
    """[P, 128] head-transformed raw logits of segment segs[p] (local index) for row rows[p], bitwise the
    invariant forward's (its tile config and operand types); -inf past the shard's valid columns."""
    n, h = hidden.shape
    valid = params.shard_valid
    G = exact.segments(valid)
    cfg = configs.tile("fwd", fp32=hidden.dtype == torch.float32, interpret=INTERPRET, H=h)
    block = cfg.block_n
    task_rows, task_seg, pos, _ = _tasks(rows, segs, G, block)
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


RANK_N, RANK_G = 32, 128
_ID_MASK = (1 << 31) - 1


def _inv_t_args(inv_t, like: torch.Tensor):
    if torch.is_tensor(inv_t):
        return inv_t.to(torch.float32).contiguous(), 1.0, True
    return like, float(inv_t), False


BEST_ELEMS = 4096  # fp32 maxima one segment_best_kernel program holds (BLOCK_N rows x BLOCK_G segments)
KEEP_MAX = 16  # candidate_width: each segment's k best are kept for k <= KEEP_MAX (a bitonic top-k in the kernel)


def rank_segments(seg_max: torch.Tensor, inv_t, kk: int) -> torch.Tensor:
    """[N, kk] local segment indices of each row's kk largest tempered segment maxima (seg_max [G, N] raw),
    ties to the lower segment (select.topk_keys): in segment order from segment_best_kernel when a row's G
    segments fit one program, else best first from torch's top-k of segment_rank_kernel's keys."""
    G, N = seg_max.shape
    it, scalar, has = _inv_t_args(inv_t, seg_max)
    block_g = triton.next_power_of_2(max(G, 1))
    if block_g <= BEST_ELEMS and kk <= KEEP_MAX:  # beyond, torch's radix top-k of the keys is the faster
        best = torch.zeros((N, kk), dtype=torch.int64, device=seg_max.device)  # a NaN row's untaken slots: 0
        if N and G and kk:
            block_n = 1  # one row per program: the fastest (benchmark/results/archive/h200_select_rank_blocks)
            with _device_ctx(seg_max.device):
                segment_best_kernel[(triton.cdiv(N, block_n),)](
                    seg_max.contiguous(), it, best, N, G, kk, scalar, HAS_INV_T=has, BLOCK_N=block_n,
                    BLOCK_G=block_g, KK2=triton.next_power_of_2(kk), num_warps=4)
        return best
    keys = _alloc((N, G), torch.int64, seg_max.device)
    if N and G:
        with _device_ctx(seg_max.device):
            segment_rank_kernel[(triton.cdiv(N, RANK_N), triton.cdiv(G, RANK_G))](
                seg_max.contiguous(), it, keys, N, G, scalar, HAS_INV_T=has, BLOCK_N=RANK_N, BLOCK_G=RANK_G,
                num_warps=4)
    return _ID_MASK - (keys.topk(kk, dim=1).values & _ID_MASK)


def candidate_width(k: int) -> int:
    """Candidate keys candidate_keys keeps per (row, segment) for a top-k: for k <= KEEP_MAX the segment's
    k best (a power of two >= k), else all 128. Under the CPU interpreter all 128 (its bitonic top-k is numpy
    over a 2^12-point hypercube per program, minutes per call; tests drive the truncation directly)."""
    return triton.next_power_of_2(max(k, 1)) if k <= KEEP_MAX and not INTERPRET else exact.SEG


def candidate_keys(hidden: torch.Tensor, weight: torch.Tensor, row0: int, segs: torch.Tensor, inv_t,
                   params: LCEParams, vocab_start: int, k: int = exact.SEG, keep: int = 0) -> torch.Tensor:
    """[c, kk·candidate_width(k)] sort keys (select.sort_key of the tempered logit and the global id) of the
    segments segs [c, kk] of rows [row0, row0 + c), computed with the forward's bits (segment_keys_kernel):
    per segment its candidate_width(k) best (or `keep`, a power of two >= k), which hold every key of the
    row's top-k from that segment."""
    c, kk = segs.shape
    n, h = hidden.shape
    dev = hidden.device
    valid = params.shard_valid
    cfg = configs.tile("fwd", fp32=hidden.dtype == torch.float32, interpret=INTERPRET, H=h)
    block = cfg.block_n
    rows = torch.arange(row0, row0 + c, device=dev).repeat_interleave(kk)
    dest = torch.arange(c * kk, device=dev)
    task_rows, task_seg, _, task_dest = _tasks(rows, segs.reshape(-1), exact.segments(valid), block, dest)
    keep = keep or candidate_width(k)
    keys = _alloc((c, kk * keep), torch.int64, dev)
    it, scalar, has = _inv_t_args(inv_t, keys)
    if c and kk:
        with _device_ctx(dev):
            segment_keys_kernel[(task_seg.shape[0],)](
                hidden, weight, task_rows, task_dest, task_seg, it, keys, h, valid, vocab_start, scalar,
                *_cap_args(params), SEG=exact.SEG, BLOCK_N=block, BLOCK_K=cfg.block_k, EVEN_K=h % cfg.block_k == 0,
                UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(hidden.dtype), HAS_INV_T=has,
                BF16_LOGITS=params.bf16_logits, SOFTCAP=bool(params.softcap), KEEP=keep, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    return keys
