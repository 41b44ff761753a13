"""Triton kernels of the selected-id and top-k outputs (areal_lce/select.py states the method).

  gather_logits_kernel  r[n, j] = h_n · W[cols[n, j]] in fp32: one program = BLOCK_R rows x BLOCK_J ids,
                        the sum over H in fixed BLOCK_H steps (a broadcast product reduced per step, then
                        added in order), so a value's bits depend on its row and id only.
  segment_logits_kernel the raw logits of one 128-id segment for up to BLOCK_N rows that all need it (the
                        launcher groups the (row, segment) pairs by segment): `_seg_logits` of the invariant
                        forward, with the forward's BLOCK_K, precision and operand types, so every value is
                        bitwise what the forward reduced (the rows of a tensor-core tile are accumulated
                        alike, wherever they come from).
  segment_best_kernel   each row's best segments and its threshold (the k-th largest tempered maximum) in
                        one kernel: an exact bisection on the maxima's 32-bit order images, ties to the
                        lower segment; with the forward's max columns and second values also the chosen
                        segments' max keys and which of them must be recomputed.
  segment_candidates_kernel  segment_logits_kernel's logits, transformed as the forward transforms them and
                        tempered; those at or above the row's threshold are appended (one atomic per row and
                        segment) as sort keys to the row's candidate list: typically about k of them.
  listed_candidates_kernel the same over segment_best_kernel's per-segment lists of rows to recompute
                        (a persistent grid over a task count held on the device).
  candidate_topk_kernel each row's k best candidates, descending (an exact bisection for the k-th, no sort).
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
                        inv_t_scalar, vocab_start, pad, HAS_INV_T: tl.constexpr, HAS_TOP: tl.constexpr,
                        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, KK2: tl.constexpr):
    """best[n, :KK] = the segments of each row's KK largest tempered maxima (seg [N, G] raw, rows contiguous),
    ties to the lower segment, in segment order, and thr[n] = the KK-th largest tempered maximum (KK <= G).
    The threshold is found exactly by bisection on the order-preserving 32-bit images of the values (counting
    passes of fp32 compares over the row, CHUNK maxima at a time: few registers, many rows in flight; no
    sort), between the images of the row's smallest and largest values, in steps of the values' common
    trailing zero bits (16 for bf16 logits at temperature 1: half the passes), stopping early once exactly
    KK values reach the midpoint (the smallest of them is then the threshold); then every segment above it and
    the lowest-indexed ones equal to it until KK are taken: exactly the set an int64 top-k of select.sort_key
    keys gives. HAS_TOP (the forward's top_col int8 [G, N] and second values top_second fp32 [G, N]): chosen
    segment j must be recomputed where its tempered second value reaches thr[n] (or is NaN) (select.py):
    then flags[n, j] = 1, cand[n, j] = pad and row n joins segment g's list (seg_list[g, :seg_count[g]],
    one atomic slot per pair: the order varies, the set does not); else cand[n, j] = the sort key of the
    segment's max (cand's rows CAP long)."""
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
    if HAS_TOP:  # over the row's KK chosen segments only (a masked load or atomic costs per lane, taken or not)
        tl.debug_barrier()  # best, written by other threads of the program
        o_j = tl.arange(0, KK2)[None, :]
        m_j = m_n[:, None] & (o_j < taken[:, None])
        g = tl.load(best + rows[:, None] * KK + o_j, mask=m_j, other=0)
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
        tl.store(cand + rows[:, None] * CAP + o_j, tl.where(redo, pad, _sort_key(z, g * 128 + col + vocab_start)),
                 mask=m_j)
        tl.store(flags + rows[:, None] * KK + o_j, redo.to(tl.int8), mask=m_j)
        m_list = m_j & redo
        slot = tl.atomic_add(seg_count + g, 1, mask=m_list)
        tl.store(seg_list + g * N + slot, rows[:, None].to(tl.int32) + tl.zeros_like(o_j), mask=m_list)


@triton.jit
def _append_candidates(h, w, rows, g, inv_t, thr, count, cand, row0, CAP, H, valid, vocab_start, inv_t_scalar,
                       softcap, inv_softcap, SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr):
    """Segment g's logits for rows `rows` ([BLOCK_N], -1: none), head-transformed as the forward does (bf16
    rounding, softcap) and tempered; those >= the row's threshold thr[row] (and inside the shard) are
    appended as sort keys (global ids) to the row's candidate list cand[row - row0, :] (CAP slots,
    count[row - row0] used). The slot of each batch comes from one atomic add per (row, segment): the lists'
    order varies, their sets do not."""
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
        z = b_r * tl.load(inv_t + o_nc, mask=live, other=1.0)[:, None]
    else:
        z = b_r * inv_t_scalar
    b_t = tl.load(thr + o_nc, mask=live, other=float("inf"))[:, None]
    local = o_nc - row0
    # the even and the odd columns one after the other (a thread holds pairs of adjacent columns, so the split
    # moves no data): half the int64 keys live at a time
    z0, z1 = tl.split(tl.reshape(z, [BLOCK_N, SEG // 2, 2]))
    c0 = g * SEG + 2 * tl.arange(0, SEG // 2)[None, :]  # the local column of z0's entries (z1's: + 1)
    take0 = live[:, None] & (c0 < valid) & (z0 >= b_t)
    take1 = live[:, None] & (c0 + 1 < valid) & (z1 >= b_t)
    n0 = tl.sum(take0.to(tl.int32), 1)
    base = tl.atomic_add(count + local, n0 + tl.sum(take1.to(tl.int32), 1), mask=live)
    p_row = cand + local[:, None] * CAP
    pos0 = base[:, None] + tl.cumsum(take0.to(tl.int32), 1) - 1
    tl.store(p_row + pos0, _sort_key(z0, c0 + vocab_start), mask=take0 & (pos0 < CAP))
    pos1 = (base + n0)[:, None] + tl.cumsum(take1.to(tl.int32), 1) - 1
    tl.store(p_row + pos1, _sort_key(z1, c0 + 1 + vocab_start), mask=take1 & (pos1 < CAP))


@triton.jit
def segment_candidates_kernel(h, w, task_rows, task_seg, inv_t, thr, count, cand, row0, CAP, H, valid, G,
                              vocab_start, inv_t_scalar, softcap, inv_softcap, SEG: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr,
                              SOFTCAP: tl.constexpr):
    """Task t: _append_candidates of segment task_seg[t] for rows task_rows[t, :]. Tasks of segment -1 or
    >= G have nothing to do."""
    t = tl.program_id(0)
    g = tl.load(task_seg + t)
    if (g >= 0) & (g < G):
        rows = tl.load(task_rows + t * BLOCK_N + tl.arange(0, BLOCK_N))
        _append_candidates(h, w, rows, g, inv_t, thr, count, cand, row0, CAP, H, valid, vocab_start, inv_t_scalar,
                           softcap, inv_softcap, SEG, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, DOT_PRECISION, HAS_INV_T,
                           BF16_LOGITS, SOFTCAP)


@triton.jit
def listed_candidates_kernel(h, w, seg_list, seg_count, task_seg, task_first, n_tasks, inv_t, thr, count, cand, N,
                             CAP, H, valid, vocab_start, inv_t_scalar, softcap, inv_softcap, n_prog,
                             SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                             UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_INV_T: tl.constexpr,
                             BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr):
    """_append_candidates over segment_best_kernel's per-segment row lists: task t is segment task_seg[t]'s
    rows seg_list[g, (t - task_first[g]) · BLOCK_N :][:BLOCK_N]; the n_tasks[0] tasks (on the device: no
    host sync) are strided over the n_prog programs."""
    o_i = tl.arange(0, BLOCK_N)
    for t in range(tl.program_id(0), tl.load(n_tasks), n_prog):
        g = tl.load(task_seg + t)
        o_r = (t - tl.load(task_first + g)) * BLOCK_N + o_i
        rows = tl.load(seg_list + g.to(tl.int64) * N + o_r, mask=o_r < tl.load(seg_count + g), other=-1)
        _append_candidates(h, w, rows, g, inv_t, thr, count, cand, 0, CAP, H, valid, vocab_start, inv_t_scalar,
                           softcap, inv_softcap, SEG, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, DOT_PRECISION, HAS_INV_T,
                           BF16_LOGITS, SOFTCAP)


@triton.jit
def _lists_topk(lst, cnt, dst, m_r, K, pad, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, K2: tl.constexpr):
    """dst[r, :K] = the K largest of the cnt[r] keys (distinct) at lst[r, :], descending, `pad` past them
    where there are fewer (lst, dst: [BLOCK_R, 1] row pointers). The K-th largest is found exactly by
    bisection on the int64 keys (counting passes over the list, no sort); the keys at or above it are
    compacted into the row's output slots, then each goes to its rank among them. The bisection starts between
    the list's smallest and largest keys and stops once exactly K keys reach its lower end."""
    c_max = tl.max(cnt, 0)
    o_c = tl.arange(0, CHUNK)[None, :]
    k_min = tl.full([BLOCK_R], 9223372036854775807, dtype=tl.int64)
    k_max = tl.zeros([BLOCK_R], dtype=tl.int64)
    for c0 in range(0, c_max, CHUNK):
        x = tl.load(lst + c0 + o_c, mask=c0 + o_c < cnt[:, None], other=-1)
        k_min = tl.minimum(k_min, tl.min(tl.where(x >= 0, x, 9223372036854775807), 1))
        k_max = tl.maximum(k_max, tl.max(x, 1))
    # count(keys >= lo) >= K (lo = 0 when there are fewer than K) and count(keys >= hi) < K; c_lo = count(keys
    # >= lo): the bisection runs between the list's extreme keys and stops once exactly K keys reach lo
    many = cnt >= K
    lo = tl.where(many, k_min, 0)
    hi = tl.where(many, k_max + 1, 1)
    c_lo = cnt
    live = m_r & (hi - lo > 1) & (c_lo != K)
    while tl.max(live.to(tl.int32), 0) > 0:
        mid = lo + ((hi - lo) >> 1)
        c = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c0 in range(0, c_max, CHUNK):
            x = tl.load(lst + c0 + o_c, mask=c0 + o_c < cnt[:, None], other=-1)
            c += tl.sum((x >= mid[:, None]).to(tl.int32), 1)
        up = live & (c >= K)
        lo = tl.where(up, mid, lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(live & (c < K), mid, hi)
        live = live & (hi - lo > 1) & (c_lo != K)
    taken = tl.zeros([BLOCK_R], dtype=tl.int32)
    for c0 in range(0, c_max, CHUNK):
        x = tl.load(lst + c0 + o_c, mask=c0 + o_c < cnt[:, None], other=-1)
        sel = x >= lo[:, None]
        pos = taken[:, None] + tl.cumsum(sel.to(tl.int32), 1) - 1
        tl.store(dst + pos, x, mask=sel & (pos < K))
        taken += tl.sum(sel.to(tl.int32), 1)
    tl.debug_barrier()  # the compacted keys, written by other threads of the program
    o_k = tl.arange(0, K2)[None, :]
    nsel = tl.minimum(taken, K)[:, None]
    y = tl.load(dst + o_k, mask=o_k < nsel, other=-1)
    rank = tl.sum((y[:, None, :] > y[:, :, None]).to(tl.int32), 2)
    tl.debug_barrier()  # every slot read before any is overwritten
    tl.store(dst + rank, y, mask=o_k < nsel)
    tl.store(dst + o_k, tl.zeros([BLOCK_R, K2], dtype=tl.int64) + pad, mask=(o_k >= nsel) & (o_k < K) & m_r[:, None])


@triton.jit
def candidate_topk_kernel(cand, count, out, C, CAP, K, pad, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                          K2: tl.constexpr):
    """out[n, :K] = the K best of row n's candidate keys cand[n, :count[n]] (_lists_topk), BLOCK_R rows per
    program. A row whose count exceeds CAP lost keys: overflow_topk_kernel rewrites it."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < C
    cnt = tl.minimum(tl.load(count + o_r, mask=m_r, other=0), CAP)
    _lists_topk(cand + o_r[:, None].to(tl.int64) * CAP, cnt, out + o_r[:, None].to(tl.int64) * K, m_r, K, pad,
                BLOCK_R, CHUNK, K2)


@triton.jit
def overflow_topk_kernel(h, w, segs, flags, cand, inv_t, thr, count, out, scratch, C, KK, CAP, row0, H, valid,
                         vocab_start, inv_t_scalar, softcap, inv_softcap, K, pad, n_prog, SEG: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr,
                         SOFTCAP: tl.constexpr, CHUNK: tl.constexpr, K2: tl.constexpr):
    """out[n] for the rows whose candidate list overflowed (count[n] > CAP: many segments to recompute, e.g.
    flat rows), each row by one program: its stored keys cand[n, j] where flags[n, j] == 0, else the logits >= thr[n]
    of segment segs[n, j] recomputed (a BLOCK_N-row tile of that one row: the forward's bits), gathered in
    the program's scratch row (KK·SEG slots), then the K best (_lists_topk). Programs stride over rows."""
    pid = tl.program_id(0)
    lst = scratch + pid.to(tl.int64) * KK * SEG
    o_s = tl.arange(0, SEG)
    zero = tl.zeros([1], dtype=tl.int32)
    for n in range(pid, C, n_prog):
        if tl.load(count + n) > CAP:
            row = row0 + n
            b_t = tl.load(thr + row)
            if HAS_INV_T:
                b_it = tl.load(inv_t + row)
            else:
                b_it = inv_t_scalar
            o_nc = tl.zeros([BLOCK_N], dtype=tl.int64) + row
            taken = zero
            for j in range(0, KK):
                g = tl.load(segs + n * KK + j)
                if tl.load(flags + n * KK + j) != 0:
                    o_v = g * SEG + o_s
                    o_vc = tl.minimum(o_v, valid - 1).to(tl.int64)
                    b_r, _ = _seg_logits(h, w, None, None, o_nc, o_vc, o_vc, 0, 0, H, SEG, 1, BLOCK_N, BLOCK_K,
                                         EVEN_K, UPCAST, DOT_PRECISION, False)
                    r = tl.max(b_r, 0)  # the tile's rows are all this row
                    if BF16_LOGITS:
                        r = round_bf16(r, UPCAST)
                    if SOFTCAP:
                        r, _ = soft_cap(r, softcap, inv_softcap, UPCAST)
                    z = r * b_it
                    take = (o_v < valid) & (z >= b_t)
                    pos = taken + tl.cumsum(take.to(tl.int32), 0) - 1
                    tl.store(lst + pos, _sort_key(z, o_v + vocab_start), mask=take)
                    taken += tl.sum(take.to(tl.int32), 0)
                else:
                    tl.store(lst + taken, tl.load(cand + n * CAP + j + zero))
                    taken += 1
            tl.debug_barrier()  # the scratch row, written by other threads of the program
            _lists_topk(lst + zero[:, None], taken, out + n * K + zero[:, None], zero == 0, K, pad, 1, CHUNK, K2)
            tl.debug_barrier()  # read before the next row overwrites it
