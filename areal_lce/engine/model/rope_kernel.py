"""Triton kernel of the fused rotary position embedding (launcher: rope.py; no allocation or host logic here)."""
import triton
import triton.language as tl


@triton.jit
def rope_kernel(x_ptr, f_ptr, o_ptr, B, H, sx_s, sx_b, sx_h, sf_s, sf_b, so_s, so_b, so_h,
                HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                INVERSE: tl.constexpr):
    """Rotary embedding of one (s, b) row of x [S, B, H, D] by the angles f [S, B or 1, R] (fp32, R = 2 *
    HALF rotated dims, D = R + PASS): with x1 = x[:HALF], x2 = x[HALF:R], c = cos f, s = sin f per
    column, o1 = x1 c1 - x2 s1 and o2 = x2 c2 + x1 s2 (megatron's x cos f + rotate_half(x) sin f);
    INVERSE applies the transpose (the backward), o1 = x1 c1 + x2 s2, o2 = x2 c2 - x1 s1. Dims past R
    are copied. cos / sin are taken once per row for all H heads and everything runs in fp32, rounded
    once to o's dtype. Last dims are contiguous (stride 1)."""
    i_row = tl.program_id(0).to(tl.int64)
    i_s, i_b = i_row // B, i_row % B
    o_k = tl.arange(0, HALF)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    p_f = f_ptr + i_s * sf_s + i_b * sf_b
    f1 = tl.load(p_f + o_k)
    f2 = tl.load(p_f + HALF + o_k)
    c1, s1, c2, s2 = tl.cos(f1)[None, :], tl.sin(f1)[None, :], tl.cos(f2)[None, :], tl.sin(f2)[None, :]
    p_x = x_ptr + i_s * sx_s + i_b * sx_b + o_h[:, None] * sx_h
    p_o = o_ptr + i_s * so_s + i_b * so_b + o_h[:, None] * so_h
    x1 = tl.load(p_x + o_k[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(p_x + HALF + o_k[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
    if INVERSE:
        o1, o2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        o1, o2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    tl.store(p_o + o_k[None, :], o1.to(o_ptr.dtype.element_ty), mask=m_h[:, None])
    tl.store(p_o + HALF + o_k[None, :], o2.to(o_ptr.dtype.element_ty), mask=m_h[:, None])
    if PASS > 0:
        o_p = tl.arange(0, BLOCK_P)
        m_p = m_h[:, None] & (o_p < PASS)[None, :]
        b_p = tl.load(p_x + 2 * HALF + o_p[None, :], mask=m_p, other=0.0)
        tl.store(p_o + 2 * HALF + o_p[None, :], b_p, mask=m_p)
