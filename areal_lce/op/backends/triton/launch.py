"""Launchers of the Triton backend: checks, allocation, grids, block choice, cuBLAS GEMMs.

Ignored rows (label == params.ignore_index) need no compaction (skips_ignored_rows, base.py): the
kernels read each row block's label columns, where an ignored row is IGNORED. A block whose rows are
all ignored runs no GEMM (the forward folds no vocab tile, the recompute stores zero d_logits); in a
block that mixes both, the ignored rows' d_logits are set to exactly 0. The cuBLAS d_hidden / d_weight
GEMMs still span all N rows, so nothing about the shapes depends on the labels.

Forward (one fused pass, no [N, V] tensor unless the logits cache is on):
    lce_fwd_kernel      grid = ceil(N / BLOCK_N) x n_splits programs, each a token block x a vocab
                        split, tensor-core GEMM tiles with the online-softmax epilogue
    lce_fwd_merge_kernel  per-split partials -> (m, s, a, zy, mn, mx[, Σr, Σr²]), fixed split order
Backward, per vocab chunk [c0, c1) of the shard (fixed chunk order, no atomics: bitwise deterministic):
    lce_bwd_kernel      recompute (or read cached) logits, write d_logits [N, c1 - c0] (bf16 for
                        bf16/fp16 inputs, fp32 for fp32 inputs and under the interpreter); persistent:
                        SM slots x BWD_PROGRAMS_PER_SM programs walk the chunk's tiles
    lce_bwd_label_kernel  add the one-hot term at each row's label column (under params.softcap
                        lce_bwd_kernel adds it, times the cap's slope, and this kernel is not launched)
    Determinism costs one thing: d_hidden is accumulated chunk after chunk, so each chunk's GEMM
    re-reads and re-writes the fp32 [N, H] accumulator (8·N·H bytes per chunk) instead of atomics.
    cuBLAS              d_weight[c0:c1] = d_logitsᵀ · h   (one GEMM over all N tokens: fp32 accumulate
                        inside cuBLAS, rounded once to the weight dtype)
                        d_hidden += d_logits · W[c0:c1]  (fp32 [N, H] accumulator, bf16 operands with an
                        fp32 output via torch's out_dtype GEMMs)

Extra device memory (bytes), beyond inputs and the returned gradients:
    forward   24·N·n_splits + 28·N            (partials, merged stats, int32 labels;
                                               32·N·n_splits + 36·N with params.logit_sums)
              + 4·N·ceil(shard_valid / 256)·256   only when the logits cache is kept
    backward  N·V_chunk·e  <=  max(B, 256·N·e),  B = min(WORKSPACE_BYTES, max(MIN_WORKSPACE_BYTES,
              BACKWARD_BYTES - 4·N·H)), with e = 2 (bf16/fp16) or 4 (fp32, interpreter) and
              V_chunk = shard_valid split into the fewest equal multiples of 256 that fit B
    (configs: WORKSPACE_BYTES 256 MiB, BACKWARD_BYTES 512 MiB, MIN_WORKSPACE_BYTES 64 MiB by default:
    the d_logits workspace plus the fp32 d_hidden stay within 512 MiB while d_hidden is under
    448 MiB.) The returned d_hidden is fp32 [N, H] (4·N·H bytes); d_weight is [V_shard, H] in the
    weight dtype.
"""
from __future__ import annotations

import functools
from typing import Any, Tuple

import torch
import triton

from ...types import LCEParams
from ..base import Backend, ShardStats, alloc, check_shard
from . import configs, output_launch, segment_launch, select_launch
from .gemms import Gemms
from .runtime import INTERPRET, cap_args, descriptors, device_ctx, dot_precision, launch_opts, sm_slots
from .value_check import record_labels
from .kernels import (lce_bwd_kernel, lce_bwd_label_kernel, lce_fwd_kernel, lce_fwd_merge_kernel,
                      local_labels_kernel)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=1024)
