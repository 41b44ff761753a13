"""Invariant mode across TP degrees on real NCCL: TP=1 vs TP=2 bitwise, and its cost at TP=2.

    torchrun --nproc_per_node=2 torchrun/run_invariant_tp2.py --out DIR [--extras] [--softcap C] [--no-cost]

Every rank builds the same inputs (seeded), computes TP=1 with the whole weight (the vocabulary padded
to a multiple of 128, as megatron pads it at TP=1) on its own GPU, then the same tokens at TP=2 over
NCCL (the vocabulary padded to 128·2 with garbage rows, each rank its shard; SP off: the whole hidden on
each rank; SP on: each rank its half of the rows), and counts the values that are not bitwise equal,
with invariant=True (the default) and invariant=False. Shapes: 4096x896 and 6000x4096 (bf16), 2048x896
(fp32), V = 151936. Then forward+backward at TP=2, invariant vs invariant=False, paired alternating
rounds. Rank 0 writes run_invariant_tp2.json. --extras adds 16 selected ids per row and top_k=8 to every
call (their outputs join the compared fields); --softcap C runs the calls soft-capped.
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from areal_lce import VocabParallel, linear_logprobs_entropy

V = 151936
FIELDS = ("logprobs", "entropy", "max_logit", "min_logit", "lse")
EXTRA_FIELDS = ("selected_logprobs", "topk_ids", "topk_logprobs")
OPTS: dict = {}  # --extras / --softcap: options of every call


def selected(y, dev):
    g = torch.Generator(device=dev).manual_seed(5)
    s = torch.randint(0, V, (y.shape[0], 16), device=dev, generator=g)
    s[:, 0] = y.clamp_min(0)
    s[:, 1] = padded(2) // 2 - 1  # the two sides of the TP=2 shard edge
    s[:, 2] = padded(2) // 2
    return s


def padded(tp):
    step = 128 * tp
    return -(-V // step) * step


def inputs(n, h, dtype, tp, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(n, h, device=dev, generator=g)
    w = torch.randn(V, h, device=dev, generator=g) / h ** 0.5 * 2
    w[:64] = hid[:64] / h ** 0.5 * 3
    y = torch.randint(0, V, (n,), device=dev, generator=g)
    y[::13] = -100
    y[1:5] = torch.tensor([padded(2) // 2 - 1, padded(2) // 2, 0, V - 1], device=dev)  # shard edges
    junk = torch.randn(padded(tp) - V, h, device=dev, generator=torch.Generator(device=dev).manual_seed(9 + tp)) * 30
    return hid.to(dtype), torch.cat([w, junk]).to(dtype), y


def call(n, h, dtype, tp, sp, invariant, rank, group):
    dev = torch.device("cuda", torch.cuda.current_device())
    hid, w, y = inputs(n, h, dtype, tp, dev)
    kw = dict(vocab_size=V, return_stats=True, invariant=invariant, softcap=OPTS.get("softcap"))
    if OPTS.get("extras"):
        kw.update(selected_ids=selected(y, dev), top_k=8)
    if tp == 1:
        return linear_logprobs_entropy(hid, w, y, **kw)
    shard = w.shape[0] // tp
    w_r = w[rank * shard:(rank + 1) * shard]
    if sp:
        rows = n // tp
        return linear_logprobs_entropy(hid[rank * rows:(rank + 1) * rows], w_r, y,
                                       vocab_parallel=VocabParallel(group, d_hidden="reduce_scatter"), **kw)
    return linear_logprobs_entropy(hid, w_r, y, vocab_parallel=VocabParallel(group), **kw)


def cost(n, h, rank, group, rounds=5, reps=8):
    dev = torch.device("cuda", torch.cuda.current_device())
    hid, w, y = inputs(n, h, torch.bfloat16, 2, dev)
    shard = w.shape[0] // 2
    w_r = w[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    hid.requires_grad_()
    times = {True: [], False: []}

    def step(inv):
        hid.grad = w_r.grad = None
        o = linear_logprobs_entropy(hid, w_r, y, vocab_size=V, vocab_parallel=VocabParallel(group), invariant=inv)
        (o.logprobs.sum() + 0.01 * o.entropy.sum()).backward()

    for r in range(rounds):
        for inv in ((True, False) if r % 2 == 0 else (False, True)):
            for _ in range(2):
                step(inv)
            ts = []
            for _ in range(reps):
                dist.barrier(group)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step(inv)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            times[inv].append(statistics.median(ts))
    ratios = [a / b for a, b in zip(times[True], times[False])]
    return dict(invariant_ms=statistics.median(times[True]), default_ms=statistics.median(times[False]),
                ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--extras", action="store_true")
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--no-cost", action="store_true")
    args = ap.parse_args()
    OPTS.update(extras=args.extras, softcap=args.softcap)
    fields = FIELDS + (EXTRA_FIELDS if args.extras else ())
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": {}, "cost": {}}
    for n, h, dtype in ((4096, 896, torch.bfloat16), (6000, 4096, torch.bfloat16), (2048, 896, torch.float32)):
        for inv in (True, False):
            ref = call(n, h, dtype, 1, False, inv, rank, group)
            for sp in (False, True):
                got = call(n, h, dtype, 2, sp, inv, rank, group)
                key = f"{n}x{h}_{str(dtype)[6:]}_sp{int(sp)}_{'invariant' if inv else 'default'}"
                res["checks"][key] = {f: int((getattr(got, f) != getattr(ref, f)).sum()) for f in fields}
                if rank == 0:
                    print(key, res["checks"][key], flush=True)
    # a 357-row slice at TP=2 against the same rows of the 6000-row call at TP=2
    dev = torch.device("cuda", torch.cuda.current_device())
    hid, w, y = inputs(6000, 4096, torch.bfloat16, 2, dev)
    shard = w.shape[0] // 2
    vp = VocabParallel(group)
    full = linear_logprobs_entropy(hid, w[rank * shard:(rank + 1) * shard], y, vocab_size=V, vocab_parallel=vp)
    part = linear_logprobs_entropy(hid[999:1356], w[rank * shard:(rank + 1) * shard], y[999:1356], vocab_size=V,
                                   vocab_parallel=vp)
    res["checks"]["slice_357_of_6000_tp2"] = {"logprobs": int((part.logprobs != full.logprobs[999:1356]).sum()),
                                              "entropy": int((part.entropy != full.entropy[999:1356]).sum())}
    for n, h in (() if args.no_cost else ((8192, 4096), (32768, 2048))):
        res["cost"][f"{n}x{h}x{V}"] = cost(n, h, rank, group)
        if rank == 0:
            print(f"{n}x{h}", res["cost"][f"{n}x{h}x{V}"], flush=True)
    bad = {k: v for k, v in res["checks"].items() if ("default" not in k) and any(v.values())}
    res["invariant_all_equal"] = not bad
    if rank == 0:
        print("INVARIANT TP=1 vs TP=2:", "all bitwise equal" if not bad else f"FAILED {bad}", flush=True)
        name = "run_invariant_tp2" + ("_extras" if args.extras else "") + ("_softcap" if args.softcap else "")
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
