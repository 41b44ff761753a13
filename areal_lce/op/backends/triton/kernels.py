"""Triton kernels of the fused linear logprobs + entropy op (CUDA and the CPU interpreter).

No allocation or host logic here (launch.py owns both):

  lce_fwd_kernel        one program = BLOCK_N tokens x one vocab split of SPLIT_V columns. For each
                        BLOCK_V tile it runs a tensor-core GEMM over H (fp32 accumulator) and folds the
                        tile into running per-token statistics (online softmax). Writes per-split
                        partials (m, s, a, zy, mn, mx), with HAS_SUMS also the raw logits' row sum and
                        sum of squares from the same accumulator tile (logit mean / L2 norm without
                        another pass), and optionally the fp32 tempered logits (cache).
                        z_label comes from the same accumulator as the max and the sum, so logprob =
                        z_label - lse keeps their rounding correlated (a separate row dot gave 7-20x
                        worse max |dlogp| on an H100, benchmark/results/archive/h100_op_run7_label_split_tpp).
  lce_fwd_merge_kernel  merges the per-split partials of each token in a fixed split order.
  lce_bwd_kernel        persistent over one vocab chunk's tiles: recomputes (or reads from the cache)
                        each logits tile in fp32 registers and writes d_logits = dz / T without the
                        one-hot term into a [N, V_chunk] workspace.
  lce_bwd_label_kernel  adds the one-hot term g_lp / T at each row's label column of the chunk;
                        cuBLAS does the rest.
  local_labels_kernel   global label ids -> this shard's int32 label columns (IGNORED for ignored rows).
  check_labels_kernel   the deferred label / temperature check of one call (value_check.py).

Cache layout. The fp32 logits cache is column-slab major, [ceil(V / CACHE_COLS), N, CACHE_COLS], and
BLOCK_V divides CACHE_COLS: a tile's addresses are a slab base plus row * CACHE_COLS plus a column
arange, so the loads and stores vectorise (no clamps or div/mod per element), and a [BLOCK_N,
CACHE_COLS] tile is one contiguous block.

Units. The accumulator holds raw logits r = h . w. With c = inv_t * log2(e), the softmax terms are
exp2((r - r_max) * c); subtracting in raw units first keeps (r - r_max) exact near the max. The partial
`a` is returned in natural units: a = ln2 * sum(d2 * exp2(d2)), d2 = (r - r_max) * c. The raw max and
min (mx, mn: the op's max_logit / min_logit) are stored as tracked; the tempered max m = r_max * inv_t
(the merge's reference point) is one more row of the partials, so the merge needs no inv_t.

NaN. tl.max / tl.maximum ignore NaN on the GPU, so a NaN logit never reaches the running max; it does
reach exp2(NaN - m) and therefore s, and the merge kernel turns m / mn / mx into NaN wherever s is NaN.

Soft-capping (SOFTCAP, params.softcap = c > 0). Every raw logit becomes c · tanh(r / c) right after the fp32
accumulation (and the bf16 rounding under BF16_LOGITS), before anything reads it: the max, min, sums, label
logit and cache are of the capped logits (base.py). The backward recomputes the same value (the cache holds
it times inv_t) and multiplies d_logits, one-hot term included, by 1 - tanh², so under SOFTCAP
lce_bwd_kernel adds the one-hot term itself and lce_bwd_label_kernel is not launched. SOFTCAP=False
compiles none of it.

Interpreter. bf16 tl.dot returns garbage under TRITON_INTERPRET=1: with
UPCAST every loaded tile is converted to fp32 right after the load.
"""
import triton
import triton.language as tl

from .kernel_common import (IGNORED, LN2, LOG2E, _cache_tile, _fwd_rows, _k_slice,  # noqa: F401
                            _split_cols, _tile_coords, head_transform)


