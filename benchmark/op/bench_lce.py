"""Fused linear logprobs + entropy: areal_lce against torch and the peers, side by side, on one GPU.

    python -m benchmark.op.bench_lce --shapes small,qwen7b --providers all [--out DIR]
    python -m benchmark.op.bench_lce --shapes qwen7b --sweep        # tile sweep of the Triton kernels
    python -m benchmark.op.bench_lce --shapes qwen7b --chunks 3584,8448   # backward GEMMs per chunk width
    python -m benchmark.op.bench_lce --merge A/bench_lce.json,B/bench_lce.json --out DIR   # no GPU needed
    TRITON_INTERPRET=1 python -m benchmark.op.bench_lce --device cpu --shapes 64x32x512 --rep 1   # smoke run

Shapes: small, qwen7b, llama8b, wide_n (SHAPES below) or NxHxV. Providers (benchmark/op/lce_providers.py):
areal_triton, areal_triton_cache, areal_triton_nochecks, areal_torch, torch_eager, torch_compile,
liger, cce, verl, or all. What is measured per provider and shape (benchmark/op/lce_run.py): forward and
fwd+bwd time (do_bench median, p20/p80), peak extra memory, accuracy against an exact fp32 reference;
per shape the cuBLAS floors (fwd, 8NHV, 6NHV: formulas in benchmark/harness.py) and the Triton
backend's breakdown.

Writes bench_lce.json, bench_lce.csv and bench_lce.png under --out, stamped with device, versions
and git sha (benchmark/op/lce_report.py); prints a table with ratios to the floors and to the targets
(targets are not asserted). --sweep writes sweep.json, --chunks chunks.json. --device cpu runs the
same measurement path on CPU tensors (host-timed, no memory figures; the Triton providers need
TRITON_INTERPRET=1): a check of the script, not a benchmark.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from ..harness import log, parse_shapes, run_meta, write_json
from .lce_providers import PROVIDERS, load_providers
from .lce_report import merge, print_table, write_outputs
from .lce_run import chunk_gemms, run_shape, sweep

SHAPES = {
    "small": (4096, 896, 151936),
    "qwen7b": (8192, 4096, 151936),
    "llama8b": (16384, 4096, 128256),
    "wide_n": (32768, 2048, 151936),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small,qwen7b,llama8b,wide_n")
    ap.add_argument("--providers", default="all")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--rep", type=int, default=400, help="do_bench rep (ms) per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (forward GEMM, provider) per time: the "
                    "ratios to the floors are medians of per-round ratios (1: one measurement over the shape's "
                    "floors)")
    ap.add_argument("--peers-script", default=os.environ.get("PEERS_SCRIPT", "/work/shared/peers/bench_peers.py"))
    ap.add_argument("--sweep", action="store_true", help="tile sweep of the Triton kernels instead")
    ap.add_argument("--merge", default="", help="comma list of bench_lce.json files: write one combined "
                    "CSV/PNG and print a markdown table (no GPU needed)")
    ap.add_argument("--chunks", default="", help="comma list of backward chunk widths: time the GEMMs only")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of the measurement path (its times are not benchmarks)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge.split(","), args.out)
    shapes = parse_shapes(args.shapes, SHAPES)
    names = PROVIDERS if args.providers == "all" else args.providers.split(",")
    if not set(names) <= set(PROVIDERS):
        raise SystemExit(f"--providers: unknown {sorted(set(names) - set(PROVIDERS))}; choose from {PROVIDERS} or all")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_lce: needs a CUDA device (or --device cpu for a smoke run)")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    m = run_meta(args.device)
    if args.chunks:
        rows = chunk_gemms(shapes, [int(x) for x in args.chunks.split(",")], args)
        write_json(args.out, "chunks.json", {"meta": m, "rows": rows})
        return 0
    if args.sweep:
        rows = sweep(shapes, args)
        write_json(args.out, "sweep.json", {"meta": m, "rows": rows})
        return 0
    providers, versions = load_providers(names, args.peers_script)
    m["peer_versions"] = versions
    log("meta", m)
    results = []
    for name, shape in shapes:
        results.append(run_shape(name, shape, providers, args))
        write_outputs(results, args.out, m)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
