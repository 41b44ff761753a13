"""Constants and small @triton.jit helpers shared by kernels.py and segment_kernels.py."""
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
def _cache_tile(z_cache, o_n, col0, N, BLOCK_V: tl.constexpr, CACHE_COLS: tl.constexpr):
    """Pointers of rows o_n x columns [col0, col0 + BLOCK_V) in the [ceil(V / CACHE_COLS), N, CACHE_COLS]
    cache (col0 is a multiple of BLOCK_V, which divides CACHE_COLS)."""
    # col0 % CACHE_COLS is a multiple of BLOCK_V; saying so lets the loads and stores vectorise
    off = tl.multiple_of((col0 // CACHE_COLS).to(tl.int64) * N * CACHE_COLS + col0 % CACHE_COLS, 16)
    return z_cache + off + o_n[:, None] * CACHE_COLS + tl.arange(0, BLOCK_V)[None, :]


# tanh(x) = x + x³·P(x²) for |x| < TANH_SMALL: a least-squares fit of (tanh(x) - x) / x³ in relative error on
# [0, 0.55]; with fp32 Horner steps it is within 0.8 ulp of tanh there, and the exp2 form
# 1 - 2 / (2^(2|x|·log2 e) + 1) within 1.8 ulp above (numpy fp32 emulation on a 2M-point grid of [0, 1]; the
# exp2 form subtracts a value <= 1/2 from 1 there, so it never cancels). Below 0.55 the exp2 form would
# lose relative accuracy as tanh(x) -> 0, which the polynomial keeps.
TANH_SMALL = tl.constexpr(0.55)
TANH_P0 = tl.constexpr(-0.33333318650020016)
TANH_P1 = tl.constexpr(0.13332616787408796)
TANH_P2 = tl.constexpr(-0.05385511069679813)
TANH_P3 = tl.constexpr(0.02108201861705096)
TANH_P4 = tl.constexpr(-0.006287600915010274)


@triton.jit
def soft_cap(r, softcap, inv_softcap):
    """(softcap · tanh(r / softcap), tanh(r / softcap)) of fp32 raw logits: the capped logit and the tanh the
    backward's slope 1 - tanh² is made of. NaN stays NaN; ±inf caps to ±softcap."""
    x = r * inv_softcap
    a = tl.abs(x)
    s = a * a
    p = (((TANH_P4 * s + TANH_P3) * s + TANH_P2) * s + TANH_P1) * s + TANH_P0
    t_small = a + a * s * p
    t_big = 1.0 - tl.fdiv(2.0, tl.exp2(a * (2.0 * LOG2E)) + 1.0)  # 2^inf + 1 = inf: 1 - 0 = 1
    t = tl.where(a < TANH_SMALL, t_small, t_big)
    t = tl.where(x < 0.0, -t, t)
    return t * softcap, t
