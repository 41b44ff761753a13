"""MegatronEngine checkpoints: one file per rank (`rank00000.pt`, ...) holding this rank's model shard,
its optimizer state (None for a frozen engine), the engine's counters and the RNG states (torch, CUDA,
Megatron's tracker), so that a resumed run reproduces the next steps exactly.

Saving is collective: every rank writes its file durably (temp name, fsync, rename), and once all are
on disk rank 0 seals the directory with a manifest (sha256 of every file, durable.write_manifest).
Loading reads nothing before the directory matches its manifest on every rank, and then only with
`torch.load(weights_only=True)`: tensors and plain values, never code. The state written is checked to
be of that kind when it is saved.
"""
from __future__ import annotations

import os
import pickle
import re
from typing import Dict

import torch

from .. import durable
from .parallel import DistInfo, all_ranks_true, barrier_world

COUNTERS = ("step_count", "gen_calls")  # the engine's counters, stored at the top level of the file
RANK_FILE = re.compile(r"^rank\d{5}\.pt$")
# what torch.load(weights_only=True) rebuilds without an allowlist: the only leaves a rank file may hold
_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class CheckpointMismatch(ValueError):
    """A readable checkpoint that does not fit this model or layout (not a damaged one)."""


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def rng_states() -> dict:
    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_states(rng: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(rng["torch"].cpu())
    if torch.cuda.is_available() and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


def check_plain(obj, where: str = "state") -> None:
    """Raise TypeError naming the first value under `obj` that torch.load(weights_only=True) would refuse
    (anything but tensors, numbers, strings, bytes, None, dtypes, devices and sizes in dicts, lists,
    tuples and sets)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            check_plain(k, f"{where} key {k!r}")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(f"engine checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; rank "
                        "files hold only tensors and plain values (they load with torch.load(weights_only=True))")


def save_state(path: str, gpt, optimizer, counters: Dict[str, int], info: DistInfo, vocab_size: int) -> None:
    """Collective: write this rank's file under the directory `path` (created if missing); rank 0 then
    writes the manifest of every rank's files."""
    os.makedirs(path, exist_ok=True)
    state = {
        "model": gpt.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        **{k: counters[k] for k in COUNTERS},
        "rng": rng_states(),
        "meta": {"world_size": info.world_size, "tp": info.tp_size, "vocab_size": vocab_size},
    }
    check_plain(state)
    durable.torch_save(state, rank_file(path, info.rank))  # temp name, fsync, rename
    barrier_world()  # every rank's file is on disk before rank 0 hashes them
    if info.rank == 0:
        durable.write_manifest(path)  # hashed from disk, written last
    barrier_world()  # no rank returns (and may load) before the manifest exists


def _verify(path: str, info: DistInfo) -> None:
    """Collective: every rank checks the directory's listing and sizes, and hashes its own file (each rank
    file is hashed by the rank that reads it, everything else by every rank); raises on every rank
    unless every rank's check passed."""
    own = os.path.basename(rank_file(path, info.rank))
    error = ""
    try:
        if own not in durable.check_manifest(path, hash_only=lambda rel: rel == own or not RANK_FILE.match(rel)):
            error = (f"no engine checkpoint for rank {info.rank} in {path} (written by fewer ranks: checkpoints "
                     "are per rank, resume with the world size and engine.parallel options that saved it)")
    except (durable.IntegrityError, OSError) as e:
        error = str(e)
    if not all_ranks_true(not error):
        raise durable.IntegrityError(error or f"engine checkpoint {path}: another rank's file does not match "
                                     f"{durable.MANIFEST} (its error names it); nothing was loaded")


def _check_fits(gpt, saved: dict, path: str) -> None:
    """A model-shape mismatch is named as such: parameter, the checkpoint's shape and the model's."""
    ours = gpt.state_dict()
    hint = ("the engine.model options, the tokenizer's vocabulary or engine.parallel.tensor_parallel differ "
            "from those of the run that saved it")
    for name in ours:
        if name not in saved:
            raise CheckpointMismatch(f"checkpoint {path} does not fit this model: it lacks {name!r} ({hint})")
        a, b = saved[name], ours[name]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            raise CheckpointMismatch(f"checkpoint {path} does not fit this model: {name!r} is {list(a.shape)} "
                                     f"in the checkpoint and {list(b.shape)} in the model ({hint})")
    extra = sorted(set(saved) - set(ours))
    if extra:
        raise CheckpointMismatch(f"checkpoint {path} does not fit this model: it holds {extra[:3]} which the "
                                 f"model lacks ({hint})")


def load_state(path: str, gpt, optimizer, info: DistInfo) -> Dict[str, int]:
    """Collective: restore model, optimizer (when given) and RNG states from this rank's file, once the
    directory matches its manifest on every rank; returns the counters."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no engine checkpoint at {path!r}")
    _verify(path, info)
    f = rank_file(path, info.rank)
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no engine checkpoint for rank {info.rank} at {f!r}")
    try:
        state = torch.load(f, map_location=info.device, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise pickle.UnpicklingError(f"{f}: refused: it holds something other than tensors and plain values "
                                     f"(torch.load(weights_only=True): {first})") from e
    meta = state["meta"]
    if meta["world_size"] != info.world_size or meta["tp"] != info.tp_size:
        raise CheckpointMismatch(f"checkpoint {path!r} was written with world_size={meta['world_size']}, "
                                 f"tp={meta['tp']}; this run has {info.world_size}, {info.tp_size} (checkpoints "
                                 "are per rank: resume with the engine.parallel options and world size that "
                                 "saved it)")
    _check_fits(gpt, state["model"], path)
    gpt.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointMismatch(f"checkpoint {path!r} has no optimizer state (written by a trainable=False "
                                     "engine); a trainable engine cannot resume from it")
        optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return {k: state[k] for k in COUNTERS}
