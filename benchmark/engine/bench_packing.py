"""Packed (THD) vs right-padded (BSHD) micro-batches, the fused LM head vs the flag-off route, RL-like lengths.

    python -m benchmark.engine.bench_packing --preset qwen2.5-0.5b --out DIR          # one GPU
    python -m benchmark.engine.bench_packing --preset tiny --seqs 8 --max-response 64  # CPU smoke run

Every step trains on `--seqs` sequences of prompt `--prompt-len` tokens plus a response of uniform
random length in [--min-response, --max-response] (what a GRPO batch looks like), split into
micro-batches of `--micro-batch` sequences. Padded: each micro-batch is right-padded to its longest
sequence. Packed: the engine packs each micro-batch into one THD row (engine.pack_sequences).
Two jobs per layout x route, each on a fresh engine from the same seed and the same batches. With the flag off
(`--routes ...,materialised`) the SFT job runs megatron-core's own loss, reported as route "megatron" (the
baseline a Megatron user has), and the GRPO job the lean materialised route, reported as "materialised":
  sft   one SFT step (token-mean NLL over response tokens)
  grpo  the GRPO step minus the rollout: behaviour logprobs (policy, no grad), reference logprobs
        (a frozen engine), and the PPO update with group advantages
`--micro-batch-padded` gives the padded layout its own micro-batch size (e.g. the largest that fits in
memory, packed rows being about half as long). Reported: median step time over the steps after the
first, real (unpadded) tokens per second, peak
GPU memory, the first step's loss (must agree across the four configurations). Floor/targets: packed
tokens/s >= 1.3x padded at these lengths; fused peak below materialised by at least the fp32 logits of a
micro-batch (4 * tokens * V / tp bytes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from areal_lce.engine.microbatch import MicroBatch

from ..harness import clean, run_meta, sync, write_json


def make_steps(args, vocab: int, micro_batch: int):
    """Per step: the same `args.seqs` sequences (seeded), as right-padded micro-batches of `micro_batch`
    sequences {'input_ids', 'labels'} with response-only labels."""
    g = torch.Generator().manual_seed(42)
    steps = []
    for _ in range(args.steps):
        lens = torch.randint(args.min_response, args.max_response + 1, (args.seqs,), generator=g)
        seqs = [torch.randint(0, vocab, (args.prompt_len + int(n),), generator=g) for n in lens]
        mbs = []
        for k in range(0, args.seqs, micro_batch):
            chunk = seqs[k:k + micro_batch]
            ids = torch.zeros(len(chunk), max(len(x) for x in chunk), dtype=torch.long)
            labels = torch.full_like(ids, -100)
            for r, x in enumerate(chunk):
                ids[r, : len(x)] = x
                labels[r, args.prompt_len - 1: len(x) - 1] = x[args.prompt_len:]
            mbs.append(MicroBatch(ids, labels))
        steps.append(mbs)
    return steps


def build(args, fused: bool, pack: bool, trainable: bool = True):
    from areal_lce.engine.config import EngineConfig, ModelConfig, OptimConfig
    from areal_lce.engine.engine import MegatronEngine

    cfg = EngineConfig(model=ModelConfig(preset=args.preset, max_seq_len=args.prompt_len + args.max_response),
                       optim=OptimConfig(lr=1e-6, clip_grad=1.0), use_fused_linear_ce=fused, pack_sequences=pack,
                       seed=1234)
    return MegatronEngine(cfg, trainable=trainable)


def sft_step(eng, mbs, _ref, _rl):
    n = sum(int((mb.labels != -100).sum()) for mb in mbs)

    def loss_fn(st, mb):
        mask = mb.labels.to(st.logprobs.device) != -100
        return -(st.logprobs * mask).sum() / n, {}

    return eng.train_step(mbs, loss_fn)["loss"]


def grpo_step(eng, mbs, ref, rl_cfg):
    import dataclasses

    from areal_lce.train.rl_losses import PolicyMicroBatch, group_advantages, rl_loss

    n_seq = sum(mb.input_ids.shape[0] for mb in mbs)
    n_tok = sum(int((mb.labels != -100).sum()) for mb in mbs)
    adv = group_advantages(torch.linspace(0, 1, n_seq), 4)
    batch, k = [], 0
    for mb in mbs:
        b = mb.input_ids.shape[0]
        old = eng.token_stats(mb.input_ids, mb.labels).logprobs
        refl = ref.token_stats(mb.input_ids, mb.labels).logprobs
        fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
        batch.append(PolicyMicroBatch(**fields, advantages=adv[k:k + b].to(old.device), old_logprobs=old,
                                      ref_logprobs=refl, num_tokens=n_tok, num_seqs=n_seq))
        k += b
    return eng.train_step(batch, lambda st, mb: rl_loss(st, mb, rl_cfg))["loss"]


def run(args, job: str, fused: bool, pack: bool) -> dict:
    from areal_lce.train.rl_config import RLConfig

    mb_size = args.micro_batch if pack else (args.micro_batch_padded or args.micro_batch)
    steps = make_steps(args, vocab_of(args), mb_size)
    eng = build(args, fused, pack)
    ref = build(args, fused, pack, trainable=False) if job == "grpo" else None
    fn = sft_step if job == "sft" else grpo_step
    times, losses = [], []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for mbs in steps:
        sync()
        t0 = time.perf_counter()
        losses.append(fn(eng, mbs, ref, RLConfig()))
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    real = statistics.mean(sum(int((mb.labels != -100).sum()) + mb.input_ids.shape[0] for mb in s)
                           for s in steps)  # ~ real tokens (targets + one per sequence)
    med = statistics.median(times[1:] if len(times) > 1 else times)
    del eng, ref
    clean()  # gc first: megatron-core's DDP hooks keep a dropped engine in reference cycles (docs/megatron.md)
    flag_off = "megatron" if job == "sft" else "materialised"  # what use_fused_linear_ce=false runs for the job
    return {"job": job, "route": "fused" if fused else flag_off, "layout": "packed" if pack else "padded",
            "micro_batch": mb_size,
            "step_s": med, "step_s_all": times, "real_tokens_per_s": real / med, "peak_mem_gib": peak,
            "loss": losses}


def vocab_of(args) -> int:
    from areal_lce.engine.config import ModelConfig
    from areal_lce.engine.model.builder import resolve_arch

    return resolve_arch(ModelConfig(preset=args.preset)).vocab_size


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--jobs", default="sft,grpo")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batch-padded", type=int, default=0,
                    help="sequences per padded micro-batch (0: --micro-batch); e.g. the largest that fits memory")
    ap.add_argument("--routes", default="fused,materialised")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--min-response", type=int, default=64)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    vocab = vocab_of(args)
    routes = [r == "fused" for r in args.routes.split(",")]
    results = []
    for job in args.jobs.split(","):
        for fused in routes:
            for pack in (True, False):
                r = run(args, job, fused, pack)
                results.append(r)
                print(f"{job:>4} {r['route']:>12} {r['layout']:>6} x{r['micro_batch']:<3}: step {r['step_s'] * 1e3:8.1f} ms  "
                      f"{r['real_tokens_per_s']:9.0f} tok/s  peak {r['peak_mem_gib']:6.2f} GiB  loss[0] {r['loss'][0]:.6f}",
                      flush=True)
    summary = {}
    for job in args.jobs.split(","):
        by = {(r["route"], r["layout"]): r for r in results if r["job"] == job}
        for route in sorted({r for r, _ in by}):
            summary[f"{job}_{route}_packed_over_padded_tokens_per_s"] = (
                by[(route, "packed")]["real_tokens_per_s"] / by[(route, "padded")]["real_tokens_per_s"])
        off = "megatron" if job == "sft" else "materialised"  # the flag-off route of this job
        for layout in ("packed", "padded"):
            if (off, layout) in by and ("fused", layout) in by:
                summary[f"{job}_{layout}_memory_saved_vs_{off}_gib"] = (by[(off, layout)]["peak_mem_gib"]
                                                                        - by[("fused", layout)]["peak_mem_gib"])
        l0 = [r["loss"][0] for r in by.values()]
        summary[f"{job}_first_loss_rel_spread"] = (max(l0) - min(l0)) / max(abs(min(l0)), 1e-12)
    logits_gib = 4 * args.micro_batch * (args.prompt_len + args.max_response) * vocab / 2**30
    print(json.dumps(summary, indent=1))
    print(f"target: packed/padded tokens/s >= 1.3; memory saved >= fp32 logits of the longest padded "
          f"micro-batch ({logits_gib:.2f} GiB)")
    meta = run_meta(args=vars(args), fp32_logits_longest_microbatch_gib=logits_gib)
    tag = f"mb{args.micro_batch}" + (f"_padded{args.micro_batch_padded}" if args.micro_batch_padded else "")
    write_json(args.out, f"packing_{args.preset}_{tag}.json", {"meta": meta, "summary": summary, "results": results})


if __name__ == "__main__":
    main()
