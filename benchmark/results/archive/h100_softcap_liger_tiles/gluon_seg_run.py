"""Run the Gluon prototype at 4096x896x151936: bits against the Triton kernel's segment partials, time against it."""
import statistics, sys, torch
sys.path.insert(0, ".")
import gluon_seg as S
from benchmark.op.bench_invariant import timed

n, h, v = 4096, 896, 151936
hid, w, y, ref = S.small_case(n, h, v)


for cap in (0.0, 30.0):
    a = ref(cap).seg
    for stages, tiles in ((3, 33), (2, 33), (3, 17)):
        b = S.seg_fwd_ws(hid, w, cap, stages, tiles)
        torch.cuda.synchronize()
        eq = [torch.equal(a[i], b[i]) for i in range(3)]
        diff = [float((a[i] - b[i]).abs().max()) for i in range(3)]
        print(f"softcap {cap} stages {stages} tiles {tiles}: bitwise equal (max, s, a) {eq}, max |diff| {diff}",
              flush=True)
# float64 sanity for a few rows: max and s of segment 5
r = (hid[:8].double() @ w[640:768].double().t()).to(torch.bfloat16).double()
b = S.seg_fwd_ws(hid, w, 0.0, 3, 33)
print("fp64 check rows 0-7 segment 5: max", float((r.max(1).values - b[0, 5, :8].double()).abs().max()),
      "s", float(((r - r.max(1, keepdim=True).values).exp().sum(1) - b[1, 5, :8].double()).abs().max()), flush=True)

variants = {
    "triton_fwd": lambda: ref(0.0), "triton_fwd_cap": lambda: ref(30.0),
    "gluon": lambda: S.seg_fwd_ws(hid, w, 0.0, 3, 33), "gluon_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 3, 33),
    "gluon_s2": lambda: S.seg_fwd_ws(hid, w, 0.0, 2, 33), "gluon_s2_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 2, 33),
    "gluon_t17": lambda: S.seg_fwd_ws(hid, w, 0.0, 3, 17),
    "gluon_1c": lambda: S.seg_fwd_ws(hid, w, 0.0, 4, 33, mode=1),
    "gluon_1c_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 4, 33, mode=1),
    "cublas_mm": lambda: torch.mm(hid, w.t()),
}
times = {k: [] for k in variants}
for _ in range(5):
    for k, f in variants.items():
        times[k].append(timed(f, 15))
for k, t in times.items():
    print(f"{k:16s} {statistics.median(t):.3f} ms  rounds {' '.join(f'{x:.3f}' for x in t)}", flush=True)
