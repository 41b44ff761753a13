"""On-policy distillation job: the student samples, a frozen teacher scores the samples with its top-k,
the student learns the forward KL on the teacher's support (distill_loss.py, docs/distill.md).

One step, on every rank (tensor-parallel ranks do identical host work; data-parallel ranks each take
`rl.prompts_per_step / dp` prompts):

1. rollout  the RL jobs' (rl.py `RLJob.rollout`): `rl.task` prompts seeded by (seed, step), each
            repeated `rl.group_size` times, sampled from the student (`policy.generate`) at
            `rl.temperature` / `rl.top_p`, scored by the task's reward (the student's `score`).
2. teacher  `teacher.token_stats(..., top_k=distill.top_k, grad=False)` on prompt + response, at the
            sampling temperature, in forwards of up to `rl.logprob_max_tokens` tokens: per response
            position its top-k ids and logprobs, and its logprob of the sampled token. With
            `distill.teacher_score` the teacher also answers the step's prompts (`teacher_score`).
3. update   `rl.minibatches` optimizer steps over the step's sequences (shuffled), each run as
            micro-batches of `trainer.micro_batch_size` sequences through `policy.train_step`; each
            micro-batch carries the teacher's ids as `selected_ids`, so the student's forward returns its
            logprobs there (`selected_logprobs`) and the loss is the token mean of KL_S(teacher || student)
            (+ `distill.reverse_kl_coef` x the sampled token's reverse-KL term).

Teacher: `MegatronEngine(..., trainable=False)` built from the student's engine options with the model
section `distill.teacher` (same vocabulary), its weights from `distill.teacher_checkpoint` (a train job's
checkpoint, model weights only, any parallel layout: `load_teacher_weights`) or `distill.teacher.hf_checkpoint_dir`. It is
rebuilt the same way on resume; checkpoints hold the student only.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import loop
from .distill_config import teacher_engine_config
from .distill_loss import DistillMicroBatch, distill_loss
from .job import last_stage_share, reduce_metrics, run_banner
from .rl import RLJob, _seed, logprob_ranges, minibatch_plan

DISTILL_LOG_KEYS = ("step", "kl_fwd", "score", "teacher_score", "entropy", "reverse_kl", "response_len",
                    "grad_norm", "lr", "step_time_s")
DISTILL_PLOT_KEYS = ("kl_fwd", "score", "teacher_score", "entropy", "reverse_kl", "grad_norm")
_REDUCE = {"tokens": "sum"}  # the others: data-parallel means (job.reduce_metrics)


def load_teacher_weights(engine, path) -> Path:
    """The teacher's model weights from a train job's checkpoint (checkpoint.load_model_weights: weights
    only, at any parallel layout): `path` is a step directory (holding the COMPLETE marker) or a run
    directory (its latest complete checkpoint). Returns the step directory read."""
    p = Path(path)
    if not (p / ckpt.MARKER).is_file():
        latest = ckpt.latest_checkpoint(p)
        if latest is None:
            raise FileNotFoundError(f"distill.teacher_checkpoint={str(path)!r} is neither a complete checkpoint "
                                    f"(no {ckpt.MARKER} marker) nor a run directory holding one under checkpoints/")
        p = latest
    ckpt.load_model_weights(engine, p)
    return p


def teacher_stats(engine, batch, ranges, top_k: int) -> dict:
    """No-grad teacher statistics of the whole batch at its temperature, one forward per row range:
    'token_logprobs' [B, S] (the sampled tokens), 'topk_ids' [B, S, k] int64, 'topk_logprobs' [B, S, k],
    host tensors (copied to the host once, after the last forward)."""
    parts = {"token_logprobs": [], "topk_ids": [], "topk_logprobs": []}
    for rows in ranges:
        st = engine.token_stats(batch.input_ids[rows], batch.labels[rows], temperature=batch.temperature,
                                grad=False, top_k=top_k)
        parts["token_logprobs"].append(st.logprobs.detach().float())
        parts["topk_ids"].append(st.topk_ids.detach())
        parts["topk_logprobs"].append(st.topk_logprobs.detach().float())
    return {k: torch.cat(v, dim=0).cpu() for k, v in parts.items()}


class DistillJob(RLJob):
    """One distillation run as the run loop drives it (job.Job): the RL job's tokenizer, task, reward and
    rollout, a student (`policy`, the trained engine) and a frozen teacher; `step` is the module's step."""

    log_keys, plot_keys = DISTILL_LOG_KEYS + ("sample",), DISTILL_PLOT_KEYS
    postfix = (("kl_fwd", ".3f"), ("score", ".3f"))

    def __init__(self, cfg, dist_info):
        super().__init__(cfg, dist_info)
        self.distill = cfg.distill
        self.plot_title = f"distill {cfg.rl.task}"
        self.teacher = None
        self.teacher_from = ""

    def build_engines(self) -> None:
        from ..engine.engine import MegatronEngine

        self.policy = MegatronEngine(self.cfg.engine, vocab_size=self.vocab_size)
        self.teacher = MegatronEngine(teacher_engine_config(self.cfg.engine, self.distill.teacher),
                                      vocab_size=self.vocab_size, trainable=False)
        if self.teacher.vocab_size != self.policy.vocab_size:
            raise ValueError(f"distill.teacher has a vocabulary of {self.teacher.vocab_size} ids, the student "
                             f"{self.policy.vocab_size}: the teacher's ids must be the student's")
        if self.distill.teacher_checkpoint:
            self.teacher_from = str(load_teacher_weights(self.teacher, self.distill.teacher_checkpoint))
        else:
            self.teacher_from = self.distill.teacher.hf_checkpoint_dir

    def banner(self) -> str:
        d = self.distill
        return (f"task {self.cfg.rl.task} {self.cfg.rl.task_options or ''}, teacher {self.teacher_from} "
                f"({self.teacher.arch.num_layers} layers, hidden {self.teacher.arch.hidden_size}), top_k {d.top_k}, "
                f"reverse_kl_coef {d.reverse_kl_coef}, student {run_banner(self.policy, self.tok)}")

    def teacher_score(self, step: int, items) -> float:
        """The teacher's mean task score on the step's prompts, sampled as the student samples."""
        rl, d = self.rl, self.dist
        prompt_ids = [self.encode_prompt(p.text) for p in items]
        gen = torch.Generator().manual_seed(_seed(self.cfg.trainer.seed, step, 4, d.dp_rank))
        eos = self.tok.eos_id if rl.stop_at_eos else None
        out = self.teacher.generate(prompt_ids, rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                                    eos_id=eos, generator=gen)
        return sum(float(self.reward_fn(prompt=p.text, response=self.tok.decode(r), answer=p.answer))
                   for p, r in zip(items, out)) / len(items)

    def step(self, step: int) -> dict:
        rl = self.rl
        t0 = time.perf_counter()
        ro = self.rollout(step)
        batch = ro["batch"]
        t_gen = time.perf_counter() - t0
        ranges = logprob_ranges(batch, rl.logprob_budget(self.policy.route.fused), self.micro,
                                self.cfg.engine.pack_sequences)
        teacher = teacher_stats(self.teacher, batch, ranges, self.distill.top_k)
        full = DistillMicroBatch(input_ids=batch.input_ids, labels=batch.labels, temperature=batch.temperature,
                                 selected_ids=teacher["topk_ids"], teacher_logprobs=teacher["topk_logprobs"],
                                 teacher_token_logprobs=teacher["token_logprobs"])
        coef = self.distill.reverse_kl_coef

        def loss_fn(stats, mb):
            return distill_loss(stats, mb, coef)

        gen = torch.Generator().manual_seed(_seed(self.cfg.trainer.seed, step, 3, self.dist.dp_rank))
        order = torch.randperm(batch.rows, generator=gen)
        shares = [self.policy.train_step_local(mbs, loss_fn)  # this rank's values, reduced once below
                  for mbs in minibatch_plan(full, order, rl.minibatches, self.micro)]
        outs = [{**s.values(self.dist), **s.extra} for s in shares]
        upd = {k: sum(o[k] for o in outs) / len(outs) for k in outs[0]}  # this rank's means over the optimizer steps
        mask = batch.labels != -100
        local = {"kl_fwd": upd["kl_fwd"], "reverse_kl": upd["reverse_kl"], "entropy": upd["entropy"],
                 "score": float(ro["rewards"].mean()), "response_len": ro["response_len"], "loss": upd["loss"],
                 "grad_norm": upd["grad_norm"], "tokens": float(mask.sum())}
        if self.distill.teacher_score:  # else absent from the record (and the plot)
            local["teacher_score"] = self.teacher_score(step, ro["items"])
        # the update's values live on the last pipeline stage, the rollout's on every stage: counted once
        rec = reduce_metrics(last_stage_share(local, _REDUCE, self.dist), _REDUCE, self.dist, over_pipeline=True)
        rec.update(tokens=int(round(rec["tokens"])), lr=upd["lr"], peak_mem_gib=upd.get("peak_mem_gib", 0.0),
                   gen_time_s=t_gen, step_time_s=time.perf_counter() - t0,
                   sample=repr(ro["items"][0].text + ro["texts"][0]))
        return rec


def run(cfg) -> dict:
    """Run the distillation job; returns {'output_dir', 'step' (last step run), 'records'}."""
    if cfg.job != "distill":
        raise ValueError(f"distill.run got job={cfg.job!r}")
    return loop.run(cfg, DistillJob)
