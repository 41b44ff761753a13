"""Triton kernels of the selected-id and top-k outputs (areal_lce/select.py states the method).

  gather_logits_kernel  r[n, j] = h_n · W[cols[n, j]] in fp32: one program = BLOCK_R rows x BLOCK_J ids,
                        the sum over H in fixed BLOCK_H steps (a broadcast product reduced per step, then
                        added in order), so a value's bits depend on its row and id only.
  segment_logits_kernel the raw logits of one 128-id segment for up to BLOCK_N rows that all need it (the
                        launcher groups the (row, segment) pairs by segment): `_seg_logits` of the invariant
                        forward, with the forward's BLOCK_K, precision and operand types, so every value is
                        bitwise what the forward reduced (the rows of a tensor-core tile are accumulated
                        alike, wherever they come from).
  segment_rank_kernel   each row's segment maxima as sort keys (the top-k picks the row's best segments).
  segment_best_kernel   each row's best segments in one kernel (a bitonic top-k of the fp32 maxima for the
                        threshold, ties to the lower segment; rows of <= 4096 segments).
  segment_keys_kernel   segment_logits_kernel's logits, transformed as the forward transforms them and
                        tempered, stored as sort keys in the row's candidate slots (the top-k's input).
  sparse_dl_kernel      the backward's sparse columns into a chunk of d_logits.
"""
import triton
import triton.language as tl

from .kernel_common import round_bf16, soft_cap
from .segment_kernels import _seg_logits


