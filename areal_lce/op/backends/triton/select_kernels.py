"""Triton kernels of the selected-id and top-k outputs (areal_lce/op/select.py states the method).

  gather_logits_kernel  r[n, j] = h_n · W[cols[n, j]] in fp32: one program = BLOCK_R rows x BLOCK_J ids,
                        the sum over H in fixed BLOCK_H steps (a broadcast product reduced per step, then
                        added in order), so a value's bits depend on its row and id only.
  selected_plan_kernel  which selected ids the invariant forward takes from its own logit tiles (one per
                        row and segment) and where each slot finds its value.
  pair_logits_kernel    the selected ids the forward did not take: one fixed-order dot product per listed
                        (row, slot).
  segment_logits_kernel the raw logits of one 128-id segment for up to BLOCK_N rows that all need it (the
                        launcher groups the (row, segment) pairs by segment): `_seg_logits` of the invariant
                        forward, with the forward's BLOCK_K, precision and operand types, so every value is
                        bitwise what the forward reduced (the rows of a tensor-core tile are accumulated
                        alike, wherever they come from).
  segment_best_kernel   each row's best segments and its threshold (the k-th largest tempered maximum) in
                        one kernel: an exact bisection on the maxima's 32-bit order images, ties to the
                        lower segment; with the forward's max columns and second values also the chosen
                        segments' max keys and which of them must be recomputed.
  sparse_dl_kernel      the backward's sparse columns into a chunk of d_logits.
The top-k's candidates and its final selection: candidate_kernels.py.
"""
import triton
import triton.language as tl

from .kernel_common import IGNORED
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
    acc = _gather_dot(h, w, b_c, o_r, m_r, m_rj, H, BLOCK_R, BLOCK_J, BLOCK_H)
    tl.store(out + o_r[:, None].to(tl.int64) * J + o_j[None, :], acc, mask=m_rj)


