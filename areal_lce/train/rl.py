"""GRPO / PPO job: rollout -> behaviour logprobs -> reference logprobs -> advantages -> PPO updates.

One RL step, on every rank (tensor-parallel ranks do identical host work; data-parallel ranks each
take `prompts_per_step / dp` prompts):

1. prompts  `rl.task` samples `prompts_per_step` prompts from an RNG seeded by (seed, step), so a
            resumed run draws the same prompts; each is repeated `group_size` times.
2. rollout  `policy.generate` samples responses from the current Megatron policy (temperature, top-p,
            stop at EOS) with a torch.Generator seeded by (seed, step, dp_rank); `rl.reward_fn` scores
            each decoded response.
3. logprobs `policy.token_stats(..., grad=False)` gives the behaviour logprobs (and the rollout's
            entropy and vocab max/min logits); `reference.token_stats(..., grad=False)` gives the frozen
            reference's. Both at the sampling temperature, through the fused op when
            `engine.use_fused_linear_ce` (materialised logits otherwise).
4. adv      group-normalised (GRPO) or batch-normalised (critic-free PPO) sequence advantages.
5. update   `ppo_epochs` passes, each split into `minibatches` optimizer steps run as microbatches of
            `trainer.micro_batch_size` sequences through `policy.train_step(mbs, rl_loss)`; every
            microbatch carries `temperature`, so the trained logprobs are those of logits / T.

Reference policy: a second, frozen `MegatronEngine(..., trainable=False)` built from the same config
(the model only: no grad buffers, no optimizer), whose parameters are copied from the policy before any
checkpoint is loaded. It therefore equals the initial policy (the preset init or `hf_checkpoint_dir`)
on a fresh run and on a resumed one alike, and needs no checkpoint of its own.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch

from ..megatron.microbatch import MicroBatch
from .checkpoint import clear_run_dir, end_of_step, load_resumable, resolve_resume
from .data import Example, check_special_ids, check_token_ids, collate
from .logging_utils import MetricsLog, ProgressBar, format_record, plot_metrics, read_metrics
from .rewards import load_reward
from .rl_losses import PolicyMicroBatch, batch_advantages, group_advantages, rl_loss
from .tasks import build_task
from .tokenizer import load_tokenizer

RL_LOG_KEYS = ("step", "reward", "entropy", "kl", "clip_frac", "approx_kl", "response_len", "max_logit",
               "min_logit", "grad_norm", "lr", "step_time_s")
RL_PLOT_KEYS = ("reward", "entropy", "kl", "clip_frac", "response_len", "max_logit", "min_logit", "grad_norm")


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (seed, step, salt, ...), stable across processes."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h * 6364136223846793005 + int(p) + 1442695040888963407) % (1 << 63)
    return h


def rollout_batch(prompt_ids: List[List[int]], responses: List[List[int]], pad_id: int,
                  pad_to_multiple_of: int = 1) -> MicroBatch:
    """Right-padded MicroBatch [B, S]: labels are the next tokens on response positions only."""
    examples = [Example(ids=tuple(p) + tuple(r), loss_start=len(p)) for p, r in zip(prompt_ids, responses)]
    return collate(examples, pad_id, pad_to_multiple_of)


def batched_token_stats(engine, batch: MicroBatch, micro_batch_size: int, temperature: float):
    """No-grad TokenStats of the whole batch, run in microbatches; returns a dict of [B, S] tensors."""
    out = {}
    n = batch.rows
    for start in range(0, n, micro_batch_size):
        idx = torch.arange(start, min(start + micro_batch_size, n))
        st = engine.token_stats(batch.input_ids[idx], batch.labels[idx], temperature=temperature, grad=False)
        for name in ("logprobs", "entropy", "max_logit", "min_logit"):
            out.setdefault(name, []).append(getattr(st, name).detach().float().cpu())
    return {k: torch.cat(v) for k, v in out.items()}


def minibatch_plan(batch: PolicyMicroBatch, order: torch.Tensor, minibatches: int,
                   micro_batch_size: int) -> List[List[PolicyMicroBatch]]:
    """Split the step's batch (in `order`) into minibatches of microbatches carrying minibatch totals."""
    plan = []
    for mb_idx in order.chunk(minibatches):
        totals = dataclasses.replace(batch, num_tokens=int((batch.labels[mb_idx] != -100).sum()),
                                     num_seqs=len(mb_idx))
        plan.append([totals.select(mi) for mi in mb_idx.split(micro_batch_size)])
    return plan


