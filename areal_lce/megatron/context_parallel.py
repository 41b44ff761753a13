"""Context parallelism (CP): megatron's load-balanced zigzag split of sequences over the CP group.

Every sequence is cut into 2·cp equal chunks; CP rank r keeps chunks r and 2cp−1−r, in that order
(causal attention then costs every rank the same). BSHD tensors `[b, s, ...]` are split per batch row
exactly as `megatron.core.utils.get_batch_on_this_cp_rank` does; packed THD tensors `[1, T, ...]` are
split per packed sequence (the layout megatron's THD RoPE and Transformer Engine's
`thd_get_partitioned_indices` assume), so every sequence length must be a multiple of 2·cp:
`pad_for_context_parallel` pads them.

    pad = pad_for_context_parallel(cu_seqlens, cp)            # a PackedLayout: slots -> multiples of 2·cp
    ids = pad_packed(input_ids, pad)                          # [1, T] -> [1, T_padded]
    local = split_for_context_parallel(ids, cp_group, pad)
    ...
    full = gather_from_context_parallel(local_out, cp_group, pad)
    out = full.index_select(1, pad.index)                     # back to the unpadded tokens

`gather_from_context_parallel` is differentiable with the replicated-loss convention: when every CP
rank computes the same loss from the gathered tensor, each rank's local slice receives exactly
d(loss)/d(slice) (its own block of the gradient, no sum over ranks and no factor cp).

The group travels as one value, `CPGroup(group, size, rank)` (`CPGroup.none()`: no context
parallelism), built once where it enters by `CPGroup.of(...)` from whatever the caller holds: a
`CPGroup`, None, a process group, or megatron's `pg_collection` (its `.cp`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from ..op import checks, comms
from .packing import PackedLayout, ranges, sequence_lengths  # noqa: F401  (ranges, sequence_lengths: re-exported)


@dataclass(frozen=True)
class CPGroup:
    """The context-parallel group as one value: the process group (None without CP), its size and this
    rank's index in it. A group of one rank is `CPGroup.none()`: nothing is split or gathered."""

    group: Any = None
    size: int = 1
    rank: int = 0

    @classmethod
    def none(cls) -> "CPGroup":
        return cls()

    @classmethod
    def of(cls, cp) -> "CPGroup":
        """The one conversion: a CPGroup (as is), None (no CP), megatron's pg_collection (its `.cp`, None
        when it has none) or a torch.distributed process group."""
        if isinstance(cp, CPGroup):
            return cp
        if cp is not None and not hasattr(cp, "size") and hasattr(cp, "cp"):  # ProcessGroupCollection
            cp = cp.cp
        size = comms.checked_group_size(cp, "the context-parallel group")
        return cls.none() if size == 1 else cls(cp, size, comms.group_rank(cp))

    @property
    def active(self) -> bool:
        """More than one rank: tokens are split over the group."""
        return self.size > 1


