import torch, sys
from torch.profiler import profile, ProfilerActivity
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import inputs
for (n, h, v) in ((8192, 4096, 151936), (32768, 2048, 151936), (4096, 896, 151936)):
    hid, w, y = inputs(n, h, v)
    for name, kw in (("base", {}), ("top8", {"top_k": 8}), ("top64", {"top_k": 64})):
        f = lambda: linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
        f(); f(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f(); torch.cuda.synchronize()
        print("=====", name, n, h, v)
        t = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40)
        print("\n".join(l[:40] + l[-60:] for l in t.splitlines()[3:13]))
import statistics, triton
from areal_lce.backends.triton.select_kernels import segment_best_kernel
def timed(fn, reps=10):
    for _ in range(2): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for N in (8192, 32768):
    G = 1187
    seg = torch.randn(N, G, device="cuda") * 3
    for kk in (8, 64):
        for nw in (1, 2, 4, 8):
            best = torch.zeros((N, kk), dtype=torch.int64, device="cuda"); thr = torch.empty(N, device="cuda")
            g = lambda: segment_best_kernel[(N,)](seg, seg, best, thr, N, G, kk, 1.0, HAS_INV_T=False, BLOCK_N=1, BLOCK_G=2048, num_warps=nw)
            print("best N", N, "kk", kk, "nw", nw, round(timed(g) * 1000, 1), "us")
