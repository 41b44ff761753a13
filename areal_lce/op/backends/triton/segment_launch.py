"""Launchers of invariant mode on the Triton backend (segment_kernels.py; exact.py states the arithmetic)."""
from __future__ import annotations

from dataclasses import replace

import torch
import triton

from ... import exact
from ...types import LCEParams
from ..base import ShardStats, alloc
from . import configs
from .runtime import (INTERPRET, TensorDescriptor, cap_args, descriptors, device_ctx, dot_precision,
                      launch_opts)
from .select_launch import pick_selected
from .segment_kernels import (lce_fwd_seg_kernel, lce_seg_finish_kernel, lce_seg_fold_kernel, lce_seg_reduce_kernel,
                              transpose_kernel)


TRANSPOSE_TILE = 64
# A top-k forward keeps each segment's max column and second value when k · H >= TOP_KH_PER_ID · V, V the
# shard's columns. That epilogue costs ~6 more operations per logit (N·V of them on each rank) and spares the
# top-k all but ~2 of a row's k chosen segments; without it each rank recomputes all k of its chosen segments (a
# GEMM of N·k·128·H, reading W once per segment). On an H100 the break-even lies between k·H/V = 0.2 and 0.5
# (results/archive/h100_select_topk_route: both ways at k = 8, 16, 64 and the four benchmark shapes, the same bits).
TOP_KH_PER_ID = 0.4


def keeps_top(k: int, h: int, params: LCEParams) -> bool:
    """Whether the forward of a top-k call keeps seg_top's max columns and second values: k, H and the shard's
    width only, so every batch decides alike (and ranks whose shards differ in width may decide apart: either way
    the top-k's keys are the same bits)."""
    return 0 < k and k * h >= TOP_KH_PER_ID * params.shard_valid


def forward_segments(hidden, weight, y, it, inv_t_scalar, params: LCEParams, cfg, split_v, n_splits,
                      cache, selected=None) -> ShardStats:
    """Invariant mode (exact.py): per-segment partials, then the exact per-row extrema and label logit.
    The split plan may follow N: a segment's partials do not depend on which program computed it.
    selected: global ids [N, K] in this row order whose raw logits the kernel takes from its tiles, one per
    row and segment (select_launch.pick_selected); ShardStats.sel then holds them."""
    N, H = hidden.shape
    valid, dev, sums = params.shard_valid, hidden.device, params.logit_sums
    seg_w = exact.SEG
    if cfg.block_v % seg_w or split_v % cfg.block_v:
        raise ValueError(f"triton backend: invariant mode needs BLOCK_V ({cfg.block_v}) a multiple of "
                         f"{seg_w} dividing the split width ({split_v})")
    sub = cfg.block_v // seg_w
    if sub not in (1, 2):
        raise ValueError(f"triton backend: invariant mode takes BLOCK_V of 128 or 256, got {cfg.block_v}")
    G = exact.segments(valid)
    k = 5 if sums else 3
    if k * G * N >= 2 ** 31:
        raise ValueError(f"triton backend: invariant mode's segment partials ({k} x {G} x {N}) exceed int32 "
                         "offsets: split the call into fewer rows")
    seg = alloc((k, G, N), torch.float32, dev)
    keep = keeps_top(params.top_k, H, params)
    top = alloc((G, N), torch.float32, dev) if keep else None  # each segment's second value
    top_col = alloc((G, N), torch.int8, dev) if keep else None
    top_rows = alloc((N, G), torch.float32, dev) if params.top_k else None
    part = alloc((3, n_splits, N), torch.float32, dev)
    picks = pick_selected(selected, y, params, G) if selected is not None else None
    sel_raw = alloc(selected.shape, torch.float32, dev) if picks is not None else None
    d_h = d_w = None
    if configs.USE_TMA and TensorDescriptor is not None:
        d_h, d_w = descriptors(hidden, weight[:valid], replace(cfg, block_v=seg_w))
    with device_ctx(dev):
        lce_fwd_seg_kernel[(triton.cdiv(N, cfg.block_n) * n_splits,)](
            hidden, weight, d_h, d_w, y, it if it is not None else part, seg, top if top is not None else part,
            top_col if top_col is not None else part, part,
            cache if cache is not None else part, *(picks[:2] if picks is not None else (part, part)),
            sel_raw if sel_raw is not None else part,
            N, H, valid, G, split_v, n_splits, G * N, n_splits * N, inv_t_scalar, *cap_args(params),
            selected.shape[1] if picks is not None else 0,
            HAS_INV_T=it is not None, HAS_CACHE=cache is not None, HAS_SUMS=sums, HAS_TOP=top is not None,
            HAS_SEL=picks is not None,
            BF16_LOGITS=params.bf16_logits, SOFTCAP=bool(params.softcap), EVEN_K=H % cfg.block_k == 0, UPCAST=INTERPRET,
            DOT_PRECISION=dot_precision(hidden.dtype), USE_TMA=d_h is not None,
            SEG=seg_w, SUB=sub, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n,
            CACHE_COLS=configs.CACHE_COLS, **launch_opts(cfg),
        )
        out = alloc((3, N), torch.float32, dev)
        lce_seg_reduce_kernel[(triton.cdiv(N, configs.MERGE_BLOCK_N),)](
            part, out, N, n_splits, n_splits * N, BLOCK_N=configs.MERGE_BLOCK_N, num_warps=4)
        if top_rows is not None:  # the maxima again with each row's segments contiguous, for the ranking
            transpose_kernel[(triton.cdiv(G, TRANSPOSE_TILE), triton.cdiv(N, TRANSPOSE_TILE))](
                seg, top_rows, G, N, BLOCK_R=TRANSPOSE_TILE, BLOCK_C=TRANSPOSE_TILE, num_warps=4)
    return ShardStats(m=None, s=None, a=None, zy=out[2], mn=out[1], mx=out[0], cache=cache, seg=seg,
                      seg_top=(top_col, top, top_rows) if top_rows is not None else None,
                      sel=(sel_raw, picks[2]) if picks is not None else None)

