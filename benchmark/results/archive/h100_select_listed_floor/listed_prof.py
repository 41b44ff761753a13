"""listed_candidates_kernel's GPU time (torch profiler, the kernel alone) at 4096x896 on the recompute route under
launch options, 3 interleaved rounds of 10 calls each; outputs compared bitwise with the shipped options."""
import statistics, torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
import areal_lce.backends.triton.select_launch as SL
from listed_exp import setup
from topk_cfg import CFGS, use

for k in (8, 64):
    hid, w, p, segs, thr, plan = setup(4096, 896, 151936, k, "cuda")
    times = {c: [] for c in CFGS}
    same = {}
    ref = None
    for rnd in range(3):
        for c, cfg in CFGS.items():
            use(cfg)
            pool = [SL.TopkPlan(*[t.clone() for t in plan]) for _ in range(11)]
            out = SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, pool[0])
            if ref is None:
                ref = out
            same[c] = same.get(c, True) and torch.equal(out, ref)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for pl in pool[1:]:
                    SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, pl)
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            lk = [e.time_range.elapsed_us() for e in ev if e.name.startswith("listed_candidates")]
            allk = sum(e.time_range.elapsed_us() for e in ev) / 10
            times[c].append((statistics.median(lk), allk))
    use(None)
    print(f"small k={k}: listed kernel us (median of calls, per round) / all kernels of candidate_topk per call: " +
          " | ".join(f"{c} {statistics.median(t[0] for t in ts):.0f} / {statistics.median(t[1] for t in ts):.0f}"
                     f"{'' if same[c] else ' DIFF'}" for c, ts in times.items()), flush=True)
