"""Checkpoints of a run directory: save, find the latest complete one, resume, prune.

Layout::

    OUTPUT_DIR/checkpoints/step_00000010/
        engine/              engine.save(): model and optimizer as sharded tensors (loadable at any parallel
                             layout), counters, RNG states; sealed by the engine's own MANIFEST.json
        trainer_state.json   step, the job config, the id of the run that wrote it
        MANIFEST.json        sha256 and size of the two entries above, written by rank 0 once all are on disk
        COMPLETE             written last by rank 0: a checkpoint without it is ignored

Anything else in a step directory (an HF export into step_N/hf, an eval result beside the weights) is the
user's: no reader opens it, so resume ignores it, the manifest does not list it and trainer.keep_last
leaves it (and the directories holding it) in place. Inside the sealed engine/ directory, which the
engine's readers open, a file its manifest does not list is refused.

The data order is a pure function of (shuffle_seed, step) (see data.py), so the step number is the
whole data-loader state; at the parallel layout that saved it the engine restores every RNG, so a resumed
run's next step equals the uninterrupted run's. A resume at another layout (engine.parallel changed) loads
the same parameters and optimizer state resharded (docs/checkpoints.md).

Durability: every file is written under a temporary name, fsynced and renamed (areal_lce.durable), the
directories are fsynced, and COMPLETE comes last, after a barrier: a checkpoint marked complete is on
disk. Integrity: nothing in a step directory is read before its files match MANIFEST.json (a file under
engine/ the job did not write, a missing one or a changed byte is refused, naming the file), and engine
files load with torch.load(weights_only=True) (the sharded tensors' index through an allowlist unpickler
first: engine/sharded.py). `load_model_weights` reads a checkpoint's model weights alone (a teacher, an
export). A complete checkpoint that cannot be read (any read error, torch.distributed.checkpoint's
CheckpointException and megatron-core's CheckpointingException included) is skipped on resume with a
warning naming it, and the previous complete one is loaded instead; when none is left the run ends with
one line naming them. A file refused as a pickled payload is a security event, not damage: it is logged
at error level, its checkpoint is moved aside to step_N.refused (kept, never overwritten by a re-save)
and the run stops. One that does not fit the model (a changed shape) stops the run with an error naming
the parameter.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Optional, Union

from .. import durable
from ..engine.parallel import all_ranks_true, barrier_world
from ..engine.sharded import RefusedPayload
from .config_io import ConfigError

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
OWN = (STATE_FILE, "engine")  # what a step directory's manifest covers; anything else there is the user's
REFUSED_SUFFIX = ".refused"
SECURITY = logging.getLogger("areal_lce.security")
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


# What a run writes directly in trainer.output_dir besides checkpoints/ and run.lock (loop.py, the loggers,
# the SFT samples).
OUTPUTS = ("config.yaml", "metrics.jsonl", "metrics.png", "samples.jsonl", "tensorboard", "wandb")


def foreign_files(output_dir) -> list[str]:
    """What a fresh start must not touch: anything under checkpoints/, any of the names a run writes
    (OUTPUTS; an empty metrics.jsonl aside)."""
    out = Path(output_dir)
    root = checkpoint_root(out)
    found = [f"checkpoints/{p.name}" for p in sorted(root.iterdir())] if root.is_dir() else []
    for name in OUTPUTS:
        p = out / name
        if os.path.lexists(p) and not (name == "metrics.jsonl" and p.is_file() and not p.stat().st_size):
            found.append(name)
    return found


def refuse_foreign_files(output_dir, resume: Union[bool, str] = False) -> None:
    """A fresh start deletes and overwrites nothing: it refuses a run directory holding another run's
    checkpoints or metrics, or any file of the names it writes (trainer.resume=false: any; auto with no
    checkpoint: called only for a directory no areal_lce run used, see run_dir.open_run)."""
    found = foreign_files(output_dir)
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if resume is False:
        raise ConfigError(f"trainer.resume=false starts a new run, but trainer.output_dir={output_dir} holds another "
                          f"run's files or files of the names a run writes ({shown}); nothing was deleted or "
                          "overwritten. Continue that run with trainer.resume=auto, or start the new one in another "
                          "trainer.output_dir (or move those files away yourself)")
    raise ConfigError(f"trainer.resume={resume}: trainer.output_dir={output_dir} holds no checkpoint to resume, but "
                      f"files the new run would overwrite, which no areal_lce run wrote ({shown}); nothing was "
                      "deleted or overwritten. Start the run in another trainer.output_dir, or move those files "
                      "away yourself")


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
    durable.check_manifest(path, hash_only=lambda rel: rel == STATE_FILE, only=OWN)
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
        durable.write_manifest(path, only=OWN)  # the files above, as on disk; a user's file is not listed
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
        durable.check_manifest(path, only=OWN)
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
    Reads the sharded format and, at the layout that wrote it, the previous per-rank one. A checkpoint
    that cannot be read raises UnreadableCheckpoint (one line naming it); a refused payload is reported
    (security event) and raises RefusedCheckpoint."""
    step_dir = Path(step_dir)
    try:
        _check_step(step_dir)
        engine.load_weights(str(step_dir / "engine"))
    except RefusedPayload as e:
        raise RefusedCheckpoint(report_refused(step_dir, describe(e), move=False)) from e
    except unreadable_errors() as e:
        raise UnreadableCheckpoint(f"checkpoint {step_dir} cannot be read: {describe(e)}") from e


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
            left = durable.remove_sealed(p, MARKER, only=OWN)  # the manifest's files; a user's stay
            deleted.append(p)
            if left:
                warnings.warn(f"trainer.keep_last: deleted the checkpoint files of {p}; kept the directory, "
                              "which holds files the job did not write", RuntimeWarning, stacklevel=2)
        except (OSError, durable.IntegrityError) as e:
            warnings.warn(f"trainer.keep_last: kept {p}: {e}", RuntimeWarning, stacklevel=2)
    return deleted


