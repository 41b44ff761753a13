"""One job's hold on its run directory (trainer.output_dir), taken before anything in it is touched.

    run = open_run(cfg, output_dir, is_main)   # lock, resume choice, checks; run.resume_from
    ...
    close_run(run)

* One job at a time: rank 0 holds an exclusive `fcntl.flock` on OUTPUT_DIR/run.lock for the whole run. The
  kernel drops it when the process ends, `kill -9` included, so a killed run resumes with
  trainer.resume=auto at once; a second job on the directory stops at start-up naming it. Not covered:
  network file systems (on NFS flock may be local to one host, or not enforced), and jobs on several
  hosts sharing one directory. Within one process the hold is re-entrant (a run that raised keeps it
  until the process ends or opens the directory again).
* The layout is checked first: trainer.output_dir, and checkpoints/ (tensorboard/, wandb/) in it, must be
  directories where they exist; a file there stops the job at start-up naming trainer.output_dir.
* A fresh start deletes and overwrites nothing it did not write: trainer.resume=false refuses a directory
  holding another run's checkpoints or metrics, or a file of a name the run writes (config.yaml,
  metrics.png, samples.jsonl, ...: checkpoint.OUTPUTS); trainer.resume=auto with no checkpoint to resume
  refuses the same in a directory no areal_lce run used (no run.lock), and in one that an earlier run of
  this directory used starts over its files.
* A resume compares the config saved with the checkpoint with this one and names every changed option:
  a change of the model's shape or of `job:` is refused, others (lr, steps, engine.parallel: checkpoints
  load at any parallel layout) go ahead with a warning.
* Each run gets an id, recorded in its checkpoints (a resumed run keeps it): trainer.keep_last deletes
  only checkpoints with this id.
"""
from __future__ import annotations

import os
import socket
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from ..engine.parallel import all_ranks_true
from . import checkpoint as ckpt
from .config_io import ConfigError, to_dict, yaml_load

LOCK_FILE = "run.lock"
# Options that change the model's parameters (shapes, dtype): a checkpoint of the old model cannot load.
# engine.model.vocab_size is not among them: the engine compares the true vocabulary it resolves with the one
# state.pt was written for (0 -> the value it resolved to resumes; a different vocabulary is refused there).
MODEL_OPTIONS = tuple(f"engine.model.{k}" for k in (
    "preset", "hf_config_dir", "hf_checkpoint_dir", "tie_word_embeddings", "num_layers",
    "make_vocab_size_divisible_by", "dtype"))
# Options of one invocation, not of the run: never reported.
INVOCATION_OPTIONS = ("trainer.resume", "trainer.stop_at", "trainer.progress", "trainer.log_interval",
                      "trainer.plot", "trainer.output_dir", "engine.parallel.timeout_s")


class RunLock:
    """An exclusive flock on OUTPUT_DIR/run.lock (the file stays; the lock goes with the process)."""

    def __init__(self, output_dir):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another process (BlockingIOError), or a file system without flock
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"trainer.output_dir={self.path.parent} is in use by another job ({holder} holds "
                              f"{self.path}); wait for it to end, or give this job another trainer.output_dir")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


@dataclass
class Run:
    output_dir: Path
    resume_from: Optional[Path]  # the checkpoint to load, None for a fresh start
    run_id: str  # meaningful on rank 0, which writes the checkpoints' trainer_state.json
    lock: Optional[RunLock]  # rank 0's


