"""Tensor-parallel scaling of the fused op: per-rank forward+backward time, peak memory and collective time.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=1 benchmark/op/bench_tp.py --tp 1 --out DIR
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmark/op/bench_tp.py --tp 2 --out DIR
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=4 benchmark/op/bench_tp.py --tp 4 --out DIR
    python benchmark/op/bench_tp.py --summarize DIR          # TP=1/2/4 table, ratios vs TP=1, targets
    torchrun --nproc_per_node=2 benchmark/op/bench_tp.py --tp 2 --shapes tiny --out DIR   # CPU/gloo smoke run

The same *global* problem at every TP size: N tokens, hidden H, vocabulary V (bf16). Rank r holds the
weight rows [r·V/tp, (r+1)·V/tp); without sequence parallel every rank holds all N hidden rows, with
`--sp` its N/tp rows. One step = `linear_logprobs_entropy` forward + backward of
sum(g_lp·logprobs + g_ent·entropy) with random upstream grads, d_hidden and d_weight both needed.

Per-rank time: each rep starts after a barrier and a device sync and ends at a device sync; a rank's
time is the median (p20, p80) over reps and the step time is the slowest rank's median. Ideal scaling
is 1/tp of TP=1 plus the collectives; the targets (printed, not asserted) are TP=2 ≤ 0.55× and
TP=4 ≤ 0.30× of TP=1. Floor: the fused op costs 8·N·H·V/tp FLOPs per rank (forward GEMM, recompute,
d_hidden and d_weight GEMMs), so floor_ms = 8·N·H·(V/tp) / peak_flops (--peak-tflops, default 700, the
measured bf16 cuBLAS rate of one H100; pass the rate of your device).

Collective time is measured two ways: (1) the same collectives the op issues for that shape, run alone
through `areal_lce.op.comms` in the same order and sizes (the API's shard-size check, MAX [2, N], SUM
[3, N], all-reduce or reduce-scatter of fp32 d_hidden [N, H], SP all-gather of hidden rows); (2) on
CUDA, torch.profiler's device time of NCCL kernels inside one profiled step ("in op"; kernels that
overlap compute count in full). Peak memory is torch.cuda.max_memory_allocated during a step, absolute
and above what was allocated before it (inputs and parameters are not in the latter).

Writes DIR/bench_tp_tp{K}.json stamped with device, versions, git sha and the command line.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import areal_lce  # noqa: F401
    import benchmark.harness  # noqa: F401
except ImportError:  # run as `benchmark/op/bench_tp.py` from a checkout: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import areal_lce  # noqa: E402
from areal_lce import VocabParallel, linear_logprobs_entropy
from areal_lce.op import comms  # noqa: E402
from benchmark.harness import PeakMemory, percentiles, run_meta, sync, write_json  # noqa: E402

SHAPES = {  # name -> list of global (N, H, V)
    "default": [(8192, 4096, 151936), (32768, 2048, 151936)],
    "tiny": [(256, 64, 4096), (512, 32, 8192)],
}
TARGETS = {2: 0.55, 4: 0.30}  # per-rank step time / TP=1 step time


def time_reps(fn, warmup: int, reps: int, device, group) -> list[float]:
    """Seconds per call of fn on this rank, each rep aligned across ranks by a barrier."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def gather_floats(values: list[float], group, device) -> list[list[float]]:
    """Every rank's list of floats (same length on all ranks), in rank order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    t = torch.zeros(world, len(values), dtype=torch.float64, device=device)
    t[rank] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)  # SUM of one-hot rows = gather
    return t.tolist()


class Step:
    """One forward+backward of the op on this rank's shard, inputs rotated over a few copies."""

    def __init__(self, n, h, v, tp, rank, sp, dtype, backend, device, group, copies=2, seed=0):
        g = torch.Generator(device=device).manual_seed(seed + rank)  # on device: GiB-sized weights
        n_local = n // tp if sp else n
        v_shard = v // tp
        self.hiddens = [torch.randn(n_local, h, generator=g, device=device).to(dtype).requires_grad_()
                        for _ in range(copies)]
        self.weight = (torch.randn(v_shard, h, generator=g, device=device) * 0.02).to(dtype).requires_grad_()
        # labels and upstream grads are replicated: same seed on every rank
        g0 = torch.Generator(device="cpu").manual_seed(seed)
        self.labels = torch.randint(0, v, (n,), generator=g0).to(device)
        self.g_lp = torch.randn(n, generator=g0).to(device)
        self.g_ent = torch.randn(n, generator=g0).to(device)
        self.sp, self.backend, self.group, self.i = sp, backend, group, 0

    def __call__(self):
        h = self.hiddens[self.i % len(self.hiddens)]
        self.i += 1
        h.grad = None
        self.weight.grad = None
        vp = VocabParallel(self.group, "reduce_scatter" if self.sp else "all_reduce")
        out = linear_logprobs_entropy(h, self.weight, self.labels, backend=self.backend, vocab_parallel=vp)
        (out.logprobs * self.g_lp + out.entropy * self.g_ent).sum().backward()


