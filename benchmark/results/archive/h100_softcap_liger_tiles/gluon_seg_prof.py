"""Kernel times (torch profiler, CUDA time per call) of the Triton forward's segment kernel and the Gluon prototype."""
import collections, sys, torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, ".")
import gluon_seg as S

n, h, v = 4096, 896, 151936
hid, w, y, ref = S.small_case(n, h, v)


calls = {"triton": lambda: ref(0.0), "triton_cap": lambda: ref(30.0),
         "gluon": lambda: S.seg_fwd_ws(hid, w, 0.0, 3, 33), "gluon_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 3, 33),
         "gluon_1c": lambda: S.seg_fwd_ws(hid, w, 0.0, 4, 33, mode=1),
         "gluon_1c_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 4, 33, mode=1),
         "pp_bk32_s6": lambda: S.seg_fwd_ws(hid, w, 0.0, 6, 33, bk=32),
         "pp_bk32_s6_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 6, 33, bk=32),
         "pp_t66": lambda: S.seg_fwd_ws(hid, w, 0.0, 3, 66),
         "pp_t66_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 3, 66),
         "1c_s6": lambda: S.seg_fwd_ws(hid, w, 0.0, 6, 33, mode=1),
         "1c_s6_cap": lambda: S.seg_fwd_ws(hid, w, 30.0, 6, 33, mode=1),
         "cublas_mm": lambda: torch.mm(hid, w.t())}
for cap in (0.0, 30.0):
    a = ref(cap).seg
    b = S.seg_fwd_ws(hid, w, cap, 6, 33, bk=32)
    print(f"bk 32, 6 stages, softcap {cap}: bitwise equal to the Triton kernel's partials: "
          f"{all(torch.equal(a[i], b[i]) for i in range(3))}", flush=True)
REPS = 20
for name, f in calls.items():
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            f()
        torch.cuda.synchronize()
    per = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name[:60]] += e.device_time_total / 1000 / REPS  # ms per call
    top = ", ".join(f"{k} {t:.3f}" for k, t in per.most_common(4))
    print(f"{name:16s} GPU ms per call {sum(per.values()):.3f}: {top}", flush=True)