@triton.jit
def _logits_tile(h, w, d_h, d_w, o_nc, o_vc, row0, col0, H, k_hi, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Raw logits h[rows] . w[cols]^T over k < k_hi (H, or 0 for a tile that needs no GEMM), fp32
    [BLOCK_N, BLOCK_V].

    Loads: _k_slice (TMA boxes [row0, k0] / [col0, k0], or pointer loads of the clamped rows o_nc / o_vc)."""
    b_acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    p_h = h + o_nc[:, None] * H  # the pointer loads' rows (unused with USE_TMA)
    p_w = w + o_vc[:, None] * H
    for k0 in range(0, k_hi, BLOCK_K):
        b_h = _k_slice(p_h, d_h, row0, k0, H, BLOCK_K, EVEN_K, UPCAST, USE_TMA)
        b_w = _k_slice(p_w, d_w, col0, k0, H, BLOCK_K, EVEN_K, UPCAST, USE_TMA)
        b_acc = tl.dot(b_h, tl.trans(b_w), b_acc, input_precision=DOT_PRECISION)
    return b_acc


@triton.jit
def _fwd_tile(h, w, d_h, d_w, z_cache, o_n, m_n, o_nc, row0, v0, v_end, N, V, H, b_y, b_it, b_c,
              b_m, b_s, b_a, b_zy, b_mn, b_ls, b_lq, softcap, inv_softcap,
              MASKED: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_SUMS: tl.constexpr, EVEN_K: tl.constexpr,
              UPCAST: tl.constexpr, BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, CACHE_COLS: tl.constexpr):
    """Fold one [BLOCK_N, BLOCK_V] logits tile into the running statistics. MASKED only for the ragged
    last tile of the shard: full tiles skip the column masks (2 of ~12 ops per element)."""
    o_v = v0 + tl.arange(0, BLOCK_V)  # int32: shard-local column
    o_vc = tl.minimum(o_v, V - 1).to(tl.int64)
    b_r = _logits_tile(h, w, d_h, d_w, o_nc, o_vc, row0, v0, H, H, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, UPCAST,
                       DOT_PRECISION, USE_TMA)
    # bf16 rounding, soft cap: from here on "raw logit" means the rounded, capped one
    b_r, _ = head_transform(b_r, softcap, inv_softcap, UPCAST, BF16_LOGITS, SOFTCAP)
    if HAS_CACHE:
        p_c = _cache_tile(z_cache, o_n, v0, N, BLOCK_V, CACHE_COLS)
        if MASKED:
            tl.store(p_c, b_r * b_it[:, None], mask=m_n[:, None] & (o_v < v_end)[None, :])
        else:
            tl.store(p_c, b_r * b_it[:, None], mask=m_n[:, None])
    b_zy += tl.sum(tl.where(o_v[None, :] == b_y[:, None], b_r, 0.0), 1)
    if HAS_SUMS:  # raw units; columns past the shard's valid end add 0 (their values are clamped reads)
        if MASKED:
            b_rv = tl.where((o_v < v_end)[None, :], b_r, 0.0)
        else:
            b_rv = b_r
        b_ls += tl.sum(b_rv, 1)
        b_lq += tl.sum(b_rv * b_rv, 1)
    if MASKED:
        m_v = o_v < v_end
        b_mn = tl.minimum(b_mn, tl.min(tl.where(m_v[None, :], b_r, float("inf")), 1))
        b_r = tl.where(m_v[None, :], b_r, float("-inf"))  # padding / split tail: -inf, never 0
    else:
        b_mn = tl.minimum(b_mn, tl.min(b_r, 1))
    b_mnew = tl.maximum(b_m, tl.max(b_r, 1))
    b_d = (b_r - b_mnew[:, None]) * b_c[:, None]
    b_e = tl.exp2(b_d)
    if MASKED:
        b_de = tl.sum(tl.where(b_e == 0.0, 0.0, b_d * b_e), 1)  # (-inf)*0 at masked columns -> 0
    else:
        b_de = tl.sum(b_d * b_e, 1)
    b_dm = (b_m - b_mnew) * b_c
    b_alpha = tl.exp2(b_dm)
    b_a = b_alpha * (b_a + tl.where(b_s == 0.0, 0.0, b_dm * b_s)) + b_de
    b_s = b_s * b_alpha + tl.sum(b_e, 1)
    return b_mnew, b_s, b_a, b_zy, b_mn, b_ls, b_lq


@triton.jit
def _store_stats(p, stride, m_n, b_m, b_s, b_a, b_zy, b_mn, b_mx, b_ls, b_lq, b_t, a_unit,
                 HAS_SUMS: tl.constexpr):
    """The rows m · b_t, s, a · a_unit, zy · b_t, mn, mx (HAS_SUMS: and Σ r, Σ r²) at p, p + stride,
    p + 2 · stride, ...: a split's partials from lce_fwd_kernel's running state (its raw m and zy tempered by
    b_t = 1/T, its base-2 a in natural units by a_unit = ln 2), or the merged stats (b_t = a_unit = 1.0:
    multiplications the compiler folds away). Each product is formed at its store."""
    tl.store(p, b_m * b_t, mask=m_n)
    tl.store(p + stride, b_s, mask=m_n)
    tl.store(p + 2 * stride, b_a * a_unit, mask=m_n)
    tl.store(p + 3 * stride, b_zy * b_t, mask=m_n)
    tl.store(p + 4 * stride, b_mn, mask=m_n)
    tl.store(p + 5 * stride, b_mx, mask=m_n)
    if HAS_SUMS:
        tl.store(p + 6 * stride, b_ls, mask=m_n)
        tl.store(p + 7 * stride, b_lq, mask=m_n)


@triton.jit
def lce_fwd_kernel(
    h, w, d_h, d_w, y, inv_t, part, z_cache,
    N, H, V, SPLIT_V, n_splits, stride_part, inv_t_scalar, softcap, inv_softcap,
    HAS_INV_T: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_SUMS: tl.constexpr, BF16_LOGITS: tl.constexpr,
    SOFTCAP: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    CACHE_COLS: tl.constexpr,
):
    """part: fp32 [6, n_splits, N] = (m, s, a, zy, mn, mx) of each split (m tempered, mn / mx raw),
    [8, n_splits, N] with HAS_SUMS (+ Σ r, Σ r² of the raw logits r); z_cache: fp32 cache (module docstring)
    or unused. V here is the number of valid columns; y holds local label columns (int32: -1 = not owned,
    IGNORED = ignored row).
    d_h / d_w: TMA descriptors of hidden [N, H] and weight [V, H] when USE_TMA, else unused.
    A token block whose rows are all ignored folds no tile (its partials keep their initial values;
    the caller ignores those rows)."""
    i_s, row0, o_n, m_n, o_nc, b_y, b_it, b_c = _fwd_rows(y, inv_t, N, n_splits, inv_t_scalar, HAS_INV_T, BLOCK_N,
                                                          GROUP_N)
    b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)  # raw units
    b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_a = tl.zeros([BLOCK_N], dtype=tl.float32)  # base-2 units, relative to b_m
    b_zy = tl.zeros([BLOCK_N], dtype=tl.float32)  # raw units
    b_mn = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)  # raw units
    b_ls = tl.zeros([BLOCK_N], dtype=tl.float32)  # raw units, HAS_SUMS only
    b_lq = tl.zeros([BLOCK_N], dtype=tl.float32)

    v_begin, v_end = _split_cols(i_s, SPLIT_V, V, b_y, m_n)
    n_full = (v_end - v_begin) // BLOCK_V
    for i_t in range(0, n_full):
        b_m, b_s, b_a, b_zy, b_mn, b_ls, b_lq = _fwd_tile(
            h, w, d_h, d_w, z_cache, o_n, m_n, o_nc, row0, v_begin + i_t * BLOCK_V, v_end, N, V, H, b_y, b_it,
            b_c, b_m, b_s, b_a, b_zy, b_mn, b_ls, b_lq, softcap, inv_softcap, False, HAS_CACHE, HAS_SUMS, EVEN_K,
            UPCAST, BF16_LOGITS, SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_K, CACHE_COLS)
    if v_begin + n_full * BLOCK_V < v_end:
        b_m, b_s, b_a, b_zy, b_mn, b_ls, b_lq = _fwd_tile(
            h, w, d_h, d_w, z_cache, o_n, m_n, o_nc, row0, v_begin + n_full * BLOCK_V, v_end, N, V, H, b_y, b_it,
            b_c, b_m, b_s, b_a, b_zy, b_mn, b_ls, b_lq, softcap, inv_softcap, True, HAS_CACHE, HAS_SUMS, EVEN_K,
            UPCAST, BF16_LOGITS, SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_K, CACHE_COLS)

    # stride_part = n_splits * N, from the host (a scalar 1 arrives as a constexpr)
    _store_stats(part + i_s * N + o_n, stride_part, m_n, b_m, b_s, b_a, b_zy, b_mn, b_m, b_ls, b_lq, b_it, LN2,
                 HAS_SUMS)


@triton.jit
def lce_fwd_merge_kernel(part, out, N, n_splits, stride_part, HAS_SUMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """out: fp32 [6, N] = (m, s, a, zy, mn, mx) over all splits, merged in split order (deterministic);
    [8, N] with HAS_SUMS (+ Σ r, Σ r², plain sums over the splits)."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    stride = stride_part
    b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    b_mn = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)
    b_mx = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for i_s in range(0, n_splits):
        p = part + i_s * N + o_n
        b_m = tl.maximum(b_m, tl.load(p, mask=m_n, other=float("-inf")))
        b_mn = tl.minimum(b_mn, tl.load(p + 4 * stride, mask=m_n, other=float("inf")))
        b_mx = tl.maximum(b_mx, tl.load(p + 5 * stride, mask=m_n, other=float("-inf")))
    b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_zy = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_ls = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_lq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i_s in range(0, n_splits):
        p = part + i_s * N + o_n
        if HAS_SUMS:
            b_ls += tl.load(p + 6 * stride, mask=m_n, other=0.0)
            b_lq += tl.load(p + 7 * stride, mask=m_n, other=0.0)
        b_mi = tl.load(p, mask=m_n, other=0.0)
        b_si = tl.load(p + stride, mask=m_n, other=0.0)
        b_ai = tl.load(p + 2 * stride, mask=m_n, other=0.0)
        b_zy += tl.load(p + 3 * stride, mask=m_n, other=0.0)
        b_dm = b_mi - b_m
        b_f = tl.exp(b_dm)
        b_s += b_si * b_f
        # a_i is relative to m_i: shift to m; a split whose s_i is 0 contributes nothing
        b_a += tl.where(b_si == 0.0, 0.0, b_f * (b_ai + b_dm * b_si))
    b_nan = b_s != b_s
    b_m = tl.where(b_nan, b_s, b_m)
    b_mn = tl.where(b_nan, b_s, b_mn)
    b_mx = tl.where(b_nan, b_s, b_mx)
    _store_stats(out + o_n, N, m_n, b_m, b_s, b_a, b_zy, b_mn, b_mx, b_ls, b_lq, 1.0, 1.0, HAS_SUMS)


