"""Checkpoints of a run directory: save, find the latest complete one, resume.

Layout::

    OUTPUT_DIR/checkpoints/step_00000010/
        engine/              engine.save(): model, optimizer, lr schedule, RNG states (per-rank files)
        trainer_state.json   step, wall time, the job config
        COMPLETE             written last by rank 0: a checkpoint without it is ignored

The data order is a pure function of (shuffle_seed, step) (see data.py), so the step number is the
whole data-loader state; the engine restores every RNG, so a resumed run's next step equals the
uninterrupted run's.

Durability: every file is written under a temporary name, fsynced and renamed (areal_lce.durable), the
directories are fsynced, and COMPLETE comes last, after a barrier: a checkpoint marked complete is on
disk. A complete checkpoint that still cannot be read (a damaged disk, a file edited by hand) is
skipped on resume with a warning naming it, and the previous complete one is loaded instead.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional, Union

from .. import durable
from ..megatron.parallel import all_ranks_true, barrier_world

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    # Every rank's engine files must be on disk before rank 0 marks the checkpoint complete.
    barrier_world()


def checkpoint_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_dir(output_dir, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step_{step:08d}"


def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """Complete checkpoints under output_dir, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir) -> Optional[Path]:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: Union[bool, str], output_dir) -> Optional[Path]:
    """trainer.resume -> the checkpoint to load, or None to start fresh."""
    if resume is False:
        return None
    latest = latest_checkpoint(output_dir)
    if resume is True and latest is None:
        raise FileNotFoundError(f"trainer.resume=true but {checkpoint_root(output_dir)} holds no complete "
                                "checkpoint (use trainer.resume=auto to start fresh when there is none)")
    return latest


def clear_run_dir(output_dir, is_main: bool) -> None:
    """A fresh start replaces the run directory's checkpoints (so a later resume=auto can't pick a stale one)."""
    if is_main:
        root = checkpoint_root(output_dir)
        if root.exists():
            shutil.rmtree(root)
    _barrier()


def save_checkpoint(engine, output_dir, step: int, state: dict, is_main: bool) -> Path:
    """Collective: every rank saves its engine files, then rank 0 writes the state and the marker."""
    path = checkpoint_dir(output_dir, step)
    if is_main:
        (path / MARKER).unlink(missing_ok=True)
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save(str(path / "engine"))  # each rank's files durably (temp name, fsync, rename)
    _barrier()
    if is_main:
        durable.write_text(path / STATE_FILE, json.dumps({**state, "step": step}, indent=1))
        durable.fsync_dir(path / "engine")
        durable.write_text(path / MARKER, "ok\n")  # last: everything above is on disk
        durable.fsync_dir(path.parent)
    _barrier()
    return path


def load_checkpoint(engine, path) -> dict:
    """Restore the engine from checkpoint `path`; returns its trainer state (with 'step')."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    with open(path / STATE_FILE) as f:
        state = json.load(f)
    engine.load(str(path / "engine"))
    return state


# What a damaged (truncated, overwritten) checkpoint file raises when read; a layout mismatch (ValueError)
# is not among them: it would fail on every checkpoint alike.
_UNREADABLE = (OSError, EOFError, RuntimeError, KeyError, pickle.UnpicklingError, json.JSONDecodeError,
               UnicodeDecodeError)


def load_resumable(engine, output_dir, path) -> tuple[Path, dict]:
    """Collective: load checkpoint `path` (the latest complete one) into `engine`; when any rank cannot read
    its files, warn naming it and try the previous complete checkpoint, on every rank together.
    Returns (the checkpoint loaded, its trainer state); raises when none can be read."""
    path = Path(path)
    step = int(_STEP_DIR.match(path.name).group(1))
    failures = []
    for s, candidate in reversed(list_checkpoints(output_dir)):
        if s > step:
            continue
        error = ""
        try:
            state = load_checkpoint(engine, candidate)
        except _UNREADABLE as e:
            error = f"{type(e).__name__}: {e}"
        if all_ranks_true(not error):
            return candidate, state
        why = error or "another rank could not read its files"
        failures.append(f"{candidate}: {why}")
        warnings.warn(f"checkpoint {candidate} is marked {MARKER} but cannot be loaded ({why}); falling back to "
                      "the previous complete checkpoint", RuntimeWarning, stacklevel=2)
    raise RuntimeError(f"no complete checkpoint under {checkpoint_root(output_dir)} can be loaded:\n  "
                       + "\n  ".join(failures or [f"{path}: not found"]))


def end_of_step(engine, trainer, output_dir, step: int, state: dict, is_main: bool, say, job: str) -> bool:
    """After a finished step: checkpoint every `trainer.save_interval` steps and at the last step (when
    `trainer.save_final`); return True when the run must stop here (`trainer.stop_at`). `say` prints
    on the main rank (the progress bar's writer)."""
    final = step == trainer.steps
    if (trainer.save_interval and step % trainer.save_interval == 0) or (final and trainer.save_final):
        path = save_checkpoint(engine, output_dir, step, state, is_main)
        if is_main:
            say(f"[{job}] saved checkpoint {path}")
    if trainer.stop_at and step == trainer.stop_at:
        if is_main:
            say(f"[{job}] stopping after step {step} (trainer.stop_at)")
        return True
    return False
