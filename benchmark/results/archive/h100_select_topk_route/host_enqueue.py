"""Host time to enqueue one call (no sync inside) against its GPU time (events) and wall time, 4096x896, variants
interleaved call by call after a warm-up (one H100)."""
import statistics, time, torch
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import SHAPES, inputs
from benchmark.op.bench_select import _sel

n, h, v = SHAPES["small"]
hid, w, y = inputs(n, h, v)
variants = {"base": {}, "sel8": {"selected_ids": _sel(y, v, 8)}, "sel64": {"selected_ids": _sel(y, v, 64)},
            "top8": {"top_k": 8}, "top64": {"top_k": 64}}
res = {k: ([], [], []) for k in variants}
for i in range(60):
    for name, kw in variants.items():
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        with torch.no_grad():
            linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
        b.record()
        t1 = time.perf_counter()
        b.synchronize()
        t2 = time.perf_counter()
        if i >= 10:
            for lst, val in zip(res[name], ((t1 - t0) * 1e3, a.elapsed_time(b), (t2 - t0) * 1e3)):
                lst.append(val)
base = [statistics.median(x) for x in res["base"]]
for name, (hs, gs, ws) in res.items():
    m = [statistics.median(x) for x in (hs, gs, ws)]
    print(f"{name}: host enqueue {m[0]:.3f} ms | GPU (events) {m[1]:.3f} ms | wall {m[2]:.3f} ms | "
          f"ratio GPU {m[1] / base[1]:.3f} wall {m[2] / base[2]:.3f}", flush=True)
