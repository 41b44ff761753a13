"""Triton kernels of the per-row steps around the selected-id and top-k outputs, each one launch where
select.py's torch code (their reference, and the route of every other backend) takes ten to twenty small
operations: at a few thousand tokens the op's time is the host's, so these steps are fused for that.

  selected_gather_kernel  the selected ids' raw logits h_n · W[id - vocab_start] (gather_logits_kernel's
                          fixed-order sum, so the same bits), rounded to bf16 with logits_precision="bf16",
                          0 where the id is not this shard's (another shard's, or ignore_index).
  selected_lp_kernel      selected logprobs from those logits: fp32(fp64(r · inv_t) - fp64(lse)), 0 at
                          ignored rows and ignore_index ids, NaN at ids outside the vocabulary (the deferred
                          check).
  topk_lp_kernel          top-k logprobs and ids from select.sort_key keys, with the same rounding.
  sparse_coef_kernel      the backward's sparse columns (select_grad.SparseGrad): per row the label's, the selected
                          ids' and the top-k ids' local columns (-1 where not this shard's) and coefficients
                          (upstream gradient · inv_t), and g_lp plus their dense part, in select.py's order.
The launchers of the two kernels that multiply compile them without FMA contraction (enable_fp_fusion=False):
z = r · inv_t is rounded to fp32 before lse is taken from it, as in torch.
"""
import triton
import triton.language as tl

from .kernel_common import round_bf16
from .select_kernels import _gather_dot


