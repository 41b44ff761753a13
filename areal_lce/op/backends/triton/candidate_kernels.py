"""Triton kernels of the top-k's candidates and its final selection (areal_lce/op/select.py states the method;
select_kernels.py ranks the segments and keys the sort).

  segment_candidates_kernel  segment_logits_kernel's logits, transformed as the forward transforms them and
                        tempered; those at or above the row's threshold are appended (one atomic per row and
                        segment) as sort keys to the row's candidate list: typically about k of them.
  listed_candidates_kernel the same over segment_best_kernel's per-segment lists of rows to recompute
                        (a persistent grid over a task count held on the device).
  candidate_topk_kernel each row's k best candidates, descending (an exact bisection for the k-th, no sort).
  overflow_topk_kernel  the same for the rows whose candidate list overflowed, one program per row.
"""
import triton
import triton.language as tl

from .kernel_common import head_transform
from .segment_kernels import _seg_logits
from .select_kernels import _sort_key


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
    b_r, _ = head_transform(b_r, softcap, inv_softcap, UPCAST, BF16_LOGITS, SOFTCAP)
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
                    r, _ = head_transform(r, softcap, inv_softcap, UPCAST, BF16_LOGITS, SOFTCAP)
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
