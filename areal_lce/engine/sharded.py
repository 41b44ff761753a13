"""Layout-independent model and optimizer state through megatron-core's dist_checkpointing.

Every tensor is saved as a ShardedTensor: its global shape, this rank's offset in it and a replica id
(which rank of the copies writes it), so a checkpoint written at one parallel layout (TP, PP, DP) loads
at any other. The files are megatron's `torch_dist` format (torch.distributed.checkpoint): `.metadata`
(a pickle of the tensors' index), one `__R_0.distcp` per writing rank, `metadata.json`.

* Model: `GPTModel.sharded_state_dict()` (the SwiGLU fc1 weight as megatron's factory, layers under
  their global numbers, the LM head / embedding with a vocabulary dimension whose padding may change
  with TP: `allow_shape_mismatch`, rows past the saved ones load as zeros). Its ShardedObjects (the
  linear layers' `_extra_state`: None for megatron's local layers) are left out: torch's reader loads
  such byte items with `torch.load(weights_only=False)`.
* torch.optim.AdamW (the CPU engine): each parameter's `exp_avg` / `exp_avg_sq` becomes a ShardedTensor
  with the parameter's own sharding (megatron's `make_sharded_optimizer_tensor`: same global shape,
  offsets and replica id, key `optimizer.state.exp_avg.<parameter key>`), so the moments reshard with
  the parameters; the step count, one for all parameters, and the param groups' hyperparameters are
  plain data (`split_plain`), saved by the caller in a file loaded with weights_only=True.
* megatron's optimizer (GPU): its own `sharded_state_dict(model_sharded_state_dict)` (fp32 master
  weights and moments as ShardedTensors of the same kind), its plain part handled as above.

Reading: `.metadata` is checked with an allowlist unpickler (`read_metadata`: torch.distributed.checkpoint
index types, dtypes and sizes only) before torch's reader unpickles it; only ShardedTensors are
requested, so no byte item is ever unpickled. The caller checks the directory's manifest first.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import warnings
from typing import Dict, Tuple

import torch

_DCP = "torch.distributed.checkpoint."
# what a `.metadata` written by torch.distributed.checkpoint (through megatron's writer) is made of
_METADATA_TYPES = {
    *((_DCP + "metadata", n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                                       "BytesStorageMetadata", "MetadataIndex", "StorageMeta",
                                       "_MEM_FORMAT_ENCODING")),
    (_DCP + "filesystem", "_StorageInfo"),
    *((_DCP + "planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
}


class CheckpointMismatch(ValueError):
    """A readable checkpoint that does not fit this model or layout (not a damaged one)."""


class RefusedPayload(pickle.UnpicklingError):
    """A checkpoint file holds a pickled object that loading would have to build by running code outside
    the allowlist (a crafted payload, or a file of another program): nothing of it was built."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_TYPES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise RefusedPayload(f"{module}.{name} is not a checkpoint index type")


def read_metadata(directory: str):
    """The torch.distributed.checkpoint index (`.metadata`) of `directory`, unpickled with an allowlist of
    its own types: anything else (a pickle that would run code) raises UnpicklingError naming it."""
    path = f"{directory}/.metadata"
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except RefusedPayload as e:
            raise RefusedPayload(f"{path}: refused: not a checkpoint index ({e})") from e
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise pickle.UnpicklingError(f"{path}: refused: not a checkpoint index ({e})") from e


def saved_shapes(metadata) -> Dict[str, Tuple[int, ...]]:
    """{sharded key: global shape} of the tensors in a checkpoint index."""
    return {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}


def load_plain(f: str, device=None):
    """torch.load(weights_only=True) of `f` (tensors and plain values only), a refusal naming the file."""
    try:
        return torch.load(f, map_location=device or "cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RefusedPayload(f"{f}: refused: it holds something other than tensors and plain values "
                                     f"(torch.load(weights_only=True): {first})") from e


# ------------------------------------------------------------------------------ state dicts

def model_sharded_state(gpt) -> dict:
    """The GPTModel's sharded state dict without its ShardedObjects (see the module docstring)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {k: v for k, v in gpt.sharded_state_dict().items() if not isinstance(v, ShardedObject)}


def _common_step(state: dict):
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"optimizer state: the parameters' step counts differ ({sorted(steps)}); a checkpoint "
                         "holds one step count for all parameters")
    return next((s["step"] for s in state["state"].values() if "step" in s), None)


def _init_adamw_state(optimizer) -> None:
    """Moments (zeros) for every parameter that has none yet: the tensors a load writes into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def stepped(plain_optimizer) -> bool:
    """Whether the plain part of a saved optimizer state says it had taken a step (and saved moments)."""
    return plain_optimizer is not None and "common_step" in plain_optimizer.get("optimizer", {}).get("state", {})