def zigzag_positions(lengths: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions, in the packed layout of sequences with these lengths, of CP rank `cp_rank`'s tokens in
    its local order: per sequence chunk r then chunk 2cp−1−r (chunk = length / 2cp). Since r < 2cp−1−r,
    local order is the packed order restricted to the kept chunks."""
    two_cp = 2 * cp_size
    bad = [n for n in lengths if n % two_cp]
    if bad:
        raise ValueError(f"context parallel size {cp_size}: every sequence length must be a multiple of "
                         f"2*cp = {two_cp} (got {bad[:4]}); pad with pad_for_context_parallel")
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    offset = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seg]
    chunk = offset // (lens // two_cp).clamp(min=1)[seg]
    keep = (chunk == cp_rank) | (chunk == two_cp - 1 - cp_rank)
    return keep.nonzero().squeeze(1)


def gathered_to_packed(lengths: Sequence[int], cp_size: int) -> torch.Tensor:
    """Index `inv` with packed[p] = gathered[inv[p]], where `gathered` concatenates every CP rank's
    local tokens in rank order (an all-gather of the local tensors)."""
    order = torch.cat([zigzag_positions(lengths, cp_size, r) for r in range(cp_size)])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return inv


def _cp_lengths(x: torch.Tensor, cu_seqlens, what: str, local: bool, cp: int) -> List[int]:
    if x.dim() < 2:
        raise ValueError(f"{what} must be [b, s, ...] (BSHD) or [1, T, ...] (THD), got shape {tuple(x.shape)}")
    tokens = x.shape[1] * (cp if local else 1)
    if cu_seqlens is None:
        return [tokens]
    if x.shape[0] != 1:
        raise ValueError(f"{what}: with cu_seqlens the tensor is packed THD [1, T, ...], got shape {tuple(x.shape)}")
    lengths = list(PackedLayout.of(cu_seqlens).padded_lengths)  # the slots the tokens sit in
    if sum(lengths) != tokens:
        raise ValueError(f"{what}: cu_seqlens[-1] = {sum(lengths)} but the tensor holds {tokens} tokens"
                         + (f" ({x.shape[1]} per rank x cp {cp})" if local else ""))
    return lengths


def split_for_context_parallel(x: torch.Tensor, cp_group, cu_seqlens=None) -> torch.Tensor:
    """This CP rank's tokens of `x` ([b, s, ...] split per row along dim 1, or packed THD [1, T, ...]
    split per sequence of `cu_seqlens`, lengths multiples of 2·cp). Identity when the group has one rank.
    `cu_seqlens`: the cumulative lengths of the slots the tokens sit in, or a (CP-padded) PackedLayout or
    megatron's PackedSeqParams (their padded slots; `PackedLayout.of`), or None for BSHD.
    `cp_group`: a CPGroup, None, a process group or megatron's pg_collection (`CPGroup.of`)."""
    cp = CPGroup.of(cp_group)
    if not cp.active:
        return x
    lengths = _cp_lengths(x, cu_seqlens, "split_for_context_parallel(x)", local=False, cp=cp.size)
    index = zigzag_positions(lengths, cp.size, cp.rank).to(x.device)
    return x.index_select(1, index)


def gather_from_context_parallel(local: torch.Tensor, cp_group, cu_seqlens=None) -> torch.Tensor:
    """Inverse of `split_for_context_parallel`: the full `[b, s, ...]` / `[1, T, ...]` on every CP rank.

    Forward all-gathers the local tokens; backward gives each rank its own slice of the gradient (the
    gathered tensor is replicated, so every rank holds the same full gradient: no reduction).
    The CP ranks must pass the same layout (local shape, cu_seqlens): `check_same_layout` checks it the
    first time this rank gathers a layout. `cp_group`, `cu_seqlens`: as `split_for_context_parallel` takes them."""
    cp = CPGroup.of(cp_group)
    if not cp.active:
        return local
    lengths = _cp_lengths(local, cu_seqlens, "gather_from_context_parallel(local)", local=True, cp=cp.size)
    disagree = check_same_layout(local, None if cu_seqlens is None else lengths, cp)
    rows = comms.all_gather_rows_replicated_grad(local.transpose(0, 1), cp.group)  # [cp*s_local, b, ...]
    if disagree is not None and rows.is_floating_point():  # deferred check: the call's output shows it
        rows = torch.where(disagree, torch.full_like(rows, float("nan")), rows)
    return rows.index_select(0, gathered_to_packed(lengths, cp.size).to(rows.device)).transpose(0, 1)


_LAYOUT_ITEMS = ("local.dim()", "local.shape[0] (rows)", "local.shape[1] (tokens on this rank)",
                 "the elements per token (local.shape[2:])", "the number of packed sequences (cu_seqlens)",
                 "the packed sequence lengths (cu_seqlens)")
_LAYOUTS_AGREED = set()  # (id(cp_group), layout) this rank has checked against the group
_LAYOUT_HINT = ("every context-parallel rank must gather its share of the same batch (its zigzag half of every "
                "sequence: the same local shape and the same cu_seqlens)")


def _layout(local: torch.Tensor, lengths: Optional[List[int]]) -> tuple:
    """The gather's layout as fixed-length integers (_LAYOUT_ITEMS), equal on the CP ranks iff they agree.
    The lengths enter as one hash (int hashes do not depend on the process: PYTHONHASHSEED is for str)."""
    per_token = 1
    for d in local.shape[2:]:
        per_token *= d
    seqs, digest = (-1, 0) if lengths is None else (len(lengths), hash(tuple(lengths)) % (1 << 62))
    return (local.dim(), local.shape[0], local.shape[1], per_token, seqs, digest)


