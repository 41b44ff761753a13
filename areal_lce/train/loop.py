"""The run loop of every train job (SFT, GRPO, PPO), driving a `job.Job`.

    run(cfg, SFTJob)   # distributed set-up, the loop below, tear-down

0. ranks     the fused-op backend is checked against this machine, the process group starts and the
             ranks compare their configs (ranks.check_same_config), before Megatron's groups exist;
1. host      the job is built (tokenizer, data or task, checks against the parallel layout): a bad option
             fails here, before the run directory is touched or a model is built;
2. run dir   rank 0 locks it (run_dir.py); trainer.resume picks the checkpoint to load (a fresh start
             refuses a directory holding another run's files, a resume names changed options); rank 0
             writes config.yaml;
3. engines   `job.build_engines()`, then python's and torch's RNGs are seeded with trainer.seed (after
             the engines, whose set-up seeds torch with engine.seed);
4. resume    the checkpoint's engine state and step (a damaged checkpoint falls back to the previous one);
             the loggers of trainer.loggers (loggers.py) open on rank 0 and hide what the interrupted run
             wrote past that step (metrics.jsonl drops those lines);
5. steps     `job.step(step)` for every remaining step: its record goes to the loggers (rank 0), the
             progress bar and every trainer.log_interval steps a metrics line; then the end-of-step
             checkpoint (trainer.save_interval, the final one) and trainer.stop_at. SIGINT / SIGTERM
             during the steps only set a flag; at the step boundary the ranks agree on it, save a
             checkpoint of that step, print "interrupted at step N; resume with trainer.resume=auto" and
             raise ranks.Interrupted (the entry point exits 130 / 143);
             A step whose loss or gradient norm is not finite stops the run (NonFiniteError naming
             the step) before its record or any checkpoint of it is written;
6. finish    after the last step: `job.finish()` and metrics.png (trainer.plot); rank 0 prints one
             closing line (steps run, the last metrics, the run directory and its newest checkpoint).

Returns {'output_dir', 'step' (last step run), 'records' (this invocation's metric records)}.
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable

import torch

from ..device import cuda_advice_hidden_on_cpu
from . import checkpoint as ckpt
from .config import check_runs_here, dump_yaml, to_dict
from .job import Job
from .loggers import RunLoggers, check_loggers_installed
from .logging_utils import ProgressBar, format_record, plot_metrics, read_metrics
from .ranks import Interrupted, StopOnSignal, check_same_config
from .run_dir import close_run, open_run


def run(cfg, make_job: Callable[..., Job]) -> dict:
    """Initialise torch.distributed, check that every rank runs this config, set up megatron's parallel
    state for `cfg`, run `make_job(cfg, dist_info)` through the loop, and tear it all down again."""
    from ..engine.parallel import destroy_distributed, init_distributed, init_process_group

    check_runs_here(cfg)
    try:
        init_process_group(cfg.engine.parallel)
        check_same_config(cfg)  # before megatron's groups: ranks that disagree on their sizes would hang there
        dist_info = init_distributed(cfg.engine.parallel, seed=cfg.engine.seed)
        with cuda_advice_hidden_on_cpu(dist_info.device):  # megatron's first TP/SP forward advises a CUDA setting
            return train(make_job(cfg, dist_info), cfg, dist_info)
    finally:
        destroy_distributed()


def train(job: Job, cfg, dist_info) -> dict:
    """The loop itself (module docstring), on an initialised job and distributed set-up."""
    tr, is_main = cfg.trainer, dist_info.is_main
    check_loggers_installed(tr.loggers)  # every rank, before the run directory is touched
    out = Path(tr.output_dir)
    run_dir = open_run(cfg, out, is_main)  # rank 0 locks it; a fresh start refuses another run's files
    resume_from = run_dir.resume_from
    config_text = dump_yaml(cfg)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(config_text)

    job.build_engines()
    random.seed(tr.seed)  # after the engines, whose set-up seeds torch with engine.seed
    torch.manual_seed(tr.seed)
    start = 0
    if resume_from is not None:
        resume_from, state = ckpt.load_resumable(job.engine, out, resume_from, is_main)  # past a damaged one
        start = int(state["step"])
    metrics = RunLoggers(tr.loggers, out, resume_step=start, config=to_dict(cfg), enabled=is_main)
    if is_main:
        resumed = f", resumed from {resume_from} (step {start})" if resume_from else ""
        print(f"[{job.name}] {job.banner()}{resumed}", flush=True)
        for where in metrics.where():
            print(f"[{job.name}] logging to {where}", flush=True)

    bar = ProgressBar(tr.steps, initial=start, enabled=tr.progress, is_main=is_main, desc=job.name)
    records, step = [], start
    with StopOnSignal() as stop, metrics:
        for step in range(start + 1, tr.steps + 1):
            rec = {"step": step, **job.step(step)}
            check_finite(rec, job.name, out)  # before the record and any checkpoint of this step are written
            records.append(rec)
            metrics.write(rec)
            bar.update({key: format(rec[key], spec) for key, spec in job.postfix})
            if is_main and (step % tr.log_interval == 0 or step == tr.steps):
                bar.write(format_record(rec, job.log_keys))
            signum = stop.agreed()  # every rank, at the same boundary: a signal on any rank stops them all
            if signum:
                path = ckpt.save_checkpoint(job.engine, out, step, {"config": config_text}, is_main)
                if is_main:
                    bar.write(f"[{job.name}] saved checkpoint {path}")
                    bar.write(f"[{job.name}] interrupted at step {step}; resume with trainer.resume=auto")
                bar.close()
                raise Interrupted(signum, step)
            if ckpt.end_of_step(job.engine, tr, out, step, {"config": config_text}, is_main, bar.write, job.name):
                break
    bar.close()

    if step == tr.steps:
        job.finish(out)
        if is_main and tr.plot:
            png = plot_metrics(read_metrics(out / "metrics.jsonl"), out / "metrics.png", job.plot_keys,
                               title=f"{job.plot_title} {out.name}")
            if png:
                print(f"[{job.name}] wrote {out / 'metrics.jsonl'} and {png}", flush=True)
    if is_main:
        print(summary_line(job, cfg, start, step, records, out), flush=True)
    close_run(run_dir)
    return {"output_dir": str(out), "step": step, "records": records}


# Megatron-LM's --check-for-nan-in-loss-and-grad: a step whose loss or gradient norm is not finite stops the
# run (every rank sees the same reduced values, so every rank stops at the same step).
FINITE_KEYS = ("loss", "grad_norm")


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss or gradient norm."""


