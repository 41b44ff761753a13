"""Where listed_candidates_kernel's time goes on the recompute route (4096x896, top-8 / top-64), and two variants:
  flat: one flattened loop over (task, K step), so the loads of a program's next task are prefetched while it
        finishes the current one (the persistent-GEMM pattern);
  fast: a task whose rows each take exactly one logit (the usual case: the segment's max) stores that key directly
        (max and its column) instead of the even/odd split, two cumsums and 2 x 64 int64 keys per row;
  noepi: the logits only (a row max stored), for the loads + MMA floor.
Candidate sets compared with the kernel's (each row's keys, sorted)."""
import os, statistics, sys, torch, triton
import triton.language as tl
import areal_lce.backends.triton.select_launch as SL
from areal_lce import exact
from areal_lce.backends import get_backend
from areal_lce.backends.triton.candidate_kernels import listed_candidates_kernel
from areal_lce.backends.triton.kernel_common import round_bf16, soft_cap
from areal_lce.backends.triton.launch import INTERPRET, _cap_args, _dot_precision, _slots
from areal_lce.backends.triton.segment_kernels import _dot, _seg_logits
from areal_lce.backends.triton.select_kernels import _sort_key
from areal_lce.types import LCEParams


@triton.jit
def _append_logits(b_r, rows, g, inv_t, thr, count, cand, CAP, valid, vocab_start, inv_t_scalar, softcap,
                   inv_softcap, SEG: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                   HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr, FAST: tl.constexpr):
    live = rows >= 0
    o_nc = tl.where(live, rows, 0).to(tl.int64)
    if BF16_LOGITS:
        b_r = round_bf16(b_r, UPCAST)
    if SOFTCAP:
        b_r, _ = soft_cap(b_r, softcap, inv_softcap, UPCAST)
    if HAS_INV_T:
        z = b_r * tl.load(inv_t + o_nc, mask=live, other=1.0)[:, None]
    else:
        z = b_r * inv_t_scalar
    b_t = tl.load(thr + o_nc, mask=live, other=float("inf"))[:, None]
    single = False
    if FAST:
        o_c = g * SEG + tl.arange(0, SEG)
        take = live[:, None] & (o_c < valid)[None, :] & (z >= b_t)
        n = tl.sum(take.to(tl.int32), 1)
        single = tl.max(n, 0) <= 1
        if single:
            zm = tl.max(tl.where(take, z, float("-inf")), 1)
            col = tl.min(tl.where(take, o_c[None, :], 2147483647), 1)
            base = tl.atomic_add(count + o_nc, n, mask=live)
            tl.store(cand + o_nc * CAP + base, _sort_key(zm, col + vocab_start), mask=live & (n == 1) & (base < CAP))
    if not single:
        z0, z1 = tl.split(tl.reshape(z, [BLOCK_N, SEG // 2, 2]))
        c0 = g * SEG + 2 * tl.arange(0, SEG // 2)[None, :]
        take0 = live[:, None] & (c0 < valid) & (z0 >= b_t)
        take1 = live[:, None] & (c0 + 1 < valid) & (z1 >= b_t)
        n0 = tl.sum(take0.to(tl.int32), 1)
        base = tl.atomic_add(count + o_nc, n0 + tl.sum(take1.to(tl.int32), 1), mask=live)
        p_row = cand + o_nc[:, None] * CAP
        pos0 = base[:, None] + tl.cumsum(take0.to(tl.int32), 1) - 1
        tl.store(p_row + pos0, _sort_key(z0, c0 + vocab_start), mask=take0 & (pos0 < CAP))
        pos1 = (base + n0)[:, None] + tl.cumsum(take1.to(tl.int32), 1) - 1
        tl.store(p_row + pos1, _sort_key(z1, c0 + 1 + vocab_start), mask=take1 & (pos1 < CAP))


@triton.jit
def listed_var_kernel(h, w, seg_list, seg_count, task_seg, task_first, n_tasks, inv_t, thr, count, cand, dummy, N,
                      CAP, H, valid, vocab_start, inv_t_scalar, softcap, inv_softcap, n_prog, SEG: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr,
                      SOFTCAP: tl.constexpr, FAST: tl.constexpr, NOEPI: tl.constexpr):
    """The shipped kernel's loop (EVEN_K assumed) with the variant epilogues."""
    o_i = tl.arange(0, BLOCK_N)
    for t in range(tl.program_id(0), tl.load(n_tasks), n_prog):
        g = tl.load(task_seg + t)
        o_r = (t - tl.load(task_first + g)) * BLOCK_N + o_i
        rows = tl.load(seg_list + g.to(tl.int64) * N + o_r, mask=o_r < tl.load(seg_count + g), other=-1)
        o_nc = tl.where(rows >= 0, rows, 0).to(tl.int64)
        o_vc = tl.minimum(g * SEG + tl.arange(0, SEG), valid - 1).to(tl.int64)
        b_r, _ = _seg_logits(h, w, None, None, o_nc, o_vc, o_vc, 0, 0, H, SEG, 1, BLOCK_N, BLOCK_K, True,
                             UPCAST, DOT_PRECISION, False)
        if NOEPI:
            tl.store(dummy + t * BLOCK_N + o_i, tl.max(b_r, 1))
        else:
            _append_logits(b_r, rows, g, inv_t, thr, count, cand, CAP, valid, vocab_start, inv_t_scalar, softcap,
                           inv_softcap, SEG, BLOCK_N, UPCAST, HAS_INV_T, BF16_LOGITS, SOFTCAP, FAST)


@triton.jit
def listed_flat_kernel(h, w, seg_list, seg_count, task_seg, task_first, n_tasks, inv_t, thr, count, cand, N, CAP, H,
                       valid, vocab_start, inv_t_scalar, softcap, inv_softcap, n_prog, SEG: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KSTEPS: tl.constexpr, UPCAST: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, HAS_INV_T: tl.constexpr, BF16_LOGITS: tl.constexpr,
                       SOFTCAP: tl.constexpr, FAST: tl.constexpr):
    """One loop over this program's (task, K step) pairs: the loads of the next task are pipelined with the
    current one's last steps and epilogue."""
    pid = tl.program_id(0)
    n_my = tl.cdiv(tl.maximum(tl.load(n_tasks) - pid, 0), n_prog)
    o_i = tl.arange(0, BLOCK_N)
    o_s = tl.arange(0, SEG)
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, SEG], dtype=tl.float32)
    rows = tl.full([BLOCK_N], -1, dtype=tl.int32)
    g = pid * 0
    p_h = h + tl.zeros([BLOCK_N], dtype=tl.int64)[:, None]
    p_w = w + tl.zeros([SEG], dtype=tl.int64)[:, None]
    for i in range(0, n_my * KSTEPS):
        kk = i % KSTEPS
        if kk == 0:
            t = pid + (i // KSTEPS) * n_prog
            g = tl.load(task_seg + t)
            o_r = (t - tl.load(task_first + g)) * BLOCK_N + o_i
            rows = tl.load(seg_list + g.to(tl.int64) * N + o_r, mask=o_r < tl.load(seg_count + g), other=-1)
            p_h = h + tl.where(rows >= 0, rows, 0).to(tl.int64)[:, None] * H
            p_w = w + tl.minimum(g * SEG + o_s, valid - 1).to(tl.int64)[:, None] * H
        b_h = tl.load(p_h + (kk * BLOCK_K + o_k)[None, :])
        b_w = tl.load(p_w + (kk * BLOCK_K + o_k)[None, :])
        if UPCAST:
            b_h = b_h.to(tl.float32)
            b_w = b_w.to(tl.float32)
        acc = _dot(b_h, b_w, acc, DOT_PRECISION, UPCAST)
        if kk == KSTEPS - 1:
            _append_logits(acc, rows, g, inv_t, thr, count, cand, CAP, valid, vocab_start, inv_t_scalar, softcap,
                           inv_softcap, SEG, BLOCK_N, UPCAST, HAS_INV_T, BF16_LOGITS, SOFTCAP, FAST)
            acc = tl.zeros([BLOCK_N, SEG], dtype=tl.float32)


def setup(n, h, v, k, dev, cap=0.0):
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(n, h, device=dev, generator=g)
    w = torch.randn(v, h, device=dev, generator=g) / h ** 0.5 * 2
    m = min(64, n)
    w[:m] = hid[:m] / h ** 0.5 * 3
    hid, w = hid.to(torch.bfloat16), w.to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True, compact_ignored=False,
                  top_k=k, softcap=cap)
    st = get_backend("triton").forward(hid, w, y, None, p, keep_cache=False)
    rows_major = st.seg_top[2] if st.seg_top is not None else st.seg[0].t().contiguous()
    segs, thr, plan = SL.rank_segments(rows_major, 1.0, k, None, 0, lists=True)
    return hid, w, p, segs, thr, plan


def launchers(hid, w, p, thr, plan):
    n, h = hid.shape
    cfg = SL._recompute_tile(h, hid.dtype)
    task_seg, task_first, n_tasks = SL._listed_tasks(plan, cfg.block_n)
    n_prog = min(task_seg.shape[0], _slots(hid.device) * SL.LISTED_PROGRAMS_PER_SM)
    cap = plan.cand.shape[1]
    kk = plan.flags.shape[1]
    args = (hid, w, plan.seg_list, plan.seg_count, task_seg, task_first, n_tasks, thr, thr)
    common = dict(SEG=exact.SEG, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=INTERPRET,
                  DOT_PRECISION=_dot_precision(hid.dtype), HAS_INV_T=False, BF16_LOGITS=p.bf16_logits,
                  SOFTCAP=bool(p.softcap), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tail = (p.shard_valid, 0, 1.0, *_cap_args(p), n_prog)
    dummy = torch.empty(task_seg.shape[0] * cfg.block_n, device=hid.device)

    def fresh():
        return torch.full((n,), kk, dtype=torch.int32, device=hid.device), plan.cand.clone()

    def run(kind, cnt, cand):
        if kind == "ship":
            listed_candidates_kernel[(n_prog,)](*args[:7], thr, thr, cnt, cand, n, cap, h, *tail, EVEN_K=True,
                                                **common)
        elif kind in ("fast", "noepi", "var"):
            listed_var_kernel[(n_prog,)](*args[:7], thr, thr, cnt, cand, dummy, n, cap, h, *tail,
                                         FAST=kind == "fast", NOEPI=kind == "noepi", **common)
        else:
            listed_flat_kernel[(n_prog,)](*args[:7], thr, thr, cnt, cand, n, cap, h, *tail, KSTEPS=h // cfg.block_k,
                                          FAST=kind == "flatfast", **common)
    return fresh, run, n_tasks, cfg, n_prog


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (4096, 896, 151936) if dev == "cuda" else (200, 64, 3000)
    caps = (0.0, 30.0) if len(sys.argv) < 2 else tuple(float(c) for c in sys.argv[1].split(","))
    for k in (8, 64):
        for cap in caps:
            hid, w, p, segs, thr, plan = setup(*shape, k, dev, cap)
            fresh, run, n_tasks, cfg, n_prog = launchers(hid, w, p, thr, plan)
            cnt_s = plan.seg_count.float()
            print(f"k={k} cap={cap} tasks {int(n_tasks.item())} of block {cfg.block_n}, programs {n_prog}, segments "
                  f"listed {int((cnt_s > 0).sum())}, rows per segment mean {cnt_s.mean():.1f} max {int(cnt_s.max())}",
                  flush=True)
            ref = None
            kinds = ("ship", "var", "fast", "flat", "flatfast") + (("noepi",) if dev == "cuda" else ())
            for kind in kinds:
                cnt, cand = fresh()
                run(kind, cnt, cand)
                if kind == "noepi":
                    same = "-"
                else:
                    got = (cnt.clone(), torch.sort(cand, 1).values)
                    if ref is None:
                        ref = got
                        extra = (cnt - plan.flags.shape[1]).float()
                        print(f"  candidates per row beyond kk: mean {extra.mean():.2f} max {int(extra.max())}")
                    same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
                t = "-"
                if dev == "cuda":
                    pool = [fresh() for _ in range(30)]
                    ts = []
                    for j, (c1, c2) in enumerate(pool):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        torch.cuda.synchronize()
                        a.record(); run(kind, c1, c2); b.record(); b.synchronize()
                        if j >= 3:
                            ts.append(a.elapsed_time(b) * 1e3)
                    t = f"{statistics.median(ts):.1f} us [{min(ts):.1f}-{max(ts):.1f}]"
                print(f"  {kind:9s} same candidates as shipped: {same} | {t}", flush=True)


if __name__ == "__main__":
    main()