class CommsOnly:
    """The collectives one step issues, alone, with the step's sizes and dtypes (see areal_lce.op.function)."""

    def __init__(self, n, h, tp, sp, dtype, device, group, v_shard):
        self.n, self.sp, self.group, self.v_shard = n, sp, group, v_shard
        self.h_local = torch.randn(n // tp if sp else n, h, device=device).to(dtype)
        self.mm = torch.randn(2, n, device=device)
        self.packed = torch.randn(3, n, device=device)
        self.dh = torch.randn(n, h, device=device)  # fp32: the op reduces d_hidden in fp32

    def parts(self):
        p = {"shape_check": lambda: comms.check_same_across_group(self.v_shard, self.group, "bench"),
             "fwd_max": lambda: comms.all_reduce_max_(self.mm, self.group),
             "fwd_sum": lambda: comms.all_reduce_sum_(self.packed, self.group)}
        if self.sp:
            p["fwd_all_gather"] = lambda: comms.all_gather_rows(self.h_local, self.group)
            p["bwd_reduce_scatter"] = lambda: comms.reduce_scatter_rows(self.dh, self.group)
        else:
            p["bwd_all_reduce_dh"] = lambda: comms.all_reduce_sum_(self.dh, self.group)
        return p


def nccl_time_in_step(step, device) -> float:
    """ms of NCCL kernels (device time) in one profiled step on this rank; NaN when unavailable."""
    if device.type != "cuda":
        return float("nan")
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync(device)
        total = 0.0
        for ev in prof.key_averages():
            if "nccl" in ev.key.lower():
                # self time: kernels count once, CPU-side wrappers (if recorded) add 0
                total += getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        return total / 1e3  # us -> ms
    except Exception as e:  # the profiler is a nice-to-have: never lose the timing run to it
        print(f"[bench_tp] profiler unavailable: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return float("nan")


def bench_shape(n, h, v, sp, args, device, group) -> dict:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    row = dict(shape=f"{n}x{h}x{v}", n=n, h=h, v=v, tp=tp, sp=sp, dtype=args.dtype, backend=args.backend)
    if v % tp or (sp and n % tp):
        return {**row, "error": f"V={v} (and N={n} under SP) must be divisible by tp={tp}"}
    step = Step(n, h, v, tp, rank, sp, dtype, args.backend, device, group)
    step()  # compiles / autotunes kernels outside the memory and time measurements
    sync(device)
    peak = [float("nan"), float("nan")]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        sync(device)
        with PeakMemory(device) as pm:
            step()
        peak = [pm.peak_gib, pm.extra_gib]
    else:
        step()
    times = time_reps(step, args.warmup, args.reps, device, group)
    comm_only = CommsOnly(n, h, tp, sp, dtype, device, group, v // tp)
    comm_parts = {k: time_reps(fn, args.warmup, args.reps, device, group) for k, fn in comm_only.parts().items()}
    in_op = nccl_time_in_step(step, device) if args.profile else float("nan")
    del step, comm_only

    med, p20, p80 = percentiles(times)
    local = [med, p20, p80, peak[0], peak[1], in_op] + [statistics.median(t) for t in comm_parts.values()]
    per_rank = gather_floats(local, group, device)
    ms = lambda s: round(s * 1e3, 4)  # noqa: E731
    slow = max(range(tp), key=lambda r: per_rank[r][0])
    flops = 8.0 * n * h * (v // tp)
    step_ms = ms(per_rank[slow][0])
    comm = {k: ms(max(r[6 + i] for r in per_rank)) for i, k in enumerate(comm_parts)}
    return {
        **row,
        "step_ms": step_ms, "step_p20_ms": ms(per_rank[slow][1]), "step_p80_ms": ms(per_rank[slow][2]),
        "per_rank_ms": [ms(r[0]) for r in per_rank],
        "peak_mem_gib": _num(max(r[3] for r in per_rank)), "peak_mem_above_inputs_gib": _num(max(r[4] for r in per_rank)),
        "comm_ms": comm, "comm_total_ms": round(sum(comm.values()), 4),
        "comm_in_op_ms": _num(max(r[5] for r in per_rank), 4),
        "floor_ms": round(flops / (args.peak_tflops * 1e12) * 1e3, 4),
        "tflops_per_rank": round(flops / (step_ms * 1e-3) / 1e12, 2) if step_ms > 0 else None,
    }


def _num(x, nd=3):
    return None if x != x else round(x, nd)


def _meta(device, group) -> dict:
    return run_meta(device, device_count=torch.cuda.device_count() if device.type == "cuda" else 0,
                    dist_backend=dist.get_backend(group), world_size=dist.get_world_size(group),
                    areal_lce=areal_lce.__version__, nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                    host=platform.node())


def _row_text(r: dict, ratio: str = "", target: str = "") -> str:
    if "error" in r:
        return f"{r['shape']:<20} {'on' if r['sp'] else 'off':<3} {r['tp']:>2}  error: {r['error']}"
    mem = "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.2f}"
    in_op = "-" if r.get("comm_in_op_ms") is None else f"{r['comm_in_op_ms']:.2f}"
    return (f"{r['shape']:<20} {'on' if r['sp'] else 'off':<3} {r['tp']:>2} {r['step_ms']:>9.2f} "
            f"{r['step_p20_ms']:>8.2f} {r['step_p80_ms']:>8.2f} {r['floor_ms']:>8.2f} {r['comm_total_ms']:>8.2f} "
            f"{in_op:>7} {mem:>8} {ratio:>6} {target:>11}")


HEADER = (f"{'shape NxHxV':<20} {'sp':<3} {'tp':>2} {'step_ms':>9} {'p20':>8} {'p80':>8} {'floor':>8} "
          f"{'comm_ms':>8} {'in_op':>7} {'peak_GiB':>8} {'ratio':>6} {'target':>11}")


def summarize(directory: str) -> int:
    files = sorted(glob.glob(os.path.join(directory, "bench_tp_tp*.json")))
    if not files:
        print(f"no bench_tp_tp*.json in {directory}", file=sys.stderr)
        return 1
    runs = [json.load(open(f)) for f in files]
    devices = {r["meta"]["device"] for r in runs}
    print(f"device(s): {', '.join(sorted(devices))}; files: {', '.join(os.path.basename(f) for f in files)}")
    if len(devices) > 1:
        print("WARNING: the runs come from different devices: ratios are not meaningful")
    rows = [row for run in runs for row in run["results"]]
    base = {(r["shape"], r["dtype"], r["backend"]): r for r in rows if r["tp"] == 1 and "error" not in r}
    print(HEADER)
    print("-" * len(HEADER))
    summary = []
    for r in sorted(rows, key=lambda r: (r["shape"], r["sp"], r["tp"])):
        b = base.get((r["shape"], r["dtype"], r["backend"]))
        ratio = target = ""
        entry = {k: r.get(k) for k in ("shape", "sp", "tp", "step_ms", "comm_total_ms", "peak_mem_gib")}
        if b is not None and "error" not in r:
            x = r["step_ms"] / b["step_ms"]
            ratio = f"{x:.3f}"
            entry["ratio_vs_tp1"] = round(x, 4)
            if r["tp"] in TARGETS:
                t = TARGETS[r["tp"]]
                target = f"{'ok' if x <= t else 'MISS'} <={t:.2f}"
                entry.update(target=t, meets_target=x <= t)
        print(_row_text(r, ratio, target))
        summary.append(entry)
    print("targets (per-rank step / TP=1 step): " + ", ".join(f"TP={k} <= {v}" for k, v in TARGETS.items())
          + "; ratio uses the TP=1 run without SP as the base")
    out = os.path.join(directory, "summary.json")
    with open(out, "w") as f:
        json.dump({"devices": sorted(devices), "targets": TARGETS, "rows": summary}, f, indent=1)
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, help="expected world size (must equal torchrun's --nproc_per_node)")
    ap.add_argument("--out", help="directory for bench_tp_tp{K}.json")
    ap.add_argument("--summarize", metavar="DIR", help="merge DIR/bench_tp_tp*.json into a table and exit")
    ap.add_argument("--shapes", default="default",
                    help=f"{'|'.join(SHAPES)} or a comma list of NxHxV (global shapes), e.g. 4096x4096x151936")
    ap.add_argument("--sp", default="both", choices=["off", "on", "both"],
                    help="sequence parallel runs at tp > 1 (TP=1 always runs without)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--backend", default="auto", help="op backend (auto: triton on CUDA, torch on CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=700.0, help="device GEMM rate for the floor")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled NCCL time")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if not args.out or not args.tp:
        ap.error("--tp and --out are required (or --summarize DIR)")

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_torchelastic_launched() and "RANK" not in os.environ:  # plain `python bench_tp.py --tp 1`
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 1000))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=600))
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp != args.tp:
        raise SystemExit(f"--tp {args.tp} but the launch has {tp} ranks: use torchrun --nproc_per_node={args.tp}")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if args.backend == "auto":
        args.backend = "triton" if use_cuda else "torch"
    if args.shapes in SHAPES:
        shapes = SHAPES[args.shapes]
    else:
        try:
            shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
            assert all(len(s) == 3 for s in shapes)
        except (ValueError, AssertionError):
            raise SystemExit(f"--shapes {args.shapes!r}: use {'|'.join(SHAPES)} or NxHxV[,NxHxV...]")
    sps = {"off": [False], "on": [True], "both": [False, True]}[args.sp] if tp > 1 else [False]
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    meta = _meta(device, group)
    say(f"bench_tp: tp={tp} device={meta['device']} dist={meta['dist_backend']} backend={args.backend} "
        f"dtype={args.dtype} reps={args.reps} git={meta['git_sha']}")
    say(HEADER)
    say("-" * len(HEADER))
    results = []
    for n, h, v in shapes:
        for sp in sps:
            try:
                r = bench_shape(n, h, v, sp, args, device, group)
            except torch.cuda.OutOfMemoryError as e:  # same shapes on every rank: all ranks land here
                r = dict(shape=f"{n}x{h}x{v}", n=n, h=h, v=v, tp=tp, sp=sp, dtype=args.dtype, backend=args.backend,
                         error=f"out of memory: {str(e).splitlines()[0]}")
                torch.cuda.empty_cache()
            results.append(r)
            say(_row_text(r))
            if rank == 0 and "comm_ms" in r:
                say("    comm alone (ms, slowest rank): " + ", ".join(f"{k} {x:.3f}" for k, x in r["comm_ms"].items()))
    if rank == 0:
        path = write_json(args.out, f"bench_tp_tp{tp}.json", {"meta": meta, "results": results})
        say(f"wrote {path}")
        prior = os.path.join(args.out, "bench_tp_tp1.json")
        if tp > 1 and os.path.exists(prior):
            say("")
            summarize(args.out)
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
