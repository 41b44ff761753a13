"""Checkpoints of a run directory: save, find the latest complete one, resume, prune.

Layout::

    OUTPUT_DIR/checkpoints/step_00000010/
        engine/              engine.save(): model and optimizer as sharded tensors (loadable at any parallel
                             layout), counters, RNG states; sealed by the engine's own MANIFEST.json
        trainer_state.json   step, the job config, the id of the run that wrote it
        MANIFEST.json        sha256 and size of every file above, written by rank 0 once all are on disk
        COMPLETE             written last by rank 0: a checkpoint without it is ignored

The data order is a pure function of (shuffle_seed, step) (see data.py), so the step number is the
whole data-loader state; at the parallel layout that saved it the engine restores every RNG, so a resumed
run's next step equals the uninterrupted run's. A resume at another layout (engine.parallel changed) loads
the same parameters and optimizer state resharded (docs/checkpoints.md).

Durability: every file is written under a temporary name, fsynced and renamed (areal_lce.durable), the
directories are fsynced, and COMPLETE comes last, after a barrier: a checkpoint marked complete is on
disk. Integrity: nothing in a step directory is read before its files match MANIFEST.json (a file the
job did not write, a missing one or a changed byte is refused, naming the file), and engine files load
with torch.load(weights_only=True) (the sharded tensors' index through an allowlist unpickler first:
megatron/state.py). `load_model_weights` reads a checkpoint's model weights alone (a teacher, an
export). A complete checkpoint that cannot be read is skipped on resume with a warning naming it, and the previous complete one is loaded instead; one that does not fit the model
(a changed shape) stops the run with an error naming the parameter.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Optional, Union

from .. import durable
from ..engine.parallel import all_ranks_true, barrier_world
from .config_io import ConfigError

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


def foreign_files(output_dir) -> list[str]:
    """What a fresh start must not touch: anything under checkpoints/, a non-empty metrics.jsonl."""
    out = Path(output_dir)
    root = checkpoint_root(out)
    found = [f"checkpoints/{p.name}" for p in sorted(root.iterdir())] if root.is_dir() else []
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    return found


def refuse_foreign_files(output_dir) -> None:
    """A fresh start (trainer.resume=false) deletes nothing: it refuses a run directory holding another run's
    checkpoints or metrics."""
    found = foreign_files(output_dir)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ConfigError(f"trainer.resume=false starts a new run, but trainer.output_dir={output_dir} holds another "
                          f"run's files ({shown}); nothing was deleted. Continue that run with trainer.resume=auto, "
                          "or start the new one in another trainer.output_dir (or move those files away yourself)")


def clear_run_dir(output_dir, is_main: bool) -> None:
    """Collective, the former name of the fresh-start check: deletes nothing, refuses another run's files."""
    refuse_foreign_files(output_dir)
    _barrier()


_RUN_IDS: dict = {}  # realpath(output_dir) -> the id of the run this process drives there (run_dir.open_run)


def set_run_id(output_dir, run_id: Optional[str]) -> None:
    """Checkpoints saved under `output_dir` from now on record `run_id` (None: forget it)."""
    key = os.path.realpath(output_dir)
    if run_id is None:
        _RUN_IDS.pop(key, None)
    else:
        _RUN_IDS[key] = run_id


def read_state(path) -> dict:
    """trainer_state.json of checkpoint `path`, once it matches the checkpoint's manifest."""
    path = Path(path)
    durable.check_manifest(path, exclude=(MARKER,), hash_only=lambda rel: rel == STATE_FILE)
    with open(path / STATE_FILE, encoding="utf-8") as f:
        return json.load(f)


def save_checkpoint(engine, output_dir, step: int, state: dict, is_main: bool) -> Path:
    """Collective: every rank saves its engine files, then rank 0 writes the state, the manifest of every
    file (hashed from disk after the barrier) and the marker."""
    path = checkpoint_dir(output_dir, step)
    if is_main:
        (path / MARKER).unlink(missing_ok=True)
        (path / durable.MANIFEST).unlink(missing_ok=True)
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save(str(path / "engine"))  # each rank's shards and files durably, sealed by the engine
    _barrier()
    if is_main:
        run_id = _RUN_IDS.get(os.path.realpath(output_dir))
        durable.write_text(path / STATE_FILE, json.dumps({**state, "step": step, "run_id": run_id}, indent=1))
        durable.fsync_dir(path / "engine")
        durable.write_manifest(path, exclude=(MARKER,))  # every file above, as on disk
        durable.write_text(path / MARKER, "ok\n")  # last: everything above is on disk
        durable.fsync_dir(path.parent)
    _barrier()
    return path


def _check_step(path: Path) -> None:
    """Collective: `path` is a complete checkpoint whose own files match its manifest on every rank (its
    sealed engine/ directory is checked by the engine's load)."""
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    error = ""
    try:
        durable.check_manifest(path, exclude=(MARKER,))
    except (durable.IntegrityError, OSError) as e:
        error = str(e)
    if not all_ranks_true(not error):  # every rank reaches the engine's collectives, or none does
        raise durable.IntegrityError(error or f"{path}: another rank found a file that does not match "
                                     f"{durable.MANIFEST} (its error names it)")


def load_checkpoint(engine, path) -> dict:
    """Collective: restore the engine from checkpoint `path` once its files match the manifest on every
    rank; returns its trainer state (with 'step'). The engine may run at another parallel layout than the
    run that saved it."""
    path = Path(path)
    _check_step(path)
    with open(path / STATE_FILE, encoding="utf-8") as f:
        state = json.load(f)
    engine.load(str(path / "engine"))
    return state


def load_model_weights(engine, step_dir) -> None:
    """Collective: the model weights only of checkpoint `step_dir` (OUTPUT_DIR/checkpoints/step_N) into
    `engine` (a MegatronEngine, trainable or frozen, at any parallel layout), once the checkpoint is
    complete and matches its manifests; its optimizer state, counters and RNG states are not read.
    Reads the sharded format and, at the layout that wrote it, the previous per-rank one."""
    step_dir = Path(step_dir)
    _check_step(step_dir)
    engine.load_weights(str(step_dir / "engine"))


def prune_checkpoints(output_dir, keep_last: int, run_id: Optional[str]) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints that run `run_id` wrote (complete, sealed by its
    manifest, its id in trainer_state.json); anything else is left alone. Returns the deleted ones."""
    if not keep_last or run_id is None:
        return []
    ours = []
    for _step, p in list_checkpoints(output_dir):
        try:
            if read_state(p).get("run_id") == run_id:
                ours.append(p)
        except (OSError, ValueError, durable.IntegrityError):
            continue  # not provably ours: kept
    deleted = []
    for p in ours[:-keep_last]:
        try:
            durable.remove_sealed(p, MARKER)
            deleted.append(p)
        except (OSError, durable.IntegrityError) as e:
            warnings.warn(f"trainer.keep_last: kept {p}: {e}", RuntimeWarning, stacklevel=2)
    return deleted


# What a damaged (truncated, overwritten) checkpoint file raises when read; a layout mismatch (ValueError)
# is not among them: it would fail on every checkpoint alike.
# A manifest mismatch (durable.IntegrityError) is a RuntimeError.
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
            keep = getattr(trainer, "keep_last", 0)
            for old in prune_checkpoints(output_dir, keep, _RUN_IDS.get(os.path.realpath(output_dir))):
                say(f"[{job}] deleted checkpoint {old} (trainer.keep_last={keep})")
    if trainer.stop_at and step == trainer.stop_at:
        if is_main:
            say(f"[{job}] stopping after step {step} (trainer.stop_at)")
        return True
    return False