def _reads_votes_now(device: torch.device) -> bool:
    """CPU: the host is the device, reading the votes stalls nothing (the checks' "sync" mode)."""
    return device.type == "cpu"


def check_same_layout(local: torch.Tensor, lengths: Optional[List[int]], cp_group) -> Optional[torch.Tensor]:
    """Check that every rank of `cp_group` gathers the layout of `local` (and packed `lengths`): one
    all-reduce of 12 int64, the first time this rank gathers a layout (then never again for it, so
    micro-batches of a known layout cost nothing). On CPU tensors the votes are read at once and every
    rank raises ValueError naming what differs. On accelerators nothing waits on them: the disagreement
    is counted for `areal_lce.op.checks.check_deferred()` (which the engine calls once per step) and the
    returned 0-d bool makes this call's output NaN. None when no check ran.
    A rank that has checked its layout before while another's is new does not join the check's
    all-reduce: the collectives then meet out of order, which gloo reports as an error."""
    cp = CPGroup.of(cp_group)
    layout = _layout(local, lengths)
    key = (id(cp.group), layout)
    if key in _LAYOUTS_AGREED:
        return None
    # filled on the device (no host-to-device copy: capturable in a CUDA graph)
    v = torch.stack([torch.full((), x, dtype=torch.int64, device=local.device) for x in layout])
    votes = comms.agreement_votes(v, cp.group)  # [max, -min] of every item over the CP group
    if not _reads_votes_now(local.device):
        _LAYOUTS_AGREED.add(key)
        return checks.record_disagreement(
            votes, f"gather_from_context_parallel: the context-parallel ranks gathered different layouts; "
            f"{_LAYOUT_HINT}")
    hi, lo = votes[0].tolist(), [-x for x in votes[1].tolist()]
    differ = [f"{name} (this rank: {mine}, min {a}, max {b})"
              for name, mine, a, b in zip(_LAYOUT_ITEMS, layout, lo, hi) if a != b]
    if differ:
        raise ValueError(f"gather_from_context_parallel: {'; '.join(differ)} differ(s) across the context-parallel "
                         f"group [rank {cp.rank} of {cp.size}]: {_LAYOUT_HINT}")
    _LAYOUTS_AGREED.add(key)
    return None


def pad_for_context_parallel(cu_seqlens, cp_size: int, multiple: Optional[int] = None) -> PackedLayout:
    """The packed layout with every sequence's slot padded up to a multiple of `multiple` (default
    2·cp_size; it must be a multiple of 2·cp_size, e.g. 2·cp·tp when sequence parallelism also splits the
    packed tokens): `PackedLayout.of(cu_seqlens).for_context_parallel(cp_size, multiple)`.
    `cu_seqlens`: a cu_seqlens tensor, megatron's PackedSeqParams or a PackedLayout (`PackedLayout.of`).
    The result's `cu_seqlens_padded`, `index` (where every packed token sits in the padded layout),
    `max_seqlen` and `padded_total` are what `pad_packed`, the CP split and megatron's PackedSeqParams take."""
    return PackedLayout.of(cu_seqlens).for_context_parallel(cp_size, multiple)


def pad_packed(x: torch.Tensor, layout: PackedLayout, value=0) -> torch.Tensor:
    """`x` [1, layout.total, ...] (the packed tokens) in the padded layout [1, layout.padded_total, ...];
    padding slots hold `value`. `layout`: a (padded) PackedLayout, e.g. `pad_for_context_parallel`'s."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"pad_packed: layout must be a PackedLayout (pad_for_context_parallel's or "
                        f"PackedLayout.for_context_parallel's), got {type(layout).__name__}")
    if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != layout.total:
        raise ValueError(f"pad_packed: x must be [1, {layout.total}, ...], got {tuple(x.shape)}")
    out = x.new_full((1, layout.padded_total) + tuple(x.shape[2:]), value)
    return out.index_copy(1, layout.index.to(x.device), x)
