"""One micro-batch as the model sees it: right-padded BSHD or packed THD, built from [b, s] ids and labels.

The jobs hand the engine right-padded [b, s] input_ids and labels (ignore_index on padding and on
tokens without a target). `prepare` turns that into the model's inputs -- padded [b, s] rows, or, with
`engine.pack_sequences`, every row's tokens up to its last target packed into one [1, T] THD row with
`PackedSeqParams` -- and `ModelBatch.stats` turns the model's per-token output back into the padded
[b, s] layout, so losses and metrics never see which layout ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .packing import PackedRows, pack_rows
from .stats import TokenStats


@dataclass
class ModelBatch:
    input_ids: torch.Tensor  # [b, s'] padded, or [1, T] packed
    labels: torch.Tensor  # laid out like input_ids
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    packed: Optional[PackedRows]  # None: BSHD
    shape: tuple  # (b, s) of the caller's padded batch

    @property
    def packed_seq_params(self):
        return None if self.packed is None else self.packed.packed_seq_params()

    def stats(self, out: torch.Tensor) -> TokenStats:
        """Model output (packed stats [b, s', 4] or [1, T, 4]) -> TokenStats in the caller's [b, s] layout."""
        if self.packed is not None:
            return TokenStats.unpack(self.packed.unpack(out))
        b, s = self.shape
        return TokenStats.unpack(out[:b, :s])


def prepare(input_ids: torch.Tensor, labels: torch.Tensor, *, device, max_seq_len: int, pack: bool,
            seq_multiple: int = 1, min_packed_length: int = 0, ignore_index: int = -100) -> ModelBatch:
    """Model inputs of one right-padded micro-batch. `seq_multiple`: the sequence (BSHD) or packed row
    (THD) length must be a multiple of it (tensor-parallel size under sequence parallelism)."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both "
                         "be [batch, seq]")
    b, s = input_ids.shape
    if s > max_seq_len:
        raise ValueError(f"sequence length {s} exceeds model.max_seq_len={max_seq_len}")
    ids, lab = input_ids.to(device, torch.long), labels.to(device, torch.long)
    if pack:
        rows = pack_rows(ids, lab, pad_to_multiple=seq_multiple, min_length=min_packed_length,
                         ignore_index=ignore_index)
        return ModelBatch(rows.input_ids, rows.labels, rows.position_ids, None, rows, (b, s))
    pad = (-s) % seq_multiple
    if pad:  # sequence parallelism splits the sequence over TP ranks: right-pad, labels ignored
        ids = torch.nn.functional.pad(ids, (0, pad), value=0)
        lab = torch.nn.functional.pad(lab, (0, pad), value=ignore_index)
    sp = ids.shape[1]
    pos = torch.arange(sp, device=device).unsqueeze(0).expand(b, sp)
    mask = None
    if device.type != "cuda":  # megatron builds its default causal mask on CUDA only
        mask = torch.triu(torch.ones(sp, sp, dtype=torch.bool, device=device), diagonal=1)[None, None]
    return ModelBatch(ids, lab, pos, mask, None, (b, s))


def packed_length(input_ids: torch.Tensor, labels: torch.Tensor, seq_multiple: int = 1,
                  ignore_index: int = -100) -> int:
    """Length of the packed row `prepare(pack=True)` builds for this micro-batch (host-side)."""
    return int(pack_rows(input_ids.cpu(), labels.cpu(), pad_to_multiple=seq_multiple,
                         ignore_index=ignore_index).input_ids.shape[1])
