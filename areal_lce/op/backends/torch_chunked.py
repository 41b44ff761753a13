"""Chunked pure-torch backend: any device (CPU included), memory bounded by a chunk budget.

Logits exist only one [n_chunk, v_chunk] fp32 block at a time. Workspace bound (bytes), besides the
fp32 d_hidden [N, H] output: 3 · n_chunk · v_chunk · 4 (logits block and two temporaries) +
v_chunk · H · 4 (fp32 d_weight accumulator of one vocab chunk). The chunk budget is
AREAL_LCE_TORCH_CHUNK_BYTES (default 256 MiB on accelerators, 32 MiB on CPU) for one logits block.

On CUDA with bf16/fp16 inputs the GEMMs take half-precision operands with fp32 output
(torch.mm(out_dtype=float32)), d_logits being rounded once to the input dtype, as every bf16 GEMM
route does; elsewhere operands are upcast to fp32 chunk by chunk.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .. import exact
from ..types import LCEParams
from .base import Backend, ShardStats, alloc, cap_slope, head_transform

# Invariant mode: every logits GEMM has the shape [INV_ROWS, H] x [H, INV_COLS], whatever N and the shard:
# rows in fixed blocks (the last one zero-padded), columns in blocks aligned to global multiples of
# INV_COLS (zero rows of W stand in for columns outside the shard). A row's fp32 GEMM result changes with
# the number of rows in the product on CPU BLAS; with one shape everywhere it does not.
INV_ROWS = 32
INV_COLS = 1024  # a multiple of exact.SEG


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


CHUNK_ENV = "AREAL_LCE_TORCH_CHUNK_BYTES"


def chunk_budget(device: torch.device) -> int:
    """Bytes of one fp32 logits block: $AREAL_LCE_TORCH_CHUNK_BYTES (a positive integer), else the default."""
    text = os.environ.get(CHUNK_ENV, "").strip()
    if not text:
        return (32 if device.type == "cpu" else 256) << 20
    try:
        budget = int(text)
    except ValueError:
        budget = 0
    if budget <= 0:
        raise ValueError(f"environment variable {CHUNK_ENV}={text!r} must be a positive integer number of bytes "
                         "(e.g. 33554432)")
    return budget


def chunk_shape(n: int, v: int, device: torch.device) -> tuple[int, int]:
    budget = chunk_budget(device)
    n_chunk = max(1, min(n, 1024 if device.type == "cpu" else 4096))
    v_chunk = max(128, min(max(v, 1), budget // (4 * n_chunk)))
    return n_chunk, v_chunk


def _half_gemm(a: torch.Tensor) -> bool:
    return a.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output: fp32 accumulation on half operands (CUDA), else fp32/fp64 operands."""
    if _half_gemm(a) and b.dtype == a.dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    return torch.mm(a.to(acc), b.to(acc))


def _inv_t(inv_t: Optional[torch.Tensor], params: LCEParams, t0: int, t1: int, dtype):
    return inv_t[t0:t1, None].to(dtype) if inv_t is not None else params.inv_t


def _weight_block(weight, start: int, vv: int, g0: int, hidden) -> tuple:
    """(lo, hi, W block) of the INV_COLS global columns starting at g0 as invariant mode multiplies them:
    the shard's rows [lo, hi) at their place, zero rows elsewhere, transposed (upcast unless half GEMM)."""
    h = weight.shape[1]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    lo, hi = max(g0, start), min(g0 + INV_COLS, start + vv)
    wb = weight[lo - start:hi - start]
    if hi - lo < INV_COLS:
        pad = weight.new_zeros((INV_COLS, h))
        pad[lo - g0:hi - g0] = wb
        wb = pad
    return lo, hi, (wb.t() if _half_gemm(hidden) else _fresh(wb.t(), acc))


def _fresh(x: torch.Tensor, dtype) -> torch.Tensor:
    """x as `dtype` in memory of its own. An fp32 block is otherwise a view into the weight or the hidden
    states at an offset that follows the TP shard or the row count, and a CPU BLAS may take another kernel
    for another alignment; a fresh allocation has the allocator's alignment on every call."""
    return x.to(dtype, copy=True)


def _hidden_block(hidden, t0: int):
    hb = _row_block(hidden, t0, INV_ROWS)
    return hb if _half_gemm(hidden) else _fresh(hb, torch.float64 if hidden.dtype == torch.float64 else torch.float32)