def _split_plan(N: int, valid: int, block_n: int, slots: int, interpret: bool) -> Tuple[int, int]:
    """(split width, n_splits) for the forward grid.

    Work is n_blocks_n x units tiles of SPLIT_UNIT columns. Time is modelled as waves x units per
    split (one program per SM slot at a time); pick the split width with the fewest modelled unit-steps,
    ties to the wider split. Small N thus gets many narrow splits and large N avoids a ragged last wave.
    """
    unit = configs.SPLIT_UNIT
    units = triton.cdiv(valid, unit)
    n_blocks_n = triton.cdiv(N, block_n)
    max_units = max(1, (1024 if interpret else configs.MAX_SPLIT) // unit)
    if interpret:
        per = min(units, max_units)
        return per * unit, triton.cdiv(units, per)
    best = None
    for per in range(1, min(units, max_units) + 1):
        n_splits = triton.cdiv(units, per)
        waves = triton.cdiv(n_blocks_n * n_splits, slots)
        cost = (waves * per, -per)
        if best is None or cost < best[0]:
            best = (cost, per)
    per = best[1]
    return per * unit, triton.cdiv(units, per)


def _local_labels(labels: torch.Tensor, params: LCEParams) -> torch.Tensor:
    """This shard's label columns as contiguous int32, in one launch (local_labels_kernel): -1 where
    another shard owns the label, IGNORED (-2) at ignore_index rows.

    The int64 labels are read from a 16-byte aligned base (copied otherwise): int64 loads from addresses
    that are not 16-byte aligned miscompile."""
    y = labels.to(torch.int64).contiguous()
    if y.data_ptr() % 16:
        y = y.clone()
    n = y.numel()
    out = torch.empty(n, dtype=torch.int32, device=y.device)
    if n:
        with device_ctx(y.device):
            local_labels_kernel[(triton.cdiv(n, configs.LOCAL_LABELS_BLOCK),)](
                y, out, n, params.vocab_start, params.shard_valid, params.ignore_index,
                BLOCK=configs.LOCAL_LABELS_BLOCK, num_warps=4)
    return out


def _check(hidden, weight, labels, inv_t, params: LCEParams) -> None:
    check_shard("triton", _DTYPES, hidden, weight, labels, inv_t, params)
    dev = hidden.device
    if dev.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"triton backend: tensors are on {dev}; run on CUDA, or set TRITON_INTERPRET=1 "
                           "before areal_lce.op.backends.triton is imported to run the kernels on CPU")


