"""Triton kernels of the Ascend backend: forward stats, backward d_hidden, backward d_weight.

Written for Triton-Ascend 3.2 and upstream Triton alike: plain pointer arithmetic, masked tl.load /
tl.store, tl.dot, no block pointers, no atomics. Three separate kernels keep the live tiles of each
small enough for an Ascend core's unified buffer (block sizes come from configs.pick_tiles).

Every program is persistent: it strides over its kernel's tiles with step tl.num_programs(0), so the
grid can be capped (65535 per axis on Triton-Ascend, or the AI-core count) without losing work.

Every tile is upcast with .to(tl.float32) right after its load: z, the softmax and every dot run in
fp32. (Besides keeping z exact, this sidesteps the CPU interpreter's bf16 bugs, where bf16 tl.dot and
arithmetic return wrong values silently.)

Logits are z = (h · Wᵀ) · inv_t; vocabulary rows >= shard_valid are never loaded as logits: the vocab
loops stop at shard_valid and the last partial tile masks its tail to -inf (never 0).

None of the kernels writes an N x V array. Work per call, N tokens, V = shard_valid, H hidden:
  forward   2NHV FLOPs;      HBM: h once per token tile, W once per token tile.
  d_hidden  4NHV FLOPs (logits recompute + d_logits·W); each token tile's fp32 d_hidden rows are
            re-read and re-written once per vocab tile (8·N·H·V/BLOCK_V bytes).
  d_weight  4NHV FLOPs (second logits recompute + d_logitsᵀ·h); each vocab tile's fp32 d_weight rows
            are re-read and re-written once per token tile (8·V·H·N/BLOCK_N bytes).
  Backward total 8NHV (two recomputes) instead of 6NHV for a single fused backward: the price of
  owning every output element in exactly one program (deterministic, no atomics, bounded UB).
"""
import triton
import triton.language as tl


