import statistics, torch, importlib, sys
sys.path.insert(0, "var")
from areal_lce.backends.triton import select_launch as SL
from areal_lce.backends import get_backend
from areal_lce.types import LCEParams
from benchmark.op.bench_invariant import inputs
def timed(fn, reps=10):
    for _ in range(2): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
n, h, v = 32768, 2048, 151936
hid, w, y = inputs(n, h, v)
p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True, compact_ignored=False, top_k=64)
st = get_backend("triton").forward(hid, w, y, None, p, keep_cache=False)
G = st.seg.shape[1]
seg = st.seg_top[1][1].view(n, G).contiguous()
top = (st.seg_top[0], st.seg_top[1][0])
del st
orig = SL.segment_best_kernel
for kk in (8, 64):
    res = ["noplan %.1f" % (timed(lambda: SL.rank_segments(seg, 1.0, kk)) * 1e3)]
    outs = {}
    for name in ("v_full", "v_new"):
        mod = importlib.import_module(name)
        if name == "v_full":  # the previous kernel has no KK2
            k0 = mod.segment_best_kernel
            def launch(*a, KK2=None, **kw):
                return k0[launch.grid](*a, **kw)
            class W:
                def __getitem__(self, grid):
                    launch.grid = grid
                    return launch
            SL.segment_best_kernel = W()
        else:
            SL.segment_best_kernel = mod.segment_best_kernel
        res.append("%s %.1f" % (name, timed(lambda: SL.rank_segments(seg, 1.0, kk, top, 0)) * 1e3))
        b, t, plan = SL.rank_segments(seg, 1.0, kk, top, 0)
        outs[name] = (b, t, plan.cand, plan.flags, plan.seg_count)
    same = all(torch.equal(x, y) for x, y in zip(outs["v_full"], outs["v_new"]))
    res.append("same outputs (lists' counts) %s" % same)
    SL.segment_best_kernel = orig
    alloc = timed(lambda: (torch.full((n, kk + 128), 5, dtype=torch.int64, device="cuda"), torch.ones((n, kk), dtype=torch.int8, device="cuda"), torch.zeros(G, dtype=torch.int32, device="cuda"), torch.empty((G, n), dtype=torch.int32, device="cuda")))
    print("best var N", n, "kk", kk, " | ".join(res), "| allocs %.1f us" % (alloc * 1e3), flush=True)
