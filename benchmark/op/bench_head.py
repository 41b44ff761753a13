"""The LM head alone, forward + backward, against megatron-core's own: at a TP rank's shapes of a 7B model.

    python -m benchmark.op.bench_head --out DIR                       # N = 8192, 16384; H = 3584; V = 76032
    python -m benchmark.op.bench_head --shapes 8192x3584x76032 --rounds 5 --out DIR

Per shape (bf16 hidden [N, H] and weight [V, H], both requiring grad; labels uniform, none ignored), each
provider runs loss.backward() from the hidden states and the weight, and is timed with do_bench (median of
its calls, L2 flushed), in `--rounds` rounds that alternate the providers; the ratio of each provider to
`megatron` is the median of the per-round ratios.

    fused             areal_lce.linear_logprobs_entropy with its default options (cache_bytes=0, invariant
                      mode on, deferred label checks); loss = -Σ logprobs
    fused_cache       the same with a logits-cache budget that holds this shape's fp32 logits (4·N·V bytes):
                      the backward reads them instead of recomputing the GEMM
    fused_auto        cache_bytes="auto", the Megatron engine's default (engine.lce.cache_bytes): a budget
                      chosen from the shapes (api.auto_cache_bytes)
    megatron          the output layer's GEMM (bf16 logits [N, V], as ColumnParallelLinear computes them) and
                      megatron.core.tensor_parallel.vocab_parallel_cross_entropy; loss = Σ CE
    megatron_fused    the same GEMM and megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy
                      (megatron's cross_entropy_loss_fusion)

Floors (cuBLAS in the same run): 6NHV = t(h·Wᵀ) + t(dl·W) + t(dlᵀ·h), what megatron's route and a logits
cache compute; the fused route without a cache adds one more 2NHV GEMM (the recompute): 8NHV.
megatron's routes run on a TP group of one process (parallel_state with TP = 1); their collectives are
then no-ops, as are the fused op's.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from ..harness import PeakMemory, bench, clean, log, parse_shapes, run_meta, write_json

SHAPES = {"7b_tp2_8k": (8192, 3584, 76032), "7b_tp2_16k": (16384, 3584, 76032)}
PROVIDERS = ("fused", "fused_cache", "fused_auto", "megatron", "megatron_fused")


def _init_megatron():
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1)
    return parallel_state.get_tensor_model_parallel_group()


def providers(tp_group):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from areal_lce import linear_logprobs_entropy

    def fused(cache):
        def fn(h, w, y):
            cb = cache if cache == "auto" else 4 * h.shape[0] * w.shape[0] + 1 if cache else 0
            return -linear_logprobs_entropy(h, w, y, cache_bytes=cb).logprobs.sum()
        return fn

    def megatron(fused_ce: bool):
        def fn(h, w, y):
            logits = (h @ w.t())[:, None]  # [s, b=1, V] bf16, the output layer's layout
            ce = (fused_vocab_parallel_cross_entropy(logits, y[:, None], tp_group) if fused_ce
                  else vocab_parallel_cross_entropy(logits, y[:, None]))
            return ce.sum()
        return fn
    return {"fused": fused(False), "fused_cache": fused(True), "fused_auto": fused("auto"), "megatron": megatron(False),
            "megatron_fused": megatron(True)}


def floors(h, w):
    """cuBLAS GEMM times of the head's 6NHV work (bf16 in and out)."""
    dl = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)
    f = bench(lambda: h @ w.t())["ms"]
    dh = bench(lambda: dl @ w)["ms"]
    dw = bench(lambda: dl.t() @ h)["ms"]
    return {"fwd_gemm_ms": f, "6nhv_ms": f + dh + dw, "8nhv_ms": 2 * f + dh + dw}


def run_shape(name, n, hd, v, fns, rounds: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, hd, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, hd, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    res = {"shape": name, "N": n, "H": hd, "V": v, "floors": floors(h.detach(), w.detach()), "providers": {}}
    per_round = {p: [] for p in fns}
    for r in range(rounds):
        for p, fn in fns.items():
            def step(fn=fn):
                fn(h, w, y).backward()
            ms = bench(step, grad_to_none=(h, w))["ms"]
            per_round[p].append(ms)
            clean()
        log(name, f"round {r}", " ".join(f"{p}={v[-1]:.2f}ms" for p, v in per_round.items()))
    for p, fn in fns.items():
        h.grad = w.grad = None
        clean()
        with PeakMemory() as pm:
            fn(h, w, y).backward()
        res["providers"][p] = {"ms_rounds": per_round[p], "ms": statistics.median(per_round[p]),
                               "peak_above_entry_gib": pm.extra_gib,
                               "ratio_to_megatron": statistics.median(
                                   a / b for a, b in zip(per_round[p], per_round["megatron"])),
                               "ratio_to_megatron_fused": statistics.median(
                                   a / b for a, b in zip(per_round[p], per_round["megatron_fused"]))}
    h.grad = w.grad = None
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    tp_group = _init_megatron()
    fns = providers(tp_group)
    results = []
    for name, (n, hd, v) in parse_shapes(args.shapes, SHAPES):
        results.append(run_shape(name, n, hd, v, fns, args.rounds))
        clean()
    print(f"{'shape':>12} {'provider':>15} {'ms':>8} {'/megatron':>10} {'/meg_fused':>10} {'peak GiB':>9}")
    for r in results:
        for p, d in r["providers"].items():
            print(f"{r['shape']:>12} {p:>15} {d['ms']:8.2f} {d['ratio_to_megatron']:10.3f} "
                  f"{d['ratio_to_megatron_fused']:10.3f} {d['peak_above_entry_gib']:9.2f}")
        print(f"{r['shape']:>12} {'6NHV floor':>15} {r['floors']['6nhv_ms']:8.2f}   8NHV floor "
              f"{r['floors']['8nhv_ms']:.2f}")
    write_json(args.out, "bench_head.json", {"meta": run_meta(), "results": results})


if __name__ == "__main__":
    main()
