"""Per-token tensors beside the labels, through a micro-batch's model layout and back.

`batch.prepare` lays the labels out as the model sees them (right-padded BSHD rows, or one packed THD
row; under context parallelism this rank's zigzag share) and `ModelBatch.stats` brings the model's
per-token output back to the caller's [b, s] layout. A per-token tensor with trailing dimensions --
`selected_ids` [b, s, K] going in, `selected_logprobs` / `topk_ids` / `topk_logprobs` [.., K] coming
out -- takes the same two paths here, so it stays aligned with the labels in every layout:

    sel = to_model_layout(selected_ids, mb, fill=ignore_index)   # [b, s', K] / [1, T, K] (CP-local)
    out = from_model_layout(topk_ids, mb, fill=ignore_index)     # [b, s, k]
"""
from __future__ import annotations

import torch

from .batch import ModelBatch
from ..megatron.context_parallel import pad_packed, split_for_context_parallel
from ..megatron.packing import host_to_device

IGNORE_INDEX = -100  # the engine's: labels and selected_ids entries without a target

def to_model_layout(x: torch.Tensor, mb: ModelBatch, fill) -> torch.Tensor:
    """`x` [b, s, ...] laid out like the caller's labels -> laid out like `mb.labels` (`fill` where the
    model batch holds padding), on the model batch's device."""
    b, s = mb.shape
    if tuple(x.shape[:2]) != (b, s):
        raise ValueError(f"per-token tensor {tuple(x.shape)} must be laid out like the labels [{b}, {s}, ...]")
    device, tail = mb.labels.device, tuple(x.shape[2:])
    if mb.packed is not None:
        rows = mb.packed
        flat = x.reshape(b * s, *tail).index_select(0, rows.index.to(x.device))
        out = flat.new_full((rows.input_ids.shape[1],) + tail, fill)
        out[: flat.shape[0]] = flat
        out = host_to_device(out[None], device)
        if not mb.cp.active:
            return out
        return split_for_context_parallel(pad_packed(out, mb.layout, fill), mb.cp, mb.layout)
    width = mb.labels.shape[1] * mb.cp.size  # the padded sequence before the CP split
    out = x.new_full((b, width) + tail, fill)
    out[:, :s] = x
    out = host_to_device(out, device)
    return split_for_context_parallel(out, mb.cp) if mb.cp.active else out


def from_model_layout(out: torch.Tensor, mb: ModelBatch, fill) -> torch.Tensor:
    """The model's per-token output laid out like `mb.labels` -> the caller's [b, s, ...] (`fill` where no
    token was computed), as `ModelBatch.stats` does for the packed statistics; differentiable."""
    return mb.to_caller_layout(out, fill)


def stats_with_extras(out, mb: ModelBatch):
    """Route.stats' output of a call with selected_ids / top_k, (packed stats, extras), -> SelectedTokenStats
    in the caller's [b, s] layout (topk_ids padded with IGNORE_INDEX, the logprobs with 0)."""
    packed, extras = out
    fields = {name: None if t is None else from_model_layout(t, mb, IGNORE_INDEX if name == "topk_ids" else 0.0)
              for name, t in extras.items()}
    return mb.stats(packed).with_extras(**fields)
