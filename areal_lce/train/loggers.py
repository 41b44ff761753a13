"""Experiment loggers of the run loop, on rank 0 only: `trainer.loggers` picks them (default [jsonl]).

jsonl        RUN_DIR/metrics.jsonl, one JSON record per step (logging_utils.MetricsLog); trainer.plot
             draws metrics.png from it.
tensorboard  event files under RUN_DIR/tensorboard/ through torch.utils.tensorboard (the `tensorboard`
             package: pip install 'areal-lce[tensorboard]'); view with `tensorboard --logdir RUN_DIR`.
wandb        a Weights & Biases run with its files under RUN_DIR/wandb/ (pip install 'areal-lce[wandb]').
             wandb reads its own environment: WANDB_MODE=offline runs without a network (upload later
             with `wandb sync RUN_DIR/wandb/offline-run-*`), WANDB_PROJECT (default areal_lce), WANDB_ENTITY.

Every logger gets the same scalars: each number of a step's record (the keys of metrics.jsonl, under
the same names) at that record's step. A resumed run (start step S) hides what the interrupted run
wrote past S: metrics.jsonl drops those lines, TensorBoard purges events from step S+1 on (purge_step),
and W&B continues the same run (its id is kept in RUN_DIR/wandb/run_id) with `step` as its x axis.
"""
from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path
from typing import Optional, Sequence

from .config_io import ConfigError
from .logging_utils import MetricsLog

# logger -> (the package it imports, the pip command that installs it)
LOGGERS = {
    "jsonl": (None, None),
    "tensorboard": ("tensorboard", "pip install 'areal-lce[tensorboard]' (or: pip install tensorboard)"),
    "wandb": ("wandb", "pip install 'areal-lce[wandb]' (or: pip install wandb)"),
}
WANDB_DEFAULT_PROJECT = "areal_lce"


def check_loggers_installed(names: Sequence[str]) -> None:
    """Raise a ConfigError naming trainer.loggers and the install command for each asked logger whose
    package is missing (run on every rank, before the run directory is touched)."""
    missing = [(name, *LOGGERS[name]) for name in names if LOGGERS[name][0] is not None
               and importlib.util.find_spec(LOGGERS[name][0]) is None]
    if missing:
        raise ConfigError("; ".join(f"trainer.loggers includes {name!r} but the package {package!r} is not "
                                    f"installed: {cmd}" for name, package, cmd in missing))


def scalars(record: dict) -> dict:
    """The numbers of a metrics record but its step (booleans and non-numbers are not scalars)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


class TensorBoardLogger:
    """One scalar per metric, tag = the metrics.jsonl key, flushed every step (a killed run keeps what
    metrics.jsonl keeps)."""

    def __init__(self, out: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = out / "tensorboard"
        # purge_step: TensorBoard hides this directory's events from that step on, the interrupted run's tail
        # on a resume and another run's events on a fresh start
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_step + 1)

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, global_step=int(record["step"]))
        self._writer.flush()

    def close(self, exit_code: int) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run under RUN_DIR/wandb/, `step` as the x axis of every metric; config = the job's config."""

    def __init__(self, out: Path, resume_step: int, config: dict):
        import os
        import secrets

        import wandb

        id_file = out / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # W&B's run ids: 8 characters of [a-z0-9]
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(dir=str(out), id=run_id, resume="allow", name=out.name, config=config,
                               project=os.environ.get("WANDB_PROJECT") or WANDB_DEFAULT_PROJECT)
        # the record's own step is the x axis: a resumed run logs steps that W&B's internal counter passed
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self.log_dir = Path(self._run.dir).parent

    def write(self, record: dict) -> None:
        self._run.log({"step": int(record["step"]), **scalars(record)})

    def close(self, exit_code: int) -> None:
        self._run.finish(exit_code=exit_code)


class RunLoggers:
    """The loggers of `trainer.loggers` (all inactive off rank 0): `write(record)` each step, closed on
    leaving the `with` block; W&B gets the exit status: 0, an interrupt's 130 / 143, else 1."""

    def __init__(self, names: Sequence[str], out, *, resume_step: int = 0, config: Optional[dict] = None,
                 enabled: bool = True):
        out = Path(out)
        self._loggers = []
        if not enabled:
            return
        for name in names:
            if name == "jsonl":
                self._loggers.append(MetricsLog(out / "metrics.jsonl", resume_step=resume_step))
            elif name == "tensorboard":
                self._loggers.append(TensorBoardLogger(out, resume_step))
            elif name == "wandb":
                self._loggers.append(WandbLogger(out, resume_step, config or {}))
            else:
                raise ConfigError(f"trainer.loggers: unknown logger {name!r} (expected some of {tuple(LOGGERS)})")

    def where(self) -> list:
        """Where the loggers other than jsonl write (for the start-up line)."""
        return [str(lg.log_dir) for lg in self._loggers if hasattr(lg, "log_dir")]

    def write(self, record: dict) -> None:
        for lg in self._loggers:
            lg.write(record)

    def close(self, exit_code: int = 0) -> None:
        loggers, self._loggers = self._loggers, []
        for lg in loggers:
            if hasattr(lg, "close"):
                lg.close(exit_code)

    def __enter__(self) -> "RunLoggers":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(0 if exc is None else getattr(exc, "exit_code", 1))  # ranks.Interrupted carries 130 / 143
