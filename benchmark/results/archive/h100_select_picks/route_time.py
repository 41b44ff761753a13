"""Selected ids, both routes (gathered / taken from the forward's tiles), forward ratios to the call without
them, paired alternating rounds, median."""
import json, statistics, sys, torch
from areal_lce import linear_logprobs_entropy as lce
from areal_lce.backends.triton import select_launch
from benchmark.op.bench_invariant import inputs
from benchmark.op.bench_select import _sel
SHAPES = {"small": (4096, 896, 151936), "qwen7b": (8192, 4096, 151936), "llama8b": (16384, 4096, 128256),
          "wide_n": (32768, 2048, 151936)}
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
def once(f):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); f(); b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b)
res = {}
for name, (n, h, v) in SHAPES.items():
    hid, w, y = inputs(n, h, v)
    variants = {"base": (None, 0.75)}
    for k in (8, 16, 32, 64):
        s = _sel(y, v, k)
        variants[f"sel{k}_gather"] = (s, float("inf"))
        variants[f"sel{k}_picks"] = (s, 0.0)
    times = {k: [] for k in variants}
    with torch.no_grad():
        for r in range(ROUNDS + 1):
            for key, (s, thr) in variants.items():
                select_launch.PICK_KH_PER_ID = thr
                f = lambda: lce(hid, w, y, vocab_size=v, selected_ids=s) if s is not None else lce(hid, w, y, vocab_size=v)
                t = once(f)
                if r:
                    times[key].append(t)
    base = times["base"]
    out = {"base_ms": statistics.median(base)}
    for key in variants:
        if key != "base":
            out[key] = round(statistics.median([a / b for a, b in zip(times[key], base)]), 4)
    res[name] = out
    print(name, json.dumps(out), flush=True)
    del hid, w, y
    torch.cuda.empty_cache()