def add_sparse_columns(dl: torch.Tensor, sparse, t0: int, t1: int, v0: int, v1: int) -> None:
    """dl (rows [t0, t1), columns [v0, v1) of d_logits) += the sparse coefficients whose column falls in the
    block, one id slot at a time (a row's repeated ids add in slot order: deterministic)."""
    cols, coef = sparse[0][t0:t1], sparse[1][t0:t1].to(dl.dtype)
    for j in range(cols.shape[1]):
        col = cols[:, j] - v0
        hit = (col >= 0) & (col < v1 - v0)
        at = col.clamp(0, v1 - v0 - 1)[:, None]
        dl.scatter_(1, at, dl.gather(1, at) + torch.where(hit, coef[:, j], 0.0)[:, None])


def segment_logits(hidden, weight, rows, segs, params: LCEParams, rows_per_block: int = INV_ROWS) -> torch.Tensor:
    """The backend contract's segment_logits (base.py) for invariant_forward's blocks: each pair's row goes
    into a zero-padded INV_ROWS block multiplied by the INV_COLS block holding its segment, as the forward
    did, so the values are the forward's bits. One host loop over the distinct column blocks.
    rows_per_block: another fixed block height, for a backend whose forward does not use these blocks
    (the values are then invariant but not its forward's bits)."""
    start, vv = params.vocab_start, params.shard_valid
    out = torch.full((rows.shape[0], exact.SEG), float("-inf"), dtype=torch.float32, device=hidden.device)
    gstart = start + segs * exact.SEG
    blk = gstart // INV_COLS
    cols = torch.arange(exact.SEG, device=hidden.device)
    for b in torch.unique(blk).tolist():
        sel = (blk == b).nonzero().squeeze(1)
        g0 = b * INV_COLS
        _, _, wt = _weight_block(weight, start, vv, g0, hidden)
        for c0 in range(0, sel.shape[0], rows_per_block):
            idx = sel[c0:c0 + rows_per_block]
            hb = _row_block(hidden[rows[idx]], 0, rows_per_block)
            hb = hb if _half_gemm(hidden) else hb.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
            r = head_transform(_mm_f32(hb, wt), params).to(torch.float32)
            at = (gstart[idx] - g0)[:, None] + cols
            vals = r[: idx.shape[0]].gather(1, at)
            out[idx] = torch.where(at + g0 < start + vv, vals, float("-inf"))
    return out


