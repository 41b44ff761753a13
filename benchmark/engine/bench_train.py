"""Training-step benchmark: fused vs materialised LM-head route inside the Megatron engine.

    # SFT step, Qwen2.5-0.5B-shaped, one GPU
    torchrun --nproc_per_node=1 -m benchmark.engine.bench_train --job sft --preset qwen2.5-0.5b --out DIR
    # SFT step, Qwen2.5-7B-shaped at TP=2 (sequence parallel on); one route per process when two
    # models with their optimizer states would not fit one GPU together
    torchrun --nproc_per_node=2 -m benchmark.engine.bench_train --job sft --preset qwen2.5-7b --tp 2 --sp --routes fused --out DIR
    # one GRPO step (rollout, behaviour + reference logprob passes, PPO update), 0.5B-shaped
    torchrun --nproc_per_node=1 -m benchmark.engine.bench_train --job grpo --preset qwen2.5-0.5b --out DIR
    # CPU smoke run: --preset tiny --device-check off

For each route (use_fused_linear_ce true / false) it builds the same model from the same seed, runs
`--steps` optimizer steps on the same random token batches, and reports the median step time of the
steps after the first (per phase for GRPO), the peak GPU memory of a step, tokens/s and the first
step's loss, which must agree between the routes (printed as a relative difference). The logits a
materialised route holds are 4·N·V_shard bytes in fp32 per microbatch (N = micro_batch × seq); the
target is: fused step not slower, peak memory lower by at least those bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from areal_lce.engine.microbatch import MicroBatch

from ..harness import clean, run_meta, sync, write_json


def _engine(args, fused: bool, trainable: bool = True, route: str = ""):
    """The engine of a route: fused / materialised / megatron as their flag sets them; fused_cache: the fused
    route with a logits-cache budget that holds any micro-batch's fp32 logits; megatron_fusedce: megatron's
    own loss with model.cross_entropy_loss_fusion on."""
    from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig
    from areal_lce.engine.engine import MegatronEngine

    cache = args.lce_cache_bytes if args.lce_cache_bytes == "auto" else int(args.lce_cache_bytes)
    cfg = EngineConfig(
        model=ModelConfig(preset=args.preset, dtype="auto", max_seq_len=max(args.seq, 64),
                          vocab_size=args.vocab, num_layers=args.layers,
                          rope_fusion=getattr(args, "rope_fusion", "on") == "on",
                          cross_entropy_loss_fusion=route == "megatron_fusedce"),
        parallel=ParallelConfig(tensor_parallel=args.tp, sequence_parallel=args.sp),
        optim=OptimConfig(lr=1e-5, clip_grad=1.0), use_fused_linear_ce=fused, seed=1234,
        model_cuda_graphs={"auto": "auto", "on": True, "off": False}[getattr(args, "model_graphs", "auto")],
        lce=LCEConfig(
            cache_bytes=1 << 40 if route == "fused_cache" else cache,
            compact_ignored={"auto": "auto", "on": True, "off": False}[getattr(args, "compact_ignored", "auto")]))
    return MegatronEngine(cfg, trainable=trainable)


def _batches(args, vocab: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    mbs = []
    for _ in range(args.micro_batches):
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        mbs.append(MicroBatch(ids, labels))
    return mbs


class _NLL:
    """The SFT loss. logprobs_only (route "megatron"): it reads the logprobs alone, so with the flag off the
    engine computes it through megatron-core's own loss (MegatronEngine.uses_megatron_loss); otherwise it
    also reads the entropy, which keeps the flag-off engine on areal_lce's materialised route."""

    def __init__(self, n_micro: int, logprobs_only: bool):
        self.n_micro, self.logprobs_only = n_micro, logprobs_only

    def __call__(self, stats, mb):
        mask = mb.labels.to(stats.logprobs.device) != -100
        nll = -(stats.logprobs * mask).sum() / mask.sum().clamp_min(1)
        if self.logprobs_only:
            return nll / self.n_micro, {}
        return nll / self.n_micro, {"entropy": ((stats.entropy * mask).sum() / mask.sum().clamp_min(1)).detach()}


def sft_loss(n_micro: int, logprobs_only: bool = False):
    return _NLL(n_micro, logprobs_only)


# megatron: flag off, megatron-core's own loss path (megatron_fusedce: with its cross_entropy_loss_fusion);
# fused_cache: the fused route with a logits cache that holds every micro-batch's logits
SFT_ROUTES = ("fused", "fused_cache", "megatron", "megatron_fusedce", "materialised")


