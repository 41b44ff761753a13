"""Constants and small @triton.jit helpers shared by the Triton kernel modules (kernels.py, segment_kernels.py,
candidate_kernels.py, select_kernels.py, output_kernels.py).

A @triton.jit helper is inlined into its caller (the first pass of Triton's TTIR pipeline): sharing one costs no
call. Its arguments are computed where the caller passes them, before the helper's first instruction."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
IGNORED = tl.constexpr(-2)  # local label of an ignore_index row (launch.py: _local_labels)


@triton.jit
def round_bf16(x, BITWISE: tl.constexpr):
    """fp32 -> nearest bf16 (ties to even) -> fp32, as torch's .to(bfloat16) rounds. BITWISE (the CPU
    interpreter, whose bf16 conversion does not round to nearest): on the bit pattern; on the GPU the
    hardware conversion."""
    if BITWISE:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _tile_coords(i_pid, n_blocks_n, n_blocks_v, GROUP_N: tl.constexpr):
    """Grouped program order: GROUP_N token blocks share each vocab tile while it is hot in L2."""
    width = GROUP_N * n_blocks_v
    i_group = i_pid // width
    first_n = i_group * GROUP_N
    group_size = tl.minimum(n_blocks_n - first_n, GROUP_N)
    i_n = first_n + (i_pid % width) % group_size
    i_v = (i_pid % width) // group_size
    return i_n, i_v


@triton.jit
def _fwd_rows(y, inv_t, N, n_splits, inv_t_scalar, HAS_INV_T: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP_N: tl.constexpr):
    """A forward program's token block and vocab split (grouped order, _tile_coords): (split index, first
    row, rows o_n (int64), their mask, the rows clamped to N - 1, their label columns, 1/T, 1/T · log2 e)."""
    i_n, i_s = _tile_coords(tl.program_id(0), tl.cdiv(N, BLOCK_N), n_splits, GROUP_N)
    row0 = i_n * BLOCK_N
    o_n = row0.to(tl.int64) + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_nc = tl.minimum(o_n, N - 1)
    b_y = tl.load(y + o_nc)
    if HAS_INV_T:
        b_it = tl.load(inv_t + o_nc)
    else:
        b_it = tl.zeros([BLOCK_N], dtype=tl.float32) + inv_t_scalar
    return i_s, row0, o_n, m_n, o_nc, b_y, b_it, b_it * LOG2E


@triton.jit
def _split_cols(i_s, SPLIT_V, V, b_y, m_n):
    """Columns [v_begin, v_end) of vocab split i_s; empty (v_end = v_begin) when every row of the block is
    ignored, so such a block folds no tile."""
    v_begin = i_s * SPLIT_V
    v_end = tl.minimum(v_begin + SPLIT_V, V)
    return v_begin, tl.where(tl.max(((b_y != IGNORED) & m_n).to(tl.int32), 0) > 0, v_end, v_begin)


@triton.jit
def _k_slice(p, d, row0, k0, H, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
             USE_TMA: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of a GEMM operand's rows: USE_TMA, the descriptor d's [row0, k0] box
    (rows and K past the tensor's end read as 0); else pointer loads at p (the rows' base pointers, [rows, 1],
    clamped by the caller), masked only for a ragged H. UPCAST (the interpreter): converted to fp32."""
    if USE_TMA:
        b = d.load([row0, k0])
    else:
        o_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            b = tl.load(p + o_k[None, :])
        else:
            b = tl.load(p + o_k[None, :], mask=(o_k < H)[None, :], other=0.0)
    if UPCAST:
        b = b.to(tl.float32)
    return b


@triton.jit
def _cache_tile(z_cache, o_n, col0, N, BLOCK_V: tl.constexpr, CACHE_COLS: tl.constexpr):
    """Pointers of rows o_n x columns [col0, col0 + BLOCK_V) in the [ceil(V / CACHE_COLS), N, CACHE_COLS]
    cache (col0 is a multiple of BLOCK_V, which divides CACHE_COLS)."""
    # col0 % CACHE_COLS is a multiple of BLOCK_V; saying so lets the loads and stores vectorise
    off = tl.multiple_of((col0 // CACHE_COLS).to(tl.int64) * N * CACHE_COLS + col0 % CACHE_COLS, 16)
    return z_cache + off + o_n[:, None] * CACHE_COLS + tl.arange(0, BLOCK_V)[None, :]


# Soft-capping's tanh, as t = 1 - 2 / (1 + 2^(2x·log2 e)) for every x (±inf and large |x| give ±1, no
# branch, no sign fix-up): one ex2 and one reciprocal on the GPU's special-function unit, which the epilogue
# is bound by (every logit already pays one ex2 for the softmax; a polynomial branch beside it cost ~10% of a
# step at H = 2048: benchmark/results/archive/h200_softcap_tanh_variants). Error bound, absolute in t, with
# u = 2^-24 and e = 2^(2x·log2 e): the argument's roundings (3u relative) and ex2.approx (4u) move 2/(1 + e) by
# at most 2e/(1 + e)^2 · (3u·|2x| + 4u) <= 1.4u + 2u, the +1 and rcp.approx (3u relative of 2/(1 + e) <= 2) by
# 6u, the final subtraction by u: |t - tanh x| <= 11u, so the capped logit c·t is within 12u·c of c·tanh(x)
# (tests/op/test_softcap_triton.py checks 11u on the interpreter and on CUDA). Relative accuracy near x = 0 is
# not kept; the softmax only sees the absolute error. The CPU interpreter takes the same formula with numpy's
# exact division (tl.inline_asm_elementwise does not run there).


@triton.jit
def soft_cap(r, softcap, inv_softcap, INTERPRET: tl.constexpr):
    """(softcap · tanh(r / softcap), tanh(r / softcap)) of fp32 raw logits: the capped logit and the tanh the
    backward's slope 1 - tanh² is made of. NaN stays NaN; ±inf caps to ±softcap."""
    d = tl.exp2(r * (inv_softcap * (2.0 * LOG2E))) + 1.0
    if INTERPRET:
        q = 1.0 / d
    else:
        q = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32, is_pure=True,
                                      pack=1)
    t = 1.0 - 2.0 * q
    return t * softcap, t


@triton.jit
def head_transform(b_r, softcap, inv_softcap, UPCAST: tl.constexpr, BF16_LOGITS: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    """base.head_transform of an fp32 tile of accumulated logits: rounded to bf16 (BF16_LOGITS, the rounding
    a bf16-head engine makes), then capped (SOFTCAP). Returns (the op's raw logits, tanh(r / softcap) for the
    backward's slope; without SOFTCAP the logits again, unused)."""
    if BF16_LOGITS:
        b_r = round_bf16(b_r, UPCAST)
    b_tanh = b_r
    if SOFTCAP:
        b_r, b_tanh = soft_cap(b_r, softcap, inv_softcap, UPCAST)
    return b_r, b_tanh
