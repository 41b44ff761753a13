"""The previous engine checkpoint format, read for one release: one `rankNNNNN.pt` per rank (model shard,
optimizer state, counters, RNG states), at the layout that wrote it only. New checkpoints are sharded
(state.py); this reader goes with the next release.
"""
from __future__ import annotations

import os
import re
import torch

from .. import durable
from .parallel import DistInfo, all_ranks_true
from .sharded import CheckpointMismatch, load_plain

RANK_FILE = re.compile(r"^rank\d{5}\.pt$")


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def is_v1(path: str) -> bool:
    """Whether the engine directory `path` holds the per-rank format (rank files without a state.pt)."""
    return os.path.isfile(rank_file(path, 0)) and not os.path.exists(os.path.join(path, "state.pt"))


def _verify(path: str, info: DistInfo) -> None:
    """Collective: the manifest check of every rank (each hashes its own rank file and the rest)."""
    own = os.path.basename(rank_file(path, info.rank))
    error = ""
    try:
        if own not in durable.check_manifest(path, hash_only=lambda rel: rel == own or not RANK_FILE.match(rel)):
            error = (f"no engine checkpoint for rank {info.rank} in {path} (a per-rank checkpoint of the previous "
                     "format, written by fewer ranks: resume it with the world size and engine.parallel options "
                     "that saved it)")
    except (durable.IntegrityError, OSError) as e:
        error = str(e)
    if not all_ranks_true(not error):
        raise durable.IntegrityError(error or f"engine checkpoint {path}: another rank's file does not match "
                                     f"{durable.MANIFEST} (its error names it); nothing was loaded")


def read(path: str, info: DistInfo) -> dict:
    """Collective: this rank's file of the per-rank checkpoint `path`, once the directory matches its manifest
    on every rank, loaded with torch.load(weights_only=True); refuses another layout, naming both."""
    _verify(path, info)
    state = load_plain(rank_file(path, info.rank), info.device)
    meta = state["meta"]
    if meta["world_size"] != info.world_size or meta["tp"] != info.tp_size:
        raise CheckpointMismatch(f"checkpoint {path!r} is of the previous per-rank format, written with world_size="
                                 f"{meta['world_size']}, tp={meta['tp']}; this run has {info.world_size}, "
                                 f"{info.tp_size}. That format loads only at the layout that saved it: resume "
                                 "once with those engine.parallel options and save again (new checkpoints load at "
                                 "any layout)")
    return state


def load_model(gpt, state: dict, path: str) -> None:
    """The model shard of a per-rank file into `gpt`, a changed shape named as such."""
    ours, saved = gpt.state_dict(), state["model"]
    hint = "the engine.model options (engine.model.vocab_size included) differ from those of the run that saved it"
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
    gpt.load_state_dict(saved)


def load_optimizer(optimizer, state: dict, path: str) -> None:
    if state["optimizer"] is None:
        raise CheckpointMismatch(f"checkpoint {path!r} has no optimizer state (written by a trainable=False "
                                 "engine); a trainable engine cannot resume from it")
    optimizer.load_state_dict(state["optimizer"])