def optimizer_sharded_state(optimizer, megatron_optimizer: bool, model_state: dict, loading: bool) -> dict:
    """The optimizer's sharded state dict: moments (and master weights) as ShardedTensors of their
    parameter's sharding, plain data for the rest. `loading`: tensors to load into."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    if megatron_optimizer:
        return optimizer.sharded_state_dict(model_state, is_loading=loading)
    if loading:
        _init_adamw_state(optimizer)
    state = optimizer.state_dict()  # references to the state tensors (a load writes into them)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    id_map = get_param_id_to_sharded_param_map(model_state, params)
    missing = [i for i in state["state"] if i not in id_map]
    if missing:
        raise ValueError(f"optimizer state: parameters {missing[:3]} have no sharded model tensor")
    step = _common_step(state)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    if step is not None:
        state["state"]["common_step"] = step
    return {"optimizer": state}


def load_optimizer_state(optimizer, megatron_optimizer: bool, state: dict) -> None:
    """Restore the optimizer from a loaded `optimizer_sharded_state` (tensors and plain part merged)."""
    if megatron_optimizer:
        optimizer.load_state_dict(state)
        return
    sd = state["optimizer"]
    step = sd["state"].pop("common_step", None)
    for s in sd["state"].values():
        s["step"] = torch.as_tensor(step if step is not None else 0.0, dtype=torch.float32).clone()
    optimizer.load_state_dict(sd)


def split_plain(sharded_state: dict, validate: bool) -> Tuple[dict, dict]:
    """(ShardedTensors, plain data) of a sharded state dict, factories applied and non-persistent items
    dropped (megatron's save_preprocess); `validate`: check, across ranks, that every shard of every
    tensor is written by exactly one rank."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    return save_preprocess(sharded_state, validate_access_integrity=validate)


# ------------------------------------------------------------------------------ save / load

@contextlib.contextmanager
def _sync_writer():
    """megatron's torch_dist writer, run synchronously in this process. Its worker hands its results over a
    multiprocessing queue that it creates from a spawned Manager server (a second Python process that
    re-imports `__main__`), and logs its memory through psutil (not a dependency of megatron-core); a sync
    save needs neither: a queue.Queue carries the results, and the memory log reads 0."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    # megatron's deprecation notice of its own async writer, which this sync save does not use
    notices = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
    level = notices.level
    notices.setLevel(logging.ERROR)
    saved = {k: getattr(fa, k) for k in ("_results_queue", "_process_memory") if hasattr(fa, k)}
    if "_results_queue" in saved and saved["_results_queue"] is None:
        fa._results_queue = queue.Queue()
    if "_process_memory" in saved and not getattr(fa, "HAVE_PSUTIL", True):
        fa._process_memory = lambda: 0
    try:
        yield
    finally:
        notices.setLevel(level)
        for k, v in saved.items():
            setattr(fa, k, v)


def save(sharded_part: dict, directory: str) -> None:
    """Collective: write the ShardedTensors of `sharded_part` under `directory` (megatron's torch_dist)."""
    from megatron.core import dist_checkpointing

    with _sync_writer():
        dist_checkpointing.save(sharded_part, directory, validate_access_integrity=False)


def load(sharded_state: dict, directory: str) -> dict:
    """Load the ShardedTensors of `sharded_state` from `directory` (into their tensors), factories merged;
    returns the state dict with the loaded tensors and the non-persistent items, without the plain data
    (the caller merges it). Call `read_metadata` first: torch's reader unpickles `.metadata` unchecked."""
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sharded, nonpersistent, factories = load_preprocess(sharded_state)
    sharded, _plain = extract_sharded_base(sharded)
    with warnings.catch_warnings():  # torch's notices about the calls megatron's reader makes
        for text in _READER_NOTICES:
            warnings.filterwarnings("ignore", message=text)
        loaded = TorchDistLoadShardedStrategy().load(sharded, directory)
    merge(loaded, nonpersistent)
    return apply_factory_merges(loaded, factories)


# what torch.distributed.checkpoint says about the way megatron's reader calls it (each rank reads its
# shards alone: no_dist=True; megatron hands it torch ShardedTensors), nothing a caller can act on
_READER_NOTICES = ("The argument order of load has been changed", "torch.distributed is disabled, unavailable",
                   "Please use DTensor instead and we are deprecating ShardedTensor")


def check_fits(sharded_state: dict, shapes: Dict[str, Tuple[int, ...]], where: str, hint: str) -> None:
    """CheckpointMismatch naming the first requested tensor that the checkpoint lacks or holds with another
    global shape (a vocabulary dimension, padded for the layout, aside)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    sharded, _, _ = load_preprocess(sharded_state)
    for t in nested_values(sharded):
        if not isinstance(t, ShardedTensor):
            continue
        if t.key not in shapes:
            raise CheckpointMismatch(f"checkpoint {where} does not fit this model: it lacks {t.key!r} ({hint})")
        saved, ours = shapes[t.key], tuple(t.global_shape)
        if saved != ours and not (t.allow_shape_mismatch and saved[1:] == ours[1:]):
            raise CheckpointMismatch(f"checkpoint {where} does not fit this model: {t.key!r} is {list(saved)} in the "
                             f"checkpoint and {list(ours)} in the model ({hint})")