def _copy_parameters(src, dst) -> None:
    """dst's parameters := src's (same architecture and parallel layout; names must match)."""
    s, d = dict(src.parameters_named()), dict(dst.parameters_named())
    if s.keys() != d.keys():
        raise RuntimeError(f"reference engine parameters differ from the policy's: {sorted(set(s) ^ set(d))[:5]}")
    with torch.no_grad():
        for name, p in s.items():
            d[name].copy_(p)


def _mean_over_dp(values: dict, dp_group, dp_size: int) -> dict:
    """Average float metrics over data-parallel ranks (identical on tensor-parallel ranks already)."""
    if dp_size == 1 or not values:
        return values
    from areal_lce.comms import all_reduce_sum_

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    all_reduce_sum_(t, dp_group)  # sum of per-rank means over DP ranks -> divided below
    return {k: float(v) / dp_size for k, v in zip(keys, t.tolist())}


def _extreme_over_dp(value: float, dp_group, dp_size: int, op: str) -> float:
    if dp_size == 1:
        return value
    from areal_lce.comms import all_reduce_max_

    t = torch.tensor([value if op == "max" else -value], dtype=torch.float64)
    all_reduce_max_(t, dp_group)  # global max (min as max of negated values) over DP ranks
    return float(t[0]) if op == "max" else -float(t[0])


