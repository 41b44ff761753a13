"""MegatronEngine checkpoints that load at any parallel layout (TP, PP, DP), the model and its optimizer
state saved through megatron-core's dist_checkpointing (sharded.py). The engine's directory::

    sharded/            model + optimizer tensors, megatron's torch_dist format (`.metadata`, `*.distcp`)
    state.pt            rank 0: format, counters, the writer's layout and vocabulary, the optimizer's
                        plain part (hyperparameters of its param groups, the step count)
    rank00000.pt        each rank's RNG states (torch, CUDA, megatron's tracker)
    MANIFEST.json       sha256 of every file above, written last by rank 0 (durable.write_manifest)

Saving is collective: the ranks write their shards and files durably, then rank 0 seals the directory.
Loading reads nothing before the directory matches its manifest on every rank (each `.distcp` file is
hashed by one rank, every other file by every rank: the directory is on one shared file system, as a
load at another layout needs). `state.pt` and the RNG files hold tensors and plain values only (checked
at save) and load with torch.load(weights_only=True); `.metadata` is unpickled with an allowlist before
torch's reader reads it; no byte item of the torch_dist files is loaded.

At the writer's layout a load restores every RNG state, so the next steps equal the uninterrupted run's
bit for bit. At another layout the RNG streams cannot carry over (they are per TP / PP rank): they stay
as `engine.seed` set them (the model presets have no dropout; `generate` seeds from the restored call
count).
"""
from __future__ import annotations

import os
import shutil
import zlib
from typing import Dict, Optional

import torch

from .. import durable
from . import sharded
from .parallel import DistInfo, all_ranks_true, barrier_world
from .sharded import CheckpointMismatch

FORMAT = "areal_lce.engine/2"
COUNTERS = ("step_count", "gen_calls")  # the engine's counters
SHARDED, STATE = "sharded", "state.pt"
# what torch.load(weights_only=True) rebuilds without an allowlist: the only leaves state files may hold
_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_HINT = "the engine.model options (engine.model.vocab_size included) differ from those of the run that saved it"

__all__ = ["CheckpointMismatch", "check_plain", "save_state", "load_state", "load_weights", "saved_vocab_size"]


def rng_file(path: str, rank: int) -> str:
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
        raise TypeError(f"engine checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; state "
                        "files hold only tensors and plain values (they load with torch.load(weights_only=True))")


def _layout(info: DistInfo) -> dict:
    return {"world_size": info.world_size, "tp": info.tp_size, "pp": info.pp_size, "cp": info.cp_size,
            "dp": info.dp_size}


def save_state(path: str, gpt, optimizer, megatron_optimizer: bool, counters: Dict[str, int], info: DistInfo,
               vocab_size: int) -> None:
    """Collective: the model (and optimizer, when given) as sharded tensors, counters and RNG states under the
    directory `path` (replaced if it exists), sealed by rank 0's manifest."""
    model_state = sharded.model_sharded_state(gpt)
    full = {"model": model_state}
    if optimizer is not None:
        full["optimizer"] = sharded.optimizer_sharded_state(optimizer, megatron_optimizer, model_state, loading=False)
    tensors, plain = sharded.split_plain(full, validate=True)  # every shard written by exactly one rank
    state = {"format": FORMAT, "layout": _layout(info), "vocab_size": vocab_size,
             "padded_vocab_size": int(gpt.vocab_size), "counters": {k: int(counters[k]) for k in COUNTERS},
             "has_optimizer": optimizer is not None, "optimizer": plain.get("optimizer")}
    rng = rng_states()
    check_plain(state)
    check_plain(rng, "rng")
    if info.rank == 0 and os.path.lexists(path):
        shutil.rmtree(path)  # an earlier, unsealed save at this path (the caller dropped its marker)
    barrier_world()
    os.makedirs(os.path.join(path, SHARDED), exist_ok=True)
    sharded.save(tensors, os.path.join(path, SHARDED))  # collective; megatron's writer fsyncs every file
    durable.torch_save(rng, rng_file(path, info.rank))  # temp name, fsync, rename
    if info.rank == 0:
        durable.torch_save(state, os.path.join(path, STATE))
    barrier_world()  # every rank's files are on disk before rank 0 hashes them
    if info.rank == 0:
        for d in (SHARDED, ""):
            durable.fsync_dir(os.path.join(path, d))
        durable.write_manifest(path)  # hashed from disk, written last
    barrier_world()  # no rank returns (and may load) before the manifest exists


def _verify(path: str, info: DistInfo) -> None:
    """Collective: the directory's listing and sizes on every rank, each `.distcp` file hashed by one rank
    (picked by its name), every other file by every rank; raises on every rank unless all passed."""
    def mine(rel: str) -> bool:
        return not rel.endswith(".distcp") or zlib.crc32(rel.encode()) % info.world_size == info.rank

    error = ""
    try:
        durable.check_manifest(path, hash_only=mine)
    except (durable.IntegrityError, OSError) as e:
        error = str(e)
    if not all_ranks_true(not error):
        raise durable.IntegrityError(error or f"engine checkpoint {path}: a file another rank checked does not "
                                     f"match {durable.MANIFEST} (its error names it); nothing was loaded")


