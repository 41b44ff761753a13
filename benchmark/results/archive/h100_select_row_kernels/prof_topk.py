import collections, torch, sys
from torch.profiler import profile, ProfilerActivity
from torch.autograd import DeviceType
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import inputs
for (n, h, v) in ((32768, 2048, 151936), (8192, 4096, 151936), (4096, 896, 151936)):
    hid, w, y = inputs(n, h, v)
    for name, kw in (("base", {}), ("top8", {"top_k": 8}), ("top64", {"top_k": 64})):
        def f():
            with torch.no_grad():
                linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
        f(); f(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f(); f(); f(); torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                a = agg[e.name[:40]]; a[0] += e.time_range.elapsed_us() / 3000.0; a[1] += 1
        rows = sorted(agg.items(), key=lambda x: -x[1][0])
        tot = sum(a[0] for _, a in rows); cnt = sum(a[1] for _, a in rows) / 3
        print("=====", name, n, h, "kernels %d busy ms %.3f" % (cnt, tot), " | ".join("%s %.3f x%d" % (k, a[0], a[1] // 3) for k, a in rows[:16]), flush=True)
