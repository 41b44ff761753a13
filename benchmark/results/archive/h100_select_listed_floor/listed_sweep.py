"""listed_candidates_kernel's loads + MMA alone (no epilogue) at 4096x896 under launch options and two loop shapes:
PREF loads the next task's segment and rows before the current task's K loop; CONTIG reads rows t·64.. instead of the
listed ones (a diagnostic of the gather's dependent loads). Floor: torch's sum over W (one read of 272 MB)."""
import statistics, sys, torch, triton
import triton.language as tl
import areal_lce.backends.triton.select_launch as SL
from areal_lce import exact
from areal_lce.backends.triton.launch import _dot_precision, _slots
from areal_lce.backends.triton.segment_kernels import _dot
from listed_exp import setup


@triton.jit
def _task(seg_list, seg_count, task_seg, task_first, t, N, o_i, BLOCK_N: tl.constexpr, CONTIG: tl.constexpr):
    g = tl.load(task_seg + t)
    if CONTIG:
        rows = (t * BLOCK_N + o_i) % N
    else:
        o_r = (t - tl.load(task_first + g)) * BLOCK_N + o_i
        rows = tl.load(seg_list + g.to(tl.int64) * N + o_r, mask=o_r < tl.load(seg_count + g), other=-1)
    return g, rows


@triton.jit
def noepi_kernel(h, w, seg_list, seg_count, task_seg, task_first, n_tasks, dummy, N, H, valid, n_prog,
                 SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 PREF: tl.constexpr, CONTIG: tl.constexpr, EV: tl.constexpr = False):
    o_i = tl.arange(0, BLOCK_N)
    o_s = tl.arange(0, SEG)
    o_k = tl.arange(0, BLOCK_K)
    nt = tl.load(n_tasks)
    pid = tl.program_id(0)
    if PREF:
        g, rows = _task(seg_list, seg_count, task_seg, task_first, tl.minimum(pid, nt - 1), N, o_i, BLOCK_N, CONTIG)
    for t in range(pid, nt, n_prog):
        if PREF:
            g_c, rows_c = g, rows
            g, rows = _task(seg_list, seg_count, task_seg, task_first, tl.minimum(t + n_prog, nt - 1), N, o_i,
                            BLOCK_N, CONTIG)
        else:
            g_c, rows_c = _task(seg_list, seg_count, task_seg, task_first, t, N, o_i, BLOCK_N, CONTIG)
        p_h = h + tl.where(rows_c >= 0, rows_c, 0).to(tl.int64)[:, None] * H
        p_w = w + tl.minimum(g_c * SEG + o_s, valid - 1).to(tl.int64)[:, None] * H
        acc = tl.zeros([BLOCK_N, SEG], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EV:
                b_h = tl.load(p_h + (k0 + o_k)[None, :], eviction_policy="evict_last")
                b_w = tl.load(p_w + (k0 + o_k)[None, :], eviction_policy="evict_first")
            else:
                b_h = tl.load(p_h + (k0 + o_k)[None, :])
                b_w = tl.load(p_w + (k0 + o_k)[None, :])
            acc = _dot(b_h, b_w, acc, DOT_PRECISION, False)
        tl.store(dummy + t * BLOCK_N + o_i, tl.max(acc, 1))


def timed(fn, reps=25):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def grid():
    """The first sweep (listed_sweep.log): BLOCK_K x programs per SM x stages, PREF and CONTIG at the shipped
    BLOCK_K 64 and 2 programs per SM, one timing each; and the floor of one read of W."""
    n, h, v = 4096, 896, 151936
    for k in (8, 64):
        hid, w, p, segs, thr, plan = setup(n, h, v, k, "cuda")
        if k == 8:
            print(f"floor: torch sum over W {timed(lambda: w.sum()):.1f} us; over W[:, :64] rows-strided "
                  f"{timed(lambda: w[:, :64].sum()):.1f} us", flush=True)
        res = []
        task_seg, task_first, n_tasks = SL._listed_tasks(plan, 64)
        dummy = torch.empty(task_seg.shape[0] * 64, device="cuda")
        for bk in (64, 128, 32):
            for pps in (1, 2, 3, 4):
                for stages in (1, 2, 3, 4, 5):
                    for pref, contig in ((False, False), (True, False), (False, True)):
                        if (bk != 64 or pps != 2) and (pref or contig):
                            continue
                        if bk == 128 and stages > 3 or bk == 32 and stages < 3:
                            continue
                        n_prog = min(task_seg.shape[0], _slots(hid.device) * pps)

                        def f():
                            noepi_kernel[(n_prog,)](hid, w, plan.seg_list, plan.seg_count, task_seg, task_first,
                                                    n_tasks, dummy, n, h, v, n_prog, SEG=exact.SEG, BLOCK_N=64,
                                                    BLOCK_K=bk, DOT_PRECISION=_dot_precision(hid.dtype), PREF=pref,
                                                    CONTIG=contig, num_warps=4, num_stages=stages)
                        res.append(f"k{bk}p{pps}s{stages}{'P' if pref else ''}{'C' if contig else ''} {timed(f):.0f}")
        print(f"top-{k} noepi (us): " + " | ".join(res), flush=True)


def main():
    n, h, v = 4096, 896, 151936
    reps = 60
    for k in (8, 64):
        hid, w, p, segs, thr, plan = setup(n, h, v, k, "cuda")
        task_seg, task_first, n_tasks = SL._listed_tasks(plan, 64)
        dummy = torch.empty(task_seg.shape[0] * 64, device="cuda")
        fns = {}
        for bk, pps, stages in ((64, 2, 3), (64, 2, 4), (64, 4, 1), (64, 4, 3), (64, 4, 4), (128, 2, 1), (128, 2, 2),
                                (128, 3, 1), (128, 4, 1), (128, 1, 3)):
            for ev in (False, True):
                n_prog = min(task_seg.shape[0], _slots(hid.device) * pps)
                def f(n_prog=n_prog, bk=bk, stages=stages, ev=ev):
                    noepi_kernel[(n_prog,)](hid, w, plan.seg_list, plan.seg_count, task_seg, task_first, n_tasks,
                                            dummy, n, h, v, n_prog, SEG=exact.SEG, BLOCK_N=64, BLOCK_K=bk,
                                            DOT_PRECISION=_dot_precision(hid.dtype), PREF=False, CONTIG=False, EV=ev,
                                            num_warps=4, num_stages=stages)
                fns[f"k{bk}p{pps}s{stages}{'E' if ev else ''}"] = f
        times = {name: [] for name in fns}
        for _ in range(3):  # rounds, variants interleaved
            for name, f in fns.items():
                times[name].append(timed(f, reps // 3))
        print(f"top-{k} noepi (us, median of 3 rounds): " + " | ".join(
            f"{name} {statistics.median(ts):.0f}" for name, ts in times.items()), flush=True)


if __name__ == "__main__":
    grid() if sys.argv[1:] == ["grid"] else main()
