"""Where an engine call spends its time: device syncs by call site, the top operators by self CPU time, and
the GPU time by kernel kind, kernel and operator (with input shapes).

    python -m benchmark.engine.prof_engine --preset qwen2.5-0.5b --out DIR        # CUDA
    python -m benchmark.engine.prof_engine --route megatron_fusedce --calls sft --model-graphs off --out DIR
    python -m benchmark.engine.prof_engine --preset tiny --seq 64 --out DIR       # CPU smoke run (no sync report)

Two calls of the 0.5B-shaped engine of --route (default fused, engine.lce as shipped; with --materialised,
the logprob call on the materialised route too), each after two warm-up calls: a logprob pass
(`token_stats` on `--lp-batch` sequences of `--lp-seq` tokens, as a GRPO step's behaviour pass runs it)
and an SFT `train_step` (`--micro-batches` of `--micro-batch` x `--seq`). For each: wall time, GPU
kernel time (profiler), kernel launches, and under `torch.cuda.set_sync_debug_mode("warn")` every
synchronizing call with the stack that made it (counted by stack). Writes prof_engine.json
(prof_engine_<route>.json for another route) and prof_<call>.txt (the profiler's table) under --out.
"""
from __future__ import annotations

import argparse
import collections
import os
import time
import traceback
import warnings

import torch

from ..harness import clean, run_meta, sync, write_json
from .bench_train import SFT_ROUTES, _batches, _engine, sft_loss


def _syncs(fn) -> list:
    """[(count, stack)] of the synchronizing CUDA calls `fn` makes."""
    if not torch.cuda.is_available():
        fn()
        return []
    stacks = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return  # another warning (megatron's deprecations, say)
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        stacks["".join(traceback.format_list(frames[-10:]))] += 1

    old_show = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old_show
    return [(count, stack) for stack, count in stacks.most_common()]


def _profile(name: str, fn, out_dir: str) -> dict:
    for _ in range(2):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    wall = time.perf_counter() - t0
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                     if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        fn()
        sync()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
    device = torch.autograd.DeviceType.CUDA  # kernels only: the ops that launch them repeat their time
    gpu_ms = sum(e.self_device_time_total for e in events
                 if e.device_type == device and not getattr(e, "is_user_annotation", False)) / 1e3
    table = events.table(sort_by="self_cpu_time_total", row_limit=30)
    with open(f"{out_dir}/prof_{name}.txt", "w") as f:
        f.write(table)
    syncs = _syncs(fn)
    print(f"=== {name}: wall {wall * 1e3:.1f} ms, GPU kernels {gpu_ms:.1f} ms, {launches} launches, "
          f"{sum(c for c, _ in syncs)} syncs", flush=True)
    for count, stack in syncs[:6]:
        print(f"--- {count}x\n{stack}", flush=True)
    return {"wall_ms": wall * 1e3, "gpu_kernel_ms": gpu_ms, "launches": launches,
            "syncs": [{"count": c, "stack": s} for c, s in syncs], **_device_time(prof, events)}


KERNEL_KINDS = (  # kernel name -> kind, first match (lower case); the rest is "other" (elementwise, reductions)
    ("lce_", "areal_lce head (Triton)"), ("nvjet", "GEMM"), ("gemm", "GEMM"), ("xmma", "GEMM"),
    ("cutlass", "GEMM"), ("flash", "attention"), ("fmha", "attention"), ("cross_entropy", "cross entropy"),
    ("nccl", "collectives"), ("memcpy", "copies"), ("memset", "copies"))


def _device_time(prof, events, rows: int = 40) -> dict:
    """Where the GPU time went: kernel time per kind (KERNEL_KINDS), the top kernels, and the top operators
    by device time with their input shapes (ops inside a replayed CUDA graph are not seen: only kernels)."""
    device = torch.autograd.DeviceType.CUDA
    kernels = sorted((e for e in events if e.device_type == device and not getattr(e, "is_user_annotation", False)),
                     key=lambda e: -e.self_device_time_total)  # kernels only: no record_function spans
    kinds = collections.Counter()
    for e in kernels:
        name = e.key.lower()
        kinds[next((k for pat, k in KERNEL_KINDS if pat in name), "other")] += e.self_device_time_total / 1e3
    ops = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.device_type != device),
                 key=lambda e: -e.device_time_total)
    return {"kernel_ms_by_kind": dict(kinds.most_common()),
            "top_kernels": [{"name": e.key[:200], "count": e.count, "ms": e.self_device_time_total / 1e3}
                            for e in kernels[:rows]],
            "top_ops": [{"name": e.key[:120], "shapes": str(e.input_shapes)[:240], "count": e.count,
                         "device_ms": e.device_time_total / 1e3, "self_device_ms": e.self_device_time_total / 1e3}
                        for e in ops[:rows] if e.device_time_total > 0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--lp-batch", type=int, default=16)
    ap.add_argument("--lp-seq", type=int, default=272)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--materialised", action="store_true",
                    help="also profile the logprob call on the materialised route (use_fused_linear_ce=false)")
    ap.add_argument("--model-graphs", choices=["auto", "on", "off"], default="auto",
                    help="engine.model_cuda_graphs (auto, the default: the fused engine's calls after the "
                         "warm-ups replay CUDA graphs)")
    ap.add_argument("--route", choices=SFT_ROUTES, default="fused",
                    help="the engine profiled (bench_train's SFT routes; megatron*: the SFT step only, through "
                         "megatron-core's own loss). One route per process: CUDA engines in one process "
                         "share memory pools and graphs")
    ap.add_argument("--calls", default="logprobs,sft", help="comma list of logprobs, sft")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    args.layers, args.vocab, args.tp, args.sp, args.lce_cache_bytes = 0, 0, 1, False, "auto"
    calls = set(args.calls.split(","))
    os.makedirs(args.out, exist_ok=True)
    fused = args.route.startswith("fused")
    eng = _engine(args, fused=fused, route=args.route)
    g = torch.Generator().manual_seed(0)
    v = eng.vocab_size
    ids = torch.randint(0, v, (args.lp_batch, args.lp_seq), generator=g)
    labels = torch.randint(0, v, (args.lp_batch, args.lp_seq), generator=g)
    labels[:, : args.lp_seq // 2] = -100  # the prompt half is not scored
    res = {}
    if "logprobs" in calls and fused:
        res["logprobs"] = _profile("logprobs", lambda: eng.token_stats(ids, labels), args.out)
    if args.materialised and "logprobs" in calls:
        mat = _engine(args, fused=False)
        res["logprobs_materialised"] = _profile("logprobs_materialised", lambda: mat.token_stats(ids, labels),
                                                args.out)
        del mat
        clean()
    if "sft" in calls:
        mbs = _batches(args, v, 0)
        loss = sft_loss(len(mbs), logprobs_only=args.route.startswith("megatron"))
        res["sft_step"] = _profile(f"sft_step_{args.route}", lambda: eng.train_step(mbs, loss), args.out)
    name = "prof_engine.json" if args.route == "fused" else f"prof_engine_{args.route}.json"
    write_json(args.out, name, {"meta": run_meta(args=vars(args)), "results": res})


if __name__ == "__main__":
    main()
