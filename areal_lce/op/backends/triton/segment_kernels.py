"""Triton kernels of invariant mode (areal_lce/op/exact.py states the arithmetic and why it is exact).

  lce_fwd_seg_kernel    one program = BLOCK_N tokens x one vocab split, as lce_fwd_kernel, but instead of
                        an online softmax over the split it reduces each 128-column segment of the
                        vocabulary on its own and stores the segment's (raw max, s, a[, Σr, Σr²]). A
                        BLOCK_V = 256 tile is computed as two [BLOCK_N, 128] accumulators in one K loop
                        (one h load feeds both dots), so the two halves of a tile are reduced by the
                        same code on the same layout: a segment's bits do not depend on whether it is
                        the first or the second half of a tile, i.e. on the shard start, nor on the
                        split, the grid or N. Per split it also stores the raw min and the label logit;
                        with selected ids (HAS_SEL) each row's pick per segment, taken by the label's
                        one-hot reduction (select_kernels.selected_plan_kernel says which).
  lce_seg_reduce_kernel raw max, raw min and label logit over the splits (exact).
  lce_seg_fold_kernel   each segment's terms relative to the global max, converted to int64 with
                        FRAC_BITS fractional bits and summed (integer atomics over chunks of segments):
                        exact, so any order gives the same bits.

BF16_LOGITS rounds every raw logit to bf16 right after the fp32 accumulation (logits_precision="bf16"); then
SOFTCAP caps it, c · tanh(r / c) (kernel_common.head_transform, elementwise: the invariance is unchanged).
"""
import triton
import triton.language as tl

from .kernel_common import LN2, LOG2E, _cache_tile, _fwd_rows, _k_slice, _split_cols, head_transform


@triton.jit
def _dot(b_h, b_w, b_acc, DOT_PRECISION: tl.constexpr, ROWWISE: tl.constexpr):
    """b_acc + b_h · b_wᵀ. ROWWISE (the CPU interpreter): as a broadcast product summed over K, because the
    interpreter's tl.dot is numpy's BLAS matmul, whose bits for a row change with its position in the
    block; on the GPU every row of a tensor-core tile is accumulated alike."""
    if ROWWISE:
        return b_acc + tl.sum(b_h.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], 2)
    return tl.dot(b_h, tl.trans(b_w), b_acc, input_precision=DOT_PRECISION)