@triton.jit
def _gather_dot(h, w, b_c, o_r, m_r, m_rj, H, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 [BLOCK_R, BLOCK_J] h[o_r] · W[b_c] (local columns), the sum over H in fixed BLOCK_H steps."""
    acc = tl.zeros([BLOCK_R, BLOCK_J], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        o_k = k0 + tl.arange(0, BLOCK_H)
        m_k = o_k < H
        b_h = tl.load(h + o_r[:, None].to(tl.int64) * H + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        b_w = tl.load(w + b_c[:, :, None] * H + o_k[None, None, :], mask=m_rj[:, :, None] & m_k[None, None, :],
                      other=0.0).to(tl.float32)
        acc += tl.sum(b_h[:, None, :] * b_w, 2)
    return acc


@triton.jit
def selected_plan_kernel(ids, y, plane, lslot, src, N, K, vocab_start, valid, ignore_index, SEG: tl.constexpr,
                         BLOCK_R: tl.constexpr, KP: tl.constexpr):
    """Which selected ids the invariant forward takes from its own logit tiles. ids [N, K] int64 global ids
    in the forward's row order, y its local labels (-1: another shard's, IGNORED: an ignored row, which
    selects nothing). The forward takes one column per row and segment, with the label's (segment_kernels
    _seg_fold): so in the label's segment only the label's own id is taken, at the lowest slot selecting it
    (lslot[n], -1 for none); in every other segment the lowest slot j with an id there is the segment's
    pick, plane[g, n] = j · SEG + (col mod SEG) (int16; the caller fills the plane with -1). src[n, j] = the
    slot whose taken value slot j reads (repeated ids share one), -1 where the id must be computed apart
    (another column was taken in its segment), -2 where this shard owns no id. Only the row's own ids and
    label decide, so which value a slot gets is batch- and TP-invariant."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_j = tl.arange(0, KP)
    m_r = o_r < N
    m = m_r[:, None] & (o_j < K)[None, :]
    row = o_r.to(tl.int64)[:, None]
    b_id = tl.load(ids + row * K + o_j[None, :], mask=m, other=ignore_index)
    b_y = tl.load(y + o_r, mask=m_r, other=IGNORED)
    loc = b_id - vocab_start
    own = m & (b_id != ignore_index) & (loc >= 0) & (loc < valid) & (b_y != IGNORED)[:, None]
    b_c = tl.where(own, loc, -1).to(tl.int32)
    b_g = tl.where(own, b_c // SEG, -1)
    in_lab = own & (b_y >= 0)[:, None] & (b_g == (b_y // SEG)[:, None])  # in the label's segment
    is_lab = own & (b_c == b_y[:, None])
    b_ls = tl.min(tl.where(is_lab, o_j[None, :], KP), 1)
    cand = own & ~in_lab
    # per (r, j): the lowest candidate slot i in j's segment, twice over, plus 1 where i's column is not j's
    key = tl.where((b_g[:, :, None] == b_g[:, None, :]) & cand[:, None, :],
                   2 * o_j[None, None, :] + (b_c[:, :, None] != b_c[:, None, :]).to(tl.int32), 2 * KP)
    best = tl.min(key, 2)
    pick = best // 2
    out = tl.where(in_lab, tl.where(is_lab, b_ls[:, None], -1), tl.where(best % 2 == 0, pick, -1))
    tl.store(src + row * K + o_j[None, :], tl.where(own, out, -2).to(tl.int64), mask=m)
    tl.store(lslot + o_r, tl.where(b_ls < KP, b_ls, -1), mask=m_r)
    code = o_j[None, :] * SEG + b_c % SEG
    tl.store(plane + b_g.to(tl.int64) * N + row, code.to(tl.int16), mask=cand & (pick == o_j[None, :]))


@triton.jit
def pair_logits_kernel(h, w, ids, pairs, count, out, K, H, vocab_start, n_prog, BLOCK_P: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """out[p] = h[p // K] · W[ids[p] - vocab_start] in fp32 for the flat (row, slot) positions p listed in
    pairs[:count] (count on the device), programs striding over the list. The sum over H goes in fixed
    BLOCK_H steps (a broadcast product reduced per step, then added in order): a value's bits depend on its
    row and id only."""
    n = tl.load(count)
    for p0 in range(tl.program_id(0) * BLOCK_P, n, n_prog * BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        m_p = o_p < n
        pos = tl.load(pairs + o_p, mask=m_p, other=0)
        col = tl.load(ids + pos, mask=m_p, other=vocab_start) - vocab_start
        row = pos // K
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            o_k = k0 + tl.arange(0, BLOCK_H)
            m_k = m_p[:, None] & (o_k < H)[None, :]
            b_h = tl.load(h + row[:, None] * H + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
            b_w = tl.load(w + col[:, None] * H + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
            acc += tl.sum(b_h * b_w, 1)
        tl.store(out + pos, acc, mask=m_p)


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
    each row's slots in order in one program (repeated ids add one after the other: deterministic). Slot
    j + 1's column and coefficient are loaded before slot j's d_logits (loads issue in order and wait at their
    use), so each step waits for one load, not two."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    row = o_n.to(tl.int64)
    c_next = tl.load(cols + row * J, mask=m_n, other=-1)
    v_next = tl.load(coef + row * J, mask=m_n, other=0.0)
    for j in range(0, J):
        c = c_next
        v = v_next
        m_next = m_n & (j + 1 < J)
        c_next = tl.load(cols + row * J + j + 1, mask=m_next, other=-1)
        v_next = tl.load(coef + row * J + j + 1, mask=m_next, other=0.0)
        m = m_n & (c >= c0) & (c < c0 + width)
        p = dl + row * stride_dl + (c - c0)
        x = tl.load(p, mask=m, other=0.0).to(tl.float32)
        tl.store(p, (x + v).to(dl.dtype.element_ty), mask=m)


@triton.jit
def _mono(z):
    """fp32 -> int64 in [0, 2^32) in the order of the values (-0.0 counts as +0.0)."""
    z = tl.where(z == 0.0, 0.0, z)
    bits = z.to(tl.int32, bitcast=True).to(tl.int64)
    u = bits & 0xFFFFFFFF
    return tl.where(bits >= 0, u + 2147483648, 4294967295 - u)


@triton.jit
def _sort_key(z, ids):
    """select.sort_key in a kernel: int64 keys ordered as (z descending, id ascending) under a descending
    order; -0.0 counts as +0.0."""
    return (_mono(z) << 31) | (2147483647 - ids.to(tl.int64))


@triton.jit
def _unmono(m):
    """The fp32 value whose _mono image is m (int64 in [0, 2^32)); -inf below the image of -inf."""
    bits = tl.where(m >= 2147483648, m - 2147483648, -1 - m).to(tl.int32)
    return tl.where(m <= 8388607, float("-inf"), bits.to(tl.float32, bitcast=True))  # 8388607: _mono(-inf)


@triton.jit
def _tempered(seg, rows, c0, m_n, it, inv_t_scalar, G, HAS_INV_T: tl.constexpr, CHUNK: tl.constexpr):
    """Tempered maxima of segments c0 + [0, CHUNK) of rows `rows` (seg [N, G]), NaN past G."""
    o_c = c0 + tl.arange(0, CHUNK)
    r = tl.load(seg + rows[:, None] * G + o_c[None, :], mask=m_n[:, None] & (o_c < G)[None, :], other=float("nan"))
    if HAS_INV_T:
        return r * it[:, None], o_c
    return r * inv_t_scalar, o_c


@triton.jit
def segment_best_kernel(seg, inv_t, best, thr, top_col, top_second, cand, flags, seg_count, seg_list, N, G, KK, CAP,
                        inv_t_scalar, vocab_start, pad, HAS_INV_T: tl.constexpr, PLAN: tl.constexpr,
                        HAS_TOP: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, KK2: tl.constexpr):
    """best[n, :KK] = the segments of each row's KK largest tempered maxima (seg [N, G] raw, rows contiguous),
    ties to the lower segment, in segment order, and thr[n] = the KK-th largest tempered maximum (KK <= G).
    The threshold is found exactly by bisection on the order-preserving 32-bit images of the values (counting
    passes of fp32 compares over the row, CHUNK maxima at a time: few registers, many rows in flight; no
    sort), between the images of the row's smallest and largest values, in steps of the values' common
    trailing zero bits (16 for bf16 logits at temperature 1: half the passes), stopping early once exactly
    KK values reach the midpoint (the smallest of them is then the threshold); then every segment above it and
    the lowest-indexed ones equal to it until KK are taken: exactly the set an int64 top-k of select.sort_key
    keys gives. PLAN: the lists candidate_topk's plan takes. With HAS_TOP (the forward's top_col int8 [G, N] and
    second values top_second fp32 [G, N]) chosen segment j must be recomputed where its tempered second value
    reaches thr[n] (or is NaN) (select.py), without it every chosen segment is: then flags[n, j] = 1,
    cand[n, j] = pad and row n joins segment g's list (seg_list[g, :seg_count[g]], one atomic slot per pair:
    the order varies, the set does not); else cand[n, j] = the sort key of the segment's max (cand's rows CAP
    long). The launcher fills cand with pad and flags with ones beforehand."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    rows = o_n.to(tl.int64)
    if HAS_INV_T:
        it = tl.load(inv_t + o_n, mask=m_n, other=1.0)
    else:
        it = tl.zeros([BLOCK_N], dtype=tl.float32) + inv_t_scalar
    n_real = tl.zeros([BLOCK_N], dtype=tl.int32)
    z_min = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)
    z_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    low = tl.full([BLOCK_N], 4294967296, dtype=tl.int64)  # the lowest bit set in any value's pattern
    for c0 in range(0, G, CHUNK):
        z, _ = _tempered(seg, rows, c0, m_n, it, inv_t_scalar, G, HAS_INV_T, CHUNK)
        real = z == z  # past G: NaN, which no compare counts
        n_real += tl.sum(real.to(tl.int32), 1)
        z_min = tl.minimum(z_min, tl.min(tl.where(real, z, float("inf")), 1))
        z_max = tl.maximum(z_max, tl.max(tl.where(real, z, float("-inf")), 1))
        b = tl.where(real, z.to(tl.int32, bitcast=True), 0).to(tl.int64) & 0xFFFFFFFF
        low = tl.minimum(low, tl.min(tl.where(b != 0, b & (-b), 4294967296), 1))
    ok = n_real >= KK  # else (NaN maxima): the whole 32-bit range, as if nothing were known
    # The values' fp32 patterns share their S lowest bits (all zero: S = 16 for bf16 logits at temperature 1), so
    # their images are one per block of 2^S consecutive images (a negative value's image ends in S ones, a
    # positive one's in S zeros, and a block never holds both signs): the bisection runs over blocks.
    # low = 2^S (2^32 when every value is ±0: S = 0 then, as for any other value pattern)
    shift = tl.where(low < 4294967296, (low.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023, 0)
    # count(block >= lo) >= KK and count(block >= hi) < KK throughout; c_lo = count(block >= lo). -0.0
    # compares as +0.0, and _mono maps both to one image
    shift = tl.where(ok, shift, 0)
    lo = tl.where(ok, _mono(z_min) >> shift, 0)
    hi = tl.where(ok, (_mono(z_max) >> shift) + 1, 4294967296)
    c_lo = tl.where(ok, n_real, KK + 1)
    live = m_n & (hi - lo > 1) & (c_lo != KK)
    while tl.max(live.to(tl.int32), 0) > 0:
        mid = (lo + hi) >> 1
        v = _unmono(mid << shift)[:, None]  # block(z) >= mid <=> image(z) >= mid · 2^S <=> z >= v
        c = tl.zeros([BLOCK_N], dtype=tl.int32)
        for c0 in range(0, G, CHUNK):
            z, _ = _tempered(seg, rows, c0, m_n, it, inv_t_scalar, G, HAS_INV_T, CHUNK)
            c += tl.sum((z >= v).to(tl.int32), 1)
        up = live & (c >= KK)
        lo = tl.where(up, mid, lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(live & (c < KK), mid, hi)
        live = live & (hi - lo > 1) & (c_lo != KK)
    # the threshold is the smallest value in blocks >= lo: exactly KK values reach lo's block, or lo's block
    # holds the threshold, its only value
    start = _unmono(lo << shift)[:, None]
    t = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)
    for c0 in range(0, G, CHUNK):
        z, _ = _tempered(seg, rows, c0, m_n, it, inv_t_scalar, G, HAS_INV_T, CHUNK)
        t = tl.minimum(t, tl.min(tl.where(z >= start, z, float("inf")), 1))
    t = tl.where(t == 0.0, 0.0, t)
    n_above = tl.zeros([BLOCK_N], dtype=tl.int32)
    for c0 in range(0, G, CHUNK):
        z, _ = _tempered(seg, rows, c0, m_n, it, inv_t_scalar, G, HAS_INV_T, CHUNK)
        n_above += tl.sum((z > t[:, None]).to(tl.int32), 1)
    need = KK - n_above
    taken = tl.zeros([BLOCK_N], dtype=tl.int32)
    tied_seen = tl.zeros([BLOCK_N], dtype=tl.int32)
    for c0 in range(0, G, CHUNK):
        z, o_c = _tempered(seg, rows, c0, m_n, it, inv_t_scalar, G, HAS_INV_T, CHUNK)
        tied = z == t[:, None]
        tied_i = tied.to(tl.int32)
        take = (z > t[:, None]) | (tied & (tied_seen[:, None] + tl.cumsum(tied_i, 1) <= need[:, None]))
        take_i = take.to(tl.int32)
        pos = taken[:, None] + tl.cumsum(take_i, 1) - 1
        m_take = m_n[:, None] & take & (pos < KK)
        p_out = rows[:, None] * KK + pos
        g = o_c[None, :].to(tl.int64) + tl.zeros_like(pos).to(tl.int64)
        tl.store(best + p_out, g, mask=m_take)
        taken += tl.sum(take_i, 1)
        tied_seen += tl.sum(tied_i, 1)
    tl.store(thr + o_n, t, mask=m_n)
    if PLAN:  # over the row's KK chosen segments only (a masked load or atomic costs per lane, taken or not)
        tl.debug_barrier()  # best, written by other threads of the program
        o_j = tl.arange(0, KK2)[None, :]
        m_j = m_n[:, None] & (o_j < taken[:, None])
        g = tl.load(best + rows[:, None] * KK + o_j, mask=m_j, other=0)
        if HAS_TOP:
            z = tl.load(seg + rows[:, None] * G + g, mask=m_j, other=0.0)
            if HAS_INV_T:
                z = z * it[:, None]
            else:
                z = z * inv_t_scalar
            p_top = g * N + rows[:, None]
            col = tl.load(top_col + p_top, mask=m_j, other=0).to(tl.int32)
            col = tl.minimum(tl.maximum(col, 0), 127)  # unset at skipped (all-ignored) rows
            second = tl.load(top_second + p_top, mask=m_j, other=0.0) * it[:, None]
            redo = ~(second < t[:, None])  # NaN: recompute
            tl.store(cand + rows[:, None] * CAP + o_j,
                     tl.where(redo, pad, _sort_key(z, g * 128 + col + vocab_start)), mask=m_j)
            tl.store(flags + rows[:, None] * KK + o_j, redo.to(tl.int8), mask=m_j)
            m_list = m_j & redo
        else:  # every chosen segment: cand and flags keep the launcher's pad keys and ones
            m_list = m_j
        slot = tl.atomic_add(seg_count + g, 1, mask=m_list)
        tl.store(seg_list + g * N + slot, rows[:, None].to(tl.int32) + tl.zeros_like(o_j), mask=m_list)
