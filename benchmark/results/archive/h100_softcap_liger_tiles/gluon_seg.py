"""Prototype: the invariant forward's per-segment partials (raw max, s, a per 128-column segment; bf16 logits,
optional soft-cap) as a warp-specialised Gluon kernel on sm_90: one producer warp (TMA loads into a ring of
stages) and two consumer warpgroups taking alternate 128x128 tiles, so that one's epilogue runs while the other's
wgmma run. Compared bitwise with the Triton kernel's partials and timed against it."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
BM, BN, BK = 128, 128, 64


@gluon.jit
def _fold_store(r, c, seg, g, G, N, o_n, m_n):
    """Segment g's (raw max, s, a) of the [BLOCK_M, 128] logits r, stored as the Triton kernel stores them."""
    mx = gl.max(r, axis=1)
    d = (r - gl.expand_dims(mx, 1)) * c
    e = gl.exp2(d)
    p = seg + g * N + o_n
    m_st = m_n & (g < G)
    gl.store(p, mx, mask=m_st)
    gl.store(p + G * N, gl.sum(e, axis=1), mask=m_st)
    gl.store(p + 2 * G * N, gl.sum(d * e, axis=1) * LN2, mask=m_st)


@gluon.jit
def _consume(h_bufs, w_bufs, ready, empty, order, seg, row0, t0, n_tiles, N, G, c, softcap, inv_softcap,
             PARITY: gl.constexpr, STEP: gl.constexpr, KSTEPS: gl.constexpr, SOFTCAP: gl.constexpr,
             BF16_LOGITS: gl.constexpr, ORDERED: gl.constexpr):
    """Tiles PARITY, PARITY + STEP, ... of this program from its own ring of stages (ready / empty)."""
    BLOCK_M: gl.constexpr = h_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = h_bufs.type.shape[0]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_n = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
    m_n = o_n < N
    for u in range(gl.cdiv(n_tiles - PARITY, STEP)):
        t = PARITY + u * STEP
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        base = u * KSTEPS
        if ORDERED:  # the two consumers' MMA phases alternate: wait for the other's previous tile
            if PARITY == 0:
                mbarrier.wait(order.index(1), (u + 1) & 1, pred=u > 0)
            else:
                mbarrier.wait(order.index(0), u & 1)
        for k in range(KSTEPS):
            i = base + k
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(h_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            if k > 0:
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((base + KSTEPS - 1) % STAGES), count=1)
        if ORDERED:
            mbarrier.arrive(order.index(PARITY), count=1)
        r = acc
        if BF16_LOGITS:
            r = r.to(gl.bfloat16).to(gl.float32)
        if SOFTCAP:
            q = gl.exp2(r * (inv_softcap * (2.0 * LOG2E))) + 1.0
            q = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [q], dtype=gl.float32, is_pure=True,
                                          pack=1)
            r = (1.0 - 2.0 * q) * softcap
        _fold_store(r, c, seg, t0 + t, G, N, o_n, m_n)


@gluon.jit
def _produce(h_desc, w_desc, h_bufs, w_bufs, ready, empty, row0, t0, n_tiles, PARITY: gl.constexpr,
             STEP: gl.constexpr, KSTEPS: gl.constexpr):
    """TMA loads of tiles PARITY, PARITY + STEP, ... into one ring of stages."""
    STAGES: gl.constexpr = h_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = h_bufs.type.shape[2]
    nbytes: gl.constexpr = h_desc.block_type.nbytes + w_desc.block_type.nbytes
    for u in range(gl.cdiv(n_tiles - PARITY, STEP)):
        t = PARITY + u * STEP
        for k in range(KSTEPS):
            i = u * KSTEPS + k
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(h_desc, [row0, k * BLOCK_K], ready.index(s), h_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [(t0 + t) * BLOCK_N, k * BLOCK_K], ready.index(s), w_bufs.index(s))


@gluon.jit
def _partition(a, ROLE: gl.constexpr):
    """One warp_specialize partition: ROLE 0 / 1 consume the even / odd tiles from ring 0 / 1, 2 every tile from
    ring 0; 3 / 4 load the even / odd tiles into ring 0 / 1, 5 every tile into ring 0."""
    (h_desc, w_desc, ring0, ring1, order, seg, row0, t0, n_tiles, N, G, c, softcap, inv_softcap, KSTEPS, SOFTCAP,
     BF16_LOGITS, ORDERED) = a
    if ROLE == 0:
        _consume(*ring0, order, seg, row0, t0, n_tiles, N, G, c, softcap, inv_softcap, 0, 2, KSTEPS, SOFTCAP,
                 BF16_LOGITS, ORDERED)
    elif ROLE == 1:
        _consume(*ring1, order, seg, row0, t0, n_tiles, N, G, c, softcap, inv_softcap, 1, 2, KSTEPS, SOFTCAP,
                 BF16_LOGITS, ORDERED)
    elif ROLE == 2:
        _consume(*ring0, order, seg, row0, t0, n_tiles, N, G, c, softcap, inv_softcap, 0, 1, KSTEPS, SOFTCAP,
                 BF16_LOGITS, False)
    elif ROLE == 3:
        _produce(h_desc, w_desc, *ring0, row0, t0, n_tiles, 0, 2, KSTEPS)
    elif ROLE == 4:
        _produce(h_desc, w_desc, *ring1, row0, t0, n_tiles, 1, 2, KSTEPS)
    else:
        _produce(h_desc, w_desc, *ring0, row0, t0, n_tiles, 0, 1, KSTEPS)