_OPEN: dict = {}  # realpath(output_dir) -> Run: the runs this process holds


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(dotted option, saved value, current value) for every option that differs, invocation ones aside."""
    a, b = _flat(saved), _flat(current)
    missing = "(not set)"
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if k not in INVOCATION_OPTIONS and a.get(k, missing) != b.get(k, missing)]


def check_layout(out: Path) -> None:
    """trainer.output_dir and what the run creates in it are directories where directories go (and files
    where files go); else a ConfigError naming the option, before anything is written."""
    for parent in (out, *out.parents):
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == out else f"is inside {parent}, a file"
                raise ConfigError(f"trainer.output_dir={out} {where}, not a directory: give a directory (created "
                                  "when missing)")
            break
    for name in ("checkpoints", "tensorboard", "wandb"):
        if (out / name).exists() and not (out / name).is_dir():
            raise ConfigError(f"trainer.output_dir={out}: {out / name} is a file, but the run keeps its {name} in a "
                              "directory of that name; move the file away, or give another trainer.output_dir")
    for name in ("config.yaml", "metrics.jsonl", "metrics.png", "samples.jsonl", LOCK_FILE):
        if (out / name).is_dir():
            raise ConfigError(f"trainer.output_dir={out}: {out / name} is a directory, but the run writes a file of "
                              "that name; move it away, or give another trainer.output_dir")


def check_resume_config(changes, checkpoint, is_main: bool) -> None:
    """Refuse changes of the job or the model naming each option; warn about the others (engine.parallel
    included: checkpoints load at any parallel layout)."""
    def show(items):
        return ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in items)

    job = [c for c in changes if c[0] == "job"]
    if job:
        raise ConfigError(f"resuming {checkpoint} with a changed job ({show(job)}): a run directory holds one job's "
                          f"checkpoints and metrics. Resume with job: {job[0][1]}, or start the {job[0][2]} job in "
                          "another trainer.output_dir")
    model = [c for c in changes if c[0] in MODEL_OPTIONS]
    if model:
        raise ConfigError(f"resuming {checkpoint} with a changed model ({show(model)}): the checkpoint's "
                          "parameters would not fit. Resume with the saved values, or start the new model in "
                          "another trainer.output_dir")
    if changes and is_main:
        warnings.warn(f"resuming {checkpoint} with changed options: {show(changes)}", RuntimeWarning,
                      stacklevel=3)


def _saved_run(output_dir, newest: Path) -> tuple[Optional[str], Optional[dict], Optional[Path]]:
    """(run id, config, checkpoint) of the newest complete checkpoint up to `newest` whose state matches its
    manifest (the one a resume will most likely load); Nones when none does."""
    for _step, p in reversed(ckpt.list_checkpoints(output_dir)):
        if p.name > newest.name:
            continue
        try:
            state = ckpt.read_state(p)
            config = yaml_load(state["config"]) if isinstance(state.get("config"), str) else None
            return state.get("run_id"), config, p
        except (OSError, ValueError, KeyError, RuntimeError, yaml.YAMLError):
            continue  # damaged: the loader says so when it falls back past it
    return None, None, None


def open_run(cfg, output_dir, is_main: bool) -> Run:
    """Collective: take the run directory (lock on rank 0), pick the checkpoint to resume from
    (trainer.resume) and check what the run may do there; raises ConfigError naming the option."""
    out = Path(output_dir)
    check_layout(out)
    # an areal_lce run used this directory before: every rank looks before rank 0 takes (creates) the lock
    used_before = all_ranks_true((out / LOCK_FILE).is_file())
    key = os.path.realpath(out)
    held = _OPEN.get(key)
    lock, error = None, ""
    if is_main:
        try:
            lock = held.lock if held is not None and held.lock is not None else RunLock(out).acquire()
        except ConfigError as e:
            error = str(e)
    if not all_ranks_true(not error):
        raise ConfigError(error or f"trainer.output_dir={out}: rank 0 could not lock it (another job uses it)")
    try:
        refused = None
        try:
            resume_from = ckpt.resolve_resume(cfg.trainer.resume, out)
            run_id = uuid.uuid4().hex
            if resume_from is None:
                if cfg.trainer.resume is False or not used_before:
                    ckpt.refuse_foreign_files(out, cfg.trainer.resume)
            else:
                saved_id, saved_config, where = _saved_run(out, resume_from)
                run_id = saved_id or run_id
                if saved_config is not None:
                    check_resume_config(config_changes(saved_config, to_dict(cfg)), where, is_main)
        except ConfigError as e:
            refused = e
        # every rank has looked at the directory before any goes on to write in it (rank 0: config.yaml)
        if not all_ranks_true(refused is None):
            raise refused or ConfigError(f"trainer.output_dir={out}: another rank refused it (its error says why)")
    except BaseException:
        if lock is not None and held is None:
            lock.release()
        raise
    run = Run(out, resume_from, run_id, lock)
    _OPEN[key] = run
    ckpt.set_run_id(out, run_id)
    return run


def close_run(run: Run) -> None:
    """Release the run directory (rank 0's lock)."""
    _OPEN.pop(os.path.realpath(run.output_dir), None)
    ckpt.set_run_id(run.output_dir, None)
    if run.lock is not None:
        run.lock.release()