def _open(path: str, info: DistInfo, vocab_size: int) -> dict:
    """Collective: the checked directory's state.pt, its format and vocabulary checked."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no engine checkpoint at {path!r}")
    _verify(path, info)
    if not os.path.isfile(os.path.join(path, STATE)):
        raise CheckpointMismatch(f"{path}: no {STATE}: not an engine checkpoint of format {FORMAT!r}")
    state = sharded.load_plain(os.path.join(path, STATE))
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointMismatch(f"{path}/{STATE}: not an engine checkpoint of format {FORMAT!r}")
    _check_vocab(path, state["vocab_size"], vocab_size)
    return state


def _check_vocab(path: str, saved: Optional[int], vocab_size: int) -> None:
    """Refuse a checkpoint written for another true vocabulary (None: not recorded), naming the option that
    loads it: a run trained over another vocabulary (e.g. its tokenizer's ids) resumes with that one set."""
    if saved is not None and saved != vocab_size:
        raise CheckpointMismatch(f"checkpoint {path} does not fit this model: it was written for a vocabulary of "
                                 f"{saved} tokens, this model has {vocab_size} ({_HINT}; "
                                 "engine.model.vocab_size: 0 takes the checkpoint config's or preset's vocab_size, "
                                 f"not the tokenizer's: set engine.model.vocab_size={saved} to load it "
                                 "with the vocabulary it was trained with)")


def _load_tensors(path: str, request: dict) -> dict:
    """The ShardedTensors of `request` from `path`/sharded, once its index is read safely and fits."""
    directory = os.path.join(path, SHARDED)
    shapes = sharded.saved_shapes(sharded.read_metadata(directory))  # the allowlist unpickler first
    sharded.check_fits(request, shapes, path, _HINT)
    return sharded.load(request, directory)


def _load_model(gpt, loaded: dict, path: str) -> None:
    missing, unexpected = gpt.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]  # left out of the sharded state (None)
    if missing or unexpected:
        raise CheckpointMismatch(f"checkpoint {path} does not fit this model: missing {missing[:3]}, unexpected "
                                 f"{unexpected[:3]} ({_HINT})")


def load_state(path: str, gpt, optimizer, megatron_optimizer: bool, info: DistInfo,
               vocab_size: int) -> Dict[str, int]:
    """Collective: restore model, optimizer (when given) and, at the writer's layout, RNG states from `save`'s
    directory `path`, at any parallel layout; returns the counters."""
    state = _open(path, info, vocab_size)
    if optimizer is not None and not state["has_optimizer"]:
        raise CheckpointMismatch(f"checkpoint {path!r} has no optimizer state (written by a trainable=False "
                                 "engine); a trainable engine cannot resume from it")
    from megatron.core.dist_checkpointing.dict_utils import merge

    model_state = sharded.model_sharded_state(gpt)
    request = {"model": model_state}
    # an optimizer saved before its first step has no moments: AdamW's plain state says so; megatron's
    # optimizer's index then holds no Adam moment (its fp32 main parameters, saved too, are the model's
    # values then): the fresh optimizer stays as it is, its main parameters reloaded from the model
    if optimizer is not None and megatron_optimizer:
        saved = sharded.saved_shapes(sharded.read_metadata(os.path.join(path, SHARDED)))
        moments = any(k.startswith("optimizer.state.exp_avg") for k in saved)
    else:
        moments = optimizer is not None and sharded.stepped(state["optimizer"])
    if moments:
        request["optimizer"] = sharded.optimizer_sharded_state(optimizer, megatron_optimizer, model_state,
                                                               loading=True)
    loaded = _load_tensors(path, request)
    _load_model(gpt, loaded["model"], path)
    if optimizer is not None and not moments:
        if megatron_optimizer:
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):  # the torch optimizers inside
                inner.optimizer.state.clear()
            optimizer.reload_model_params()  # fp32 main parameters from the loaded model
        else:
            optimizer.state.clear()
    if moments:
        try:
            merge(loaded["optimizer"], state["optimizer"])  # the param groups' hyperparameters, the step count
        except ValueError as e:
            raise CheckpointMismatch(f"checkpoint {path}: its optimizer's param groups do not fit this "
                                     f"optimizer's ({e})") from e
        sharded.load_optimizer_state(optimizer, megatron_optimizer, loaded["optimizer"])
    if state["layout"] == _layout(info):
        set_rng_states(sharded.load_plain(rng_file(path, info.rank)))
    return dict(state["counters"])


def load_weights(path: str, gpt, info: DistInfo, vocab_size: int) -> None:
    """Collective: the model weights only from `save`'s directory `path`, at any layout, once it matches its
    manifest."""
    _open(path, info, vocab_size)
    _load_model(gpt, _load_tensors(path, {"model": sharded.model_sharded_state(gpt)})["model"], path)


def saved_vocab_size(path: str) -> Optional[int]:
    """The true vocabulary `save`'s directory `path` was written for (None: not recorded). Read without the
    manifest check that loading does (the files load weights-only)."""
    state = sharded.load_plain(os.path.join(path, STATE))
    return int(state["vocab_size"]) if isinstance(state, dict) and "vocab_size" in state else None
