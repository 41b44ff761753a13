"""Packed (THD) sequences: labels of packed token rows, and packing right-padded batches.

Layout (megatron-core's `PackedSeqParams(qkv_format="thd")`): every sequence of a micro-batch sits in
one row, input_ids [1, T]; sequence i holds tokens [cu_seqlens[i], cu_seqlens[i + 1]); attention and
RoPE restart at every boundary. Labels are next-token targets *within* a sequence: the last token of
every sequence has no target (ignore_index) -- rolling the whole packed row instead would train each
sequence's last token on the next sequence's first token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def _check_cu(cu: torch.Tensor, name: str, total: int) -> torch.Tensor:
    if not torch.is_tensor(cu) or cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        raise ValueError(f"{name} must be a 1-D integer tensor [num_sequences + 1] starting at 0")
    cu = cu.to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(f"{name}={cu.tolist()} must start at 0, be non-decreasing and end at most at the "
                         f"number of packed tokens {total}")
    return cu


def packed_next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, *,
                             cu_seqlens_padded: Optional[torch.Tensor] = None, ignore_index: int = -100) -> torch.Tensor:
    """Next-token labels of packed input_ids ([1, T] or [T]), sequence by sequence.

    labels[t] = input_ids[t + 1] when t + 1 is in the same sequence, else ignore_index (the last token of
    every sequence, and every token past cu_seqlens[-1]). With `cu_seqlens_padded` (Megatron's padded THD
    layout: sequence i starts at cu_seqlens_padded[i] and holds cu_seqlens[i + 1] - cu_seqlens[i] real
    tokens), the padding slots get ignore_index too. Returns a tensor shaped and placed like input_ids.
    """
    if not torch.is_tensor(input_ids) or input_ids.is_floating_point() or input_ids.dim() not in (1, 2) \
            or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError(f"input_ids must be an integer tensor [1, T] or [T], got "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    flat = input_ids.reshape(-1)
    total = flat.numel()
    cu = _check_cu(cu_seqlens, "cu_seqlens", total)
    lengths = cu[1:] - cu[:-1]
    starts = cu[:-1]
    if cu_seqlens_padded is not None:
        cup = _check_cu(cu_seqlens_padded, "cu_seqlens_padded", total)
        if cup.numel() != cu.numel() or bool((cup[1:] - cup[:-1] < lengths).any()):
            raise ValueError("cu_seqlens_padded must have one entry per cu_seqlens entry and every padded "
                             "sequence must be at least as long as its real sequence")
        starts = cup[:-1]
    # position t has a target iff t + 1 is a real token of the same sequence: starts <= t < start + len - 1
    has_target = torch.zeros(total + 1, dtype=torch.int64)
    has_target.index_add_(0, starts, torch.ones_like(starts))
    has_target.index_add_(0, starts + (lengths - 1).clamp(min=0), -torch.ones_like(starts))
    valid = has_target.cumsum(0)[:total] > 0
    nxt = torch.roll(flat, -1)
    labels = torch.where(valid.to(flat.device), nxt, torch.full_like(flat, ignore_index))
    return labels.view_as(input_ids)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: through pinned memory on CUDA (a copy from
    pageable memory blocks the host until the stream reaches it), a plain copy elsewhere."""
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def row_lengths(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Host int64 [b]: tokens of each right-padded row up to and including its last labelled position
    (what packing keeps of the row; 0 for a row without labels)."""
    has = labels.detach().to("cpu") != ignore_index
    col = torch.arange(1, labels.shape[1] + 1).expand_as(has)
    return torch.where(has, col, torch.zeros_like(col)).amax(1) if labels.shape[1] else \
        torch.zeros(labels.shape[0], dtype=torch.int64)


@dataclass
class PackedRows:
    """Right-padded rows packed into one THD row (see `pack_rows`)."""

    input_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 in every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32 (see `to` for where it lives)
    max_seqlen: int
    index: torch.Tensor  # [T_real] flat positions (row * s + col) in the padded [b, s] layout
    padded_shape: tuple  # (b, s) of the padded batch

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def to(self, device, cu_seqlens_on_host: bool = False) -> "PackedRows":
        """The same rows on `device` (`index` stays on the host: it only addresses the padded layout).
        `cu_seqlens_on_host`: leave cu_seqlens on the host, where megatron's THD RoPE reads it with
        `.tolist()` / `.item()` at every layer (a device tensor would cost two device syncs per call);
        SDPAttention builds its device-side segments from it once per forward. Transformer Engine's
        attention needs it on the device."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        cu = self.cu_seqlens if cu_seqlens_on_host else move(self.cu_seqlens)
        return PackedRows(move(self.input_ids), move(self.labels), move(self.position_ids), cu,
                          self.max_seqlen, self.index, self.padded_shape)

    def unpack(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[1, T, ...] per-token values -> the padded [b, s, ...] layout (fill elsewhere); differentiable."""
        b, s = self.padded_shape
        flat = values.reshape(values.shape[1], *values.shape[2:])[: self.index.numel()]
        out = flat.new_full((b * s, *flat.shape[1:]), fill)
        return out.index_copy(0, host_to_device(self.index, flat.device), flat).view(b, s, *flat.shape[1:])


def pack_rows(input_ids: torch.Tensor, labels: torch.Tensor, *, pad_to_multiple: int = 1, min_length: int = 0,
              ignore_index: int = -100) -> PackedRows:
    """Pack a right-padded batch ([b, s] ids and labels) into one THD row.

    Row r keeps its tokens up to its last labelled position (under causal attention later tokens change
    no statistic of earlier ones); rows without any label are dropped. When the packed length is not a
    multiple of `pad_to_multiple` (sequence parallelism needs tp | T) or shorter than `min_length` (a
    pipeline sends one shape per step), one padding sequence of ignored tokens is appended. Host-side bookkeeping on CPU copies of the (small) id/label tensors.
    """
    if input_ids.dim() != 2 or tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be [b, s]")
    b, s = input_ids.shape
    lengths = row_lengths(labels, ignore_index)  # last labelled position + 1
    keep = lengths > 0
    rows = torch.arange(b)[keep]
    lengths = lengths[keep]
    index = torch.cat([r * s + torch.arange(int(n)) for r, n in zip(rows.tolist(), lengths.tolist())]) \
        if rows.numel() else torch.zeros(0, dtype=torch.int64)
    t_real = index.numel()
    mult = max(int(pad_to_multiple), 1)
    total = max(t_real, int(min_length), 1)  # at least one (ignored) token: the model needs T >= 1
    pad = -(-total // mult) * mult - t_real
    seq_lens = lengths.tolist() + ([pad] if pad else [])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0)
    device = input_ids.device
    dev_index = index.to(device)
    ids = input_ids.reshape(-1).index_select(0, dev_index)
    lab = labels.to(device).reshape(-1).index_select(0, dev_index)
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        lab = torch.cat([lab, lab.new_full((pad,), ignore_index)])
    pos = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    return PackedRows(input_ids=ids[None], labels=lab[None], position_ids=pos[None],
                      cu_seqlens=cu.to(device=device, dtype=torch.int32), max_seqlen=max(seq_lens),
                      index=index, padded_shape=(b, s))
