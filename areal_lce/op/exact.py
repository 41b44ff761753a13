"""Invariant mode's arithmetic: per-segment partials folded into exact fixed-point sums.

A token's logprob / entropy / lse are sums over the vocabulary. Floating-point sums depend on their
order, and the order of the usual online-softmax merge follows the vocab split the kernel picked for
this row count, the tile grid, and the tensor-parallel shard boundaries. Invariant mode removes every
one of those dependencies:

1. The vocabulary is cut into fixed segments of SEG = 128 global ids, [128·g, 128·g + 128). Megatron
   pads the vocabulary to a multiple of 128·tp (`make_vocab_size_divisible_by`), so every TP shard is a
   whole number of segments on any TP degree. A backend reduces each segment on its own, in an order
   fixed by the backend and its tile shape (never by N, by the split, or by where the segment sits in a
   shard), to the segment's raw max `rmax_g`, `s_g = Σ exp(z_j - m_g)`, `a_g = Σ (z_j - m_g) exp(z_j - m_g)`
   with m_g = rmax_g · inv_t (and the raw sums Σ r_j, Σ r_j² with logit sums). Columns at ids >=
   vocab_size are left out, which is what every TP degree's padding needs.
2. max and min are exact in any order: the global raw max `mx` (a MAX over the TP group) and the
   tempered max M = mx · inv_t are the same bits on every split and TP degree.
3. Relative to M each segment's term is bounded: s_g · exp(m_g - M) lies in [0, 128] and
   exp(m_g - M) · (a_g + (m_g - M) · s_g) = Σ (z_j - M) exp(z_j - M) lies in [-128/e, 0]. Each term is
   converted to a 64-bit integer with FRAC_BITS = 40 fractional bits (truncated toward zero) and the
   integers are summed: integer addition is exact and associative, so the sum over segments, over
   programs and over TP ranks (an int64 all-reduce SUM) has one value whatever its order. The
   quantisation step 2^-40 is 2^-16 of an fp32 ulp at 1.0, and the exp-sum is >= 1 (the max column's
   term is exactly 1): it never shows after the final rounding to fp32 except at rounding ties.
4. The raw logit sums use the same integers, scaled by a power of two taken from the exact row
   extremum R = max(|mx|, |mn|): term / 2^E with R < 2^E (2^2E for the squares).

The label logit needs no care: exactly one column in the whole vocabulary contributes, so its sum in
any order is that value; across TP ranks it travels as its fp32 bit pattern inside the int64 SUM
(the other ranks add 0).

Limits: vocab_size < 2^22 keeps every integer sum below 2^63 (MAX_VOCAB). Only `merge` communicates
(the two all-reduces of the tensor-parallel merge).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

SEG = 128  # vocabulary segment width in global ids
FRAC_BITS = 40  # fixed-point fractional bits of the folded terms
MAX_VOCAB = 1 << 22  # 128-wide terms below 2^(7+40) each: the sum of 2^15 segments stays below 2^62
KEY_ID_BITS = 31  # top-k sort keys (select.sort_key): 32 order-preserving value bits above 31 bits of (2^31 - 1 - id)
PAD_KEY = ((1 << 23) - 1) << KEY_ID_BITS  # sort_key(-inf, 2^31 - 1): below every logit's key
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
_E_MIN, _E_MAX = -40, 60  # clamp of the logit-sum exponent (|logits| between 2^-40 and 2^60)


# Elementwise functions of the invariant path, built from IEEE-754 basic operations only (add, subtract,
# multiply, divide, floor, comparisons, exact integer conversions and bit moves), each correctly rounded in
# a CPU's scalar and vector units and on every accelerator alike. torch.exp2 / torch.log are not: ATen's
# CPU loops run whole vector chunks through SLEEF and the remainder (and each thread's chunk edge) through
# the scalar libm, which differ by an ulp on a few percent of inputs, so an element's bits would follow its
# position in the tensor, i.e. the row count, the segment count and the thread count. A CUDA kernel applies one
# device function to every element (its vectorised loads and its tail run the same exp2f / log), so on CUDA
# tensors the library functions keep that property and are used: the fp64 temporaries below would triple the
# materialised route's memory on a GPU for nothing.
_EXP2_TAYLOR = tuple(LN2 ** i / math.factorial(i) for i in range(8, -1, -1))  # 2^f = Σ (f ln 2)^i / i!
_LOG_SERIES = tuple(1.0 / (2 * i + 1) for i in range(13, -1, -1))  # atanh series: log m = 2 Σ u^(2i+1) / (2i+1)


def pow2(e: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """2^e exactly for integer-valued e (normal range of `dtype`: fp64 |e| <= 1022, fp32 |e| <= 126), from
    the exponent bits: no transcendental function involved."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x of fp32 x <= 0 (the shifts to a max the invariant path takes), the same bits wherever x sits.
    x = k + f with k = floor(x + 1/2), |f| <= 1/2; 2^f from its degree-8 Taylor polynomial in fp64
    (truncation < 2e-10 relative), times 2^k exactly, rounded once to fp32: within 0.51 ulp. Results below
    2^-126 (x < -126) are 0, -inf gives 0, NaN stays NaN; x > 0 is outside the contract (capped at 2^127).
    CUDA tensors: torch.exp2 (see above)."""
    if x.is_cuda:
        return torch.exp2(x)
    xd = x.to(torch.float64).clamp(-127.0, 127.0)  # NaN passes through clamp
    k = torch.floor(xd + 0.5)
    f = xd - k
    p = torch.full_like(f, _EXP2_TAYLOR[0])
    for c in _EXP2_TAYLOR[1:]:
        p = p * f + c
    k = torch.where(torch.isnan(k), torch.zeros_like(k), k)
    y = (p * pow2(k)).to(torch.float32)
    y = torch.where(x < -126.0, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def log(s: torch.Tensor) -> torch.Tensor:
    """Natural log of fp64 s > 0 (the folded exp-sums, >= 1), the same bits wherever s sits: s = m · 2^e
    with m in [1/√2, √2) (frexp is exact), log m = 2 atanh(u), u = (m - 1) / (m + 1), |u| <= 0.172, from 14
    terms of its series (truncation < 1e-22), plus e · ln 2. Relative error a few fp64 ulp; the callers round
    to fp32. s = 0 gives -inf, non-positive or non-finite s NaN (the rows invariant mode reports as bad).
    CUDA tensors: torch.log (see above)."""
    if s.is_cuda:
        return torch.log(s)
    m, e = torch.frexp(s)
    low = m < 0.5 ** 0.5
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    u = (m - 1.0) / (m + 1.0)
    u2 = u * u
    p = torch.full_like(u, _LOG_SERIES[0])
    for c in _LOG_SERIES[1:]:
        p = p * u2 + c
    y = e * LN2 + 2.0 * u * p
    y = torch.where(s == 0, torch.full_like(y, float("-inf")), y)
    return torch.where((s < 0) | ~torch.isfinite(s), torch.full_like(y, float("nan")), y)


def segments(valid: int) -> int:
    """Segments covering `valid` columns starting at a segment boundary."""
    return -(-valid // SEG)


class Folded(NamedTuple):
    """The int64 rows of one shard (or, after the SUM over the TP group, of the whole vocabulary)."""

    q: torch.Tensor  # int64 [4, N] (s, a, bad, zy bits) or [6, N] with logit sums (+ Σ r, Σ r²)


def sum_scales(mx: torch.Tensor, mn: torch.Tensor):
    """(2^(FRAC_BITS - E), 2^(FRAC_BITS - 2E)) per row as fp32, with R = max(|mx|, |mn|) < 2^E: the
    scales of the raw logit sums. E comes from the exact global extremum, so every rank and split
    agrees on it."""
    r = torch.maximum(mx.abs(), mn.abs()).to(torch.float64)
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    _, e = torch.frexp(r)  # r = f · 2^e, 0.5 <= f < 1 (e = 0 for r = 0)
    e = e.clamp(_E_MIN, _E_MAX)
    return pow2(FRAC_BITS - e).float(), pow2(FRAC_BITS - 2 * e).float()


def fold_segments(seg: torch.Tensor, mx: torch.Tensor, inv_t, scales=None) -> torch.Tensor:
    """Fold one shard's segment partials into int64 sums (torch version; the triton backend has the same
    arithmetic in a kernel).

    seg: fp32 [3, G, N] (rmax, s, a) or [5, G, N] (+ Σ r, Σ r²), a = Σ (z - m_g) exp(z - m_g) in natural
    units; mx: the global raw max [N]; inv_t: [N] fp32 or a float; scales: sum_scales(...) when seg has 5
    rows. Returns int64 [3, N] (s, a, bad) or [5, N] (+ Σ r, Σ r²); bad counts the non-finite terms."""
    rmax, s, a = seg[0], seg[1], seg[2]
    c = (inv_t * LOG2E) if not torch.is_tensor(inv_t) else (inv_t.float() * LOG2E)
    d2 = (rmax - mx) * c  # base-2 shift of each segment to the global max, <= 0
    empty = s == 0
    d2 = torch.where(empty, torch.zeros_like(d2), d2)
    w = exp2(d2)
    ts = s * w
    ta = torch.where(empty, torch.zeros_like(a), w * (a + (d2 * LN2) * s))
    one = float(2 ** FRAC_BITS)
    terms = [ts * one, ta * one]
    if seg.shape[0] == 5:
        terms += [seg[3] * scales[0], seg[4] * scales[1]]
    t = torch.stack(terms)
    finite = torch.isfinite(t)
    # truncation toward zero; exact for terms >= 2^-16 (their fp32 value is already a multiple of 2^-40)
    q = torch.where(finite, t, torch.zeros_like(t)).to(torch.int64).sum(1)
    bad = (~finite).sum((0, 1)).to(torch.int64)
    return torch.cat([q[:2], bad[None], q[2:]])


def pack(q: torch.Tensor, zy: torch.Tensor) -> torch.Tensor:
    """[s, a, bad, zy bits(, Σ r, Σ r²)] int64: the one tensor the TP group sums."""
    bits = zy.contiguous().view(torch.int32).to(torch.int64)
    return torch.cat([q[:3], bits[None], q[3:]])


def unpack(packed: torch.Tensor):
    """(q, zy) of a summed `pack`: zy's bits come back from the one rank that held the label."""
    return torch.cat([packed[:3], packed[4:]]), packed[3].to(torch.int32).view(torch.float32)