def run_sft(args, route: str) -> dict:
    if route not in SFT_ROUTES:
        raise SystemExit(f"--routes: the sft job takes {', '.join(SFT_ROUTES)}, got {route!r}")
    eng = _engine(args, route.startswith("fused"), route=route)
    times, losses, peaks, reserved = [], [], [], []
    try:
        for step in range(args.steps):
            mbs = _batches(args, eng.vocab_size, step)
            sync()
            t0 = time.perf_counter()
            out = eng.train_step(mbs, sft_loss(len(mbs), route.startswith("megatron")))
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(out["loss"])
            peaks.append(out["peak_mem_gib"])
            reserved.append(out["peak_reserved_gib"])
    except torch.OutOfMemoryError as e:
        del eng
        clean()
        print(f"[sft {route}] out of memory: {str(e).splitlines()[0]}", flush=True)
        return {"route": route, "oom": True}
    tokens = args.micro_batch * args.seq * args.micro_batches
    med = statistics.median(times[1:] if len(times) > 1 else times)
    del eng
    clean()  # gc first: megatron-core's DDP hooks keep a dropped engine in reference cycles (docs/megatron.md)
    return {"route": route, "step_s": med, "step_s_all": times,
            "tokens_per_s": tokens / med, "peak_mem_gib": max(peaks[1:] or peaks),
            "peak_reserved_gib": max(reserved[1:] or reserved), "loss": losses}


def grpo_passes(args, eng, ref, prompts, resp, g) -> tuple:
    """The phases of one GRPO step after its rollout: behaviour and reference logprob passes (the RL job's
    own `batched_token_stats`, in forwards of up to --logprob-max-tokens tokens) and the PPO update, in
    microbatches of args.micro_batch. Returns ({phase: seconds}, train_step's output)."""
    from areal_lce.train.rl import batched_token_stats, logprob_ranges
    from areal_lce.train.rl_config import RLConfig
    from areal_lce.train.rl_losses import PolicyMicroBatch, group_advantages, rl_loss

    sync(); t1 = time.perf_counter()
    seqs = [p + r for p, r in zip(prompts, resp)]
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    labels = torch.full((len(seqs), s), -100, dtype=torch.long)
    for i, (p, x) in enumerate(zip(prompts, seqs)):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, len(p) - 1: len(x) - 1] = torch.tensor(x[len(p):])
    batch = MicroBatch(ids, labels)
    lmt = args.logprob_max_tokens if args.logprob_max_tokens == "auto" else int(args.logprob_max_tokens)
    budget = RLConfig(logprob_max_tokens=lmt).logprob_budget(eng.route.fused)
    ranges = logprob_ranges(batch, budget, args.micro_batch, eng.cfg.pack_sequences)  # as the RL job runs them
    old = batched_token_stats(eng, batch, ranges)["logprobs"]
    sync(); t2 = time.perf_counter()
    refl = batched_token_stats(ref, batch, ranges)["logprobs"]
    sync(); t3 = time.perf_counter()
    rewards = torch.rand(len(seqs), generator=g)
    adv = group_advantages(rewards, args.group)
    n_tok = int((labels != -100).sum())
    mbs = []
    for i in range(0, len(seqs), args.micro_batch):
        sl = slice(i, i + args.micro_batch)
        mbs.append(PolicyMicroBatch(input_ids=ids[sl], labels=labels[sl], advantages=adv[sl],
                                    old_logprobs=old[sl], ref_logprobs=refl[sl], num_tokens=n_tok,
                                    num_seqs=len(seqs)))
    rl = RLConfig()
    out = eng.train_step(mbs, lambda st, mb: rl_loss(st, mb, rl))
    sync(); t4 = time.perf_counter()
    return {"behaviour_logprobs": t2 - t1, "reference_logprobs": t3 - t2, "update": t4 - t3}, out