@triton.jit
def lce_bwd_kernel(
    h, w, d_h, d_w, y, inv_t, lse, ent, g_lp, g_ent, z_cache, dl,
    N, H, V, v_begin, width, stride_dl, n_programs, inv_t_scalar, softcap, inv_softcap,
    HAS_INV_T: tl.constexpr, USE_CACHE: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    CACHE_COLS: tl.constexpr,
):
    """dl[n, j - v_begin] = dz[n, j] * inv_t[n] for the chunk j in [v_begin, v_begin + width).

    dz_j = g_lp (1[j = y] - p_j) - g_ent p_j (log p_j + ent), p_j = exp(z_j - lse). In base 2 with
    x = log2(e) (z_j - lse): d_logits = -p (A + B x) + C 1[j = y], A = (g_lp + g_ent ent) / T,
    B = ln2 g_ent / T, C = g_lp / T. This kernel writes -p (A + B x); lce_bwd_label_kernel adds C.
    V is the number of valid columns of the shard; y holds local label columns as lce_fwd_kernel's.

    Ignored rows (y == IGNORED) get d_logits exactly 0, whatever their hidden, 1/T, lse or cached values
    (a select, only in tiles that hold one); a tile whose rows are all ignored runs no GEMM and stores
    zeros (cuBLAS reads every row of dl).

    Persistent: n_programs programs (one per SM slot) walk the chunk's [BLOCK_N, BLOCK_V] tiles in grouped
    order, program i taking tiles i, i + n_programs, ... One resident program per SM thus starts its next
    tile's loads without a block launch, and the ragged last wave is a few tiles, not a few blocks. Each
    tile is computed exactly as a one-tile program would (same K order): the result does not depend on
    n_programs."""
    i_pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    n_blocks_v = tl.cdiv(width, BLOCK_V)
    for i_tile in tl.range(i_pid, n_blocks_n * n_blocks_v, n_programs):
        i_n, i_v = _tile_coords(i_tile, n_blocks_n, n_blocks_v, GROUP_N)
        row0 = i_n * BLOCK_N
        o_n = row0.to(tl.int64) + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        o_nc = tl.minimum(o_n, N - 1)
        b_y = tl.load(y + o_nc)
        b_live = (b_y != IGNORED) & m_n
        n_live = tl.sum(b_live.to(tl.int32), 0)
        if HAS_INV_T:
            b_it = tl.load(inv_t + o_nc)
        else:
            b_it = tl.zeros([BLOCK_N], dtype=tl.float32) + inv_t_scalar
        b_lse = tl.load(lse + o_nc)
        b_gent = tl.load(g_ent + o_nc)
        b_glp = tl.load(g_lp + o_nc)
        b_A = (b_glp + b_gent * tl.load(ent + o_nc)) * b_it
        b_B = b_gent * b_it * LN2
        o_j = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # int32: column inside the chunk
        if USE_CACHE:
            # unmasked: clamped rows, and a slab is allocated CACHE_COLS wide, so the columns past the
            # shard's end are readable (their values are never stored); no mask keeps the loads vectorised
            b_z = tl.load(_cache_tile(z_cache, o_nc, v_begin + i_v * BLOCK_V, N, BLOCK_V, CACHE_COLS))
            b_x = (b_z - b_lse[:, None]) * LOG2E
            if SOFTCAP:  # the cache holds softcap · tanh · inv_t
                b_tanh = b_z * (1.0 / (b_it * softcap))[:, None]
        else:
            o_vc = tl.minimum(v_begin + o_j, V - 1).to(tl.int64)
            k_hi = tl.where(n_live > 0, H, 0)  # all rows ignored: no GEMM
            b_r = _logits_tile(h, w, d_h, d_w, o_nc, o_vc, row0, v_begin + i_v * BLOCK_V, H, k_hi, BLOCK_N,
                               BLOCK_V, BLOCK_K, EVEN_K, UPCAST, DOT_PRECISION, USE_TMA)
            # the forward's rounding (its gradient taken as identity) and cap
            b_r, b_tanh = head_transform(b_r, softcap, inv_softcap, UPCAST, BF16_LOGITS, SOFTCAP)
            b_x = b_r * (b_it * LOG2E)[:, None] - (b_lse * LOG2E)[:, None]
        b_p = tl.exp2(b_x)
        b_dl = -b_p * (b_A[:, None] + b_B[:, None] * b_x)
        if SOFTCAP:  # the one-hot term here (lce_bwd_label_kernel is not run), then d cap / d r = 1 - tanh²
            c0 = i_v * BLOCK_V  # the one-hot compare only in a tile that holds a label (~BLOCK_N·BLOCK_V/V of them)
            b_yt = b_y - v_begin
            if tl.sum(((b_yt >= c0) & (b_yt < c0 + BLOCK_V)).to(tl.int32), 0) > 0:
                b_dl += tl.where(o_j[None, :] == b_yt[:, None], (b_glp * b_it)[:, None], 0.0)
            b_dl *= tl.fma(-b_tanh, b_tanh, 1.0)  # 1 - t² with one rounding (exact product inside the fma)
        if n_live < BLOCK_N:  # an ignored row, or the ragged last block (its extra rows are not stored)
            b_dl = tl.where(b_live[:, None], b_dl, 0.0)
        p_dl = dl + o_n[:, None] * stride_dl + o_j[None, :]
        tl.store(p_dl, b_dl.to(dl.dtype.element_ty), mask=m_n[:, None] & (o_j < width)[None, :])