class Finished(NamedTuple):
    lp: torch.Tensor
    ent: torch.Tensor
    lse: torch.Tensor
    mx: torch.Tensor
    mn: torch.Tensor
    lsum: Optional[torch.Tensor]
    lsq: Optional[torch.Tensor]


def finish(q: torch.Tensor, zy: torch.Tensor, mx: torch.Tensor, mn: torch.Tensor, inv_t, scales=None) -> Finished:
    """(logprob, entropy, lse, max, min[, Σ r, Σ r²]) from the summed integers q [3 or 5, N], the label
    logit and the global extrema: log S and A / S in fp64, rounded once to fp32. Rows with a non-finite
    term get NaN everywhere. (The triton backend runs the same arithmetic in one kernel.)"""
    f = 2.0 ** -FRAC_BITS
    s = q[0].to(torch.float64) * f
    a = q[1].to(torch.float64) * f
    bad = q[2] > 0
    big_m = (mx * inv_t).to(torch.float64)  # the tempered max, exactly as every segment saw it
    log_s = log(s)
    lse64 = big_m + log_s
    nan = torch.full_like(mx, float("nan"))

    def out(x):
        return torch.where(bad, nan, x.to(torch.float32))

    lsum = lsq = None
    if q.shape[0] == 5:
        lsum = out(q[3].to(torch.float64) / scales[0].to(torch.float64))
        lsq = out(q[4].to(torch.float64) / scales[1].to(torch.float64))
    return Finished(out(zy.to(torch.float64) - lse64), out(log_s - a / s), out(lse64), out(mx), out(mn), lsum, lsq)


