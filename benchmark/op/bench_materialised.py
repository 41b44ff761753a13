"""The RL jobs' materialised route against megatron-core's CE plus an RL-framework entropy, on one GPU.

    python -m benchmark.op.bench_materialised --out DIR [--shapes qwen0.5b,qwen7b] [--rounds 3]

Every row runs forward + backward of (logprob + entropy) per token from logits that a bf16 GEMM builds
(hidden [N, H] @ weight[V, H]ᵀ, the GEMM and its backward included), labels all valid, T = 1:
  (a) autograd  the materialised route as it was (`materialised_autograd`: fp32 copies of the logits,
                softmax by torch autograd)
  (b) lean      the route now (`logprobs_entropy_from_logits`: bf16 logits kept, fp32 only per row block,
                one custom backward writing bf16 d_logits)
  (c) megatron  megatron-core's `tensor_parallel.vocab_parallel_cross_entropy` on the same bf16 logits
                (logprob = -CE) plus the entropy as verl / AReaL compute it materialised: log_softmax of the
                fp32 logits, -(p · log p).sum
Time: each round times every row (median of 5 reps, `timed`), the rows' medians over rounds; ratios to (c)
per round, their median. Peak: max_memory_allocated above what the inputs (hidden, weight, labels) hold.
Values: max |Δ| of (a), (b) logprob and entropy against (c). --lean-blocks E1,E2 adds rows lean_E (the lean
route with materialised_lean.CHUNK_ELEMENTS = E: fp32 elements per row block) to tune the block size.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from areal_lce.op import materialised_lean
from areal_lce.op.materialised import logprobs_entropy_from_logits
from benchmark.op.materialised_autograd import logprobs_entropy_autograd

from ..harness import log, parse_shapes, run_meta, write_json
from .bench_invariant import timed

SHAPES = {"qwen0.5b": (8192, 896, 151936), "qwen7b": (8192, 3584, 152064), "tiny": (64, 32, 1000)}
ROWS = ("autograd", "lean", "megatron")


def _group():
    """A one-rank process group for megatron's CE (it all-reduces over its tp_group even at TP=1)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    return dist.group.WORLD


def _megatron_row(logits, y, group):
    """(logprob, entropy) the way a Megatron RL framework gets them: megatron's CE, entropy materialised."""
    from megatron.core import tensor_parallel

    lp = -tensor_parallel.vocab_parallel_cross_entropy(logits, y, tp_group=group)
    logp = torch.log_softmax(logits.float(), -1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _with_blocks(elements, route):
    def run(logits, y):
        default, materialised_lean.CHUNK_ELEMENTS = materialised_lean.CHUNK_ELEMENTS, elements
        try:
            return route(logits, y)
        finally:
            materialised_lean.CHUNK_ELEMENTS = default
    return run


def _routes(group, blocks=()):
    def autograd(logits, y):
        o = logprobs_entropy_autograd(logits, y)
        return o.logprobs, o.entropy

    def lean(logits, y):
        o = logprobs_entropy_from_logits(logits, y)
        return o.logprobs, o.entropy

    routes = {"autograd": autograd, "lean": lean, "megatron": lambda x, y: _megatron_row(x, y, group)}
    # the block size is fixed when the call begins (LeanParams.rows_per_block): backward keeps it
    routes.update({f"lean_{e}": _with_blocks(e, lean) for e in blocks})
    return routes


def _inputs(n, h, v, device):
    g = torch.Generator(device=device).manual_seed(0)
    hid = torch.randn(n, h, device=device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device=device, generator=g) * (2 / h ** 0.5)).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=device, generator=g)
    return hid, w, y


def _step(route, hid, w, y):
    hid.grad = w.grad = None
    lp, ent = route(hid @ w.t(), y)  # the bf16 GEMM, in every row
    (lp.sum() + ent.sum()).backward()


def _peak_gib(fn, device) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 30


def _host_timed(fn, reps) -> float:  # CPU smoke runs only (timed() needs CUDA events)
    import time

    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def cost(name, n, h, v, rounds, device, group, blocks=()) -> dict:
    hid, w, y = _inputs(n, h, v, device)
    routes = _routes(group, blocks)
    rows = list(routes)
    time_fn = timed if device == "cuda" else _host_timed
    with torch.no_grad():
        x = hid @ w.t()
        ref = routes["megatron"](x, y)
        values = {}
        for k in (r for r in rows if r != "megatron"):
            got = routes[k](x, y)
            values[k] = {"logprob_max_abs_vs_megatron": float((got[0] - ref[0]).abs().max()),
                         "entropy_max_abs_vs_megatron": float((got[1] - ref[1]).abs().max())}
        del x, ref, got
    times = {k: [] for k in rows}
    for _ in range(rounds):
        for k in rows:
            times[k].append(time_fn(lambda: _step(routes[k], hid, w, y), 5))
    out = {"shape": {"N": n, "H": h, "V": v}, "values": values}
    for k in rows:
        out[f"{k}_ms"] = statistics.median(times[k])
        out[f"{k}_peak_gib"] = _peak_gib(lambda: _step(routes[k], hid, w, y), device)
    for k in (r for r in rows if r != "megatron"):
        out[f"{k}_time_ratio_to_megatron"] = statistics.median(a / b for a, b in zip(times[k], times["megatron"]))
        out[f"{k}_peak_ratio_to_megatron"] = out[f"{k}_peak_gib"] / out["megatron_peak_gib"]
    log(f"{name}: " + ", ".join(f"{k} {out[f'{k}_ms']:.1f} ms {out[f'{k}_peak_gib']:.2f} GiB" for k in rows)
        + f"; lean/megatron time {out['lean_time_ratio_to_megatron']:.3f} peak {out['lean_peak_ratio_to_megatron']:.3f}"
        + f"; autograd/megatron time {out['autograd_time_ratio_to_megatron']:.3f}"
        + f" peak {out['autograd_peak_ratio_to_megatron']:.3f}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen0.5b,qwen7b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lean-blocks", default="", help="comma-separated CHUNK_ELEMENTS values: extra lean rows")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    group = _group()
    result = {"meta": run_meta(args.device if args.device == "cuda" else "cpu", rows=list(ROWS),
                               default_block_elements=materialised_lean.CHUNK_ELEMENTS), "cost": {}}
    for name, (n, h, v) in parse_shapes(args.shapes, SHAPES):
        blocks = [int(e) for e in args.lean_blocks.split(",") if e]
        result["cost"][name] = cost(name, n, h, v, args.rounds, args.device, group, blocks)
        write_json(args.out, "bench_materialised", result)


if __name__ == "__main__":
    main()
