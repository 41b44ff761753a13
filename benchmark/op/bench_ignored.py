"""Ignored rows: the fused op's two ways of keeping them out of the work, on the layouts real batches have.

    python -m benchmark.op.bench_ignored --out DIR                      # the GPU run (H100: about a minute)
    python -m benchmark.op.bench_ignored --device cpu --shapes 256x32x512 --rep 1   # smoke run of the script

`linear_logprobs_entropy(compact_ignored=None)` on Triton keeps the rows in place and skips each 128-row
block without a target inside the kernels; `compact_ignored=True` partitions the rows with a target to the
front on the device (a copy of their hidden states, and of d_hidden back) and the kernels stop after
them. Which costs less depends on where the ignored rows sit, which the engine knows on the host and the
op does not (engine.lce.compact_ignored="auto", megatron/batch.py). Layouts, per shape:

    all          every row has a target (SFT on packed batches)
    rl_P_R       packed sequences of P prompt tokens (no target) and R response tokens (RL logprob
                 passes and updates: the prompts are masked)
    scattered_F  a fraction F of the rows ignored at random (no 128-row block is free of targets)

For each layout and option: forward time (no grad) and fwd+bwd time (loss = -Σ logp - Σ entropy),
do_bench medians, and each over the all-targets time of the same option. Prints compact / in-place per
layout. Writes bench_ignored.json (stamped with device, versions, git sha).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..harness import bench, clean, log, parse_shapes, run_meta, write_json
from .lce_run import make_inputs

SHAPES = {"qwen0.5b": (16384, 896, 151936), "qwen7b": (8192, 4096, 151936)}
LAYOUTS = ("all", "rl_256_16", "rl_128_128", "rl_64_192", "rl_16_240", "scattered_0.25", "scattered_0.5")


def layout_labels(y: torch.Tensor, layout: str, seed: int = 0) -> torch.Tensor:
    """y with ignore_index (-100) where `layout` has no target (module doc)."""
    y = y.clone()
    n = y.numel()
    if layout == "all":
        return y
    if layout.startswith("rl_"):
        p, r = (int(x) for x in layout.split("_")[1:])
        pos = torch.arange(n, device=y.device) % (p + r)
        y[pos < p] = -100
        return y
    if layout.startswith("scattered_"):
        g = torch.Generator(device="cpu").manual_seed(seed)
        drop = torch.rand(n, generator=g) < float(layout.split("_")[1])
        y[drop.to(y.device)] = -100
        return y
    raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")


def run_shape(name: str, shape, layouts, args) -> dict:
    from areal_lce import linear_logprobs_entropy

    N, H, V = shape
    h0, W0, y0 = make_inputs(N, H, V, seed=11, device=args.device)
    h = h0.clone().requires_grad_(True)
    W = W0.clone().requires_grad_(True)
    res = {"shape": name, "N": N, "H": H, "V": V, "layouts": {}}
    for layout in layouts:
        y = layout_labels(y0, layout)
        row = res["layouts"][layout] = {"ignored_share": float((y == -100).float().mean())}
        for opt, compact in (("in_place", None), ("compact", True)):
            def fwd():
                return linear_logprobs_entropy(h0, W0, y, backend=args.backend, compact_ignored=compact)

            def step():
                out = linear_logprobs_entropy(h, W, y, backend=args.backend, compact_ignored=compact)
                (-out.logprobs.sum() - out.entropy.sum()).backward()

            with torch.no_grad():
                row[f"{opt}_fwd_ms"] = bench(fwd, rep=args.rep)["ms"]
            row[f"{opt}_fwdbwd_ms"] = bench(step, rep=args.rep, grad_to_none=[h, W])["ms"]
            h.grad = W.grad = None
            clean()
        for kind in ("fwd", "fwdbwd"):
            row[f"compact_over_in_place_{kind}"] = row[f"compact_{kind}_ms"] / row[f"in_place_{kind}_ms"]
        log(name, layout, {k: round(v, 4) for k, v in row.items()})
    base = res["layouts"].get("all")
    if base:  # each layout's time over the all-targets time of the same option
        for row in res["layouts"].values():
            for opt in ("in_place", "compact"):
                for kind in ("fwd", "fwdbwd"):
                    row[f"{opt}_{kind}_over_all"] = row[f"{opt}_{kind}_ms"] / base[f"{opt}_{kind}_ms"]
    return res


def print_table(results) -> None:
    print("\ncompact_ignored=True over the in-place default (< 1: compaction is faster); in brackets each "
          "option's time over its all-targets time")
    print(f"{'shape':>10} {'layout':>15} {'ignored':>8} {'fwd':>22} {'fwd+bwd':>22}")
    for res in results:
        for layout, r in res["layouts"].items():
            cells = []
            for kind in ("fwd", "fwdbwd"):
                extra = (f" [{r[f'in_place_{kind}_over_all']:.2f}/{r[f'compact_{kind}_over_all']:.2f}]"
                         if f"in_place_{kind}_over_all" in r else "")
                cells.append(f"{r[f'compact_over_in_place_{kind}']:.3f}{extra}")
            print(f"{res['shape']:>10} {layout:>15} {r['ignored_share']:>8.2f} {cells[0]:>22} {cells[1]:>22}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"names ({', '.join(SHAPES)}) or NxHxV")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    for layout in layouts:
        layout_labels(torch.zeros(1, dtype=torch.long), layout)  # a bad name fails before any timing
    results = [run_shape(name, shape, layouts, args) for name, shape in parse_shapes(args.shapes, SHAPES)]
    print_table(results)
    path = write_json(args.out, "bench_ignored.json", {"meta": run_meta(args.device), "shapes": results})
    log("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