class TritonBackend(Backend):
    """Backend contract of base.py on CUDA (and on CPU under TRITON_INTERPRET=1). Memory bound: module
    docstring. backward_gemms=False is for profiling (`benchmark.op.bench_lce` times the backward kernels
    alone): the backward skips its cuBLAS d_hidden / d_weight GEMMs and returns (None, None)."""

    name = "triton"
    skips_ignored_rows = True  # module docstring: no compaction needed
    supports_softcap = True  # the kernels' SOFTCAP flag (kernels.py)

    def __init__(self, backward_gemms: bool = True):
        self.backward_gemms = bool(backward_gemms)

    def cache_spec(self, n, h, v_shard, dtype, params: LCEParams, keep_cache: bool):
        """fp32 column slabs (_cache_shape) when this shard's fp32 logits 4·N·V_shard fit cache_bytes."""
        if not (keep_cache and n > 0 and params.shard_valid > 0 and 0 < n * v_shard * 4 <= params.cache_bytes):
            return None
        cfg = configs.tile("fwd", fp32=dtype == torch.float32, interpret=INTERPRET, H=h)
        if configs.CACHE_COLS % cfg.block_v:
            return None  # the cache tiles assume BLOCK_V divides CACHE_COLS (kernels.py)
        return _cache_shape(n, params.shard_valid), torch.float32

    # deferred label / temperature check in one launch (checks.record's `fold`)
    record_labels = staticmethod(record_labels)

    # ------------------------------------------------------------------------------------ forward
    extracts_selected = True  # forward(..., selected=ids) in invariant mode: ShardStats.sel (base.py)

    def forward(self, hidden, weight, labels, inv_t, params: LCEParams, keep_cache: bool,
                selected=None) -> ShardStats:
        _check(hidden, weight, labels, inv_t, params)
        N, H = hidden.shape
        valid = params.shard_valid
        dev = hidden.device
        sums = params.logit_sums
        if N == 0 or valid == 0:
            return _empty_stats(N, dev, sums, params.invariant)
        hidden, weight = hidden.contiguous(), weight.contiguous()
        y = _local_labels(labels, params)
        it = inv_t.to(torch.float32).contiguous() if inv_t is not None else None
        inv_t_scalar = params.inv_t if inv_t is None else 1.0
        spec = self.cache_spec(N, H, weight.shape[0], hidden.dtype, params, keep_cache)
        use_cache = spec is not None

        cfg = configs.tile("fwd", fp32=hidden.dtype == torch.float32, interpret=INTERPRET, H=H)
        split_v, n_splits = _split_plan(N, valid, cfg.block_n, sm_slots(dev), INTERPRET)
        if params.invariant:
            cache = alloc(spec[0], torch.float32, dev) if use_cache else None
            if selected is not None and not select_launch.takes_picks(selected.shape[1], H, params):
                selected = None  # gathered afterwards (select.py)
            return segment_launch.forward_segments(hidden, weight, y, it, inv_t_scalar, params, cfg, split_v, n_splits,
                                                   cache, selected)
        rows = 8 if sums else 6  # (m, s, a, zy, mn, mx[, Σr, Σr²])
        part = alloc((rows, n_splits, N), torch.float32, dev)
        cache = alloc(spec[0], torch.float32, dev) if use_cache else None
        out = alloc((rows, N), torch.float32, dev)
        grid = (triton.cdiv(N, cfg.block_n) * n_splits,)
        d_h, d_w = descriptors(hidden, weight[:valid], cfg)
        with device_ctx(dev):
            lce_fwd_kernel[grid](
                hidden, weight, d_h, d_w, y, it if it is not None else part, part, cache if use_cache else part,
                N, H, valid, split_v, n_splits, n_splits * N, inv_t_scalar, *cap_args(params),
                HAS_INV_T=it is not None, HAS_CACHE=use_cache, HAS_SUMS=sums, BF16_LOGITS=params.bf16_logits,
                SOFTCAP=bool(params.softcap),
                EVEN_K=H % cfg.block_k == 0,
                UPCAST=INTERPRET, DOT_PRECISION=dot_precision(hidden.dtype), USE_TMA=d_h is not None,
                BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n,
                CACHE_COLS=configs.CACHE_COLS, **launch_opts(cfg),
            )
            lce_fwd_merge_kernel[(triton.cdiv(N, configs.MERGE_BLOCK_N),)](
                part, out, N, n_splits, n_splits * N, HAS_SUMS=sums, BLOCK_N=configs.MERGE_BLOCK_N, num_warps=4,
            )
        return ShardStats(m=out[0], s=out[1], a=out[2], zy=out[3], mn=out[4], mx=out[5], cache=cache,
                          lsum=out[6] if sums else None, lsq=out[7] if sums else None)

    # invariant mode (exact.py): segment_launch.py
    def fold_segments(self, seg, mx, inv_t, scales):
        return segment_launch.fold_segments(seg, mx, inv_t, scales)

    def finish_folded(self, q, zy, mx, mn, inv_t, scales):
        return segment_launch.finish_folded(q, zy, mx, mn, inv_t, scales)

    # selected ids and top-k (select.py): select_launch.py and output_launch.py
    ranks_topk = True  # rank_segments / candidate_topk
    fused_rows = True  # selected_raw, selected_logprobs, topk_logprobs, sparse_columns

    def gather_logits(self, hidden, weight, cols):
        return select_launch.gather_logits(hidden, weight, cols)

    def pair_logits(self, hidden, weight, ids, need, vocab_start):
        return select_launch.pair_logits(hidden, weight, ids, need, vocab_start)

    def rank_segments(self, seg_max, inv_t, kk, top=None, vocab_start=0, lists=False):
        return select_launch.rank_segments(seg_max, inv_t, kk, top, vocab_start, lists)

    def candidate_topk(self, hidden, weight, row0, segs, thr, inv_t, params, vocab_start, k, plan=None):
        return select_launch.candidate_topk(hidden, weight, row0, segs, thr, inv_t, params, vocab_start, k, plan)

    def selected_raw(self, hidden, weight, ids, params):
        return output_launch.selected_raw(hidden, weight, ids, params)

    def selected_logprobs(self, r, ids, labels, lse, inv_t, params):
        return output_launch.selected_logprobs(r, ids, labels, lse, inv_t, params)

    def topk_logprobs(self, keys, labels, lse, params):
        return output_launch.topk_logprobs(keys, labels, lse, params)

    def sparse_columns(self, labels, inv_t, params, g, g_lse, parts):
        return output_launch.sparse_columns(labels, inv_t, params, g, g_lse, parts)

    # ----------------------------------------------------------------------------------- backward
    takes_sparse = True  # backward(..., sparse=(cols, coef)): base.py; select_launch.add_sparse_columns

    def backward(self, hidden, weight, labels, inv_t, params: LCEParams, cache: Any, lse, ent, g_lp, g_ent,
                 need_d_hidden: bool, need_d_weight: bool, sparse=None):
        _check(hidden, weight, labels, inv_t, params)
        if not (need_d_hidden or need_d_weight):
            return None, None
        N, H = hidden.shape
        Vs = weight.shape[0]
        valid = params.shard_valid
        dev = hidden.device
        dh = alloc((N, H), torch.float32, dev) if need_d_hidden else None
        dw = alloc((Vs, H), params.d_weight_dtype(weight.dtype), dev) if need_d_weight else None
        if dw is not None and valid < Vs:
            dw[valid:].zero_()  # vocabulary padding rows get no gradient
        if N == 0 or valid == 0:
            if dh is not None:
                dh.zero_()
            if dw is not None:
                dw.zero_()
            return dh, dw
        if cache is not None and (not torch.is_tensor(cache) or tuple(cache.shape) != _cache_shape(N, valid)):
            raise ValueError(f"triton backend: logits cache must be this backend's fp32 "
                             f"{_cache_shape(N, valid)} forward cache, got {getattr(cache, 'shape', type(cache))}")
        hidden, weight = hidden.contiguous(), weight.contiguous()
        y = _local_labels(labels, params)
        it = inv_t.to(torch.float32).contiguous() if inv_t is not None else None
        inv_t_scalar = params.inv_t if inv_t is None else 1.0
        vecs = [t.to(torch.float32).contiguous() for t in (lse, ent, g_lp, g_ent)]

        fp32 = hidden.dtype == torch.float32
        cfg = configs.tile("bwd", fp32=fp32, interpret=INTERPRET, H=H)
        if cache is not None and configs.CACHE_COLS % cfg.block_v:
            raise ValueError(f"triton backend: backward BLOCK_V={cfg.block_v} must divide CACHE_COLS="
                             f"{configs.CACHE_COLS} to read the logits cache")
        ws_dtype = torch.float32 if (fp32 or INTERPRET) else hidden.dtype
        esize = torch.finfo(ws_dtype).bits // 8
        chunk = _chunk_width(N, H, valid, esize, cfg.block_v)
        ws = alloc((N * chunk,), ws_dtype, dev)
        gemm = Gemms(hidden, weight, ws_dtype)
        d_h, d_w = descriptors(hidden, weight[:valid], cfg) if cache is None else (None, None)
        with device_ctx(dev):
            for c0 in range(0, valid, chunk):
                width = min(chunk, valid - c0)
                dl = ws[: N * width].view(N, width)
                tiles = triton.cdiv(N, cfg.block_n) * triton.cdiv(width, cfg.block_v)
                n_programs = min(tiles, sm_slots(dev) * configs.BWD_PROGRAMS_PER_SM)
                lce_bwd_kernel[(n_programs,)](
                    hidden, weight, d_h, d_w, y, it if it is not None else vecs[0], *vecs,
                    cache if cache is not None else vecs[0], dl,
                    N, H, valid, c0, width, width, n_programs, inv_t_scalar, *cap_args(params),
                    HAS_INV_T=it is not None, USE_CACHE=cache is not None, SOFTCAP=bool(params.softcap),
                    EVEN_K=H % cfg.block_k == 0,
                    UPCAST=INTERPRET, BF16_LOGITS=params.bf16_logits, DOT_PRECISION=dot_precision(hidden.dtype),
                    USE_TMA=d_h is not None,
                    BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n,
                    CACHE_COLS=configs.CACHE_COLS, **launch_opts(cfg),
                )
                if not params.softcap:  # under softcap lce_bwd_kernel adds the one-hot term (times its slope)
                    lce_bwd_label_kernel[(triton.cdiv(N, configs.LABEL_FIX_BLOCK_N),)](
                        dl, y, it if it is not None else vecs[0], vecs[2], N, c0, width, width, inv_t_scalar,
                        HAS_INV_T=it is not None, BLOCK_N=configs.LABEL_FIX_BLOCK_N, num_warps=4,
                    )
                if sparse is not None:
                    select_launch.add_sparse_columns(dl, sparse, c0, width)
                if dw is not None and self.backward_gemms:
                    gemm.d_weight(dl, dw[c0:c0 + width])
                if dh is not None and self.backward_gemms:
                    gemm.d_hidden(dl, weight[c0:c0 + width], dh, first=c0 == 0)
        return (dh, dw) if self.backward_gemms else (None, None)


