"""Launchers of the selected-id and top-k kernels (select_kernels.py) for the Triton backend: the backend
contract's optional `gather_logits` and `segment_logits` (base.py)."""
from __future__ import annotations

import torch
import triton

from ... import exact
from ...types import LCEParams
from ..base import head_transform
from . import configs
from .launch import INTERPRET, _alloc, _device_ctx, _dot_precision
from .select_kernels import gather_logits_kernel, segment_logits_kernel, sparse_dl_kernel

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
    pair in the [T·block] output): the pairs grouped by segment into tasks of up to `block` rows, on the
    device, no host sync (T = ceil(P / block) + G bounds the task count)."""
    p = rows.shape[0]
    dev = rows.device
    order = torch.sort(segs, stable=True).indices
    s_sorted = segs[order]
    counts = torch.bincount(segs, minlength=G)
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
