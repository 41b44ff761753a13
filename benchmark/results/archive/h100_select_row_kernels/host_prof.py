"""Host-overhead diagnosis: event time (sync per call), host enqueue time, stream time (10 calls, one sync),
and the GPU's idle gaps attributed to the Python frame that launched the next kernel."""
import json, os, statistics, sys, time, collections
import torch
from torch.profiler import profile, ProfilerActivity
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import inputs
from benchmark.op.bench_select import _sel

OUT = os.environ.get("OUT", "/tmp")
SH = {"small": (4096, 896, 151936), "qwen7b": (8192, 4096, 151936)}
which = sys.argv[1:] or ["small"]


def make(hid, w, y, v, kw, bwd):
    def f():
        if not bwd:
            with torch.no_grad():
                linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
            return
        o = linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
        loss = o.logprobs.sum()
        for t in (o.selected_logprobs, o.topk_logprobs):
            if t is not None:
                loss = loss + t.sum()
        loss.backward()
        hid.grad = w.grad = None
    return f


def measure(f, reps=15):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ev, host, stream = [], [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(); t0 = time.perf_counter(); f(); t1 = time.perf_counter(); b.record(); b.synchronize()
        ev.append(a.elapsed_time(b)); host.append((t1 - t0) * 1e3)
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(10):
            f()
        b.record(); b.synchronize()
        stream.append(a.elapsed_time(b) / 10)
    return statistics.median(ev), statistics.median(host), statistics.median(stream)


def gaps(f, tag):
    f(); f(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=True) as prof:
        f(); torch.cuda.synchronize()
    path = f"/tmp/trace_{tag}.json"
    prof.export_chrome_trace(path)
    tr = json.load(open(path))["traceEvents"]
    kern = sorted([e for e in tr if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
    rt = {e["args"].get("correlation"): e for e in tr if e.get("cat") == "cuda_runtime" and "args" in e}
    py = [e for e in tr if e.get("cat") == "python_function"]
    py.sort(key=lambda e: e["ts"])

    def frames(ts):
        enc = [e for e in py if e["ts"] <= ts <= e["ts"] + e.get("dur", 0)]
        enc.sort(key=lambda e: -e["ts"])
        names = [e["name"] for e in enc if "areal_lce" in e["name"] or "benchmark" in e["name"] or "autograd" in e["name"]]
        return " < ".join(n.split("/")[-1][:60] for n in names[:4])
    busy = sum(e["dur"] for e in kern)
    span = kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]
    rows = []
    for p, n in zip(kern, kern[1:]):
        g = n["ts"] - (p["ts"] + p["dur"])
        if g > 15:
            r = rt.get(n["args"].get("correlation"))
            rows.append((g, n["name"][:40], frames(r["ts"]) if r else "?"))
    first_rt = min((e["ts"] for e in rt.values()), default=0)
    print(f"== {tag}: kernels {len(kern)} busy {busy/1e3:.3f} ms span {span/1e3:.3f} ms; first launch->first kernel "
          f"{(kern[0]['ts']-first_rt)/1e3:.3f} ms; gaps>15us total {sum(r[0] for r in rows)/1e3:.3f} ms", flush=True)
    agg = collections.defaultdict(float)
    for g, k, fr in rows:
        agg[fr] += g
    for fr, g in sorted(agg.items(), key=lambda x: -x[1])[:12]:
        print(f"   {g/1e3:.3f} ms  {fr}")
    for g, k, fr in sorted(rows, key=lambda r: -r[0])[:8]:
        print(f"   gap {g:.0f}us before {k} | {fr}")
    # CPU self time by function (top)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table, flush=True)


if __name__ != "__main__":
    which = []
for name in which:
    n, h, v = SH[name]
    hid, w, y = inputs(n, h, v)
    hid.requires_grad_(); w.requires_grad_()
    variants = {"base": {}, "sel8": {"selected_ids": _sel(y, v, 8)}, "sel64": {"selected_ids": _sel(y, v, 64)},
                "top8": {"top_k": 8}, "top64": {"top_k": 64}, "cap30": {"softcap": 30.0}}
    res = {}
    for bwd in (False, True):
        for k, kw in variants.items():
            ev, host, stream = measure(make(hid, w, y, v, kw, bwd))
            res[(k, bwd)] = (ev, host, stream)
        b = res[("base", bwd)]
        for k in variants:
            ev, host, stream = res[(k, bwd)]
            print(f"{name} {'fwd_bwd' if bwd else 'fwd':7s} {k:6s} event {ev:7.3f} ms ({ev/b[0]:.3f}) host {host:7.3f} ms "
                  f"stream {stream:7.3f} ms ({stream/b[2]:.3f})", flush=True)
    if os.environ.get("GAPS", "1") == "1":
        for k in ("base", "sel8", "top8"):
            gaps(make(hid, w, y, v, variants[k], True), f"{name}_{k}_fb")
        gaps(make(hid, w, y, v, variants["top8"], False), f"{name}_top8_f")