@triton.jit
def _rows_dot_rows(a_ptr, b_ptr, o_a, o_b, m_a, m_b, K, stride_a, stride_b,
                   BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_A, BLOCK_B] = A[o_a, :K] · B[o_b, :K]ᵀ for row-major A, B (unit column stride)."""
    b_acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    o_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        p_a = a_ptr + o_a[:, None] * stride_a + (k0 + o_k)[None, :]
        p_b = b_ptr + o_b[None, :] * stride_b + (k0 + o_k)[:, None]
        b_a = tl.load(p_a, mask=m_a[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_b = tl.load(p_b, mask=m_k[:, None] & m_b[None, :], other=0.0).to(tl.float32)
        b_acc += tl.dot(b_a, b_b)
    return b_acc


@triton.jit
def _add_dot_rows(out_ptr, b_ptr, b_d, o_out, o_b, m_out, m_b, accumulate, K, stride_out, stride_b, o_k,
                  BLOCK_K: tl.constexpr):
    """out[o_out, :K] = (out[o_out, :K] if accumulate else 0) + b_d · B[o_b, :K] in fp32, over K in BLOCK_K
    steps (o_k = arange(BLOCK_K), made once by the kernel), for row-major out, B (unit column stride) and b_d
    fp32 [len(o_out), len(o_b)]: the backward's d_hidden rows (B = W) and d_weight rows (B = h)."""
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        p_b = b_ptr + o_b[:, None] * stride_b + (k0 + o_k)[None, :]
        b_b = tl.load(p_b, mask=m_b[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        p_out = out_ptr + o_out[:, None] * stride_out + (k0 + o_k)[None, :]
        m_o = m_out[:, None] & m_k[None, :]
        b_out = tl.load(p_out, mask=m_o & accumulate, other=0.0).to(tl.float32)
        b_out += tl.dot(b_d, b_b)
        tl.store(p_out, b_out, mask=m_o)


@triton.jit
def _d_logits(b_z, m_ok, m_label, b_lse, b_ent, b_glp, b_gent, b_t):
    """d loss / d raw logit of a tile; per-token operands arrive broadcastable against b_z.

    dz = g_lp·(1[label] - p) - g_ent·p·(log p + H), p = exp(z - lse); d_raw = dz · inv_t.
    m_ok masks padding columns, out-of-range tokens and rows without upstream gradient to exactly 0
    (at padding log p = -inf and p·log p would be NaN).
    """
    b_logp = tl.where(m_ok, b_z - b_lse, 0.0)  # masked entries never form -inf·0 or overflow
    b_p = tl.exp(b_logp)
    b_dz = -b_glp * b_p - b_gent * b_p * (b_logp + b_ent)
    b_dz += tl.where(m_label, b_glp, 0.0)
    return tl.where(m_ok, b_dz * b_t, 0.0)


@triton.jit
def lce_fwd_kernel(
    h_ptr, w_ptr, y_ptr, inv_t_ptr,
    m_ptr, s_ptr, a_ptr, zy_ptr, mn_ptr, mx_ptr, ls_ptr, lq_ptr,
    N, H, shard_valid, vocab_start, inv_t_scalar,
    stride_h, stride_w,
    HAS_INV_T: tl.constexpr, HAS_SUMS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Per token over this shard's valid columns: m = max z, s = Σ e^(z-m), a = Σ (z-m)·e^(z-m),
    zy = z[label] (0 if the label is not in the shard), mn / mx = min / max of the raw logits
    r = h·Wᵀ (before temperature); with HAS_SUMS also Σ r and Σ r². Online over vocab tiles.

    The running max is kept in raw units (mx) and the tempered one derived as m = mx · inv_t, which is
    exactly the max of the tempered z (rounding a product by inv_t > 0 is monotone): the raw max costs
    no extra reduction and is stored as computed."""
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    for i_n in range(i_p, n_tiles, n_p):
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        m_n = o_n < N
        if HAS_INV_T:
            b_t = tl.load(inv_t_ptr + o_n, mask=m_n, other=1.0).to(tl.float32)
        else:
            b_t = tl.zeros((BLOCK_N,), dtype=tl.float32) + inv_t_scalar
        b_y = tl.load(y_ptr + o_n, mask=m_n, other=-1) - vocab_start
        b_mx = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        b_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
        b_a = tl.zeros((BLOCK_N,), dtype=tl.float32)
        b_zy = tl.zeros((BLOCK_N,), dtype=tl.float32)
        b_mn = tl.full((BLOCK_N,), float("inf"), tl.float32)
        b_ls = tl.zeros((BLOCK_N,), dtype=tl.float32)
        b_lq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(0, shard_valid, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            m_v = o_v < shard_valid
            b_r = _rows_dot_rows(h_ptr, w_ptr, o_n, o_v, m_n, m_v, H, stride_h, stride_w,
                                 BLOCK_N, BLOCK_V, BLOCK_H)
            if HAS_SUMS:  # raw logits; masked columns load as 0, the where keeps that explicit
                b_rv = tl.where(m_v[None, :], b_r, 0.0)
                b_ls += tl.sum(b_rv, 1)
                b_lq += tl.sum(b_rv * b_rv, 1)
            b_mn = tl.minimum(b_mn, tl.min(tl.where(m_v[None, :], b_r, float("inf")), 1))
            b_mx_new = tl.maximum(b_mx, tl.max(tl.where(m_v[None, :], b_r, float("-inf")), 1))
            b_m, b_m_new = b_mx * b_t, b_mx_new * b_t  # tempered maxima before / after this tile
            b_z = b_r * b_t[:, None]
            b_z = tl.where(m_v[None, :], b_z, float("-inf"))
            b_d = tl.where(m_v[None, :], b_z - b_m_new[:, None], 0.0)  # 0, not -inf: no (-inf)·0 below
            b_e = tl.where(m_v[None, :], tl.exp(b_d), 0.0)
            # Rescale the running sums to the new max: a' = e^δ (a + δ s), s' = e^δ s, δ = m - m'.
            # Before the first tile m = -inf and s = a = 0; δ := 0 there avoids (-inf)·0.
            b_shift = tl.where(b_m == float("-inf"), 0.0, b_m - b_m_new)
            b_alpha = tl.exp(b_shift)
            b_a = b_alpha * (b_a + b_shift * b_s) + tl.sum(b_d * b_e, 1)
            b_s = b_alpha * b_s + tl.sum(b_e, 1)
            b_mx = b_mx_new
            m_label = (o_v[None, :] == b_y[:, None]) & m_v[None, :]
            b_zy += tl.sum(tl.where(m_label, b_z, 0.0), 1)
        tl.store(m_ptr + o_n, b_mx * b_t, mask=m_n)
        tl.store(mx_ptr + o_n, b_mx, mask=m_n)
        tl.store(s_ptr + o_n, b_s, mask=m_n)
        tl.store(a_ptr + o_n, b_a, mask=m_n)
        tl.store(zy_ptr + o_n, b_zy, mask=m_n)
        tl.store(mn_ptr + o_n, b_mn, mask=m_n)
        if HAS_SUMS:
            tl.store(ls_ptr + o_n, b_ls, mask=m_n)
            tl.store(lq_ptr + o_n, b_lq, mask=m_n)


@triton.jit
def _row_terms(o_n, m_n, y_ptr, inv_t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, vocab_start, inv_t_scalar,
               HAS_INV_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """The backward's per-token terms of one token tile: inv_t, local label, lse, entropy, upstream
    grads (fp32), and the mask of rows that carry any gradient."""
    if HAS_INV_T:
        b_t = tl.load(inv_t_ptr + o_n, mask=m_n, other=1.0).to(tl.float32)
    else:
        b_t = tl.zeros((BLOCK_N,), dtype=tl.float32) + inv_t_scalar
    b_y = tl.load(y_ptr + o_n, mask=m_n, other=-1) - vocab_start
    b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_ent = tl.load(ent_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_glp = tl.load(glp_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_gent = tl.load(gent_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    m_row = m_n & ((b_glp != 0.0) | (b_gent != 0.0))
    return b_t, b_y, b_lse, b_ent, b_glp, b_gent, m_row


@triton.jit
def lce_bwd_dh_kernel(
    h_ptr, w_ptr, y_ptr, inv_t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dh_ptr,
    N, H, shard_valid, vocab_start, inv_t_scalar,
    stride_h, stride_w, stride_dh,
    HAS_INV_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """d_hidden[n, :] = Σ_j d_logits[n, j] · W[j, :] in fp32, one token tile per program step.

    The program owns its token rows of d_hidden: the first vocab tile stores, later ones load, add and
    store, in a fixed vocab order (deterministic). Requires shard_valid > 0 (the launcher zero-fills
    otherwise).
    """
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    o_k = tl.arange(0, BLOCK_H)
    for i_n in range(i_p, n_tiles, n_p):
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        m_n = o_n < N
        b_t, b_y, b_lse, b_ent, b_glp, b_gent, m_row = _row_terms(
            o_n, m_n, y_ptr, inv_t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, vocab_start, inv_t_scalar,
            HAS_INV_T, BLOCK_N)
        for v0 in range(0, shard_valid, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            m_v = o_v < shard_valid
            b_z = _rows_dot_rows(h_ptr, w_ptr, o_n, o_v, m_n, m_v, H, stride_h, stride_w,
                                 BLOCK_N, BLOCK_V, BLOCK_H) * b_t[:, None]
            b_dl = _d_logits(b_z, m_row[:, None] & m_v[None, :],
                             (o_v[None, :] == b_y[:, None]) & m_v[None, :],
                             b_lse[:, None], b_ent[:, None], b_glp[:, None], b_gent[:, None],
                             b_t[:, None])
            _add_dot_rows(dh_ptr, w_ptr, b_dl, o_n, o_v, m_n, m_v, v0 > 0, H, stride_dh, stride_w, o_k, BLOCK_H)


@triton.jit
def lce_bwd_dw_kernel(
    h_ptr, w_ptr, y_ptr, inv_t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dw_ptr,
    N, H, shard_valid, vocab_start, inv_t_scalar,
    stride_h, stride_w, stride_dw,
    HAS_INV_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """d_weight[j, :] = Σ_n d_logits[n, j] · h[n, :] in fp32, one vocab tile per program step.

    Works in the transposed orientation (logits tile [BLOCK_V, BLOCK_N]) so no tl.trans is needed.
    The program owns its rows of d_weight (rows < shard_valid): the first token tile stores, later ones
    load, add and store, in a fixed token order (deterministic). Requires N > 0.
    """
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    v_tiles = tl.cdiv(shard_valid, BLOCK_V)
    o_k = tl.arange(0, BLOCK_H)
    for i_v in range(i_p, v_tiles, n_p):
        o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
        m_v = o_v < shard_valid
        for n0 in range(0, N, BLOCK_N):
            o_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            m_n = o_n < N
            b_t, b_y, b_lse, b_ent, b_glp, b_gent, m_row = _row_terms(
                o_n, m_n, y_ptr, inv_t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, vocab_start, inv_t_scalar,
                HAS_INV_T, BLOCK_N)
            b_zt = _rows_dot_rows(w_ptr, h_ptr, o_v, o_n, m_v, m_n, H, stride_w, stride_h,
                                  BLOCK_V, BLOCK_N, BLOCK_H) * b_t[None, :]
            b_dlt = _d_logits(b_zt, m_v[:, None] & m_row[None, :],
                              (o_v[:, None] == b_y[None, :]) & m_v[:, None],
                              b_lse[None, :], b_ent[None, :], b_glp[None, :], b_gent[None, :],
                              b_t[None, :])
            _add_dot_rows(dw_ptr, h_ptr, b_dlt, o_v, o_n, m_v, m_n, n0 > 0, H, stride_dw, stride_h, o_k, BLOCK_H)