# What a damaged (truncated, overwritten) checkpoint file raises when read; a layout mismatch (ValueError)
# is not among them: it would fail on every checkpoint alike.
# A manifest mismatch (durable.IntegrityError) is a RuntimeError.
_UNREADABLE = (OSError, EOFError, RuntimeError, KeyError, pickle.UnpicklingError, json.JSONDecodeError,
               UnicodeDecodeError)


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint (or every one left to fall back to) cannot be read; the message is one line naming it."""


class RefusedCheckpoint(RuntimeError):
    """A checkpoint file holds a pickled payload the loader refused (a security event, logged as such)."""


def unreadable_errors() -> tuple:
    """_UNREADABLE plus torch.distributed.checkpoint's CheckpointException (a BaseException: what its reader
    raises for a `.metadata` that points past its data) and megatron-core's CheckpointingException."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    return (*_UNREADABLE, CheckpointException, CheckpointingException)


def describe(e: BaseException) -> str:
    """One line for a read error: its type and first line; a CheckpointException (whose text holds every
    rank's traceback) by the first failing rank's own error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items(), key=lambda kv: kv[0])[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"{type(e).__name__} on rank {rank}: {describe(inner)}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def report_refused(path: Path, why: str, move: bool) -> str:
    """Log a refused payload in checkpoint `path` as a security event (error level); with `move`, rename
    the checkpoint to step_N.refused (kept as evidence, out of resume's and any re-save's way). Returns
    the short message of the error the caller raises (the logged line holds the details)."""
    where = ""
    if move:
        aside = path.with_name(path.name + REFUSED_SUFFIX)
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}{REFUSED_SUFFIX}.{n}")
        os.rename(path, aside)
        durable.fsync_dir(path.parent)
        where = f"; the checkpoint was moved to {aside} (kept for inspection, nothing in it was deleted)"
    msg = (f"security: checkpoint {path} holds a file the loader refused to unpickle, a payload the job did "
           f"not write ({why}){where}; nothing of it was run. Find out who wrote it before resuming")
    SECURITY.error(msg)
    return f"checkpoint {path} holds a payload the loader refused (a security event: see the line above){where}"


def load_resumable(engine, output_dir, path, is_main: bool = True) -> tuple[Path, dict]:
    """Collective: load checkpoint `path` (the latest complete one) into `engine`; when any rank cannot read
    its files, warn naming it and try the previous complete checkpoint, on every rank together.
    Returns (the checkpoint loaded, its trainer state); raises UnreadableCheckpoint (one line) when none
    can be read, RefusedCheckpoint (after moving that checkpoint aside) when a payload was refused."""
    path = Path(path)
    step = int(_STEP_DIR.match(path.name).group(1))
    failures = []
    for s, candidate in reversed(list_checkpoints(output_dir)):
        if s > step:
            continue
        error, refused = "", False
        try:
            state = load_checkpoint(engine, candidate)
        except RefusedPayload as e:
            error, refused = describe(e), True
        except unreadable_errors() as e:
            error = describe(e)
        if all_ranks_true(not error):
            return candidate, state
        if not all_ranks_true(not refused):  # a crafted payload on some rank: stop, every rank alike
            raise RefusedCheckpoint(report_refused(candidate, error or "refused on another rank", move=is_main))
        why = error or "another rank could not read its files"
        failures.append(f"{candidate.name}: {why}")
        warnings.warn(f"checkpoint {candidate} is marked {MARKER} but cannot be loaded ({why}); falling back to "
                      "the previous complete checkpoint", RuntimeWarning, stacklevel=2)
    raise UnreadableCheckpoint(f"no complete checkpoint under {checkpoint_root(output_dir)} can be loaded: "
                               + "; ".join(failures or [f"{path.name}: not found"]))


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