def check_finite(rec: dict, name: str, out: Path) -> None:
    """Raise NonFiniteError naming the step and the values when the record's loss or grad norm is NaN / inf."""
    bad = [f"{k}={rec[k]}" for k in FINITE_KEYS if isinstance(rec.get(k), float) and not math.isfinite(rec[k])]
    if bad:
        last = ckpt.latest_checkpoint(out)
        where = f"the newest checkpoint is {last}" if last else "no checkpoint was saved"
        raise NonFiniteError(f"[{name}] step {rec['step']}: {', '.join(bad)}: training diverged; the run stops "
                             f"without saving this step ({where}). Lower engine.optim.lr or check the data, then "
                             "resume with trainer.resume=auto or start over")


def summary_line(job: Job, cfg, start: int, step: int, records: list, out: Path) -> str:
    """The run's closing line: steps run, the last step's metrics, where its files are."""
    total = cfg.trainer.steps
    ran = f"steps {start + 1}-{step} of {total}" if step > start else f"no steps (at {step} of {total})"
    last = format_record(records[-1], [k for k in job.log_keys if k != "step"]) if records else ""
    latest = ckpt.latest_checkpoint(out)
    files = ", ".join(n for n in ckpt.OUTPUTS if (out / n).exists())
    saved = f"; newest checkpoint {latest}" if latest else "; no checkpoint"
    return f"[{job.name}] done: {ran}{'; last ' + last if last else ''}; wrote {out} ({files}){saved}"