def segment_stats_torch(r: torch.Tensor, inv_t, valid_cols: int, sums: bool) -> torch.Tensor:
    """Segment partials of one block of raw fp32 logits r [R, C] whose column 0 is a segment start and
    C a multiple of SEG; columns >= valid_cols are padding. Returns fp32 [3 or 5, C / SEG, R]. Every
    reduction runs over the last dimension of a [R, C / SEG, SEG] view, the same shape on every call, so
    a segment's bits do not depend on where it sits."""
    R, C = r.shape
    if valid_cols < C:
        col = torch.arange(C, device=r.device)
        r_max_in = r.masked_fill(col >= valid_cols, float("-inf"))
        r_sum_in = r.masked_fill(col >= valid_cols, 0.0)
    else:
        r_max_in = r_sum_in = r
    v = r_max_in.view(R, C // SEG, SEG)
    rmax = v.amax(-1)
    c = inv_t * LOG2E if not torch.is_tensor(inv_t) else (inv_t.float() * LOG2E).view(R, 1, 1)
    d2 = (v - rmax[..., None]) * c
    e = exp2(d2)
    s = e.sum(-1)
    a = torch.where(e == 0, torch.zeros_like(e), d2 * e).sum(-1) * LN2
    rows = [rmax, s, a]
    if sums:
        u = r_sum_in.view(R, C // SEG, SEG)
        rows += [u.sum(-1), (u * u).sum(-1)]
    return torch.stack(rows).transpose(1, 2)  # [k, G, R]


def merge(st, params, inv_t) -> Finished:
    """Invariant mode: one shard's ShardStats (segment partials, mx, mn, zy) folded into int64 sums and
    merged over params' TP group, exactly; inv_t: [N] or the scalar. Two collectives, as the online
    merge has: MAX of [max, -min], SUM of the packed int64 rows."""
    from . import comms

    mx, mn = st.mx, st.mn
    if params.tp_size > 1:
        # 1 collective: MAX of the raw [mx, -mn] (exact in any order)
        mm = torch.stack([mx, -mn])
        comms.all_reduce_max_(mm, params.tp_group)
        mx, mn = mm[0], -mm[1]
    scales = torch.stack(sum_scales(mx, mn)) if params.logit_sums else None
    backend = params.backend  # its fold_segments / finish_folded: these functions, or its own kernels
    q = backend.fold_segments(st.seg, mx, inv_t, scales)
    zy = st.zy
    if params.tp_size > 1:
        # 1 collective: SUM of the packed int64 [s, a, bad, label-logit bits(, Σr, Σr²)]: integer sums are
        # exact, so the result does not depend on the order the library adds the ranks in
        packed = pack(q, zy)
        comms.all_reduce_sum_(packed, params.tp_group)
        q, zy = unpack(packed)
    return backend.finish_folded(q, zy, mx, mn, inv_t, scales)
