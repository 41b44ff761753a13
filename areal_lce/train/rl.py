"""GRPO / PPO job: rollout -> behaviour logprobs -> reference logprobs -> advantages -> PPO updates.

One RL step, on every rank (tensor-parallel ranks do identical host work; data-parallel ranks each
take `prompts_per_step / dp` prompts):

1. prompts  `rl.task` samples `prompts_per_step` prompts from an RNG seeded by (seed, step), so a
            resumed run draws the same prompts; each is repeated `group_size` times.
2. rollout  `policy.generate` samples responses from the current Megatron policy (temperature, top-p,
            stop at EOS) with a torch.Generator seeded by (seed, step, dp_rank), and returns the
            sampler's logprobs of them (the training head's, docs/rl.md "Zero-mismatch RL");
            `rl.reward_fn` scores each decoded response.
3. logprobs `policy.token_stats(..., grad=False)` gives the behaviour logprobs (and the rollout's
            entropy and vocab max/min logits); `reference.token_stats(..., grad=False)` gives the frozen
            reference's. Both at the sampling temperature, through the fused op when
            `engine.use_fused_linear_ce` (materialised logits otherwise), in forwards of up to
            `rl.logprob_max_tokens` packed tokens (no grad: the fused route runs a whole step's batch in
            a few large forwards, where the per-forward host cost of megatron's eager model no longer
            dominates), with one device-to-host copy of the statistics at the end.
4. adv      group-normalised (GRPO) or batch-normalised (critic-free PPO) sequence advantages.
5. update   `ppo_epochs` passes, each split into `minibatches` optimizer steps run as microbatches of
            `trainer.micro_batch_size` sequences through `policy.train_step(mbs, rl_loss)`; every
            microbatch carries `temperature`, so the trained logprobs are those of logits / T.
            The first update's logprobs (the policy that sampled, before any optimizer step) against
            the rollout's on the same response tokens give the mismatch metrics, every step:
            train_rollout_logprob_abs_diff_max / _mean and importance_ratio_abs_dev_max
            (max |exp(lp_train - lp_rollout) - 1|).

Reference policy: a second, frozen `MegatronEngine(..., trainable=False)` built from the same config
(the model only: no grad buffers, no optimizer), whose parameters are copied from the policy before any
checkpoint is loaded. It therefore equals the initial policy (the preset init or `hf_checkpoint_dir`)
on a fresh run and on a resumed one alike, and needs no checkpoint of its own.
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import List

import torch

from ..engine.microbatch import MicroBatch, token_budget_ranges
from . import loop
from .config import RL_JOBS
from .data import Example, check_token_ids, collate
from .job import last_stage_share, model_vocab_size, reduce_metrics, run_banner, sequence_multiple
from .rewards import load_reward
from .rl_losses import PolicyMicroBatch, batch_advantages, group_advantages, rl_loss, rollout_mismatch
from .tasks import build_task
from .tokenizer import load_tokenizer

RL_LOG_KEYS = ("step", "reward", "entropy", "kl", "clip_frac", "approx_kl", "response_len", "max_logit",
               "min_logit", "grad_norm", "lr", "step_time_s")
RL_PLOT_KEYS = ("reward", "entropy", "kl", "clip_frac", "response_len", "max_logit", "min_logit", "grad_norm")
# how the step's per-rank metrics become the job's (job.reduce_metrics); the others are data-parallel means,
# ratio_max / ratio_min included: like every loss metric, each micro-batch's value averaged over the
# micro-batches, the updates and the data-parallel ranks (the max / min of the whole step is not logged)
_REDUCE = {"max_logit": "max", "min_logit": "min", "tokens": "sum"}
# the train-vs-rollout metrics' parts, reduced over pipeline stages (only the last one runs the loss) and ranks
_MISMATCH_REDUCE = {"abs_diff_max": "max", "abs_diff_sum": "sum", "tokens": "sum", "ratio_dev_max": "max"}


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (seed, step, salt, ...), stable across processes."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h * 6364136223846793005 + int(p) + 1442695040888963407) % (1 << 63)
    return h


def rollout_batch(prompt_ids: List[List[int]], responses: List[List[int]], pad_id: int,
                  pad_to_multiple_of: int = 1, temperature: float = 1.0) -> MicroBatch:
    """Right-padded MicroBatch [B, S] at the sampling `temperature`: labels are the next tokens on response
    positions only."""
    examples = [Example(ids=tuple(p) + tuple(r), loss_start=len(p)) for p, r in zip(prompt_ids, responses)]
    return dataclasses.replace(collate(examples, pad_id, pad_to_multiple_of), temperature=temperature)


def batched_token_stats(engine, batch: MicroBatch, ranges) -> dict:
    """No-grad TokenStats of the whole batch at its temperature, one forward per row range of `ranges`;
    returns a dict of [B, S] fp32 host tensors. The forwards are queued back to back: the statistics stay
    on the device until one copy to the host at the end."""
    names = ("logprobs", "entropy", "max_logit", "min_logit")
    parts = []
    for rows in ranges:
        st = engine.token_stats(batch.input_ids[rows], batch.labels[rows], temperature=batch.temperature, grad=False)
        parts.append(torch.stack([getattr(st, name).detach().float() for name in names]))
    return dict(zip(names, torch.cat(parts, dim=1).cpu().unbind(0)))


def rollout_logprob_rows(batch: MicroBatch, prompt_ids: List[List[int]], logprobs: List[List[float]]) -> torch.Tensor:
    """The sampler's logprobs laid out like `batch.labels` [B, S] (`rollout_batch`): response token k of
    row i is the label at position len(prompt) - 1 + k; 0 elsewhere."""
    out = torch.zeros(batch.labels.shape, dtype=torch.float32)
    for i, (p, lp) in enumerate(zip(prompt_ids, logprobs)):
        out[i, len(p) - 1:len(p) - 1 + len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


def logprob_ranges(batch: MicroBatch, budget, micro_batch_size: int, packed: bool) -> list:
    """Row ranges of the logprob passes: up to `budget` tokens per forward (token_budget_ranges), or
    `micro_batch_size` sequences per forward when `budget` is None."""
    if budget is None:
        return [slice(i, i + micro_batch_size) for i in range(0, batch.rows, micro_batch_size)]
    return token_budget_ranges(batch.labels, budget, packed=packed)


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


class RLJob:
    """One GRPO/PPO run as the run loop drives it (job.Job): tokenizer, task, reward, and once built the
    policy and frozen reference engines; `step` is one RL step (module docstring)."""

    log_keys, plot_keys = RL_LOG_KEYS + ("sample",), RL_PLOT_KEYS
    postfix = (("reward", ".3f"), ("kl", ".2e"))

    def __init__(self, cfg, dist_info):
        self.cfg, self.rl, self.dist = cfg, cfg.rl, dist_info
        self.name = cfg.job
        self.plot_title = f"{cfg.job} {cfg.rl.task}"
        rl = cfg.rl
        self.local_prompts, self.micro = rl.rank_split(dist_info.dp_size, cfg.trainer.micro_batch_size)
        self.advantage = rl.advantage_for(cfg.job)
        self.tok = load_tokenizer(cfg.data.tokenizer)
        self.task = build_task(rl.task, rl.task_options)
        self.reward_fn = load_reward(rl.reward_fn or self.task.default_reward)
        self.pad_mult = sequence_multiple(cfg, dist_info)
        self.vocab_size = model_vocab_size(cfg, self.tok)
        self.policy = self.reference = None

    @property
    def engine(self):
        """The policy: the trained engine, whose state the checkpoints hold."""
        return self.policy

    def build_engines(self) -> None:
        from ..engine.engine import MegatronEngine

        self.policy = MegatronEngine(self.cfg.engine, vocab_size=self.vocab_size)
        self.reference = MegatronEngine(self.cfg.engine, vocab_size=self.vocab_size, trainable=False)
        _copy_parameters(self.policy, self.reference)

    def banner(self) -> str:
        cfg = self.cfg
        reward = cfg.rl.reward_fn or self.task.default_reward
        return (f"task {cfg.rl.task} {cfg.rl.task_options or ''}, reward {reward}, advantage {self.advantage}, "
                f"{run_banner(self.policy, self.tok)}, rollout: "
                f"{'KV cache' if cfg.engine.kv_cache and self.policy.dist.cp_size == 1 else 'full recompute'}")

    def finish(self, output_dir) -> None:
        pass

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
        responses, logprobs = self.policy.generate(prompt_ids, rl.max_new_tokens, temperature=rl.temperature,
                                                   top_p=rl.top_p, eos_id=eos, generator=gen, return_logprobs=True)
        texts = [self.tok.decode(r) for r in responses]
        rewards = torch.tensor([float(self.reward_fn(prompt=p.text, response=t, answer=p.answer))
                                for p, t in zip(items, texts)], dtype=torch.float32)
        batch = rollout_batch(prompt_ids, responses, self.tok.pad_id, self.pad_mult, rl.temperature)
        return {"batch": batch, "rewards": rewards, "texts": texts, "items": items,
                "rollout_logprobs": rollout_logprob_rows(batch, prompt_ids, logprobs),
                "response_len": sum(len(r) for r in responses) / len(responses)}

    def step(self, step: int) -> dict:
        rl = self.rl
        t0 = time.perf_counter()
        ro = self.rollout(step)
        batch, rewards = ro["batch"], ro["rewards"]
        t_gen = time.perf_counter() - t0
        ranges = logprob_ranges(batch, rl.logprob_budget(self.policy.route.fused), self.micro,
                                self.cfg.engine.pack_sequences)
        behav = batched_token_stats(self.policy, batch, ranges)
        ref = batched_token_stats(self.reference, batch, ranges)
        if self.advantage == "group":
            adv = group_advantages(rewards, rl.group_size, std_norm=rl.adv_std_norm, eps=rl.adv_eps)
        else:
            adv = batch_advantages(rewards, std_norm=rl.adv_std_norm, eps=rl.adv_eps)
        full = PolicyMicroBatch(input_ids=batch.input_ids, labels=batch.labels, temperature=batch.temperature,
                                old_logprobs=behav["logprobs"], ref_logprobs=ref["logprobs"], advantages=adv,
                                rollout_logprobs=ro["rollout_logprobs"])

        sums: dict = {}
        count = 0
        first_update: list = []  # rollout_mismatch of each micro-batch of the step's first update

        def loss_fn(stats, mb):
            if count == 0:  # the policy that sampled: no optimizer step yet
                first_update.append(rollout_mismatch(stats.logprobs, mb.rollout_logprobs, mb.labels != -100))
            return rl_loss(stats, mb, rl)

        gen = torch.Generator().manual_seed(_seed(self.cfg.trainer.seed, step, 3, self.dist.dp_rank))
        for _ in range(rl.ppo_epochs):
            order = torch.randperm(rewards.numel(), generator=gen)
            for mbs in minibatch_plan(full, order, rl.minibatches, self.micro):
                share = self.policy.train_step_local(mbs, loss_fn)  # this rank's values, reduced once below
                for k, v in {**share.values(self.dist), **share.extra}.items():
                    sums[k] = sums[k] + v if k in sums else v
                count += 1
        upd = {k: v / count for k, v in sums.items()}  # this rank's means over the optimizer steps

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
            "ratio_max": upd.get("ratio_max", 1.0),
            "ratio_min": upd.get("ratio_min", 1.0),
            # vocab logit extremes of the rollout's response tokens (raw logits, before temperature)
            "max_logit": float(behav["max_logit"][mask].max()),
            "min_logit": float(behav["min_logit"][mask].min()),
            "tokens": float(mask.sum()),  # response tokens
        }
        # the update's values live on the last pipeline stage, the rollout's on every stage: counted once
        rec = reduce_metrics(last_stage_share(local, _REDUCE, self.dist), _REDUCE, self.dist, over_pipeline=True)
        tokens = int(round(rec.pop("tokens")))
        rec.update(self.mismatch_metrics(first_update))
        rec.update(lr=upd.get("lr", 0.0), peak_mem_gib=upd.get("peak_mem_gib", 0.0), tokens=tokens,
                   gen_time_s=t_gen, step_time_s=time.perf_counter() - t0,
                   sample=repr(ro["items"][0].text + ro["texts"][0]))
        return rec

    def mismatch_metrics(self, parts: list) -> dict:
        """The first update's `rollout_mismatch` parts (one per micro-batch on the last pipeline stage, none
        elsewhere) -> the job's train-vs-rollout metrics."""
        if parts:
            keys = list(_MISMATCH_REDUCE)
            rows = torch.stack([torch.stack([p[k] for k in keys]) for p in parts]).cpu()  # one copy to the host
            local = {k: float(rows[:, j].max() if _MISMATCH_REDUCE[k] == "max" else rows[:, j].sum())
                     for j, k in enumerate(keys)}
        else:  # a stage without the LM head: the reductions' identities
            local = {k: float("-inf") if op == "max" else 0.0 for k, op in _MISMATCH_REDUCE.items()}
        m = reduce_metrics(local, _MISMATCH_REDUCE, self.dist, over_pipeline=self.dist.pp_size > 1)
        n = m["tokens"]
        return {"train_rollout_logprob_abs_diff_max": m["abs_diff_max"] if n else 0.0,
                "train_rollout_logprob_abs_diff_mean": m["abs_diff_sum"] / n if n else 0.0,
                "importance_ratio_abs_dev_max": m["ratio_dev_max"] if n else 0.0}


def run(cfg) -> dict:
    """Run the GRPO/PPO job `cfg` (a JobConfig with job grpo|ppo).

    Returns {'output_dir', 'step' (last step run), 'records' (this invocation's metric records)}.
    """
    if cfg.job not in RL_JOBS:
        raise ValueError(f"job={cfg.job!r}: the RL runner handles {' and '.join(RL_JOBS)}")
    return loop.run(cfg, RLJob)
