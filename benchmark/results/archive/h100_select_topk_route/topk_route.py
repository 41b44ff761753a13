"""Top-k forward / fwd+bwd with and without the forward's max-column / second-value epilogue (one H100)."""
import collections, statistics, sys, torch
from torch.profiler import profile, ProfilerActivity
from torch.autograd import DeviceType
from areal_lce import linear_logprobs_entropy
from areal_lce.backends.triton import segment_launch as sl
from benchmark.op.bench_invariant import SHAPES, inputs, timed
from benchmark.harness import paired_ratios, PeakMemory

KS = (8, 16, 64)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
from areal_lce.backends.triton import select_launch as SLn
EPI = {"epi": (0.0, False), "re": (float("inf"), False), "re128": (float("inf"), True)}


def set_route(r):
    sl.TOP_KH_PER_ID, SLn.EVERY_FULL_TILE = EPI[r]

for name in names:
    n, h, v = SHAPES[name]
    hid, w, y = inputs(n, h, v)
    hid.requires_grad_(); w.requires_grad_()

    def fwd(kw, route):
        set_route(route)
        with torch.no_grad():
            return linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)

    def fwd_bwd(kw, route):
        set_route(route)
        o = linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
        loss = o.logprobs.sum() + (o.topk_logprobs.sum() if o.topk_logprobs is not None else 0)
        loss.backward()
        g = (hid.grad, w.grad)
        hid.grad = w.grad = None
        return o, g

    # the two routes give the same bits
    for k in KS:
        a = fwd({"top_k": k}, "epi")
        oa, ga = fwd_bwd({"top_k": k}, "epi")
        for r in ("re", "re128"):
            b = fwd({"top_k": k}, r)
            same = torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
            ob, gb = fwd_bwd({"top_k": k}, r)
            sameg = torch.equal(ga[0], gb[0]) and torch.equal(ga[1], gb[1])
            print(f"{name} k={k} {r} equal to epi: outputs {same} grads {sameg}", flush=True)
    variants = [("base", {}, "epi")] + [(f"top{k}_{r}", {"top_k": k}, r) for k in KS for r in ("epi", "re", "re128")]
    for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        reps = max(3, min(15, int(100 / max(timed(lambda: fn({}, "epi"), 3), 1e-3))))
        times = {vn: [] for vn, _, _ in variants}
        for _ in range(ROUNDS):
            for vn, kw, r in variants:
                times[vn].append(timed(lambda: fn(kw, r), reps))
        base = times["base"]
        line = [f"{name} {mode} base {statistics.median(base):.3f} ms reps {reps}"]
        for vn, _, _ in variants[1:]:
            rr, sp = paired_ratios(times[vn], base)
            line.append(f"{vn} {rr:.3f} [{sp[0]:.3f}-{sp[1]:.3f}]")
        print(" | ".join(line), flush=True)
    for vn, kw, r in variants:
        torch.cuda.synchronize()
        with PeakMemory() as pm:
            fwd(kw, r)
        print(f"{name} fwd peak extra {vn} {pm.extra_gib:.3f} GiB", flush=True)
        fn = lambda: fwd(kw, r)
        fn(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); fn(); torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                a_ = agg[e.name[:28]]; a_[0] += e.time_range.elapsed_us() / 2000.0; a_[1] += 1
        rows = sorted(agg.items(), key=lambda x: -x[1][0])
        print(f"  prof {name} {vn} busy {sum(a_[0] for _, a_ in rows):.3f} ms: " +
              " | ".join("%s %.3f" % (kk, a_[0]) for kk, a_ in rows[:9]), flush=True)
