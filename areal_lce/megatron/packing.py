"""Packed (THD) sequences: labels of packed token rows, and packing right-padded batches.

Layout (megatron-core's `PackedSeqParams(qkv_format="thd")`): every sequence of a micro-batch sits in
one row, input_ids [1, T]; sequence i holds tokens [cu_seqlens[i], cu_seqlens[i + 1]); attention and
RoPE restart at every boundary. Labels are next-token targets *within* a sequence: the last token of
every sequence has no target (ignore_index) -- rolling the whole packed row instead would train each
sequence's last token on the next sequence's first token.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

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
    `cu_seqlens` may also be a PackedLayout or megatron's PackedSeqParams (`PackedLayout.of`; their padded
    layout, when they have one, stands for `cu_seqlens_padded`).
    """
    if isinstance(cu_seqlens, PackedLayout) or hasattr(cu_seqlens, "cu_seqlens_q"):
        layout = PackedLayout.of(cu_seqlens)
        cu_seqlens = layout.cu_seqlens
        if layout.padded and cu_seqlens_padded is None:
            cu_seqlens_padded = layout.cu_seqlens_padded
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


def sequence_lengths(cu_seqlens, what: str = "cu_seqlens") -> List[int]:
    """Per-sequence lengths of cumulative lengths `[0, l0, l0+l1, ...]` (host ints; checked)."""
    cu = torch.as_tensor(cu_seqlens).reshape(-1).tolist()
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"{what} must be 1-D cumulative lengths starting at 0, got {cu[:8]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{what} must be non-decreasing, got {cu[:8]}...")
    return lengths


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """cat([arange(s, s + n) for s, n in zip(starts, lengths)]) without a Python loop (int64)."""
    lengths = lengths.to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return starts.to(torch.int64)[seg] + torch.arange(seg.numel(), device=lengths.device) - first[seg]