def _chunk_width(N: int, H: int, valid: int, esize: int, block_v: int = 256) -> int:
    """Vocab columns per backward chunk: the fewest equal chunks whose [N, width] workspace fits the
    budget. Wide chunks matter: each chunk re-reads and re-writes the fp32 d_hidden accumulator
    (8·N·H bytes) in its cuBLAS GEMM, so halving the width costs ~5 ms at 8192x4096x151936 (H100)."""
    unit = max(configs.SPLIT_UNIT, block_v)
    budget = min(configs.WORKSPACE_BYTES, max(configs.MIN_WORKSPACE_BYTES, configs.BACKWARD_BYTES - 4 * N * H))
    t_max = max(1, budget // max(1, N * esize) // unit)
    tiles = triton.cdiv(valid, unit)
    n_chunks = triton.cdiv(tiles, t_max)
    return int(triton.cdiv(tiles, n_chunks) * unit)


def _cache_shape(N: int, valid: int) -> Tuple[int, int, int]:
    """The forward's logits cache: column slabs [ceil(valid / CACHE_COLS), N, CACHE_COLS] (kernels.py)."""
    return (triton.cdiv(valid, configs.CACHE_COLS), N, configs.CACHE_COLS)


def cache_logits(cache: torch.Tensor, valid: int) -> torch.Tensor:
    """The cached fp32 tempered logits as an [N, valid] view-copy (for tests and debugging)."""
    t, n, c = cache.shape
    return cache.permute(1, 0, 2).reshape(n, t * c)[:, :valid]


def _empty_stats(N: int, dev, sums: bool, invariant: bool = False) -> ShardStats:
    z = torch.zeros(N, dtype=torch.float32, device=dev)
    inf = torch.full((N,), float("inf"), dtype=torch.float32, device=dev)
    if invariant:
        return ShardStats(m=None, s=None, a=None, zy=z, mn=inf, mx=-inf, cache=None,
                          seg=torch.zeros((5 if sums else 3, 0, N), dtype=torch.float32, device=dev))
    return ShardStats(m=-inf, s=z, a=z.clone(), zy=z.clone(), mn=inf.clone(), mx=-inf, cache=None,
                      lsum=z.clone() if sums else None, lsq=z.clone() if sums else None)
