"""candidate_topk's listed recompute with the weight by pointer loads vs TMA (one H100); outputs compared bitwise,
and the whole top-k forward ratio with each."""
import statistics, sys, torch
import areal_lce.backends.triton.select_launch as SL
from areal_lce.backends.triton import segment_launch as SGL
from areal_lce.backends import get_backend
from areal_lce.types import LCEParams
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import SHAPES, inputs


def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts) * 1e3


for name in sys.argv[1].split(","):
    n, h, v = SHAPES[name]
    hid, w, y = inputs(n, h, v)
    for k in (8, 64):
        p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True, compact_ignored=False,
                      top_k=k)
        SGL.TOP_KH_PER_ID = 0.0
        st = get_backend("triton").forward(hid, w, y, None, p, keep_cache=False)
        SGL.TOP_KH_PER_ID = 0.4
        rows, top = st.seg_top[2], st.seg_top[:2]
        for route in ("keep", "every"):
            tp = top if route == "keep" else None
            if (route == "keep") != SGL.keeps_top(k, h, p):
                continue
            segs, thr, plan = SL.rank_segments(rows, 1.0, k, tp, 0, lists=True)
            res, outs = [], []
            for tma in (False, True, False, True):
                SL.LISTED_W_TMA = tma
                out = SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, SL.TopkPlan(*[t.clone() for t in plan]))
                outs.append(out)
                fresh = iter([SL.TopkPlan(*[t.clone() for t in plan]) for _ in range(25)])
                res.append(f"{'tma' if tma else 'ptr'} {timed(lambda: SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, next(fresh))):.0f}")
            same = all(torch.equal(o, outs[0]) for o in outs)
            print(f"cand {name} k={k} {route}: " + " | ".join(res) + f" us | same {same}", flush=True)
    # the whole forward, ratio to no top-k, alternating
    def fwd(kw, tma):
        SL.LISTED_W_TMA = tma
        with torch.no_grad():
            linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
    reps = 15 if name == "small" else 3
    times = {key: [] for key in ("base", "8p", "8t", "64p", "64t")}
    for _ in range(7):
        times["base"].append(timed(lambda: fwd({}, False), reps))
        for k in (8, 64):
            times[f"{k}p"].append(timed(lambda: fwd({"top_k": k}, False), reps))
            times[f"{k}t"].append(timed(lambda: fwd({"top_k": k}, True), reps))
    r = {key: statistics.median(a / b for a, b in zip(times[key], times["base"])) for key in times if key != "base"}
    print(f"fwd {name}: base {statistics.median(times['base'])/1e3:.3f} ms | " +
          " | ".join(f"top{key[:-1]} {'tma' if key[-1] == 't' else 'ptr'} {val:.3f}" for key, val in r.items()), flush=True)
    SL.LISTED_W_TMA = False
