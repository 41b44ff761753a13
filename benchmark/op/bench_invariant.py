"""Invariant mode on a GPU: the bitwise checks of the consistency contract, and its cost.

    python -m benchmark.op.bench_invariant --out DIR [--shapes small,qwen7b,llama8b,wide_n] [--rounds 7]

Checks (public op, Triton backend, default options but the one compared): the same rows computed in
different calls must be torch.equal -- rows alone / 7 / a 357-row slice / the first 6000 of the call,
a permutation, more ignored neighbours, compact_ignored on and off, the logits cache on and off,
garbage padding rows past vocab_size, a per-token temperature equal to the scalar one, CUDA-graph
replay, torch.compile, and the tensor-parallel degrees 2, 4, 8 emulated on one GPU (each shard's
backend forward with megatron's padded vocabulary, the shards merged by the same max / int64 sum a
process group does; tests/op/test_invariance.py runs the real collectives on gloo, torchrun/run_lce_tp2.py
on NCCL). The same checks with invariant=False show what the online-softmax merge gives. Accuracy of
both against the fp64 reference on 256 rows.

Cost: forward and forward+backward of invariant=True (fp32 and bf16 logits) against invariant=False,
paired alternating rounds in one process, the median of each round's median; the ratio per round's
pair, its median and spread (min / max over rounds). Floor: the default (invariant=False) itself.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from areal_lce.op import exact
from areal_lce import linear_logprobs_entropy
from areal_lce.op.backends import get_backend
from areal_lce.op.types import LCEParams

from ..harness import log, parse_shapes, run_meta, write_json

SHAPES = {"small": (4096, 896, 151936), "qwen7b": (8192, 4096, 151936), "llama8b": (16384, 4096, 128256),
          "wide_n": (32768, 2048, 151936)}
FIELDS = ("logprobs", "entropy", "max_logit", "min_logit", "lse")


def inputs(n, h, v, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = torch.randn(n, h, device="cuda", generator=g, dtype=torch.float32)
    w = torch.randn(v, h, device="cuda", generator=g, dtype=torch.float32) / h ** 0.5 * 2
    w[:64] = hid[:64] / h ** 0.5 * 3  # peaked rows
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::11] = -100
    return hid.to(dtype), w.to(dtype), y


def call(h, w, y, v, **kw):
    return linear_logprobs_entropy(h, w, y, vocab_size=v, return_stats=True, **kw)


def diff(a, b, rows=None) -> int:
    n = 0
    for f in FIELDS:
        x, z = getattr(a, f), getattr(b, f)
        z = z if rows is None else z[rows]
        n += int((x != z).sum())
    return n


def tp_emulated(h, w, y, v, tp, invariant, dtype):
    """Outputs of TP degree tp on one GPU: megatron pads the vocabulary to 128·tp; each shard's backend
    forward; max / int64 sums across shards (what the all-reduces compute). Returns (lp, ent, lse)."""
    step = 128 * tp
    vp = -(-v // step) * step
    junk = torch.randn(vp - w.shape[0], w.shape[1], device="cuda", dtype=torch.float32).to(dtype) * 30
    wp = torch.cat([w, junk])
    shard = vp // tp
    be = get_backend("triton")
    sts = []
    for r in range(tp):
        p = LCEParams(inv_t=1.0, vocab_size=v, vocab_start=r * shard, shard_valid=max(0, min(shard, v - r * shard)),
                      backend=be, compact_ignored=False, invariant=invariant)
        sts.append((p, be.forward(h, wp[r * shard:(r + 1) * shard], y, None, p, keep_cache=False)))
    mx = torch.stack([s.mx for _, s in sts]).amax(0)
    mn = torch.stack([s.mn for _, s in sts]).amin(0)
    if invariant:
        packed = sum(exact.pack(be.fold_segments(s.seg, mx, 1.0, None), s.zy) for _, s in sts)
        fin = be.finish_folded(*exact.unpack(packed), mx, mn, 1.0, None)
        return fin.lp, fin.ent, fin.lse
    # the online merge, shards summed in rank order as a ring all-reduce might
    big_m = mx
    s_tot = a_tot = zy = 0
    for _, s in sts:
        empty = s.s == 0
        shift = torch.where(empty, torch.zeros_like(s.m), s.m - big_m)
        sc = torch.exp(shift)
        s_tot = s_tot + s.s * sc
        a_tot = a_tot + torch.where(empty, torch.zeros_like(s.a), (s.a + shift * s.s) * sc)
        zy = zy + s.zy
    log_s = torch.log(s_tot)
    lse = big_m + log_s
    return zy - lse, log_s - a_tot / s_tot, lse


def checks(name, n, h, v, dtype, invariant, rows_6000=True) -> dict:
    hid, w, y = inputs(n, h, v, dtype)
    kw = dict(invariant=invariant)
    full = call(hid, w, y, v, **kw)
    res = {}
    for label, rows in (("row_alone", [1]), ("rows_7", list(range(100, 107))), ("slice_357", list(range(999, 1356))),
                        ("first_6000", list(range(6000)) if rows_6000 and n > 6000 else None)):
        if rows is None:
            continue
        idx = torch.tensor(rows, device="cuda")
        res[label] = diff(call(hid[idx], w, y[idx], v, **kw), full, idx)
    perm = torch.randperm(n, device="cuda")
    res["permutation"] = diff(call(hid[perm], w, y[perm], v, **kw), full, perm)
    y2 = y.clone()
    y2[1::7] = -100
    keep = (y2 != -100).nonzero().squeeze(1)
    o2 = call(hid, w, y2, v, **kw)
    res["more_ignored"] = sum(int((getattr(o2, f)[keep] != getattr(full, f)[keep]).sum()) for f in FIELDS)
    res["compact_ignored"] = diff(call(hid, w, y, v, compact_ignored=True, **kw), full)
    res["cache_auto"] = diff(call(hid, w, y, v, cache_bytes="auto", **kw), full)
    wp = torch.cat([w, torch.randn(128, h, device="cuda").to(dtype) * 30])
    res["padding_rows"] = diff(call(hid, wp, y, v, **kw), full)
    half = call(hid, w, y, v, temperature=0.5, **kw)
    res["per_token_temperature"] = diff(call(hid, w, y, v, temperature=torch.full_like(y, 2, dtype=torch.float32) / 4,
                                             **kw), half)
    # CUDA graph replay of the forward
    static_h, static_y = hid.clone(), y.clone()
    call(static_h, w, static_y, v, **kw)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        g_out = call(static_h, w, static_y, v, **kw)
    gr.replay()
    torch.cuda.synchronize()
    res["cuda_graph_replay"] = diff(g_out, full)
    comp = torch.compile(lambda a, b, c: call(a, b, c, v, **kw), fullgraph=True)
    res["torch_compile"] = diff(comp(hid, w, y), full)
    lp1, ent1, lse1 = tp_emulated(hid, w, y, v, 1, invariant, dtype)
    for tp in (2, 4, 8):
        lp, ent, lse = tp_emulated(hid, w, y, v, tp, invariant, dtype)
        valid = y != -100
        res[f"tp{tp}_vs_tp1"] = int(((lp != lp1) & valid).sum() + ((ent != ent1) & valid).sum()
                                    + ((lse != lse1) & valid).sum())
    ref_rows = torch.arange(0, n, max(1, n // 256), device="cuda")[:256]
    yr = y[ref_rows].clamp(min=0)
    z = torch.log_softmax(hid[ref_rows].double() @ w.double().t(), -1)
    ref_lp = z.gather(1, yr[:, None]).squeeze(1)
    ref_ent = -(z.exp() * z).sum(-1)
    o = call(hid[ref_rows], w, yr, v, **kw)
    res["max_abs_logprob_err_vs_fp64"] = float((o.logprobs.double() - ref_lp).abs().max())
    res["max_abs_entropy_err_vs_fp64"] = float((o.entropy.double() - ref_ent).abs().max())
    log(f"{name} {dtype} invariant={invariant}: {res}")
    return res


def timed(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def stream_timed(fn, calls):
    """ms per call of `calls` calls issued back to back between one pair of events, with no synchronisation
    between them: the host runs ahead as it does inside a training step, so this is the GPU's time for the
    calls unless the host falls behind (timed() syncs before each call, so its times also hold the host's
    time from the call to its first kernel)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