@gluon.jit
def _serial(h_desc, w_desc, h_bufs, w_bufs, ready, seg, row0, t0, n_tiles, N, G, c, KSTEPS: gl.constexpr):
    """No warp specialisation: load one stage, wait, wgmma, repeat (the debug baseline)."""
    BLOCK_M: gl.constexpr = h_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = h_bufs.type.shape[2]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_n = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
    m_n = o_n < N
    nbytes: gl.constexpr = h_desc.block_type.nbytes + w_desc.block_type.nbytes
    phase = 0
    for t in range(n_tiles):
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        for k in range(KSTEPS):
            mbarrier.expect(ready.index(0), nbytes)
            tma.async_copy_global_to_shared(h_desc, [row0, k * BLOCK_K], ready.index(0), h_bufs.index(0))
            tma.async_copy_global_to_shared(w_desc, [(t0 + t) * BLOCK_N, k * BLOCK_K], ready.index(0), w_bufs.index(0))
            mbarrier.wait(ready.index(0), phase)
            phase ^= 1
            acc = warpgroup_mma(h_bufs.index(0), w_bufs.index(0).permute((1, 0)), acc)
        r = acc.to(gl.bfloat16).to(gl.float32)
        _fold_store(r, c, seg, t0 + t, G, N, o_n, m_n)


@gluon.jit
def seg_fwd_ws_kernel(h_desc, w_desc, seg, N, G, c, softcap, inv_softcap, TILES: gl.constexpr, KSTEPS: gl.constexpr,
                      STAGES: gl.constexpr, SOFTCAP: gl.constexpr, BF16_LOGITS: gl.constexpr,
                      REG_C: gl.constexpr, REG_P: gl.constexpr, MODE: gl.constexpr,
                      ORDERED: gl.constexpr):
    BLOCK_M: gl.constexpr = h_desc.block_type.shape[0]
    pid = gl.program_id(0)
    n_rb = gl.cdiv(N, BLOCK_M)
    row0 = (pid % n_rb) * BLOCK_M
    t0 = (pid // n_rb) * TILES
    n_tiles = gl.minimum(G - t0, TILES)
    ring0 = _ring(h_desc, w_desc, STAGES)
    ring1 = _ring(h_desc, w_desc, STAGES if MODE == 0 else 1)
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(order.index(0), count=1)
    mbarrier.init(order.index(1), count=1)
    fence_async_shared()
    args = (h_desc, w_desc, ring0, ring1, order, seg, row0, t0, n_tiles, N, G, c, softcap, inv_softcap, KSTEPS, SOFTCAP,
            BF16_LOGITS, ORDERED)
    if MODE == 0:
        gl.warp_specialize([(_partition, (args, 0)), (_partition, (args, 1)), (_partition, (args, 3)),
                            (_partition, (args, 4))], [4, 1, 1], [REG_C, REG_P, REG_P])
    elif MODE == 1:
        gl.warp_specialize([(_partition, (args, 2)), (_partition, (args, 5))], [1], [REG_P])
    else:
        _serial(h_desc, w_desc, ring0[0], ring0[1], ring0[2], seg, row0, t0, n_tiles, N, G, c, KSTEPS)


@gluon.jit
def _ring(h_desc, w_desc, STAGES: gl.constexpr):
    """(h stages, w stages, ready barriers, empty barriers) of one ring, barriers initialised."""
    h_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return h_bufs, w_bufs, ready, empty


def descriptors(h, w, bk=BK):
    hl = gl.NVMMASharedLayout.get_default_for([BM, bk], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([BN, bk], gl.bfloat16)
    return TensorDescriptor.from_tensor(h, [BM, bk], hl), TensorDescriptor.from_tensor(w, [BN, bk], wl)


def seg_fwd_ws(h, w, softcap=0.0, stages=3, tiles=33, seg=None, regs=(232, 24), maxnreg=168, mode=0, ordered=False,
               bk=BK):
    """seg [3, G, N] of h [N, H] and w [V, H] (bf16, V a multiple of 128). mode 0: two consumers taking alternate
    tiles (ordered: their MMA phases alternate strictly), 1: one consumer and one producer, 2: no warp
    specialisation; stages per ring, tiles per program, regs = (consumer, producer) registers."""
    N, H = h.shape
    V = w.shape[0]
    assert V % BN == 0 and H % bk == 0
    G = V // BN
    seg = torch.empty(3, G, N, dtype=torch.float32, device=h.device) if seg is None else seg
    hd, wd = descriptors(h, w, bk)
    grid = (triton.cdiv(N, BM) * triton.cdiv(G, tiles),)
    seg_fwd_ws_kernel[grid](hd, wd, seg, N, G, LOG2E.value, float(softcap), 1.0 / softcap if softcap else 0.0,
                            TILES=tiles, KSTEPS=H // bk, STAGES=stages, SOFTCAP=bool(softcap), BF16_LOGITS=True,
                            REG_C=regs[0], REG_P=regs[1], MODE=mode, ORDERED=ordered, num_warps=4,
                            **({"maxnreg": maxnreg} if maxnreg else {}))
    return seg


def small_case(n=4096, h=896, v=151936):
    """(hidden, weight, labels, ref) at the benchmark's 4096x896 shape; ref(cap) is the Triton backend's invariant
    forward (bf16 logits), whose ShardStats.seg holds the partials this kernel computes."""
    from areal_lce.backends.triton.launch import TritonBackend
    from areal_lce.types import LCEParams
    from benchmark.op.bench_invariant import inputs
    hid, w, y = inputs(n, h, v)
    y = y.clamp_min(0)
    be = TritonBackend()

    def ref(cap):
        p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True,
                      logits_precision="bf16", softcap=cap)
        return be.forward(hid, w, y, None, p, False)
    return hid, w, y, ref
