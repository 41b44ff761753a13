"""GRPO rollout benchmark: generation with the KV cache vs full recompute, against the rest of the step.

    # 0.5B-shaped GRPO on one GPU: 8 prompts x 8 samples = 64 sequences, 1024 new tokens each
    torchrun --nproc_per_node=1 -m benchmark.engine.bench_rollout --preset qwen2.5-0.5b --out DIR
    # CPU smoke run
    python -m benchmark.engine.bench_rollout --preset tiny --new-tokens 16 --recompute-tokens 4 --prompt-len 12 --out DIR

One policy engine (trainable) and one frozen reference engine, as the RL job builds them; prompts of
random ids with lengths drawn from [prompt_len - spread, prompt_len] (each repeated `group` times), so
the cache holds left-padded prompts of different lengths. Phases, each after a warm-up call:
  * rollout, KV cache: `--new-tokens` tokens per sequence (no EOS: every sequence runs to the end),
    wall time, ms per new token (one decode step of the whole batch), peak memory of the rollout;
    decode steps replayed from CUDA graphs (the default, `engine.decode_cuda_graphs`), and for
    `--eager-tokens` tokens with the same steps run eagerly.
  * rollout, full recompute: too slow to run to the end. Measured twice for `--recompute-tokens`
    tokens: from the prompts, and from the prompts extended by the KV rollout's first
    new_tokens - recompute_tokens tokens (the end of the same rollout). The cost of a step grows
    with the prefix; the estimate for the whole rollout is the mean of the two per-token times times
    new_tokens (trapezoid rule: a linear-in-prefix model). It is an estimate, and says so.
  * the same step's behaviour and reference logprob passes and the PPO update on the KV rollout's
    sequences (benchmark.engine.bench_train.grpo_passes; timed on their second run, the first warms up), for
    the ratio rollout / (logprob passes + update).
Targets (issue 15): KV rollout of 64 x 1024 <= 15 s (~15 ms per token), and at most ~5x the rest.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from ..harness import run_meta, sync, write_json
from .bench_train import _engine, grpo_passes


def _prompts(args, vocab: int, g: torch.Generator):
    lo = max(1, args.prompt_len - args.prompt_spread)
    out = []
    for _ in range(args.prompts):
        n = int(torch.randint(lo, args.prompt_len + 1, (1,), generator=g))
        out += [torch.randint(0, vocab, (n,), generator=g).tolist()] * args.group
    return out


def _rollout(eng, prompts, n: int, kv: bool, seed: int, graphs: bool = True) -> dict:
    eng.cfg.kv_cache, eng.cfg.decode_cuda_graphs = kv, graphs
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    sync(); t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    resp = eng.generate(prompts, n, temperature=1.0, top_p=1.0, eos_id=None, generator=gen)
    sync(); dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else eng.peak_mem_gib()
    return {"s": dt, "ms_per_token": dt / n * 1e3, "new_tokens": n, "peak_mem_gib": peak,
            "peak_over_start_gib": peak - base, "resp": resp}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--vocab", type=int, default=0, help="true vocab (0: the preset's)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="longest prompt")
    ap.add_argument("--prompt-spread", type=int, default=64, help="prompt lengths in [len - spread, len]")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--recompute-tokens", type=int, default=32)
    ap.add_argument("--eager-tokens", type=int, default=32,
                    help="tokens of a KV rollout with eager decode steps (engine.decode_cuda_graphs=false)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per update microbatch")
    ap.add_argument("--logprob-max-tokens", default="auto", help="rl.logprob_max_tokens of the logprob passes")
    ap.add_argument("--lce-cache-bytes", default="0", help="engine.lce.cache_bytes: bytes or auto")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    args.seq = args.prompt_len + args.new_tokens  # engine max_seq_len (bench_train._engine reads args.seq)
    if not 0 < args.recompute_tokens <= args.new_tokens or not 0 < args.eager_tokens <= args.new_tokens:
        ap.error("--recompute-tokens and --eager-tokens must be in [1, --new-tokens]")

    eng = _engine(args, fused=True)
    ref = _engine(args, fused=True, trainable=False)
    g = torch.Generator().manual_seed(7)
    prompts = _prompts(args, eng.vocab_size, g)
    for kv in (True, False):  # warm-up: allocator, kernels, RoPE tables
        _rollout(eng, prompts, 2, kv, seed=1)
    kv = _rollout(eng, prompts, args.new_tokens, True, seed=0)
    print(f"[rollout] KV cache: {len(prompts)} x {args.new_tokens} tokens in {kv['s']:.2f} s "
          f"({kv['ms_per_token']:.1f} ms/token), peak {kv['peak_mem_gib']:.2f} GiB", flush=True)
    n, r = args.new_tokens, args.recompute_tokens
    eager = _rollout(eng, prompts, args.eager_tokens, True, seed=0, graphs=False)
    print(f"[rollout] KV cache, eager decode steps (decode_cuda_graphs=false): {eager['ms_per_token']:.1f} ms/token "
          f"over the first {args.eager_tokens} tokens", flush=True)
    start = _rollout(eng, prompts, r, False, seed=0)
    late = [p + x[: n - r] for p, x in zip(prompts, kv["resp"])]
    end = _rollout(eng, late, r, False, seed=0)
    same = sum(a[:r] == b for a, b in zip(kv["resp"], start["resp"])) / len(prompts)
    estimate = (start["ms_per_token"] + end["ms_per_token"]) / 2 * n / 1e3
    print(f"[rollout] full recompute: {start['ms_per_token']:.1f} ms/token from the prompts, "
          f"{end['ms_per_token']:.1f} ms/token at prefix +{n - r}: ESTIMATED {estimate:.1f} s for {n} tokens",
          flush=True)
    grpo_passes(args, eng, ref, prompts, kv["resp"], g)  # warm-up: these shapes' first calls
    times, out = grpo_passes(args, eng, ref, prompts, kv["resp"], g)
    rest = sum(times.values())
    print("[step] " + " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in times.items()), flush=True)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    meta = run_meta(args=vars(args), world=int(os.environ.get("WORLD_SIZE", "1")),
                    prompt_lengths=sorted({len(p) for p in prompts}))
    a, slots = eng.arch, max(len(p) for p in prompts) + n  # the last slot stages each decode step
    # K and V per layer: [slots, sequences, kv_heads / tp, head_dim] in the model dtype
    cache_gib = 2 * a.num_layers * slots * len(prompts) * a.num_kv_heads // args.tp * a.head_dim \
        * torch.finfo(eng.dtype).bits // 8 / 2**30
    drop = ("resp",)
    result = {
        "kv_cache": {**{k: v for k, v in kv.items() if k not in drop}, "cache_gib": cache_gib},
        "kv_cache_eager_steps": {k: v for k, v in eager.items() if k not in drop},
        "recompute_from_prompts": {k: v for k, v in start.items() if k not in drop},
        "recompute_at_end": {k: v for k, v in end.items() if k not in drop},
        "recompute_estimated_s": estimate,
        "recompute_tokens_same_as_kv_fraction": same,  # bf16: sampled tokens may part on rounding
        "kv_speedup_estimated": estimate / kv["s"],
        "step_phases_s": times, "update_peak_mem_gib": out["peak_mem_gib"],
        "rollout_over_rest": kv["s"] / rest,
        "targets": {"kv_rollout_s<=15": kv["s"] <= 15.0, "rollout_over_rest<=5": kv["s"] / rest <= 5.0},
    }
    print(f"\nrollout {len(prompts)} x {n} on {meta['device']} (git {meta['git_sha']}): KV cache {kv['s']:.2f} s "
          f"(target <= 15 s), recompute estimated {estimate:.1f} s ({estimate / kv['s']:.0f}x); "
          f"logprob passes + update {rest:.2f} s; rollout / rest = {kv['s'] / rest:.2f} (target <= 5)")
    write_json(args.out, f"rollout_{args.preset}_tp{args.tp}.json", {"meta": meta, "results": result})


if __name__ == "__main__":
    main()