def cost(name, n, h, v, rounds) -> dict:
    hid, w, y = inputs(n, h, v)
    hid.requires_grad_()
    w.requires_grad_()
    variants = {"default": dict(invariant=False), "invariant": dict(invariant=True),
                "invariant_bf16": dict(invariant=True, logits_precision="bf16"),
                "default_bf16": dict(invariant=False, logits_precision="bf16")}

    def fwd(kw):
        with torch.no_grad():
            linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)

    def fwd_bwd(kw):
        hid.grad = w.grad = None
        o = linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
        (o.logprobs.sum() + 0.01 * o.entropy.sum()).backward()

    out = {}
    for mode, fn, reps in (("forward", fwd, 20), ("fwd_bwd", fwd_bwd, 8)):
        times = {k: [] for k in variants}
        for r in range(rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(list(variants)))
            for k in order:
                times[k].append(timed(lambda: fn(variants[k]), reps))
        row = {k: statistics.median(t) for k, t in times.items()}
        for k in ("invariant", "invariant_bf16", "default_bf16"):
            ratios = [a / b for a, b in zip(times[k], times["default"])]
            row[f"{k}_ratio_median"] = statistics.median(ratios)
            row[f"{k}_ratio_min"], row[f"{k}_ratio_max"] = min(ratios), max(ratios)
        out[mode] = row
        log(f"{name} {mode}: " + ", ".join(f"{k}={x:.3f}" for k, x in row.items()))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small,qwen7b,llama8b,wide_n")
    ap.add_argument("--check-shapes", default="small,qwen7b")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"meta": run_meta(torch.device("cuda")), "checks": {}, "cost": {}}
    for name, (n, h, v) in parse_shapes(args.check_shapes, SHAPES):
        for dtype in (torch.bfloat16, torch.float32):
            if dtype == torch.float32 and n * h > 4096 * 1024:
                n = 2048
            for inv in (True, False):
                result["checks"][f"{name}_{str(dtype)[6:]}_{'invariant' if inv else 'default'}"] = \
                    checks(name, n, h, v, dtype, inv)
        write_json(args.out, "bench_invariant", result)
    if not args.skip_cost:
        for name, (n, h, v) in parse_shapes(args.shapes, SHAPES):
            result["cost"][name] = cost(name, n, h, v, args.rounds)
            write_json(args.out, "bench_invariant", result)
    failed = {k: {c: x for c, x in r.items() if not c.startswith("max_abs") and x} for k, r in result["checks"].items()
              if k.endswith("_invariant")}
    failed = {k: r for k, r in failed.items() if r}
    log("INVARIANT CHECKS: " + ("all bitwise equal" if not failed else f"FAILED {failed}"))
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