class RLJob:
    """State of one GRPO/PPO run: engines, tokenizer, task, reward and the step loop."""

    def __init__(self, cfg, dist_info, engine_factory: Optional[Callable] = None):
        self.cfg, self.rl, self.dist = cfg, cfg.rl, dist_info
        self.algo = cfg.job
        rl, tr = cfg.rl, cfg.trainer
        self.local_prompts, self.micro = rl.rank_split(dist_info.dp_size, tr.micro_batch_size)
        self.advantage = rl.advantage_for(self.algo)

        self.tok = load_tokenizer(cfg.data.tokenizer)
        self.task = build_task(rl.task, rl.task_options)
        self.reward_fn = load_reward(rl.reward_fn or self.task.default_reward)
        self.pad_mult = cfg.data.pad_to_multiple_of
        if cfg.engine.parallel.sequence_parallel:  # the sequence is split over TP ranks
            self.pad_mult = math.lcm(self.pad_mult, dist_info.tp_size)

        model_vocab = cfg.engine.model.vocab_size  # when set, a model vocabulary larger than the tokenizer's
        if model_vocab and model_vocab < self.tok.vocab_size:
            raise ValueError(f"engine.model.vocab_size={model_vocab} is smaller than the tokenizer's "
                             f"{self.tok.vocab_size} ids (data.tokenizer={cfg.data.tokenizer!r})")
        self.vocab_size = model_vocab or self.tok.vocab_size
        check_special_ids(self.tok, self.vocab_size)
        factory = engine_factory or _default_engine
        self.policy = factory(cfg.engine, model_vocab or self.tok.vocab_size)
        self.reference = factory(cfg.engine, model_vocab or self.tok.vocab_size, trainable=False)
        _copy_parameters(self.policy, self.reference)

        from megatron.core import parallel_state as mpu

        self.dp_group = mpu.get_data_parallel_group() if dist_info.dp_size > 1 else None

    # ---- one step ------------------------------------------------------------------------------
    def encode_prompt(self, text: str) -> List[int]:
        ids = self.tok.encode(text)
        if self.cfg.data.add_bos and self.tok.bos_id is not None:
            ids = [self.tok.bos_id] + ids
        check_token_ids(ids, self.vocab_size, f"rl.task={self.rl.task!r} prompt {text!r}")
        longest = len(ids) + self.rl.max_new_tokens
        if longest > self.cfg.engine.model.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens + rl.max_new_tokens={self.rl.max_new_tokens} exceeds "
                             f"engine.model.max_seq_len={self.cfg.engine.model.max_seq_len}")
        return ids

    def rollout(self, step: int) -> dict:
        rl, seed, d = self.rl, self.cfg.trainer.seed, self.dist
        prompts = self.task.sample(rl.prompts_per_step, random.Random(_seed(seed, step, 1)))
        prompts = prompts[d.dp_rank * self.local_prompts:(d.dp_rank + 1) * self.local_prompts]
        items = [p for p in prompts for _ in range(rl.group_size)]
        prompt_ids = [self.encode_prompt(p.text) for p in items]
        gen = torch.Generator().manual_seed(_seed(seed, step, 2, d.dp_rank))
        eos = self.tok.eos_id if rl.stop_at_eos else None
        responses = self.policy.generate(prompt_ids, rl.max_new_tokens, temperature=rl.temperature,
                                         top_p=rl.top_p, eos_id=eos, generator=gen)
        texts = [self.tok.decode(r) for r in responses]
        rewards = torch.tensor([float(self.reward_fn(prompt=p.text, response=t, answer=p.answer))
                                for p, t in zip(items, texts)], dtype=torch.float32)
        batch = rollout_batch(prompt_ids, responses, self.tok.pad_id, self.pad_mult)
        return {"batch": batch, "rewards": rewards, "texts": texts, "items": items,
                "response_len": sum(len(r) for r in responses) / len(responses)}

    def step(self, step: int) -> dict:
        rl = self.rl
        t0 = time.perf_counter()
        ro = self.rollout(step)
        batch, rewards = ro["batch"], ro["rewards"]
        t_gen = time.perf_counter() - t0
        behav = batched_token_stats(self.policy, batch, self.micro, rl.temperature)
        ref = batched_token_stats(self.reference, batch, self.micro, rl.temperature)
        if self.advantage == "group":
            adv = group_advantages(rewards, rl.group_size, std_norm=rl.adv_std_norm, eps=rl.adv_eps)
        else:
            adv = batch_advantages(rewards, std_norm=rl.adv_std_norm, eps=rl.adv_eps)
        full = PolicyMicroBatch(input_ids=batch.input_ids, labels=batch.labels, temperature=rl.temperature,
                                old_logprobs=behav["logprobs"], ref_logprobs=ref["logprobs"], advantages=adv)

        sums: dict = {}
        count = 0
        gen = torch.Generator().manual_seed(_seed(self.cfg.trainer.seed, step, 3, self.dist.dp_rank))
        for _ in range(rl.ppo_epochs):
            order = torch.randperm(rewards.numel(), generator=gen)
            for mbs in minibatch_plan(full, order, rl.minibatches, self.micro):
                out = self.policy.train_step(mbs, lambda stats, mb: rl_loss(stats, mb, rl))
                for k, v in out.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        upd = {k: v / count for k, v in sums.items()}

        mask = batch.labels != -100
        n_tok = mask.sum().clamp_min(1)
        local = {
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std(correction=0)),
            "response_len": ro["response_len"],
            "entropy": float((behav["entropy"] * mask).sum() / n_tok),  # rollout (behaviour) entropy
            "kl": upd.get("kl", 0.0),
            "clip_frac": upd.get("clip_frac", 0.0),
            "approx_kl": upd.get("approx_kl", 0.0),
            "ratio_mean": upd.get("ratio_mean", 1.0),
            "pg_loss": upd.get("pg_loss", 0.0),
            "loss": upd.get("loss", 0.0),
            "grad_norm": upd.get("grad_norm", 0.0),
        }
        rec = _mean_over_dp(local, self.dp_group, self.dist.dp_size)
        rec["ratio_max"] = _extreme_over_dp(upd.get("ratio_max", 1.0), self.dp_group, self.dist.dp_size, "max")
        rec["ratio_min"] = _extreme_over_dp(upd.get("ratio_min", 1.0), self.dp_group, self.dist.dp_size, "min")
        # vocab logit extremes of the rollout's response tokens (raw logits, before temperature)
        rec["max_logit"] = _extreme_over_dp(float(behav["max_logit"][mask].max()), self.dp_group,
                                            self.dist.dp_size, "max")
        rec["min_logit"] = _extreme_over_dp(float(behav["min_logit"][mask].min()), self.dp_group,
                                            self.dist.dp_size, "min")
        rec.update(lr=upd.get("lr", 0.0), peak_mem_gib=upd.get("peak_mem_gib", 0.0),
                   tokens=int(n_tok) * self.dist.dp_size, gen_time_s=t_gen, step_time_s=time.perf_counter() - t0,
                   sample=repr(ro["items"][0].text + ro["texts"][0]))
        return rec