def run_grpo(args, route: str) -> dict:
    if route not in ("fused", "materialised"):
        raise SystemExit(f"--routes: the grpo job takes fused and materialised, got {route!r}")
    fused = route == "fused"
    eng = _engine(args, fused)
    ref = _engine(args, fused, trainable=False)  # frozen reference policy, as the RL job builds it
    print(f"[grpo] engines built ({'fused' if fused else 'materialised'})", flush=True)
    phases = {"rollout": [], "behaviour_logprobs": [], "reference_logprobs": [], "update": []}
    peaks, reserved = [], []
    g = torch.Generator().manual_seed(7)
    for step in range(args.steps):
        prompts = [torch.randint(0, eng.vocab_size, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.prompts)]
        prompts = [p for p in prompts for _ in range(args.group)]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sync(); t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(step)  # the engine samples on the host
        resp = eng.generate(prompts, args.new_tokens, temperature=1.0, top_p=1.0, eos_id=None, generator=gen)
        sync()
        phases["rollout"].append(time.perf_counter() - t0)
        times, out = grpo_passes(args, eng, ref, prompts, resp, g)
        for k, v in times.items():
            phases[k].append(v)
        print(f"[grpo {'fused' if fused else 'materialised'} step {step}] " +
              " ".join(f"{k}={v[-1] * 1e3:.0f}ms" for k, v in phases.items()), flush=True)
        peaks.append(out["peak_mem_gib"] if not torch.cuda.is_available() else torch.cuda.max_memory_allocated() / 2**30)
        reserved.append(out["peak_reserved_gib"] if not torch.cuda.is_available() else torch.cuda.max_memory_reserved() / 2**30)
    med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in phases.items()}
    del eng, ref
    clean()
    return {"route": "fused" if fused else "materialised", "phase_s": med, "phase_s_all": phases,
            "step_s": sum(med.values()), "peak_mem_gib": max(peaks[1:] or peaks),
            "peak_reserved_gib": max(reserved[1:] or reserved)}


def merge_rounds(runs: list) -> dict:
    """One route's result over paired rounds: the first round's record with its step time (and phases) the
    median over the rounds, the peaks the largest, every round's step time kept (step_s_rounds)."""
    if any(r.get("oom") for r in runs):
        return runs[0] if runs[0].get("oom") else {"route": runs[0]["route"], "oom": True}
    out = dict(runs[0])
    out["step_s_rounds"] = [r["step_s"] for r in runs]
    out["step_s"] = statistics.median(out["step_s_rounds"])
    if "phase_s" in out:
        out["phase_s"] = {k: statistics.median(r["phase_s"][k] for r in runs) for k in out["phase_s"]}
        out["step_s"] = sum(out["phase_s"].values())
    for k in ("peak_mem_gib", "peak_reserved_gib"):
        out[k] = max(r[k] for r in runs)
    if "tokens_per_s" in out:
        out["tokens_per_s"] = runs[0]["tokens_per_s"] * runs[0]["step_s"] / out["step_s"]
    return out


