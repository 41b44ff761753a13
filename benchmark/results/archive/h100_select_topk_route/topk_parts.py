"""segment_best_kernel (HEAD's vs this tree's) and candidate_topk's listed recompute under launch options, on
real maxima of the four benchmark shapes (one H100). Outputs compared bitwise."""
import statistics, sys, torch, triton
import areal_lce.backends.triton.select_launch as SL
from areal_lce.backends.triton import segment_launch as SGL
from areal_lce.backends import get_backend
from areal_lce.types import LCEParams
from benchmark.op.bench_invariant import SHAPES, inputs
import old_sk


def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts) * 1e3


def old_rank(seg_rows, kk, top):
    N, G = seg_rows.shape
    dev = seg_rows.device
    best = torch.zeros((N, kk), dtype=torch.int64, device=dev)
    thr = torch.empty((N,), dtype=torch.float32, device=dev)
    plan = SL.TopkPlan(torch.full((N, kk + SL.TOPK_SPILL), SL.PAD_KEY, dtype=torch.int64, device=dev),
                       torch.ones((N, kk), dtype=torch.int8, device=dev),
                       torch.zeros(G, dtype=torch.int32, device=dev), torch.empty((G, N), dtype=torch.int32, device=dev))
    old_sk.segment_best_kernel[(N,)](seg_rows, seg_rows, best, thr, top[0], top[1], *plan, N, G, kk, kk + SL.TOPK_SPILL,
                                     1.0, 0, SL.PAD_KEY, HAS_INV_T=False, HAS_TOP=True, BLOCK_N=1, CHUNK=256,
                                     KK2=triton.next_power_of_2(kk), num_warps=1)
    return best, thr, plan


for name in sys.argv[1].split(","):
    n, h, v = SHAPES[name]
    hid, w, y = inputs(n, h, v)
    for k in (8, 64):
        p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True, compact_ignored=False,
                      top_k=k)
        SGL.TOP_KH_PER_ID = 0.0
        st = get_backend("triton").forward(hid, w, y, None, p, keep_cache=False)
        rows, top = st.seg_top[2], st.seg_top[:2]
        new = SL.rank_segments(rows, 1.0, k, top, 0, lists=True)
        old = old_rank(rows, k, top)
        same = torch.equal(new[0], old[0]) and torch.equal(new[1], old[1]) and torch.equal(new[2].cand, old[2].cand)
        t_new = timed(lambda: SL.rank_segments(rows, 1.0, k, top, 0, lists=True))
        t_old = timed(lambda: old_rank(rows, k, top))
        t_new_all = timed(lambda: SL.rank_segments(rows, 1.0, k, None, 0, lists=True))
        print(f"best {name} k={k}: HEAD {t_old:.1f} us | new {t_new:.1f} us | new, every segment listed "
              f"{t_new_all:.1f} us | same outputs {same}", flush=True)
        for route in ("keep", "every"):
            tp = top if route == "keep" else None
            if route == "every" and SGL.keeps_top(k, h, p) and name != "small":
                continue
            segs, thr, plan = SL.rank_segments(rows, 1.0, k, tp, 0, lists=True)
            ref = SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, SL.TopkPlan(*[t.clone() for t in plan]))
            res = []
            orig_tile, orig_pps = SL._recompute_tile, SL.LISTED_PROGRAMS_PER_SM
            for pps in (2, 3, 4):
                for stages in (2, 3, 4):
                    SL.LISTED_PROGRAMS_PER_SM = pps
                    SL._recompute_tile = lambda hh, dt, s=stages: __import__("dataclasses").replace(orig_tile(hh, dt), num_stages=s)
                    try:
                        out = SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, SL.TopkPlan(*[t.clone() for t in plan]))
                        ok = torch.equal(out, ref)
                        fresh = [SL.TopkPlan(*[t.clone() for t in plan]) for _ in range(25)]
                        it = iter(fresh)
                        t = timed(lambda: SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, next(it)), 20)
                        res.append(f"p{pps}s{stages} {t:.0f}{'' if ok else ' DIFF'}")
                    except Exception as e:  # out of shared memory etc.
                        res.append(f"p{pps}s{stages} err {type(e).__name__}")
            SL._recompute_tile, SL.LISTED_PROGRAMS_PER_SM = orig_tile, orig_pps
            print(f"cand {name} k={k} {route}: " + " | ".join(res), flush=True)
