"""The fused head call: `linear_logprobs_entropy` run inside an `nn.Linear` head's own `__call__`.

Running the op through ``lm_head.__call__`` (its forward temporarily swapped) keeps the head's module
hooks: FSDP2's unshard/reshard and gradient reduce-scatter work exactly as for the unpatched head.

DTensor `lm_head.weight` (only seen when the head is not FSDP2-unsharded around its forward, i.e.
tensor parallelism): Replicate placements use the local tensor; Shard(0) over one mesh dimension with
the vocabulary divisible by that dimension's size uses the op's vocab-parallel path on that mesh
dimension's process group (no gather of the weight); anything else raises.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ...op.api import call_options, linear_logprobs_entropy
from ...op.checks import check_temperature
from ...op.options import LCEOptions
from ...op.types import VocabParallel

_MISSING = object()


def fused_head(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, options: Optional[LCEOptions] = None,
               *, ignore_index: int = -100, temperature=None, **overrides: Any):
    """`linear_logprobs_entropy(hidden, head.weight, labels, options, temperature=..., **overrides)` for
    `hidden` [..., H], run inside `head.__call__` so the head's module hooks (FSDP2 unshard/reshard,
    gradient reduce-scatter) fire. Returns an `LCEOutput` whose fields are shaped like `labels`."""
    lead = labels.shape
    if temperature is not None:  # None: the options' own
        overrides["temperature"] = temperature
    options, temperature = call_options(options, dict(overrides, ignore_index=ignore_index, return_stats=True),
                                        "areal_lce.integrations.transformers")
    if temperature is not None:  # per sample / per token: flatten along with the labels
        temperature = check_temperature(temperature.to(labels.device), "areal_lce.integrations.transformers: temperature", shape=lead)
        temperature = {"temperature": temperature.reshape(-1)}
    else:
        temperature = {}

    def head_forward(h):
        return _run_op(head.weight, h, labels.reshape(-1), options, temperature)

    previous = head.__dict__.get("forward", _MISSING)
    head.__dict__["forward"] = head_forward
    try:
        out = head(hidden.reshape(-1, hidden.shape[-1]))
    finally:
        if previous is _MISSING:
            del head.__dict__["forward"]
        else:
            head.__dict__["forward"] = previous
    return type(out)(*(None if v is None else v.reshape(lead) for v in out))


def _run_op(weight, hidden, labels, options: LCEOptions, temperature: dict):
    """The op on the head's local weight; `temperature`: {"temperature": the per-token tensor} or {}."""
    labels = labels.to(hidden.device)
    global_vocab = weight.shape[0]
    weight, hidden, vocab_parallel = _resolve_dtensor(weight, hidden)
    if hidden.device != weight.device:  # e.g. an accelerate device map put the head elsewhere
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
    if options.vocab_size is None and vocab_parallel is not None:
        options = options.replace("areal_lce.integrations.transformers", vocab_size=global_vocab)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # nn.Linear would run in the autocast dtype: do the same, then keep autocast off inside the op.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device_type, enabled=False):
        return linear_logprobs_entropy(hidden.contiguous(), weight, labels.contiguous(), options,
                                       vocab_parallel=vocab_parallel, **temperature)


def _resolve_dtensor(weight, hidden):
    """(local weight, local hidden, VocabParallel or None) for DTensor weight/hidden (see the module
    docstring)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch built without distributed
        return weight, hidden, None
    if not isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):
            raise ValueError("areal_lce.integrations.transformers: hidden states are a DTensor but lm_head.weight is not; unsupported layout")
        return weight, hidden, None
    placements = tuple(weight.placements)
    shard_dims = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not shard_dims:
        if isinstance(hidden, DTensor):
            hidden = hidden.to_local()  # replicated weight: d_hidden is complete on every rank
        return weight.to_local(), hidden, None
    elif len(shard_dims) == 1 and placements[shard_dims[0]] == Shard(0):
        mesh_dim = shard_dims[0]
        world = weight.device_mesh.size(mesh_dim)
        if weight.shape[0] % world:
            raise ValueError(f"areal_lce.integrations.transformers: lm_head.weight is a DTensor sharded along the vocabulary "
                             f"({weight.shape[0]} rows) over {world} ranks unevenly; the vocab-parallel op needs "
                             "equal shards")
        local_w = weight.to_local()
        group = weight.device_mesh.get_group(mesh_dim)
    else:
        raise ValueError(f"areal_lce.integrations.transformers: lm_head.weight is a DTensor with placements {placements}; supported are "
                         "all-Replicate and Shard(0) on one mesh dimension (vocab parallel). An FSDP2-sharded "
                         "lm_head is unsharded by its own hooks and needs nothing")
    if isinstance(hidden, DTensor):  # vocab-sharded weight, replicated hidden
        if any(not isinstance(p, Replicate) for p in hidden.placements):
            raise ValueError(f"areal_lce.integrations.transformers: hidden states are a DTensor with placements {tuple(hidden.placements)};"
                             " only Replicate is supported")
        if hidden.device_mesh != weight.device_mesh:
            raise ValueError("areal_lce.integrations.transformers: hidden states and lm_head.weight are DTensors on different meshes")
        from torch.distributed.tensor import Partial

        # Each rank's d_hidden is then a partial over the vocab shards of mesh_dim; DTensor sums it
        # where it needs the total, so the op leaves it to the caller.
        hidden = hidden.to_local(grad_placements=[Partial() if i == mesh_dim else Replicate()
                                                  for i in range(len(placements))])
        return local_w, hidden, VocabParallel(group, d_hidden="caller")
    return local_w, hidden, VocabParallel(group)  # plain replicated hidden: the op all-reduces d_hidden
