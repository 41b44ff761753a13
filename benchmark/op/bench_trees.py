"""The public op's default call in this tree against another tree's, in paired rounds on one GPU.

    git archive aeb80a5 | tar -x -C /tmp/base        # the tree to compare with (any commit's areal_lce)
    python -m benchmark.op.bench_trees --base /tmp/base --rounds 3 --out DIR

What a user calls: `areal_lce.linear_logprobs_entropy(hidden, weight, labels)` with every option at its
default, on bench_lce's inputs (lce_run.make_inputs: bf16, W ~ N(0, 16/H)), forward and forward+backward
(loss -sum(logprobs) - sum(entropy)), at bench_lce's four shapes. Each round runs one child process per
tree, the order alternating round by round (two trees' packages cannot share one process: both are
`areal_lce`); each child times, per shape, the cuBLAS forward GEMM h·Wᵀ (the clock's reference), then the
forward, then forward+backward (harness.bench: triton.testing.do_bench, 500 ms warm-up, --rep ms). Per
shape and tree: the median over rounds of the times and of the ratio to that child's GEMM; per shape the
ratio this / base, the median over rounds of the per-round ratios of GEMM-normalised times (a clock that
moves between processes moves both terms of a ratio together). Writes bench_trees.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..harness import bench, run_meta, write_json
from .bench_lce import SHAPES
from .lce_run import make_inputs

ROOT = Path(__file__).resolve().parents[2]  # this tree: its benchmark helpers serve every child
# a child: the tree under test's areal_lce imported first (PYTHONPATH holds that tree alone), then this module
# from ROOT, whose helpers import no areal_lce
CHILD = ("import json, sys; import areal_lce; sys.path.insert(0, {root!r}); "
         "from benchmark.op.bench_trees import child; print(json.dumps(child({shapes!r}, {rep})))")


def child(shapes: list, rep: int) -> dict:
    """In a child process (CHILD), timing the areal_lce imported there: {shape: {gemm, fwd, fwd_bwd (ms),
    peak_gib}} plus the package's version and path."""
    import torch

    import areal_lce
    from areal_lce import linear_logprobs_entropy

    out = {"version": areal_lce.__version__, "path": str(Path(areal_lce.__file__).parent)}
    for name in shapes:
        h, W, y = make_inputs(*SHAPES[name], seed=0)
        hg, Wg = h.clone().requires_grad_(), W.clone().requires_grad_()

        def fwd():
            with torch.no_grad():
                linear_logprobs_entropy(h, W, y)

        def fwd_bwd():
            o = linear_logprobs_entropy(hg, Wg, y)
            (-o.logprobs.sum() - o.entropy.sum()).backward()

        def gemm():
            h @ W.t()

        r = {"gemm": bench(gemm, rep=rep, warmup=500)["ms"], "fwd": bench(fwd, rep=rep, warmup=500)["ms"],
             "fwd_bwd": bench(fwd_bwd, rep=rep, grad_to_none=[hg, Wg], warmup=500)["ms"]}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        r["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        out[name] = r
        del h, W, y, hg, Wg
        torch.cuda.empty_cache()
    return out


def _run_child(tree: str, shapes: list, rep: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-c", CHILD.format(root=str(ROOT), shapes=shapes, rep=int(rep))]
    res = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"child for {tree} failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare(rounds: list, shapes: list) -> dict:
    """rounds: [{"this": child result, "base": child result}] -> per shape and tree the medians, and the
    ratio this / base of GEMM-normalised times per round and its median."""
    table = {}
    for name in shapes:
        row = {}
        for what in ("fwd", "fwd_bwd"):
            per_round = [(r["this"][name][what] / r["this"][name]["gemm"])
                         / (r["base"][name][what] / r["base"][name]["gemm"]) for r in rounds]
            row[what] = {tree: statistics.median(r[tree][name][what] for r in rounds) for tree in ("this", "base")}
            row[what]["ratio_rounds"] = per_round
            row[what]["ratio"] = statistics.median(per_round)
        row["peak_gib"] = {tree: max(r[tree][name]["peak_gib"] for r in rounds) for tree in ("this", "base")}
        table[name] = row
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="root of the tree to compare with (holds areal_lce/)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=300, help="do_bench rep (ms) per time")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    if not args.base or not (Path(args.base) / "areal_lce").is_dir():
        raise SystemExit(f"--base must be a tree holding areal_lce/, got {args.base!r}")
    this = str(ROOT)
    rounds = []
    for i in range(args.rounds):
        order = ("base", "this") if i % 2 == 0 else ("this", "base")
        r = {}
        for tree in order:
            r[tree] = _run_child(args.base if tree == "base" else this, shapes, args.rep)
        rounds.append(r)
        times = (f"{s} fwd+bwd {r['this'][s]['fwd_bwd']:.2f} / {r['base'][s]['fwd_bwd']:.2f} ms" for s in shapes)
        print(f"round {i + 1}: " + "  ".join(times), flush=True)
    table = compare(rounds, shapes)
    print(f"{'shape':8} {'fwd this/base ms':>22} {'ratio':>6} {'fwd+bwd this/base ms':>24} {'ratio':>6}  rounds")
    for s, row in table.items():
        f, b = row["fwd"], row["fwd_bwd"]
        print(f"{s:8} {f['this']:10.3f} / {f['base']:9.3f} {f['ratio']:6.3f} {b['this']:11.3f} / {b['base']:10.3f} "
              f"{b['ratio']:6.3f}  {' '.join(f'{x:.3f}' for x in b['ratio_rounds'])}")
    write_json(args.out, "bench_trees.json", {"meta": run_meta(args=vars(args)), "base": args.base,
                                              "versions": {t: rounds[0][t]["version"] for t in ("this", "base")},
                                              "rounds": rounds, "table": table})


if __name__ == "__main__":
    main()
