"""The engine's batch value: right-padded token rows with their next-token labels.

`MicroBatch` is what `MegatronEngine.train_step` takes and what its `loss_fn(stats, mb)` receives
back; jobs subclass it to carry their loss inputs (the RL job's `PolicyMicroBatch` adds behaviour and
reference logprobs and advantages). A typed value replaces dict keys: a misspelt field is an error at
construction, not a silently missing loss term. Packed (THD) layouts are never passed in: the engine
packs right-padded rows itself (`engine.pack_sequences`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..op.checks import check_temperature
from ..megatron.packing import host_to_device, row_lengths


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded rows: `input_ids` [b, s] token ids, `labels` [b, s] next-token targets aligned with
    input positions (-100 where there is no target: padding, prompts, the last token), and the softmax
    temperature the token statistics are taken at (a finite float > 0, checked here by
    `checks.check_temperature`). Optional
    `selected_ids` [b, s, K]: per position, K global vocabulary ids whose logprobs the stats also carry
    (`TokenStats.selected_logprobs`; -100 entries give 0), laid out and padded like labels."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    temperature: float = 1.0
    selected_ids: Optional[torch.Tensor] = None

    def __post_init__(self):
        for name in ("input_ids", "labels"):
            t = getattr(self, name)
            if not torch.is_tensor(t) or t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool:
                got = f"{tuple(t.shape)} {t.dtype}" if torch.is_tensor(t) else type(t).__name__
                raise ValueError(f"MicroBatch.{name} must be an integer tensor [batch, seq]; got {got}")
        if self.input_ids.shape != self.labels.shape:
            raise ValueError(f"MicroBatch.labels {tuple(self.labels.shape)} must match input_ids "
                             f"{tuple(self.input_ids.shape)}")
        object.__setattr__(self, "temperature",
                           check_temperature(self.temperature, "MicroBatch.temperature", allow_tensor=False))
        sel = self.selected_ids
        if sel is not None and (not torch.is_tensor(sel) or sel.dim() != 3 or sel.dtype != torch.int64
                                or tuple(sel.shape[:2]) != tuple(self.labels.shape) or sel.shape[2] < 1):
            got = f"{tuple(sel.shape)} {sel.dtype}" if torch.is_tensor(sel) else type(sel).__name__
            raise ValueError(f"MicroBatch.selected_ids must be an int64 tensor [batch, seq, K>=1] laid out like "
                             f"labels {tuple(self.labels.shape)}; got {got}")

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def target_tokens(self) -> int:
        """Positions with a target (labels != -100): a host read, free for the host-built batches the
        engine takes (a device sync where labels live on a GPU)."""
        return int((self.labels != -100).sum())

    def to(self, device) -> "MicroBatch":
        """The same value with every tensor field on `device`, copied without a host sync (pinned memory
        on CUDA): what `train_step` hands `loss_fn`, so that its device-side math waits on nothing."""
        moved = {f.name: host_to_device(getattr(self, f.name), device) for f in dataclasses.fields(self)
                 if torch.is_tensor(getattr(self, f.name))}
        return dataclasses.replace(self, **moved)

    def select(self, rows) -> "MicroBatch":
        """The same kind of value with only `rows` (an index tensor, list or slice) of every per-row
        tensor field; other fields are copied as they are."""
        n = self.rows
        picked = {f.name: getattr(self, f.name)[rows]
                  for f in dataclasses.fields(self)
                  if torch.is_tensor(getattr(self, f.name)) and getattr(self, f.name).dim() > 0
                  and getattr(self, f.name).shape[0] == n}
        return dataclasses.replace(self, **picked)


def check_microbatches(microbatches) -> None:
    """train_step's input check: a non-empty sequence of MicroBatch values."""
    if not microbatches:
        raise ValueError("train_step needs at least one microbatch")
    for i, mb in enumerate(microbatches):
        if not isinstance(mb, MicroBatch):
            raise TypeError(f"train_step: microbatches[{i}] is a {type(mb).__name__}; pass "
                            "areal_lce.megatron.MicroBatch(input_ids, labels, temperature) values of "
                            "right-padded [batch, seq] rows (the engine packs them itself: "
                            "engine.pack_sequences; pre-packed cu_seqlens are not taken)")


def token_budget_ranges(labels: torch.Tensor, max_tokens: int, *, packed: bool,
                        ignore_index: int = -100) -> list:
    """Contiguous row ranges (slices) of a right-padded [b, s] batch, in order, each costing at most
    `max_tokens` tokens in one forward: the sum of the rows' kept lengths when the engine packs (THD),
    rows x s when it right-pads. A row that alone costs more than the budget gets a range of its own."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
    b, s = labels.shape
    costs = row_lengths(labels, ignore_index).tolist() if packed else [s] * b
    ranges, start, used = [], 0, 0
    for r, c in enumerate(costs):
        if r > start and used + c > max_tokens:
            ranges.append(slice(start, r))
            start, used = r, 0
        used += c
    if b:
        ranges.append(slice(start, b))
    return ranges