def _cumulative(lengths: Sequence[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return host_to_device(cu, device) if device is not None else cu


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """The packed (THD) layout of one micro-batch as one value, built once where it enters.

    Sequence i holds `lengths[i]` real tokens in a slot of `padded_lengths[i]` tokens starting at
    `cu_seqlens_padded[i]` (real tokens first); without padding both cumulative tensors are the same
    tensor. Host copies (`lengths`, `padded_lengths`: python ints) and the cumulative int32 tensors (on
    the layout's device) are made once, so consumers never read a device tensor back or rebuild one.
    `index` [total] int64: where every real token sits in the padded layout (kept beside the tensors
    when padded, `padded_index`; an arange made on demand when not).
    """

    lengths: Tuple[int, ...]
    padded_lengths: Tuple[int, ...]
    cu_seqlens: torch.Tensor  # int32 [n + 1] of `lengths`
    cu_seqlens_padded: torch.Tensor  # int32 [n + 1] of `padded_lengths` (`cu_seqlens` itself when unpadded)
    padded_index: Optional[torch.Tensor] = None  # int64 [total] when padded (see `index`)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], padded_lengths: Optional[Sequence[int]] = None, *,
                     device=None) -> "PackedLayout":
        """The layout of sequences with these real lengths (and padded slot lengths, default: unpadded);
        tensors built on the host and moved to `device` once."""
        lengths = _check_lengths(lengths, "lengths")
        cu = _cumulative(lengths, device)
        if padded_lengths is None:
            return cls(lengths, lengths, cu, cu)
        padded = _check_lengths(padded_lengths, "padded_lengths")
        if len(padded) != len(lengths) or any(p < n for p, n in zip(padded, lengths)):
            raise ValueError(f"padded_lengths {list(padded)[:8]} must have one entry per sequence of lengths "
                             f"{list(lengths)[:8]}, each at least its real length")
        cu_padded = _cumulative(padded, None)
        index = ranges(cu_padded[:-1], torch.tensor(lengths, dtype=torch.int64))
        dev = lambda t: t if device is None else host_to_device(t, device)  # noqa: E731
        return cls(lengths, padded, cu, dev(cu_padded), dev(index))

    @classmethod
    def of(cls, layout, what: str = "cu_seqlens") -> "PackedLayout":
        """The one conversion of what callers pass: a PackedLayout (as is), a cu_seqlens tensor or list
        (its tensor kept when already int32), or megatron's PackedSeqParams (qkv_format "thd": its
        cu_seqlens_q and, when set, cu_seqlens_q_padded; the layout it was built from when it carries one)."""
        if isinstance(layout, PackedLayout):
            return layout
        if hasattr(layout, "cu_seqlens_q"):  # megatron's PackedSeqParams
            return cls._of_params(layout, what)
        if layout is None or (torch.is_tensor(layout) and layout.is_floating_point()):
            raise ValueError(f"{what} must be 1-D integer cumulative lengths, a PackedSeqParams or a "
                             f"PackedLayout, got {layout if layout is None else layout.dtype}")
        lengths = sequence_lengths(layout, what)
        if not torch.is_tensor(layout):
            return cls.from_lengths(lengths)
        cu = (layout if layout.dim() == 1 else layout.reshape(-1)).to(torch.int32)  # as is when int32
        return cls(tuple(lengths), tuple(lengths), cu, cu)

    @classmethod
    def bound(cls, cu_seqlens: torch.Tensor, tokens: int) -> "PackedLayout":
        """The layout of `tokens` packed tokens in `cu_seqlens.numel() - 1` sequences whose lengths live
        only in the tensor (a CUDA graph's static input, refilled on the device before every replay):
        the host side holds just the bound -- one slot of every token, then empty ones, so `max_seqlen`
        is `tokens` and `total` the token count -- not the lengths. Only what reads no host length may
        take it (attention's captured plan, RoPE's per-token angles); `PackedLayout.of` of its
        PackedSeqParams reads the tensor again once the tensor has been written."""
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
                or cu_seqlens.numel() < 2:
            raise ValueError(f"PackedLayout.bound: cu_seqlens must be a 1-D int32 tensor [n + 1] (n >= 1), got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                             f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"PackedLayout.bound: tokens={tokens!r} must be an int >= 1")
        lengths = (tokens,) + (0,) * (cu_seqlens.numel() - 2)
        return cls(lengths, lengths, cu_seqlens, cu_seqlens)

    @classmethod
    def _of_params(cls, psp, what: str) -> "PackedLayout":
        fmt = getattr(psp, "qkv_format", "thd")
        if fmt != "thd":
            raise ValueError(f"{what}.qkv_format={fmt!r}: a packed layout is 'thd'")
        carried = getattr(psp, "packed_layout", None)
        if isinstance(carried, PackedLayout) and carried.cu_seqlens is psp.cu_seqlens_q and (
                psp.cu_seqlens_q_padded is (carried.cu_seqlens_padded if carried.padded else None)) and \
                getattr(psp, "packed_layout_versions", None) == carried._versions():
            return carried  # the layout it was built from: its tensors neither replaced nor modified since
        real = cls.of(psp.cu_seqlens_q, f"{what}.cu_seqlens_q")
        if psp.cu_seqlens_q_padded is None or psp.cu_seqlens_q_padded is psp.cu_seqlens_q:
            return real
        padded = cls.of(psp.cu_seqlens_q_padded, f"{what}.cu_seqlens_q_padded")
        if len(padded.lengths) != len(real.lengths) or any(p < n for p, n in zip(padded.lengths, real.lengths)):
            raise ValueError(f"{what}.cu_seqlens_q lengths {list(real.lengths)[:4]}... must not exceed the "
                             f"cu_seqlens_q_padded lengths {list(padded.lengths)[:4]}... (same number of sequences)")
        cu_p = padded.cu_seqlens.to("cpu", torch.int64)
        index = ranges(cu_p[:-1], torch.tensor(real.lengths, dtype=torch.int64)).to(real.cu_seqlens.device)
        return cls(real.lengths, padded.lengths, real.cu_seqlens, padded.cu_seqlens, index)

    @property
    def index(self) -> torch.Tensor:
        """int64 [total]: the position of every real token in the padded layout (on the layout's device)."""
        if self.padded_index is not None:
            return self.padded_index
        return torch.arange(self.total, device=self.cu_seqlens.device)

    @property
    def total(self) -> int:
        """Real packed tokens."""
        return sum(self.lengths)

    @property
    def padded_total(self) -> int:
        """Tokens of the padded layout (the packed row's length)."""
        return sum(self.padded_lengths)

    @property
    def max_seqlen(self) -> int:
        """Longest padded sequence (megatron's PackedSeqParams.max_seqlen_q / _kv; 0 without sequences)."""
        return max(self.padded_lengths, default=0)

    @property
    def padded(self) -> bool:
        """Whether the padded layout has its own tensor (set as PackedSeqParams' *_padded fields)."""
        return self.cu_seqlens_padded is not self.cu_seqlens

    def to(self, device) -> "PackedLayout":
        """The same layout with its tensors on `device` (pinned, non-blocking copies from the host)."""
        if not self.padded:
            cu = host_to_device(self.cu_seqlens, device)
            return PackedLayout(self.lengths, self.padded_lengths, cu, cu)
        return PackedLayout(self.lengths, self.padded_lengths, *(
            host_to_device(t, device) for t in (self.cu_seqlens, self.cu_seqlens_padded, self.padded_index)))

    def for_context_parallel(self, cp_size: int, multiple: Optional[int] = None) -> "PackedLayout":
        """Every sequence's slot padded up to a multiple of `multiple` (default 2·cp_size; it must be a
        multiple of 2·cp_size, e.g. 2·cp·tp when sequence parallelism also splits the packed tokens):
        the layout megatron's zigzag context-parallel split takes."""
        multiple = 2 * cp_size if multiple is None else int(multiple)
        if cp_size < 1 or multiple < 1 or multiple % (2 * cp_size):
            raise ValueError(f"pad_for_context_parallel: multiple={multiple} must be a positive multiple of "
                             f"2*cp_size = {2 * cp_size}")
        padded = tuple(-(-n // multiple) * multiple for n in self.padded_lengths)
        host = PackedLayout.from_lengths(self.lengths, padded)  # the real cu_seqlens tensor is kept
        device = self.cu_seqlens.device
        return PackedLayout(self.lengths, padded, self.cu_seqlens, host_to_device(host.cu_seqlens_padded, device),
                            host_to_device(host.padded_index, device))

    def packed_seq_params(self):
        """megatron's PackedSeqParams(qkv_format="thd") of this layout (the *_padded fields set when the
        layout is padded); it carries the layout (`packed_layout`), so `PackedLayout.of` of it is free."""
        from megatron.core.packed_seq_params import PackedSeqParams

        padded = self.cu_seqlens_padded if self.padded else None
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                              cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                              max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
        psp.packed_layout, psp.packed_layout_versions = self, self._versions()
        return psp

    def _versions(self) -> tuple:
        return (self.cu_seqlens._version, self.cu_seqlens_padded._version)


def _check_lengths(lengths, what: str) -> Tuple[int, ...]:
    if torch.is_tensor(lengths):
        if lengths.is_floating_point():
            raise ValueError(f"{what} must hold integers, got {lengths.dtype}")
        lengths = lengths.reshape(-1).tolist()
    lengths = list(lengths)
    try:  # python and numpy integers (not bools, floats or strings)
        out = tuple(operator.index(n) for n in lengths if not isinstance(n, bool))
    except TypeError:
        out = ()
    if len(out) != len(lengths) or any(n < 0 for n in out):
        raise ValueError(f"{what} must be non-negative integers, got {lengths[:8]}")
    return out


def row_lengths(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Host int64 [b]: tokens of each right-padded row up to and including its last labelled position
    (what packing keeps of the row; 0 for a row without labels)."""
    has = labels.detach().to("cpu") != ignore_index
    col = torch.arange(1, labels.shape[1] + 1).expand_as(has)
    return torch.where(has, col, torch.zeros_like(col)).amax(1) if labels.shape[1] else \
        torch.zeros(labels.shape[0], dtype=torch.int64)


@dataclass
class PackedRows:
    """Right-padded rows packed into one THD row (see `pack_rows`); their sequences are `layout`."""

    input_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 in every sequence
    layout: PackedLayout  # the packed sequences (unpadded; see `to` for where its tensors live)
    index: torch.Tensor  # [T_real] flat positions (row * s + col) in the padded [b, s] layout
    padded_shape: tuple  # (b, s) of the padded batch

    def packed_seq_params(self):
        """megatron's PackedSeqParams of `layout` (`PackedLayout.packed_seq_params`)."""
        return self.layout.packed_seq_params()

    def to(self, device, cu_seqlens_on_host: bool = False) -> "PackedRows":
        """The same rows on `device` (`index` stays on the host: it only addresses the padded layout).
        `cu_seqlens_on_host`: leave the layout's tensors on the host, where megatron's THD RoPE reads
        cu_seqlens with `.tolist()` / `.item()` at every layer (a device tensor would cost two device
        syncs per call); SDPAttention builds its device-side segments from it once per forward.
        Transformer Engine's attention needs it on the device."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        layout = self.layout if cu_seqlens_on_host else self.layout.to(device)
        return PackedRows(move(self.input_ids), move(self.labels), move(self.position_ids), layout, self.index,
                          self.padded_shape)

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
    layout = PackedLayout.from_lengths(seq_lens, device=input_ids.device)
    device = input_ids.device
    dev_index = index.to(device)
    ids = input_ids.reshape(-1).index_select(0, dev_index)
    lab = labels.to(device).reshape(-1).index_select(0, dev_index)
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        lab = torch.cat([lab, lab.new_full((pad,), ignore_index)])
    pos = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    return PackedRows(input_ids=ids[None], labels=lab[None], position_ids=pos[None], layout=layout, index=index,
                      padded_shape=(b, s))
