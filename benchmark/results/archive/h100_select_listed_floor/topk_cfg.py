"""candidate_topk (the listed recompute with its epilogue, the final top-k, the overflow pass) under launch options
of listed_candidates_kernel, at the four benchmark shapes on the route each takes by default; outputs compared
bitwise with the shipped options. Rounds interleave the options."""
import dataclasses, statistics, torch
import areal_lce.backends.triton.select_launch as SL
from areal_lce.backends import get_backend
from areal_lce.backends.triton import segment_launch as SGL
from areal_lce.types import LCEParams
from benchmark.op.bench_invariant import SHAPES, inputs
from listed_sweep import timed

ORIG_TILE, ORIG_PPS = SL._recompute_tile, SL.LISTED_PROGRAMS_PER_SM
CFGS = {"ship": None, "k64p4s1": (64, 4, 1), "k64p3s1": (64, 3, 1), "k64p2s1": (64, 2, 1), "k128p3s1": (128, 3, 1),
        "k128p2s1": (128, 2, 1)}


def use(cfg):
    if cfg is None:
        SL._recompute_tile, SL.LISTED_PROGRAMS_PER_SM = ORIG_TILE, ORIG_PPS
        return
    bk, pps, st = cfg
    SL._recompute_tile = lambda h, dt: dataclasses.replace(ORIG_TILE(h, dt), block_k=bk, num_stages=st)
    SL.LISTED_PROGRAMS_PER_SM = pps


def main():
    for name, (n, h, v) in SHAPES.items():
        hid, w, y = inputs(n, h, v)
        for k in (8, 64):
            p = LCEParams(inv_t=1.0, vocab_size=v, shard_valid=v, backend="triton", invariant=True, compact_ignored=False,
                          top_k=k)
            st = get_backend("triton").forward(hid, w, y, None, p, keep_cache=False)
            rows_major = st.seg_top[2] if st.seg_top is not None else st.seg[0].t().contiguous()
            top = st.seg_top[:2] if st.seg_top is not None and st.seg_top[0] is not None else None
            segs, thr, plan = SL.rank_segments(rows_major, 1.0, k, top, 0, lists=True)
            del st
            ref = None
            times = {c: [] for c in CFGS}
            same = {}
            for rnd in range(3):
                for c, cfg in CFGS.items():
                    use(cfg)
                    pool = iter([SL.TopkPlan(*[t.clone() for t in plan]) for _ in range(12)])
                    if rnd == 0:
                        out = SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, next(pool))
                        ref = out if ref is None else ref
                        same[c] = torch.equal(out, ref)
                    times[c].append(timed(lambda: SL.candidate_topk(hid, w, 0, segs, thr, 1.0, p, 0, k, next(pool)), 10))
            use(None)
            print(f"{name} k={k} {'keep' if top is not None else 'every'}: " + " | ".join(
                f"{c} {statistics.median(ts):.0f}{'' if same[c] else ' DIFF'}" for c, ts in times.items()), flush=True)
            del plan, segs, thr
        del hid, w, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