def isolated(args, route: str, k: int) -> dict:
    """`route`'s result from a torchrun process of its own (the same arguments, that route, one round)."""
    skip = {"--routes", "--rounds", "--out", "--isolate", "--nproc"}
    argv, it = [], iter(sys.argv[1:])
    for a in it:
        name = a.split("=", 1)[0]
        if name in skip:
            if "=" not in a and name not in ("--isolate",):
                next(it, None)
            continue
        argv.append(a)
    out = os.path.join(args.out, f"isolated_round{k}_{route}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m",
           "benchmark.engine.bench_train", *argv, "--routes", route, "--out", out]
    print(f"[round {k}] {route}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True)
    (name,) = [f for f in os.listdir(out) if f.endswith(".json")]
    with open(os.path.join(out, name)) as f:
        return json.load(f)["results"][0]


def paired_ratio(a: dict, b: dict) -> float:
    """a's step time over b's: the median of the per-round ratios (each round runs both in turn)."""
    return statistics.median(x / y for x, y in zip(a["step_s_rounds"], b["step_s_rounds"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=["sft", "grpo"], default="sft")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--vocab", type=int, default=0, help="true vocab (0: the preset's)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--routes", default="fused,materialised",
                    help="comma list: fused, materialised, and for sft megatron (flag off through megatron-core's "
                         "own loss)")
    ap.add_argument("--logprob-max-tokens", default="auto",
                    help="rl.logprob_max_tokens of the logprob passes: tokens per forward, or auto (the job's "
                         "default: 16384 on the fused route, --micro-batch sequences on the materialised one)")
    ap.add_argument("--lce-cache-bytes", default="0", help="engine.lce.cache_bytes of the fused route: bytes or auto")
    ap.add_argument("--compact-ignored", choices=["auto", "on", "off"], default="auto",
                    help="engine.lce.compact_ignored of the fused route: auto, true (on) or false (off)")
    ap.add_argument("--rope-fusion", choices=["on", "off"], default="on",
                    help="model.rope_fusion of both routes (on: the fused RoPE kernel, the default)")
    ap.add_argument("--model-graphs", choices=["auto", "on", "off"], default="auto",
                    help="engine.model_cuda_graphs of both routes: auto (the default: the fused route's packed "
                         "model calls replayed from CUDA graphs), on (both routes), off")
    ap.add_argument("--rounds", type=int, default=1,
                    help="paired rounds: the whole route list runs this many times in one process, one round after "
                         "another; a route's time is its median over the rounds, a ratio the median of the rounds' ratios")
    ap.add_argument("--isolate", action="store_true",
                    help="each route of each round in its own torchrun process (run this one with plain python): "
                         "nothing of one route's engine (allocations, CUDA-graph pools) is left when the next runs")
    ap.add_argument("--nproc", type=int, default=1, help="with --isolate: processes per route (torchrun's nproc_per_node)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds}: expected >= 1")
    runner = run_sft if args.job == "sft" else run_grpo
    if args.isolate:
        rounds = [[isolated(args, r, k) for r in args.routes.split(",")] for k in range(args.rounds)]
    else:
        rounds = [[runner(args, r) for r in args.routes.split(",")] for _ in range(args.rounds)]
    results = [merge_rounds([rnd[i] for rnd in rounds]) for i in range(len(rounds[0]))]
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    meta = run_meta(args=vars(args), world=int(os.environ.get("WORLD_SIZE", "1")))
    seq = args.seq if args.job == "sft" else args.prompt_len + args.new_tokens
    n_tok = args.micro_batch * seq
    from areal_lce.engine.model.builder import padded_vocab_size  # noqa: F401  (documented padding rule)
    print(f"\n{args.job} {args.preset} tp={args.tp} sp={args.sp} seq={args.seq} micro_batch={args.micro_batch} "
          f"x{args.micro_batches} rope_fusion={args.rope_fusion} model_graphs={args.model_graphs} on {meta['device']} (git {meta['git_sha']})")
    for r in results:
        if r.get("oom"):
            print(f"  {r['route']:>13}: out of memory")
            continue
        extra = ("  " + "  ".join(f"{k}={v * 1e3:.0f}ms" for k, v in r["phase_s"].items())) if "phase_s" in r else ""
        loss = f" loss[0]={r['loss'][0]:.6f}" if "loss" in r else ""
        print(f"  {r['route']:>13}: step {r['step_s'] * 1e3:8.1f} ms  peak {r['peak_mem_gib']:7.2f} GiB allocated, "
              f"{r['peak_reserved_gib']:7.2f} GiB reserved{loss}{extra}")
    ok = {r["route"]: r for r in results if not r.get("oom")}
    if "fused" in ok and len(ok) > 2:
        for other in (k for k in ok if k != "fused"):
            meta[f"fused_over_{other}_time"] = paired_ratio(ok["fused"], ok[other])
            meta[f"memory_saved_vs_{other}_gib"] = ok[other]["peak_mem_gib"] - ok["fused"]["peak_mem_gib"]
            print(f"  fused/{other} step time {meta[f'fused_over_{other}_time']:.3f}; memory saved "
                  f"{meta[f'memory_saved_vs_{other}_gib']:.2f} GiB")
    if len(results) == 2 and len(ok) == 2:
        f, m = results
        if "phase_s" in f:
            passes = [sum(r["phase_s"][k] for k in ("behaviour_logprobs", "reference_logprobs")) for r in (f, m)]
            meta["logprob_passes_fused_over_materialised"] = passes[0] / passes[1]
            print(f"  logprob passes (behaviour + reference) fused/materialised "
                  f"{meta['logprob_passes_fused_over_materialised']:.3f}")
        meta["fused_over_materialised_time"] = paired_ratio(f, m)
        meta["memory_saved_gib"] = m["peak_mem_gib"] - f["peak_mem_gib"]
        meta["reserved_saved_gib"] = m["peak_reserved_gib"] - f["peak_reserved_gib"]
        print(f"  fused/materialised step time {meta['fused_over_materialised_time']:.3f} (target <= 1.0); "
              f"memory saved {meta['memory_saved_gib']:.2f} GiB allocated, {meta['reserved_saved_gib']:.2f} GiB reserved; fp32 logits of one microbatch "
              f"(4·N·V/tp) = {4 * n_tok * 151936 / args.tp / 2**30:.2f} GiB for a 151936 vocab")
        if "loss" in f:
            rel = abs(f["loss"][0] - m["loss"][0]) / max(abs(m["loss"][0]), 1e-12)
            meta["first_loss_rel_diff"] = rel
            print(f"  first-step loss relative difference {rel:.2e}")
    routes = "" if args.routes == "fused,materialised" else "_" + args.routes.replace(",", "_")
    routes += "" if args.rope_fusion == "on" else "_unfused_rope"
    routes += "" if args.model_graphs == "auto" else f"_graphs_{args.model_graphs}"
    routes += "" if args.compact_ignored == "auto" else f"_compact_{args.compact_ignored}"
    routes += "" if args.rounds == 1 else f"_rounds{args.rounds}"
    routes += "_isolated" if args.isolate else ""
    write_json(args.out, f"train_{args.job}_{args.preset}_tp{args.tp}{routes}.json", {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
