"""MegatronEngine checkpoints: one file per rank (`rank00000.pt`, ...) holding this rank's model shard,
its optimizer state (None for a frozen engine), the engine's counters and the RNG states (torch, CUDA,
Megatron's tracker), so that a resumed run reproduces the next steps exactly. Written durably (temp
name, fsync, rename) so a file is on disk before the job marks the checkpoint complete.
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from .. import durable
from .parallel import DistInfo

COUNTERS = ("step_count", "gen_calls")  # the engine's counters, stored at the top level of the file


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


def save_state(path: str, gpt, optimizer, counters: Dict[str, int], info: DistInfo, vocab_size: int) -> None:
    """Write this rank's file under the directory `path` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    state = {
        "model": gpt.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        **{k: counters[k] for k in COUNTERS},
        "rng": rng_states(),
        "meta": {"world_size": info.world_size, "tp": info.tp_size, "vocab_size": vocab_size},
    }
    durable.torch_save(state, rank_file(path, info.rank))  # temp name, fsync, rename: on disk before COMPLETE


def load_state(path: str, gpt, optimizer, info: DistInfo) -> Dict[str, int]:
    """Restore model, optimizer (when given) and RNG states from this rank's file; returns the counters."""
    f = rank_file(path, info.rank)
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no engine checkpoint for rank {info.rank} at {f!r}")
    state = torch.load(f, map_location=info.device, weights_only=False)
    meta = state["meta"]
    if meta["world_size"] != info.world_size or meta["tp"] != info.tp_size:
        raise ValueError(f"checkpoint {path!r} was written with world_size={meta['world_size']}, "
                         f"tp={meta['tp']}; this run has {info.world_size}, {info.tp_size}")
    gpt.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"checkpoint {path!r} has no optimizer state (written by a trainable=False "
                             "engine); a trainable engine cannot resume from it")
        optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return {k: state[k] for k in COUNTERS}