def fold_segments(seg, mx, inv_t, scales):
    """exact.fold_segments in one launch: int64 [3 or 5, N]."""
    k, G, N = seg.shape
    q = torch.zeros((k, N), dtype=torch.int64, device=seg.device)
    it = inv_t.to(torch.float32).contiguous() if torch.is_tensor(inv_t) else None
    if N and G:
        with device_ctx(seg.device):
            lce_seg_fold_kernel[(triton.cdiv(N, configs.MERGE_BLOCK_N), triton.cdiv(G, configs.FOLD_SEGMENTS))](
                seg, mx.contiguous(), it if it is not None else mx,
                scales.contiguous() if scales is not None else mx, q, N, G, G * N,
                float(inv_t) if it is None else 1.0,
                HAS_INV_T=it is not None, HAS_SUMS=k == 5, SCALE=float(2 ** exact.FRAC_BITS),
                BLOCK_N=configs.MERGE_BLOCK_N, G_CHUNK=configs.FOLD_SEGMENTS, num_warps=4)
    return q

def finish_folded(q, zy, mx, mn, inv_t, scales) -> exact.Finished:
    """exact.finish in one launch."""
    k, N = q.shape
    sums = k == 5
    out = alloc((7 if sums else 5, N), torch.float32, q.device)
    it = inv_t.to(torch.float32).contiguous() if torch.is_tensor(inv_t) else None
    if N:
        with device_ctx(q.device):
            lce_seg_finish_kernel[(triton.cdiv(N, configs.MERGE_BLOCK_N),)](
                q, zy.contiguous(), mx.contiguous(), mn.contiguous(), it if it is not None else mx,
                scales.contiguous() if sums else mx, out, N, float(inv_t) if it is None else 1.0,
                HAS_INV_T=it is not None, HAS_SUMS=sums, INV_SCALE=2.0 ** -exact.FRAC_BITS,
                BLOCK_N=configs.MERGE_BLOCK_N, num_warps=4)
    return exact.Finished(out[0], out[1], out[2], out[3], out[4], out[5] if sums else None,
                          out[6] if sums else None)
