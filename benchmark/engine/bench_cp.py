"""Long-context SFT step under context parallelism: fused vs materialised LM head, per-rank time and memory.

    torchrun --nproc_per_node=2 -m benchmark.engine.bench_cp --seq 32768 --route fused --out DIR
    torchrun --nproc_per_node=2 -m benchmark.engine.bench_cp --seq 131072 --route materialised --out DIR

One configuration per process group (a rank that runs out of memory would leave the other waiting in a
collective: run each configuration in its own launch, under `timeout`). The model is the
Qwen2.5-0.5B-shaped preset (bf16, random init), CP = world size, one packed sequence of `--seq` tokens
per micro-batch with next-token labels on every token, `--steps` optimizer steps. Each CP rank holds
seq / cp tokens: the materialised route's fp32 logits alone are 4 * (seq / cp) * 151936 bytes per rank
(9.3 GiB at 32k tokens, 37 GiB at 128k), before the softmax and gradient copies of its backward; the
fused route never builds them. Writes cp_<route>_<seq>.json with the median step time (steps after the
first), the peak memory of every rank, and the first step's loss, or {"oom": true}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from areal_lce.engine.microbatch import MicroBatch

from ..harness import run_meta, sync, write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--route", choices=["fused", "megatron", "materialised"], default="fused",
                    help="megatron: the flag off with a logprobs-only loss, i.e. megatron-core's own loss path")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", action="store_true", help="model.activation_recompute (full, per layer)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()

    from areal_lce.engine.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
    from areal_lce.engine.engine import MegatronEngine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = EngineConfig(model=ModelConfig(preset=args.preset, max_seq_len=args.seq,
                                         activation_recompute=args.recompute),
                       parallel=ParallelConfig(context_parallel=world), optim=OptimConfig(lr=1e-6),
                       use_fused_linear_ce=args.route == "fused", seed=1234)
    eng = MegatronEngine(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, eng.vocab_size, (1, args.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    n = int((labels != -100).sum())

    def loss_fn(st, mb):
        mask = mb.labels.to(st.logprobs.device) != -100
        return -(st.logprobs * mask).sum() / n, {}

    # reads the logprobs alone: with the flag off the engine then runs megatron-core's own loss; the
    # materialised route is areal_lce's (entropy and logit stats per token)
    loss_fn.logprobs_only = args.route == "megatron"

    times, losses, oom = [], [], False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            losses.append(eng.train_step([MicroBatch(ids, labels)], loss_fn)["loss"])
            sync()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        oom = True
        print(f"[rank {eng.dist.rank}] out of memory: {str(e).splitlines()[0]}", flush=True)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")], device=eng.device)
    if oom:  # the other rank may be stuck in a collective: report this rank alone and stop
        peaks = [float(peak)]
    else:
        gathered = [torch.zeros_like(peak) for _ in range(world)]
        torch.distributed.all_gather(gathered, peak)
        peaks = [float(x) for x in gathered]
    res = {"route": args.route, "seq": args.seq, "cp": world, "tokens_per_rank": args.seq // world,
           "recompute": args.recompute, "oom": oom, "peak_mem_gib_per_rank": peaks,
           "fp32_logits_per_rank_gib": 4 * (args.seq // world) * 151936 / 2**30}
    if not oom:
        med = statistics.median(times[1:] if len(times) > 1 else times)
        res.update(step_s=med, step_s_all=times, tokens_per_s=args.seq / med, loss=losses)
    if eng.dist.rank == 0 or oom:
        print(json.dumps(res), flush=True)
        write_json(args.out, f"cp_{args.route}_{args.seq}.json", {"meta": run_meta(args=vars(args)), "result": res})
    if oom:
        os._exit(3)  # do not wait on the other rank


if __name__ == "__main__":
    main()