@triton.jit
def gather_logits_kernel(h, w, cols, out, N, J, H, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_j = tl.program_id(1)
    o_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    m_r = o_r < N
    m_j = o_j < J
    m_rj = m_r[:, None] & m_j[None, :]
    b_c = tl.load(cols + o_r[:, None].to(tl.int64) * J + o_j[None, :], mask=m_rj, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_J], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        o_k = k0 + tl.arange(0, BLOCK_H)
        m_k = o_k < H
        b_h = tl.load(h + o_r[:, None].to(tl.int64) * H + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        b_w = tl.load(w + b_c[:, :, None] * H + o_k[None, None, :], mask=m_rj[:, :, None] & m_k[None, None, :],
                      other=0.0).to(tl.float32)
        acc += tl.sum(b_h[:, None, :] * b_w, 2)
    tl.store(out + o_r[:, None].to(tl.int64) * J + o_j[None, :], acc, mask=m_rj)


@triton.jit
def segment_logits_kernel(h, w, task_rows, task_seg, out, N, H, valid,
                          SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Task t: rows task_rows[t, :] (-1: none) x segment task_seg[t] (-1: no task) -> out[t, :, :] raw fp32
    logits of the segment's 128 local columns (columns >= valid: -inf)."""
    t = tl.program_id(0)
    g = tl.load(task_seg + t)
    if g >= 0:
        o_i = tl.arange(0, BLOCK_N)
        rows = tl.load(task_rows + t * BLOCK_N + o_i)
        o_nc = tl.where(rows >= 0, rows, 0).to(tl.int64)
        o_v = g * SEG + tl.arange(0, SEG)
        o_vc = tl.minimum(o_v, valid - 1).to(tl.int64)
        b_r, _ = _seg_logits(h, w, None, None, o_nc, o_vc, o_vc, 0, 0, H, SEG, 1, BLOCK_N, BLOCK_K, EVEN_K,
                             UPCAST, DOT_PRECISION, False)
        b_r = tl.where((o_v < valid)[None, :], b_r, float("-inf"))
        p = out + (t * BLOCK_N + o_i)[:, None].to(tl.int64) * SEG + tl.arange(0, SEG)[None, :]
        tl.store(p, b_r)


@triton.jit
def sparse_dl_kernel(dl, cols, coef, N, J, c0, width, stride_dl, BLOCK_N: tl.constexpr):
    """dl[n, cols[n, j] - c0] += coef[n, j] for the slots whose column lies in this chunk [c0, c0 + width),
    each row's slots in order in one program (repeated ids add one after the other: deterministic)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    row = o_n.to(tl.int64)
    for j in range(0, J):
        c = tl.load(cols + row * J + j, mask=m_n, other=-1)
        v = tl.load(coef + row * J + j, mask=m_n, other=0.0)
        m = m_n & (c >= c0) & (c < c0 + width)
        p = dl + row * stride_dl + (c - c0)
        x = tl.load(p, mask=m, other=0.0).to(tl.float32)
        tl.store(p, (x + v).to(dl.dtype.element_ty), mask=m)


@triton.jit
def _sort_key(z, ids):
    """select.sort_key in a kernel: int64 keys ordered as (z descending, id ascending) under a descending
    order; -0.0 counts as +0.0."""
    z = tl.where(z == 0.0, 0.0, z)
    bits = z.to(tl.int32, bitcast=True).to(tl.int64)
    u = bits & 0xFFFFFFFF
    mono = tl.where(bits >= 0, u + 2147483648, 4294967295 - u)
    return (mono << 31) | (2147483647 - ids.to(tl.int64))


@triton.jit
def segment_rank_kernel(seg, inv_t, keys, N, G, inv_t_scalar, HAS_INV_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr):
    """keys[n, g] = sort_key(seg[g, n] · inv_t[n], g): the segments of each row in top-k order."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    m = (o_n < N)[:, None] & (o_g < G)[None, :]
    r = tl.load(seg + o_g[None, :].to(tl.int64) * N + o_n[:, None], mask=m, other=0.0)
    if HAS_INV_T:
        it = tl.load(inv_t + o_n, mask=o_n < N, other=1.0)
        z = r * it[:, None]
    else:
        z = r * inv_t_scalar
    tl.store(keys + o_n[:, None].to(tl.int64) * G + o_g[None, :], _sort_key(z, o_g[None, :]), mask=m)


@triton.jit
def segment_best_kernel(seg, inv_t, best, N, G, KK, inv_t_scalar, HAS_INV_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr, KK2: tl.constexpr):
    """best[n, :KK] = the segments of each row's KK largest tempered maxima, ties to the lower segment, in
    segment order: T = the KK-th largest value (a bitonic top-KK2 of the fp32 values, KK2 >= KK a power of
    two), then every segment above T and the lowest-indexed ones equal to T until KK are taken. Exactly the
    set segment_rank_kernel's keys give under an int64 top-k, without sorting the keys."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_g = tl.arange(0, BLOCK_G)
    m_n = o_n < N
    m_g = (o_g < G)[None, :]
    r = tl.load(seg + o_g[None, :].to(tl.int64) * N + o_n[:, None], mask=m_n[:, None] & m_g, other=float("-inf"))
    if HAS_INV_T:
        z = r * tl.load(inv_t + o_n, mask=m_n, other=1.0)[:, None]
    else:
        z = r * inv_t_scalar
    z = tl.where(m_g, z, float("-inf"))
    top = tl.topk(z, KK2, dim=1)
    t = tl.max(tl.where((tl.arange(0, KK2) == KK - 1)[None, :], top, float("-inf")), 1)  # the KK-th largest
    above = z > t[:, None]
    tied = (z == t[:, None]) & m_g
    need = KK - tl.sum(above.to(tl.int32), 1)
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), 1) <= need[:, None]))
    pos = tl.cumsum(take.to(tl.int32), 1) - 1
    tl.store(best + o_n[:, None].to(tl.int64) * KK + pos, o_g[None, :].to(tl.int64) + tl.zeros_like(pos),
             mask=m_n[:, None] & take & (pos < KK))


@triton.jit
def segment_keys_kernel(h, w, task_rows, task_dest, task_seg, inv_t, keys, H, valid, vocab_start, inv_t_scalar,
                        softcap, inv_softcap, SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr,
                        KEEP: tl.constexpr):
    """segment_logits_kernel's logits, head-transformed as the forward does (bf16 rounding, softcap) and
    tempered, as sort keys (global ids; -inf past the shard): each row's KEEP best of the segment, descending,
    at keys[task_dest[t, i] · KEEP + j] (KEEP = SEG: all of them, in column order). A row's top-k (k <= KEEP)
    lies within its segments' KEEP best, so the row's candidates shrink by SEG / KEEP before the top-k."""
    t = tl.program_id(0)
    g = tl.load(task_seg + t)
    if g >= 0:
        o_i = tl.arange(0, BLOCK_N)
        rows = tl.load(task_rows + t * BLOCK_N + o_i)
        live = rows >= 0
        o_nc = tl.where(live, rows, 0).to(tl.int64)
        o_v = g * SEG + tl.arange(0, SEG)
        o_vc = tl.minimum(o_v, valid - 1).to(tl.int64)
        b_r, _ = _seg_logits(h, w, None, None, o_nc, o_vc, o_vc, 0, 0, H, SEG, 1, BLOCK_N, BLOCK_K, EVEN_K,
                             UPCAST, DOT_PRECISION, False)
        if BF16_LOGITS:
            b_r = round_bf16(b_r, UPCAST)
        if SOFTCAP:
            b_r, _ = soft_cap(b_r, softcap, inv_softcap, UPCAST)
        if HAS_INV_T:
            it = tl.load(inv_t + o_nc, mask=live, other=1.0)
            z = b_r * it[:, None]
        else:
            z = b_r * inv_t_scalar
        z = tl.where((o_v < valid)[None, :], z, float("-inf"))
        k = _sort_key(z, (o_v + vocab_start)[None, :])
        dest = tl.load(task_dest + t * BLOCK_N + o_i)
        o_j = tl.arange(0, KEEP)
        p = keys + dest[:, None].to(tl.int64) * KEEP + o_j[None, :]
        if KEEP < SEG:
            tl.store(p, tl.topk(k, KEEP, dim=1), mask=live[:, None])  # the segment's KEEP best, bitonic
        else:
            tl.store(p, k, mask=live[:, None])