def _default_engine(engine_cfg, vocab_size: int, *, trainable: bool = True):
    from areal_lce.megatron.engine import MegatronEngine

    return MegatronEngine(engine_cfg, vocab_size=vocab_size, trainable=trainable)


def run(cfg, engine_factory: Optional[Callable] = None) -> dict:
    """Run the GRPO/PPO job `cfg` (a JobConfig with job grpo|ppo).

    Returns {'output_dir', 'step' (last step run), 'records' (this invocation's metric records)}.
    `engine_factory(engine_cfg, vocab_size, *, trainable=True)` replaces MegatronEngine (tests only);
    the reference policy is built with trainable=False.
    """
    from areal_lce.megatron.parallel import destroy_distributed, init_distributed

    if cfg.job not in ("grpo", "ppo"):
        raise ValueError(f"job={cfg.job!r}: the RL runner handles grpo and ppo")
    dist_info = init_distributed(cfg.engine.parallel, seed=cfg.engine.seed)
    try:
        return _train(cfg, dist_info, engine_factory)
    finally:
        destroy_distributed()


def _train(cfg, dist_info, engine_factory) -> dict:
    from .config import dump_yaml

    tr, main = cfg.trainer, dist_info.is_main
    out = Path(tr.output_dir)
    resume_from = resolve_resume(tr.resume, out)
    if resume_from is None:
        clear_run_dir(out, main)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_yaml(cfg))
    job = RLJob(cfg, dist_info, engine_factory)
    random.seed(tr.seed)  # after the engines, whose set-up seeds torch with engine.seed
    torch.manual_seed(tr.seed)
    start = 0
    if resume_from is not None:
        resume_from, state = load_resumable(job.policy, out, resume_from)  # falls back past a damaged one
        start = int(state["step"])
    log = MetricsLog(out / "metrics.jsonl", enabled=main, resume_step=start)
    if main:
        route = "fused linear op" if cfg.engine.use_fused_linear_ce else "materialised logits"
        print(f"[{cfg.job}] task {cfg.rl.task} {cfg.rl.task_options or ''}, reward "
              f"{cfg.rl.reward_fn or job.task.default_reward}, advantage {job.advantage}, tokenizer "
              f"{job.tok.name} ({job.tok.vocab_size} ids), world {dist_info.world_size} = TP {dist_info.tp_size} "
              f"x PP {dist_info.pp_size} x CP {dist_info.cp_size} x DP {dist_info.dp_size}, LM-head route: {route}, rollout: "
              f"{'KV cache' if cfg.engine.kv_cache else 'full recompute'}"
              + (f", resumed from {resume_from} (step {start})" if resume_from else ""), flush=True)
    bar = ProgressBar(tr.steps, initial=start, enabled=tr.progress, is_main=main, desc=cfg.job)
    records, step = [], start
    for step in range(start + 1, tr.steps + 1):
        rec = {"step": step, **job.step(step)}
        records.append(rec)
        log.write(rec)
        bar.update({"reward": f"{rec['reward']:.3f}", "kl": f"{rec['kl']:.2e}"})
        if main and (step % tr.log_interval == 0 or step == tr.steps):
            bar.write(format_record(rec, RL_LOG_KEYS) + f"  sample={rec['sample']}")
        if end_of_step(job.policy, tr, out, step, {"config": dump_yaml(cfg)}, main, bar.write, cfg.job):
            break
    bar.close()
    if main and tr.plot and step == tr.steps:
        png = plot_metrics(read_metrics(out / "metrics.jsonl"), out / "metrics.png", RL_PLOT_KEYS,
                           title=f"{cfg.job} {cfg.rl.task} {out.name}")
        if png:
            print(f"[{cfg.job}] wrote {out / 'metrics.jsonl'} and {png}", flush=True)
    return {"output_dir": str(out), "step": step, "records": records}