@triton.jit
def _rows_and_cols(N, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's rows (int64), its BLOCK_K slots of K (grid axis 1), and their masks."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_r = o_r < N
    return o_r.to(tl.int64), o_k, m_r, m_r[:, None] & (o_k < K)[None, :]


@triton.jit
def _owned(ids, vocab_start, shard_valid, ignore_index):
    """(local column, clamped to 0 where not owned; whether this shard owns the global id)."""
    loc = ids - vocab_start
    own = (ids != ignore_index) & (loc >= 0) & (loc < shard_valid)
    return tl.where(own, loc, 0), own


@triton.jit
def selected_gather_kernel(h, w, ids, out, N, J, H, vocab_start, shard_valid, ignore_index, BLOCK_R: tl.constexpr,
                           BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, BF16_LOGITS: tl.constexpr,
                           UPCAST: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    m_r = o_r < N
    m_rj = m_r[:, None] & (o_j < J)[None, :]
    p_ids = ids + o_r[:, None].to(tl.int64) * J + o_j[None, :]
    b_c, own = _owned(tl.load(p_ids, mask=m_rj, other=ignore_index), vocab_start, shard_valid, ignore_index)
    acc = _gather_dot(h, w, b_c, o_r, m_r, m_rj, H, BLOCK_R, BLOCK_J, BLOCK_H)  # gather_logits_kernel's sum
    if BF16_LOGITS:
        acc = round_bf16(acc, UPCAST)
    tl.store(out + o_r[:, None].to(tl.int64) * J + o_j[None, :], tl.where(own, acc, 0.0), mask=m_rj)


@triton.jit
def _row_terms(y, inv_t, row, m_r, inv_t_scalar, ignore_index, HAS_INV_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """(row holds a label, fp32 1/T) of rows `row`."""
    b_y = tl.load(y + row, mask=m_r, other=ignore_index)
    if HAS_INV_T:
        it = tl.load(inv_t + row, mask=m_r, other=1.0)
    else:
        it = tl.full([BLOCK_R], inv_t_scalar, tl.float32)
    return b_y != ignore_index, it


@triton.jit
def selected_lp_kernel(r, ids, y, lse, inv_t, out, N, K, inv_t_scalar, ignore_index, vocab_size,
                       HAS_INV_T: tl.constexpr, CHECK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row, o_k, m_r, m = _rows_and_cols(N, K, BLOCK_R, BLOCK_K)
    valid, it = _row_terms(y, inv_t, row, m_r, inv_t_scalar, ignore_index, HAS_INV_T, BLOCK_R)
    b_lse = tl.load(lse + row, mask=m_r, other=0.0).to(tl.float64)
    off = row[:, None] * K + o_k[None, :]
    b_id = tl.load(ids + off, mask=m, other=ignore_index)
    z = tl.load(r + off, mask=m, other=0.0) * it[:, None]
    lp = (z.to(tl.float64) - b_lse[:, None]).to(tl.float32)
    real = b_id != ignore_index
    lp = tl.where(valid[:, None] & real, lp, 0.0)
    if CHECK:
        lp = tl.where(real & ((b_id < 0) | (b_id >= vocab_size)), float("nan"), lp)
    tl.store(out + off, lp, mask=m)


@triton.jit
def topk_lp_kernel(keys, y, lse, lp_out, id_out, N, K, ignore_index, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row, o_k, m_r, m = _rows_and_cols(N, K, BLOCK_R, BLOCK_K)
    valid = tl.load(y + row, mask=m_r, other=ignore_index) != ignore_index
    b_lse = tl.load(lse + row, mask=m_r, other=0.0).to(tl.float64)
    off = row[:, None] * K + o_k[None, :]
    key = tl.load(keys + off, mask=m, other=0)
    mono = key >> 31  # select.key_value: the order image back to the fp32 bits
    v = tl.where(mono >= 2147483648, mono - 2147483648, -1 - mono).to(tl.int32).to(tl.float32, bitcast=True)
    lp = (v.to(tl.float64) - b_lse[:, None]).to(tl.float32)
    ids = 2147483647 - (key & 2147483647)
    tl.store(lp_out + off, tl.where(valid[:, None], lp, 0.0), mask=m)
    tl.store(id_out + off, tl.where(valid[:, None], ids, ignore_index), mask=m)


@triton.jit
def _sparse_part(ids, g, cols, coef, row, m_r, valid, it, K, J, j0, vocab_start, shard_valid, ignore_index,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One id set's columns and coefficients at slots j0 + [0, K), BLOCK_K slots at a time; returns the row
    sums of its gradients (each block's sum added in block order)."""
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m = m_r[:, None] & (o_k < K)[None, :]
        off = row[:, None] * K + o_k[None, :]
        b_id = tl.load(ids + off, mask=m, other=ignore_index)
        b_g = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
        b_g = tl.where(valid[:, None] & (b_id != ignore_index), b_g, 0.0)
        loc, own = _owned(b_id, vocab_start, shard_valid, ignore_index)
        out = row[:, None] * J + j0 + o_k[None, :]
        tl.store(cols + out, tl.where(own, loc, -1), mask=m)
        tl.store(coef + out, tl.where(own & valid[:, None], b_g * it[:, None], 0.0), mask=m)
        total += tl.sum(b_g, 1)
    return total


@triton.jit
def sparse_coef_kernel(y, inv_t, g, g_lse, sel, g_sel, top, g_top, g_out, cols, coef, N, K1, K2, inv_t_scalar,
                       ignore_index, vocab_start, shard_valid, HAS_INV_T: tl.constexpr, HAS_LSE: tl.constexpr,
                       HAS_SEL: tl.constexpr, HAS_TOP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < N
    row = o_r.to(tl.int64)
    valid, it = _row_terms(y, inv_t, row, m_r, inv_t_scalar, ignore_index, HAS_INV_T, BLOCK_R)
    J = 1 + K1 + K2
    dense = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_SEL:
        dense += _sparse_part(sel, g_sel, cols, coef, row, m_r, valid, it, K1, J, 1, vocab_start, shard_valid,
                              ignore_index, BLOCK_R, BLOCK_K)
    if HAS_TOP:
        dense += _sparse_part(top, g_top, cols, coef, row, m_r, valid, it, K2, J, 1 + K1, vocab_start, shard_valid,
                              ignore_index, BLOCK_R, BLOCK_K)
    if HAS_LSE:
        b_lse = tl.load(g_lse + row, mask=m_r, other=0.0).to(tl.float32)
    else:
        b_lse = tl.zeros([BLOCK_R], dtype=tl.float32)
    g0 = tl.load(g + row, mask=m_r, other=0.0)
    tl.store(g_out + row, g0 - b_lse + dense, mask=m_r)
    tl.store(g_out + N + row, tl.load(g + N + row, mask=m_r, other=0.0), mask=m_r)
    loc, own = _owned(tl.load(y + row, mask=m_r, other=ignore_index), vocab_start, shard_valid, ignore_index)
    tl.store(cols + row * J, tl.where(own, loc, -1), mask=m_r)
    tl.store(coef + row * J, tl.where(own & valid, (b_lse - dense) * it, 0.0), mask=m_r)
