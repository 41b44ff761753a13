import torch, statistics, sys, triton
from torch.profiler import profile, ProfilerActivity
from areal_lce import linear_logprobs_entropy, exact
from benchmark.op.bench_invariant import inputs
from areal_lce.backends.triton import select_launch as sl, configs
from areal_lce.backends.triton.select_kernels import segment_best_kernel, segment_candidates_kernel
from areal_lce.backends.triton.launch import _dot_precision
from areal_lce.types import LCEParams

def timed(fn, reps=10):
    for _ in range(2): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

for (n, h, v) in ((8192, 4096, 151936), (32768, 2048, 151936)):
    hid, w, y = inputs(n, h, v)
    f = lambda: linear_logprobs_entropy(hid, w, y, vocab_size=v, top_k=8)
    f(); f(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f(); torch.cuda.synchronize()
    print("===== top8", n, h, v)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))

n, h, v = 8192, 4096, 151936
hid, w, y = inputs(n, h, v)
G = (v + 127) // 128
p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True, compact_ignored=False)
from areal_lce.backends import get_backend
st = get_backend("triton").forward(hid, w, y, None, p, keep_cache=False)
seg = st.seg[0].contiguous()
for kk in (8, 64):
    for bn in (1, 2, 4, 8):
        for nw in (1, 2, 4, 8):
            bg = 2048
            if bn * bg > 16384: continue
            best = torch.zeros((n, kk), dtype=torch.int64, device="cuda"); thr = torch.empty(n, device="cuda")
            def g():
                segment_best_kernel[(triton.cdiv(n, bn),)](seg, seg, best, thr, n, G, kk, 1.0, HAS_INV_T=False,
                                                           BLOCK_N=bn, BLOCK_G=bg, num_warps=nw)
            try:
                print("best kk", kk, "bn", bn, "nw", nw, round(timed(g) * 1000, 1), "us")
            except Exception as e:
                print("best", kk, bn, nw, "fail", str(e)[:100])
    segs, thr = sl.rank_segments(seg, 1.0, kk)
    ref = sl.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, kk)
    cap = kk * 128
    for (bn, nw, ns) in ((128, 8, 3), (128, 4, 3), (128, 8, 4), (128, 8, 2), (64, 4, 3), (64, 4, 4), (256, 8, 3)):
        rows = torch.arange(0, n, device="cuda").repeat_interleave(kk)
        task_rows, task_seg, _, _ = sl._tasks(rows, segs.reshape(-1), G, bn)
        count = torch.zeros(n, dtype=torch.int32, device="cuda")
        cand = torch.empty((n, cap), dtype=torch.int64, device="cuda")
        def c():
            count.zero_()
            segment_candidates_kernel[(task_seg.shape[0],)](
                hid, w, task_rows, task_seg, thr, thr, count, cand, 0, cap, h, v, 0, 1.0, 0.0, 0.0, SEG=128,
                BLOCK_N=bn, BLOCK_K=64, EVEN_K=True, UPCAST=False, DOT_PRECISION="tf32", HAS_INV_T=False,
                BF16_LOGITS=False, SOFTCAP=False, num_warps=nw, num_stages=ns)
        try:
            t = timed(c)
            out = torch.empty((n, kk), dtype=torch.int64, device="cuda")
            sl.candidate_topk_kernel[(triton.cdiv(n, 4),)](cand, count, out, n, cap, kk, sl.PAD_KEY, BLOCK_R=4,
                                                           CHUNK=128, K2=triton.next_power_of_2(kk), num_warps=4)
            print("cand kk", kk, "bn", bn, "nw", nw, "ns", ns, round(t * 1000, 1), "us", "tasks", task_seg.shape[0],
                  "equal", bool(torch.equal(out, ref)), "mean count", float(count.float().mean()), "max", int(count.max()))
        except Exception as e:
            print("cand", kk, bn, nw, ns, "fail", str(e)[:200])
    for rr, nw in ((1, 1), (4, 4), (8, 4), (16, 4), (4, 1), (8, 8)):
        out = torch.empty((n, kk), dtype=torch.int64, device="cuda")
        def t_():
            sl.candidate_topk_kernel[(triton.cdiv(n, rr),)](cand, count, out, n, cap, kk, sl.PAD_KEY, BLOCK_R=rr,
                                                            CHUNK=128, K2=triton.next_power_of_2(kk), num_warps=nw)
        print("topk kk", kk, "rows", rr, "nw", nw, round(timed(t_) * 1000, 1), "us", bool(torch.equal(out, ref)))