def _row_block(x: torch.Tensor, t0: int, rows: int) -> torch.Tensor:
    """Rows [t0, t0 + rows) of x, zero-padded to `rows` when x ends first."""
    blk = x[t0:t0 + rows]
    if blk.shape[0] == rows:
        return blk
    pad = x.new_zeros((rows - blk.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([blk, pad])


def invariant_forward(hidden, weight, labels, inv_t, params: LCEParams, cache=None) -> ShardStats:
    """Segment partials (exact.py) from fixed-shape GEMM blocks (INV_ROWS, INV_COLS above); `cache`: an
    [N, shard_valid] buffer that receives the tempered logits (the backward then skips its GEMM)."""
    n, h = hidden.shape
    dev = hidden.device
    chunk_budget(dev)  # the backward's chunks follow it: a bad value is named here, at the first call
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    vv, start = params.shard_valid, params.vocab_start
    if start % exact.SEG:
        raise ValueError(f"invariant mode: the shard starts at global id {start}, not a multiple of {exact.SEG}")
    sums = params.logit_sums
    G = exact.segments(vv)
    seg = torch.empty((5 if sums else 3, G, n), dtype=torch.float32, device=dev)
    mx = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    mn = torch.full((n,), float("inf"), dtype=torch.float32, device=dev)
    zy = torch.zeros(n, dtype=torch.float32, device=dev)
    if vv == 0 or n == 0:  # a shard of padding only (or no rows): it contributes the merge's identities
        return ShardStats(m=None, s=None, a=None, zy=zy, mn=mn, mx=mx, seg=seg, cache=cache)
    local = labels - start
    first = start - start % INV_COLS  # global start of the first column block touching the shard
    w_blocks = [(g0,) + _weight_block(weight, start, vv, g0, hidden) for g0 in range(first, start + vv, INV_COLS)]
    for t0 in range(0, n, INV_ROWS):
        t1 = min(n, t0 + INV_ROWS)
        hb = _hidden_block(hidden, t0)
        it = _row_block(inv_t.to(torch.float32), t0, INV_ROWS) if inv_t is not None else params.inv_t
        if torch.is_tensor(it):
            it = torch.where(torch.arange(INV_ROWS, device=dev) < t1 - t0, it, torch.ones_like(it))
        yb = local[t0:t1]
        for g0, lo, hi, wt in w_blocks:
            r = head_transform(_mm_f32(hb, wt), params).to(torch.float32)  # raw logits [INV_ROWS, INV_COLS]
            part = exact.segment_stats_torch(r, it, hi - g0, sums)  # [k, INV_COLS / SEG, INV_ROWS]
            j0 = (lo - g0) // exact.SEG  # segments before the shard start belong to another rank
            gs = (lo - start) // exact.SEG
            gn = exact.segments(hi - lo)
            seg[:, gs:gs + gn, t0:t1] = part[:, j0:j0 + gn, : t1 - t0]
            rv = r[: t1 - t0, lo - g0:hi - g0]
            if cache is not None:
                cache[t0:t1, lo - start:hi - start] = rv * (it[: t1 - t0, None] if torch.is_tensor(it) else it)
            torch.maximum(mx[t0:t1], rv.amax(1), out=mx[t0:t1])
            torch.minimum(mn[t0:t1], rv.amin(1), out=mn[t0:t1])
            col = yb - (lo - start)
            own = (col >= 0) & (col < hi - lo)
            picked = rv.gather(1, col.clamp(0, hi - lo - 1)[:, None]).squeeze(1)
            zy[t0:t1] += torch.where(own, picked, torch.zeros_like(picked))
    it_all = inv_t.to(torch.float32) if inv_t is not None else params.inv_t
    return ShardStats(m=None, s=None, a=None, zy=zy * it_all, mn=mn, mx=mx, seg=seg, cache=cache)


class TorchChunkedBackend(Backend):
    name = "torch"

    def segment_logits(self, hidden, weight, rows, segs, params: LCEParams) -> torch.Tensor:
        return segment_logits(hidden, weight, rows, segs, params)  # the invariant forward's own blocks

    def _logits(self, hidden, weight, inv_t, params, t0, t1, v0, v1):
        """(tempered logits of the block, their cap slope or None)."""
        r = head_transform(_mm_f32(hidden[t0:t1], weight[v0:v1].t()), params)
        slope = cap_slope(r, params) if params.softcap else None
        return r * _inv_t(inv_t, params, t0, t1, r.dtype), slope

    def cache_spec(self, n, h, v_shard, dtype, params: LCEParams, keep_cache):
        vv = params.shard_valid
        if keep_cache and vv > 0 and not params.softcap and n * vv * 4 <= params.cache_bytes:
            return (n, vv), (torch.float64 if dtype == torch.float64 else torch.float32)
        return None

    def forward(self, hidden, weight, labels, inv_t, params: LCEParams, keep_cache: bool) -> ShardStats:
        if params.invariant:
            spec = self.cache_spec(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype, params, keep_cache)
            return invariant_forward(hidden, weight, labels, inv_t, params,
                                     cache=None if spec is None else alloc(spec[0], spec[1], hidden.device))
        n, dev = hidden.shape[0], hidden.device
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        vv = params.shard_valid
        m = torch.full((n,), float("-inf"), dtype=acc, device=dev)  # tempered running max
        mx = torch.full((n,), float("-inf"), dtype=acc, device=dev)  # raw running max
        mn = torch.full((n,), float("inf"), dtype=acc, device=dev)  # raw running min
        s, a, zy = (torch.zeros(n, dtype=acc, device=dev) for _ in range(3))
        lsum = torch.zeros(n, dtype=acc, device=dev) if params.logit_sums else None
        lsq = torch.zeros(n, dtype=acc, device=dev) if params.logit_sums else None
        spec = self.cache_spec(n, hidden.shape[1], weight.shape[0], hidden.dtype, params, keep_cache)
        cache = None if spec is None else alloc(spec[0], spec[1], dev)
        local = labels - params.vocab_start
        n_chunk, v_chunk = chunk_shape(n, vv, dev)
        for t0, t1 in _chunks(n, n_chunk):
            mt, st, at, mxt = m[t0:t1], s[t0:t1], a[t0:t1], mx[t0:t1]
            for v0, v1 in _chunks(vv, v_chunk):
                z = head_transform(_mm_f32(hidden[t0:t1], weight[v0:v1].t()), params)  # raw logits of this block
                if lsum is not None:  # raw-logit sums from the same block, before temperature
                    lsum[t0:t1] += z.sum(1)
                    lsq[t0:t1] += (z * z).sum(1)
                torch.maximum(mxt, z.max(dim=1).values, out=mxt)
                torch.minimum(mn[t0:t1], z.min(dim=1).values, out=mn[t0:t1])
                it = _inv_t(inv_t, params, t0, t1, z.dtype)
                z.mul_(it)
                if cache is not None:
                    cache[t0:t1, v0:v1] = z
                new_m = mxt * (it[:, 0] if torch.is_tensor(it) else it)  # = max of the tempered z (base.py)
                shift = mt - new_m
                scale = torch.exp(shift)
                d = z - new_m[:, None]
                e = torch.exp(d)
                # (m_old - m_new)·s_old is (-inf)·0 before the first chunk: keep a at 0 there.
                at.copy_(torch.where(st > 0, (at + shift * st) * scale, torch.zeros_like(at)) + (d * e).sum(1))
                st.copy_(st * scale + e.sum(1))
                mt.copy_(new_m)
                col = local[t0:t1] - v0
                own = (col >= 0) & (col < v1 - v0)
                picked = z.gather(1, col.clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
                zy[t0:t1] += torch.where(own, picked, torch.zeros_like(picked))
        return ShardStats(m=m, s=s, a=a, zy=zy, mn=mn, mx=mx, cache=cache, lsum=lsum, lsq=lsq)

    takes_sparse = True  # backward(..., sparse=(cols, coef)): base.py

    def backward(self, hidden, weight, labels, inv_t, params: LCEParams, cache, lse, ent, g_lp, g_ent,
                 need_d_hidden, need_d_weight, sparse=None):
        n, h = hidden.shape
        dev = hidden.device
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        vv = params.shard_valid
        dh = torch.zeros(n, h, dtype=acc, device=dev) if need_d_hidden else None
        dw_dtype = params.d_weight_dtype(weight.dtype)  # weight's, or fp32 with d_weight_fp32
        dw = torch.zeros(weight.shape, dtype=dw_dtype, device=dev) if need_d_weight else None
        local = labels - params.vocab_start
        n_chunk, v_chunk = chunk_shape(n, vv, dev)
        half = _half_gemm(hidden)
        for v0, v1 in _chunks(vv, v_chunk):
            dw_acc = torch.zeros(v1 - v0, h, dtype=acc, device=dev) if need_d_weight else None
            for t0, t1 in _chunks(n, n_chunk):
                z, slope = ((cache[t0:t1, v0:v1], None) if cache is not None
                            else self._logits(hidden, weight, inv_t, params, t0, t1, v0, v1))
                lse_t, ent_t = lse[t0:t1, None].to(acc), ent[t0:t1, None].to(acc)
                logp = z - lse_t
                p = torch.exp(logp)
                dz = -(g_lp[t0:t1, None].to(acc) + g_ent[t0:t1, None].to(acc) * (logp + ent_t)) * p
                col = local[t0:t1] - v0
                own = (col >= 0) & (col < v1 - v0)
                # one-hot term at each row's label column: one element per row, so a gather + scatter
                # (no nonzero(): its data-dependent size is a host sync on accelerators)
                at = col.clamp(0, v1 - v0 - 1)[:, None]
                hot = torch.where(own, g_lp[t0:t1].to(acc), 0.0)[:, None]
                dz.scatter_(1, at, dz.gather(1, at) + hot)
                dl = dz.mul_(_inv_t(inv_t, params, t0, t1, acc))
                if slope is not None:
                    dl.mul_(slope)
                if sparse is not None:
                    add_sparse_columns(dl, sparse, t0, t1, v0, v1)
                if half:
                    dl = dl.to(hidden.dtype)
                if need_d_hidden:
                    dh[t0:t1] += _mm_f32(dl, weight[v0:v1])
                if need_d_weight:
                    dw_acc += _mm_f32(dl.t(), hidden[t0:t1])
            if need_d_weight:
                dw[v0:v1] = dw_acc  # cast to dw's dtype (none with d_weight_fp32)
        return dh, dw