@triton.jit
def _seg_logits(h, w, d_h, d_w, o_nc, o_vc0, o_vc1, row0, col0, H,
                SEG: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Raw logits of columns [col0, col0 + SEG) and (SUB == 2) [col0 + SEG, col0 + 2·SEG) as two fp32
    [BLOCK_N, SEG] accumulators sharing each loaded h tile."""
    b_acc0 = tl.zeros([BLOCK_N, SEG], dtype=tl.float32)
    b_acc1 = tl.zeros([BLOCK_N, SEG], dtype=tl.float32)
    p_h = h + o_nc[:, None] * H  # the pointer loads' rows (unused with USE_TMA)
    p_w0 = w + o_vc0[:, None] * H
    p_w1 = w + o_vc1[:, None] * H
    for k0 in range(0, H, BLOCK_K):
        b_h = _k_slice(p_h, d_h, row0, k0, H, BLOCK_K, EVEN_K, UPCAST, USE_TMA)
        b_w0 = _k_slice(p_w0, d_w, col0, k0, H, BLOCK_K, EVEN_K, UPCAST, USE_TMA)
        b_acc0 = _dot(b_h, b_w0, b_acc0, DOT_PRECISION, UPCAST)
        if SUB == 2:
            b_w1 = _k_slice(p_w1, d_w, col0 + SEG, k0, H, BLOCK_K, EVEN_K, UPCAST, USE_TMA)
            b_acc1 = _dot(b_h, b_w1, b_acc1, DOT_PRECISION, UPCAST)
    return b_acc0, b_acc1


@triton.jit
def _seg_fold(b_r, c0, v_end, g, G, seg, top, top_col, stride_seg, o_n, m_n, N, b_y, b_it, b_c, z_cache, b_mn, b_mx,
              b_zy, softcap, inv_softcap, b_pick, b_lslot, sel_raw, K_sel, UPCAST: tl.constexpr, MASKED: tl.constexpr,
              HAS_CACHE: tl.constexpr, HAS_SUMS: tl.constexpr, HAS_TOP: tl.constexpr, HAS_SEL: tl.constexpr,
              BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr, SEG: tl.constexpr, CACHE_COLS: tl.constexpr):
    """Reduce one [BLOCK_N, SEG] raw-logits segment (local columns c0 + [0, SEG), valid below v_end) and
    store its partials at segment index g (only when g < G: a tile's second half may lie past the shard).
    HAS_TOP (a top-k call) also stores the column of the segment's max (the lowest one on ties) and its
    second largest raw value (-inf for a one-column segment): select.py's top-k reads them. HAS_SEL (selected
    ids): b_pick [BLOCK_N] is each row's pick in this segment (selected_plan_kernel's code, -1 for none), never
    in the label's segment; the label's value is stored at the slot b_lslot that selects it (-1 for none).
    Label and pick share one one-hot reduction, so picking costs no work per logit."""
    o_v = c0 + tl.arange(0, SEG)
    b_r, _ = head_transform(b_r, softcap, inv_softcap, UPCAST, BF16_LOGITS, SOFTCAP)
    if HAS_CACHE:
        p_c = _cache_tile(z_cache, o_n, c0, N, SEG, CACHE_COLS)
        tl.store(p_c, b_r * b_it[:, None], mask=m_n[:, None] & (o_v < v_end)[None, :])
    # one column per row is taken from the tile: the label's where it lies here, else the row's pick
    b_lab = (b_y >= c0) & (b_y < c0 + SEG)
    if HAS_SEL:
        b_want = tl.where(b_lab, b_y - c0, tl.where(b_pick >= 0, b_pick % SEG, -1))
    else:
        b_want = tl.where(b_lab, b_y - c0, -1)
    b_val = tl.sum(tl.where(tl.arange(0, SEG)[None, :] == b_want[:, None], b_r, 0.0), 1)
    b_zy += tl.where(b_lab, b_val, 0.0)
    if HAS_SEL:  # the label's value also goes to the slot selecting it (b_lslot), a pick's to its slot
        m_sel = m_n & tl.where(b_lab, b_lslot >= 0, b_pick >= 0)
        tl.store(sel_raw + o_n * K_sel + tl.where(b_lab, b_lslot, b_pick // SEG), b_val, mask=m_sel)
    # Both paths must give a fully valid segment the same bits (at another TP degree it sits in a masked
    # tile): the same d·e product feeds the same sum (a where() between them would change whether the
    # compiler fuses the product into the reduction's adds), masked columns entering as d = e = 0.
    if MASKED:
        m_v = (o_v < v_end)[None, :]
        b_mn = tl.minimum(b_mn, tl.min(tl.where(m_v, b_r, float("inf")), 1))
        b_max = tl.max(tl.where(m_v, b_r, float("-inf")), 1)
        b_d = tl.where(m_v, (b_r - b_max[:, None]) * b_c[:, None], 0.0)
        b_e = tl.where(m_v, tl.exp2(b_d), 0.0)
    else:
        b_mn = tl.minimum(b_mn, tl.min(b_r, 1))
        b_max = tl.max(b_r, 1)
        b_d = (b_r - b_max[:, None]) * b_c[:, None]
        b_e = tl.exp2(b_d)
    b_mx = tl.maximum(b_mx, b_max)
    b_de = tl.sum(b_d * b_e, 1)
    m_st = m_n & (g < G)
    if HAS_TOP:
        o_c = tl.arange(0, SEG)[None, :]
        if MASKED:
            b_rm = tl.where((o_v < v_end)[None, :], b_r, float("-inf"))
        else:
            b_rm = b_r
        b_am = tl.min(tl.where(b_rm == b_max[:, None], o_c, SEG), 1)
        tl.store(top_col + g * N + o_n, b_am.to(tl.int8), mask=m_st)
        tl.store(top + g * N + o_n, tl.max(tl.where(o_c == b_am[:, None], float("-inf"), b_rm), 1), mask=m_st)
    p = seg + g * N + o_n
    tl.store(p, b_max, mask=m_st)
    tl.store(p + stride_seg, tl.sum(b_e, 1), mask=m_st)
    tl.store(p + 2 * stride_seg, b_de * LN2, mask=m_st)
    if HAS_SUMS:
        if MASKED:
            b_rs = tl.where((o_v < v_end)[None, :], b_r, 0.0)
        else:
            b_rs = b_r
        tl.store(p + 3 * stride_seg, tl.sum(b_rs, 1), mask=m_st)
        tl.store(p + 4 * stride_seg, tl.sum(b_rs * b_rs, 1), mask=m_st)
    return b_mn, b_mx, b_zy


@triton.jit
def lce_fwd_seg_kernel(
    h, w, d_h, d_w, y, inv_t, seg, top, top_col, part, z_cache, sel_plane, sel_lslot, sel_raw,
    N, H, V, G, SPLIT_V, n_splits, stride_seg, stride_part, inv_t_scalar, softcap, inv_softcap, K_sel,
    HAS_INV_T: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_SUMS: tl.constexpr, HAS_TOP: tl.constexpr,
    HAS_SEL: tl.constexpr,
    BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    SEG: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    CACHE_COLS: tl.constexpr,
):
    """seg: fp32 [3, G, N] (raw max, s, a) per 128-column segment of this shard's V valid columns,
    [5, G, N] with HAS_SUMS; with HAS_TOP top: fp32 [G, N] (the second largest value) and top_col: int8
    [G, N] (the max's column). HAS_SEL: sel_plane int16 [G, N] each row's pick per segment and sel_lslot
    int32 [N] the slot selecting its label (selected_plan_kernel), sel_raw fp32 [N, K_sel] where their raw
    logits go.
    SPLIT_V is a
    multiple of SUB·SEG. part: fp32 [3, n_splits, N] (raw min, tempered label logit, raw max) per split.
    A token block whose rows are all ignored folds no tile (its values stay unset;
    the caller ignores those rows)."""
    i_s, row0, o_n, m_n, o_nc, b_y, b_it, b_c = _fwd_rows(y, inv_t, N, n_splits, inv_t_scalar, HAS_INV_T, BLOCK_N,
                                                          GROUP_N)
    b_lslot = b_y  # placeholder when not HAS_SEL
    if HAS_SEL:
        b_lslot = tl.load(sel_lslot + o_nc)
    b_zy = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_mn = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)
    b_mx = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)

    TILE: tl.constexpr = SUB * SEG
    v_begin, v_end = _split_cols(i_s, SPLIT_V, V, b_y, m_n)
    for i_t in range(0, tl.cdiv(v_end - v_begin, TILE)):
        col0 = v_begin + i_t * TILE
        o_v0 = col0 + tl.arange(0, SEG)
        o_v1 = o_v0 + SEG
        b_r0, b_r1 = _seg_logits(h, w, d_h, d_w, o_nc, tl.minimum(o_v0, V - 1).to(tl.int64),
                                 tl.minimum(o_v1, V - 1).to(tl.int64), row0, col0, H, SEG, SUB, BLOCK_N,
                                 BLOCK_K, EVEN_K, UPCAST, DOT_PRECISION, USE_TMA)
        g = col0 // SEG
        b_p0 = b_y  # placeholders when not HAS_SEL
        b_p1 = b_y
        if HAS_SEL:  # loaded before the tile's GEMM is needed (nothing here depends on it)
            b_p0 = tl.load(sel_plane + g * N + o_n, mask=m_n & (g < G), other=-1).to(tl.int32)
            b_p1 = tl.load(sel_plane + (g + 1) * N + o_n, mask=m_n & (g + 1 < G) & (SUB == 2),
                           other=-1).to(tl.int32)
        if col0 + TILE <= v_end:
            b_mn, b_mx, b_zy = _seg_fold(
                b_r0, col0, v_end, g, G, seg, top, top_col, stride_seg, o_n, m_n, N, b_y, b_it, b_c, z_cache, b_mn,
                b_mx, b_zy, softcap, inv_softcap, b_p0, b_lslot, sel_raw, K_sel, UPCAST, False, HAS_CACHE, HAS_SUMS,
                HAS_TOP, HAS_SEL, BF16_LOGITS, SOFTCAP, SEG, CACHE_COLS)
            if SUB == 2:
                b_mn, b_mx, b_zy = _seg_fold(
                    b_r1, col0 + SEG, v_end, g + 1, G, seg, top, top_col, stride_seg, o_n, m_n, N, b_y, b_it, b_c,
                    z_cache, b_mn, b_mx, b_zy, softcap, inv_softcap, b_p1, b_lslot, sel_raw, K_sel, UPCAST, False,
                    HAS_CACHE, HAS_SUMS, HAS_TOP, HAS_SEL, BF16_LOGITS, SOFTCAP, SEG, CACHE_COLS)
        else:
            b_mn, b_mx, b_zy = _seg_fold(
                b_r0, col0, v_end, g, G, seg, top, top_col, stride_seg, o_n, m_n, N, b_y, b_it, b_c, z_cache, b_mn,
                b_mx, b_zy, softcap, inv_softcap, b_p0, b_lslot, sel_raw, K_sel, UPCAST, True, HAS_CACHE, HAS_SUMS,
                HAS_TOP, HAS_SEL, BF16_LOGITS, SOFTCAP, SEG, CACHE_COLS)
            if SUB == 2:
                if col0 + SEG < v_end:
                    b_mn, b_mx, b_zy = _seg_fold(
                        b_r1, col0 + SEG, v_end, g + 1, G, seg, top, top_col, stride_seg, o_n, m_n, N, b_y, b_it,
                        b_c, z_cache, b_mn, b_mx, b_zy, softcap, inv_softcap, b_p1, b_lslot, sel_raw, K_sel, UPCAST,
                        True, HAS_CACHE, HAS_SUMS, HAS_TOP, HAS_SEL, BF16_LOGITS, SOFTCAP, SEG, CACHE_COLS)
    p_part = part + i_s * N + o_n
    tl.store(p_part, b_mn, mask=m_n)
    tl.store(p_part + stride_part, b_zy * b_it, mask=m_n)
    tl.store(p_part + 2 * stride_part, b_mx, mask=m_n)


@triton.jit
def transpose_kernel(src, dst, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst [C, R] = src [R, C]ᵀ, one BLOCK_R x BLOCK_C tile per program (loads and stores both along rows: the
    compiler moves the tile through shared memory). The top-k's ranking reads each row's segment maxima
    contiguous; storing them so from the forward's epilogue (one scattered store per row and segment) cost
    more than this copy."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    x = tl.load(src + o_r[:, None].to(tl.int64) * C + o_c[None, :], mask=m)
    tl.store(dst + o_c[:, None].to(tl.int64) * R + o_r[None, :], tl.trans(x), mask=tl.trans(m))


@triton.jit
def lce_seg_reduce_kernel(part, out, N, n_splits, stride_part, BLOCK_N: tl.constexpr):
    """out fp32 [3, N] = (raw max, raw min, tempered label logit) over the splits: maxima, minima and a
    sum of one nonzero value, all exact in any order."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_mx = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    b_mn = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)
    b_zy = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i_s in range(0, n_splits):
        p = part + i_s * N + o_n
        b_mn = tl.minimum(b_mn, tl.load(p, mask=m_n, other=float("inf")))
        b_zy += tl.load(p + stride_part, mask=m_n, other=0.0)
        b_mx = tl.maximum(b_mx, tl.load(p + 2 * stride_part, mask=m_n, other=float("-inf")))
    tl.store(out + o_n, b_mx, mask=m_n)
    tl.store(out + N + o_n, b_mn, mask=m_n)
    tl.store(out + 2 * N + o_n, b_zy, mask=m_n)


@triton.jit
def _fixed(x, SCALE: tl.constexpr):
    b_ok = (x == x) & (tl.abs(x) < float("inf"))
    return tl.where(b_ok, x * SCALE, 0.0).to(tl.int64), (~b_ok).to(tl.int64)


@triton.jit
def lce_seg_fold_kernel(seg, mx, inv_t, scales, q, N, G, stride_seg, inv_t_scalar,
                        HAS_INV_T: tl.constexpr, HAS_SUMS: tl.constexpr, SCALE: tl.constexpr,
                        BLOCK_N: tl.constexpr, G_CHUNK: tl.constexpr):
    """q int64 [3, N] += (Σ s-terms, Σ a-terms, non-finite terms), [5, N] with HAS_SUMS (+ Σ r, Σ r² terms
    scaled by scales [2, N]); mx: the global raw max. The arithmetic of exact.fold_segments. Grid: row
    blocks x chunks of G_CHUNK segments; each program adds its chunk's integer sums with atomics
    (integer additions: the same result in any order), q zero-filled by the caller."""
    i_n = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * G_CHUNK
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_mx = tl.load(mx + o_n, mask=m_n, other=0.0)
    if HAS_INV_T:
        b_c = tl.load(inv_t + o_n, mask=m_n, other=1.0) * LOG2E
    else:
        b_c = tl.zeros([BLOCK_N], dtype=tl.float32) + inv_t_scalar * LOG2E
    b_qs = tl.zeros([BLOCK_N], dtype=tl.int64)
    b_qa = tl.zeros([BLOCK_N], dtype=tl.int64)
    b_bad = tl.zeros([BLOCK_N], dtype=tl.int64)
    b_ql = tl.zeros([BLOCK_N], dtype=tl.int64)
    b_qq = tl.zeros([BLOCK_N], dtype=tl.int64)
    if HAS_SUMS:
        b_sl = tl.load(scales + o_n, mask=m_n, other=0.0)
        b_sq = tl.load(scales + N + o_n, mask=m_n, other=0.0)
    for g in range(g0, tl.minimum(g0 + G_CHUNK, G)):
        p = seg + g * N + o_n
        b_rm = tl.load(p, mask=m_n, other=0.0)
        b_s = tl.load(p + stride_seg, mask=m_n, other=0.0)
        b_a = tl.load(p + 2 * stride_seg, mask=m_n, other=0.0)
        b_empty = b_s == 0.0
        b_d2 = tl.where(b_empty, 0.0, (b_rm - b_mx) * b_c)
        b_w = tl.exp2(b_d2)
        q0, e0 = _fixed(b_s * b_w, SCALE)
        q1, e1 = _fixed(tl.where(b_empty, 0.0, b_w * (b_a + (b_d2 * LN2) * b_s)), SCALE)
        b_qs += q0
        b_qa += q1
        b_bad += e0 + e1
        if HAS_SUMS:
            q2, e2 = _fixed(tl.load(p + 3 * stride_seg, mask=m_n, other=0.0) * b_sl, 1.0)
            q3, e3 = _fixed(tl.load(p + 4 * stride_seg, mask=m_n, other=0.0) * b_sq, 1.0)
            b_ql += q2
            b_qq += q3
            b_bad += e2 + e3
    p_q = q + o_n
    tl.atomic_add(p_q, b_qs, mask=m_n)
    tl.atomic_add(p_q + N, b_qa, mask=m_n)
    tl.atomic_add(p_q + 2 * N, b_bad, mask=m_n)
    if HAS_SUMS:
        tl.atomic_add(p_q + 3 * N, b_ql, mask=m_n)
        tl.atomic_add(p_q + 4 * N, b_qq, mask=m_n)


@triton.jit
def lce_seg_finish_kernel(q, zy, mx, mn, inv_t, scales, out, N, inv_t_scalar, HAS_INV_T: tl.constexpr,
                          HAS_SUMS: tl.constexpr, INV_SCALE: tl.constexpr, BLOCK_N: tl.constexpr):
    """out fp32 [5, N] = (logprob, entropy, lse, max, min), [7, N] with HAS_SUMS (+ Σ r, Σ r²), from the
    summed integers q: exact.finish's arithmetic (fp64, rounded once) in one launch."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_s = tl.load(q + o_n, mask=m_n, other=1).to(tl.float64) * INV_SCALE
    b_a = tl.load(q + N + o_n, mask=m_n, other=0).to(tl.float64) * INV_SCALE
    b_bad = tl.load(q + 2 * N + o_n, mask=m_n, other=0) > 0
    b_mx = tl.load(mx + o_n, mask=m_n, other=0.0)
    b_mn = tl.load(mn + o_n, mask=m_n, other=0.0)
    if HAS_INV_T:
        b_it = tl.load(inv_t + o_n, mask=m_n, other=1.0)
    else:
        b_it = tl.zeros([BLOCK_N], dtype=tl.float32) + inv_t_scalar
    b_m = (b_mx * b_it).to(tl.float64)
    b_log_s = tl.log(b_s)
    b_lse = b_m + b_log_s
    b_lp = tl.load(zy + o_n, mask=m_n, other=0.0).to(tl.float64) - b_lse
    b_ent = b_log_s - b_a / b_s
    nan = float("nan")
    p = out + o_n
    tl.store(p, tl.where(b_bad, nan, b_lp.to(tl.float32)), mask=m_n)
    tl.store(p + N, tl.where(b_bad, nan, b_ent.to(tl.float32)), mask=m_n)
    tl.store(p + 2 * N, tl.where(b_bad, nan, b_lse.to(tl.float32)), mask=m_n)
    tl.store(p + 3 * N, tl.where(b_bad, nan, b_mx), mask=m_n)
    tl.store(p + 4 * N, tl.where(b_bad, nan, b_mn), mask=m_n)
    if HAS_SUMS:
        b_ls = (tl.load(q + 3 * N + o_n, mask=m_n, other=0).to(tl.float64)
                / tl.load(scales + o_n, mask=m_n, other=1.0).to(tl.float64))
        b_lq = (tl.load(q + 4 * N + o_n, mask=m_n, other=0).to(tl.float64)
                / tl.load(scales + N + o_n, mask=m_n, other=1.0).to(tl.float64))
        tl.store(p + 5 * N, tl.where(b_bad, nan, b_ls.to(tl.float32)), mask=m_n)
        tl.store(p + 6 * N, tl.where(b_bad, nan, b_lq.to(tl.float32)), mask=m_n)