@triton.jit
def lce_bwd_label_kernel(dl, y, inv_t, g_lp, N, v_begin, width, stride_dl, inv_t_scalar, HAS_INV_T: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """dl[n, y[n] - v_begin] += g_lp[n] * inv_t[n] where the label falls inside this chunk (runs after
    lce_bwd_kernel on the same stream; one element per row, so no write conflicts)."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_j = tl.load(y + o_n, mask=m_n, other=-1) - v_begin
    m = m_n & (o_j >= 0) & (o_j < width)
    if HAS_INV_T:
        b_it = tl.load(inv_t + o_n, mask=m, other=0.0)
    else:
        b_it = tl.zeros([BLOCK_N], dtype=tl.float32) + inv_t_scalar
    b_c = tl.load(g_lp + o_n, mask=m, other=0.0) * b_it
    p = dl + o_n * stride_dl + tl.maximum(o_j, 0)
    b = tl.load(p, mask=m, other=0.0).to(tl.float32) + b_c
    tl.store(p, b.to(dl.dtype.element_ty), mask=m)


@triton.jit
def local_labels_kernel(y_ptr, out_ptr, N, vocab_start, shard_valid, ignore_index, BLOCK: tl.constexpr):
    """out[i] (int32) = y[i] - vocab_start when this shard owns label y[i] (global id, int64), IGNORED when
    y[i] == ignore_index, else -1: the label column every other kernel reads."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    y = tl.load(y_ptr + offs, mask=inb, other=0).to(tl.int64)
    local = y - vocab_start
    out = tl.where((local >= 0) & (local < shard_valid), local, -1)
    out = tl.where(y == ignore_index, IGNORED, out)
    tl.store(out_ptr + offs, out.to(tl.int32), mask=inb)


@triton.jit
def check_labels_kernel(y_ptr, inv_t_ptr, bad_ptr, rec_ptr, N, vocab_size, ignore_index,
                        HAS_INV_T: tl.constexpr, BLOCK: tl.constexpr):
    """The deferred value check of one call in one launch (checks.py "deferred"): bad[i] = 1 where label i
    is outside [0, vocab_size) and not ignore_index; the block's count of them, the largest of their
    negated values and of their values, and (HAS_INV_T) its count of 1/T outside (0, inf) are folded into
    the int64 record rec = [bad labels, -(smallest bad), largest bad, bad temperatures, ...] by atomics
    (integer sums and maxima: the same record in any order)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    y = tl.load(y_ptr + offs, mask=inb, other=0).to(tl.int64)
    bad = inb & ((y < 0) | (y >= vocab_size)) & (y != ignore_index)
    tl.store(bad_ptr + offs, bad.to(tl.int8), mask=inb)
    n_bad = tl.sum(bad.to(tl.int64), axis=0)
    if n_bad > 0:
        low = -9223372036854775807
        tl.atomic_add(rec_ptr, n_bad)
        tl.atomic_max(rec_ptr + 1, tl.max(tl.where(bad, -y, low), axis=0))
        tl.atomic_max(rec_ptr + 2, tl.max(tl.where(bad, y, low), axis=0))
    if HAS_INV_T:
        t = tl.load(inv_t_ptr + offs, mask=inb, other=1.0)
        bad_t = inb & ~((t > 0.0) & (t <= 3.4028234663852886e38))  # NaN fails both comparisons
        n_bad_t = tl.sum(bad_t.to(tl.int64), axis=0)
        if n_bad_t > 0:
            tl.atomic_add(rec_ptr + 3, n_bad_t)

