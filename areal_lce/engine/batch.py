"""One micro-batch as the model sees it: right-padded BSHD or packed THD, built from [b, s] ids and labels.

The jobs hand the engine right-padded [b, s] input_ids and labels (ignore_index on padding and on
tokens without a target). `prepare` turns that into the model's inputs -- padded [b, s] rows, or, with
`engine.pack_sequences`, every row's tokens up to its last target packed into one [1, T] THD row with
`PackedSeqParams` -- and, under context parallelism, this CP rank's zigzag share of them (context_parallel.py:
BSHD rows split along the sequence, THD sequences each padded to a multiple of 2*cp and split).
`ModelBatch.stats` turns the model's per-token output back into the caller's padded [b, s] layout
(under CP through a differentiable all-gather: every CP rank then holds the same full statistics and
computes the same loss; each rank's backward reaches only its own tokens), so losses and metrics never
see which layout ran.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .. import patching
from ..megatron.context_parallel import CPGroup, gather_from_context_parallel, pad_packed, split_for_context_parallel
from ..megatron.packing import PackedLayout, PackedRows, pack_rows
from ..megatron.stats import TokenStats


@dataclass
class ModelBatch:
    input_ids: torch.Tensor  # [b, s'] padded, or [1, T] packed (this CP rank's share under CP)
    labels: torch.Tensor  # laid out like input_ids
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    packed: Optional[PackedRows]  # None: BSHD
    shape: tuple  # (b, s) of the caller's padded batch
    cp: CPGroup = CPGroup.none()  # the context-parallel group (CPGroup.none(): no CP)
    # THD: the packed layout the model sees, built once by `prepare` (`packed.layout`, under CP its slots
    # padded for the zigzag split); attention, RoPE, the CP split and gather and the per-token tensors all
    # read this value. None for BSHD
    layout: Optional[PackedLayout] = None
    compact_ignored: Optional[bool] = None  # the fused LM head's choice for this batch (compact_choice)

    def __post_init__(self):
        if (self.packed is None) != (self.layout is None):
            raise ValueError("ModelBatch: a packed (THD) batch carries its PackedLayout (layout=) and a BSHD "
                             f"batch none; got packed={type(self.packed).__name__}, "
                             f"layout={type(self.layout).__name__}")

    def rope_positions(self) -> Optional[torch.Tensor]:
        """Position of every token of the whole packed row (before any CP split) within its sequence."""
        if self.packed is None:
            return None
        pos = self.packed.position_ids
        return (pos if not self.cp.active else pad_packed(pos, self.layout, 0)).reshape(-1)

    @property
    def packed_seq_params(self):
        # under CP: real lengths + the padded layout megatron's THD RoPE and attention use
        return None if self.layout is None else self.layout.packed_seq_params()

    def stats(self, out: torch.Tensor) -> TokenStats:
        """Model output (packed stats [b, s', 4] or [1, T, 4], CP-local under CP) -> TokenStats in the
        caller's [b, s] layout."""
        return TokenStats.unpack(self.to_caller_layout(out))

    def to_caller_layout(self, out: torch.Tensor, fill=0.0) -> torch.Tensor:
        """Per-token model output laid out like `self.labels` ([b, s', ...] or [1, T, ...], CP-local under
        CP) -> the caller's [b, s, ...] (`fill` where no token was computed); differentiable (under CP through
        the all-gather whose backward returns each rank its own slice)."""
        if self.cp.active:
            out = gather_from_context_parallel(out, self.cp, self.layout)
            if self.layout is not None:
                out = out.index_select(1, self.layout.index.to(out.device))
        if self.packed is not None:
            return self.packed.unpack(out, fill)
        b, s = self.shape
        return out[:b, :s]


# engine.lce.compact_ignored: auto compacts a micro-batch when at least this share of the rows the LM head
# sees have no target. Measured on an H100 (benchmark/op/bench_ignored.py, results/h100_ignored_compact_choice):
# compaction over in-place skipping is 0.96 / 0.98 (forward / fwd+bwd) with 1/16 of the rows ignored,
# 0.22-0.24 / 0.69-0.72 with 15/16 (RL prompts), 0.99-1.02 with none (its copies of hidden and d_hidden
# cost about as much as the noise); in-place skipping only matches it where the ignored runs cover whole
# 128-row blocks.
AUTO_COMPACT_SHARE = 1 / 16


def compact_choice(option, labels: torch.Tensor, positions: int, ignore_index: int = -100) -> Optional[bool]:
    """The fused LM head's `compact_ignored` for one micro-batch under engine.lce.compact_ignored=`option`:
    True / False as given; "auto": True when at least AUTO_COMPACT_SHARE of the `positions` rows the head
    sees have no target (prompt-masked RL batches), else None (the backend's choice: Triton skips
    128-row blocks without a target in place). Counted on `labels` where they are: the engine's batches
    live on the host, so no device sync."""
    if option != "auto":
        return option
    targets = int((labels != ignore_index).sum())
    return True if positions and positions - targets >= AUTO_COMPACT_SHARE * positions else None


def prepare(input_ids: torch.Tensor, labels: torch.Tensor, *, device, max_seq_len: int, pack: bool,
            seq_multiple: int = 1, min_packed_length: int = 0, cp: CPGroup = CPGroup.none(),
            cu_seqlens_on_host: bool = False, ignore_index: int = -100, compact_ignored=None) -> ModelBatch:
    """Model inputs of one right-padded micro-batch. `seq_multiple`: the sequence (BSHD) or packed row
    (THD) length must be a multiple of it (tensor-parallel size under sequence parallelism). `cp`: the
    context-parallel group (a CPGroup, `CPGroup.of(...)` of the engine's group).
    `compact_ignored`: engine.lce.compact_ignored (None, True, False or "auto"; see compact_choice)."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both "
                         "be [batch, seq]")
    b, s = input_ids.shape
    if s > max_seq_len:
        raise ValueError(f"sequence length {s} exceeds model.max_seq_len={max_seq_len}")
    if not isinstance(cp, CPGroup):
        raise TypeError(f"prepare: cp must be a CPGroup (CPGroup.of(group)), got {type(cp).__name__}")
    group = cp if cp.active else None
    if pack:  # packed on the host (the jobs' batches live there), then moved: no device syncs
        host = pack_rows(input_ids.cpu().long(), labels.cpu().long(), pad_to_multiple=1 if group else seq_multiple,
                         min_length=min_packed_length, ignore_index=ignore_index)
        compact = compact_choice(compact_ignored, host.labels, host.labels.numel(), ignore_index)
        rows = host.to(device, cu_seqlens_on_host)
        if group is None:
            return ModelBatch(rows.input_ids, rows.labels, rows.position_ids, None, rows, (b, s),
                              layout=rows.layout, compact_ignored=compact)
        # every packed sequence padded to a multiple of 2*cp (x tp under SP: each CP share is then split
        # over TP too), then this rank's zigzag chunks of each
        layout = rows.layout.for_context_parallel(cp.size, 2 * cp.size * seq_multiple)
        local = [split_for_context_parallel(pad_packed(x, layout, fill), group, layout)
                 for x, fill in ((rows.input_ids, 0), (rows.labels, ignore_index), (rows.position_ids, 0))]
        return ModelBatch(*local, None, rows, (b, s), group, layout, compact_ignored=compact)
    pad = (-s) % (seq_multiple * (2 * cp.size if group else 1))
    compact = compact_choice(compact_ignored, labels, b * (s + pad), ignore_index)
    ids, lab = input_ids.to(device, torch.long), labels.to(device, torch.long)
    if pad:  # sequence / context parallelism split the sequence: right-pad, labels ignored
        ids = torch.nn.functional.pad(ids, (0, pad), value=0)
        lab = torch.nn.functional.pad(lab, (0, pad), value=ignore_index)
    sp = ids.shape[1]
    pos = torch.arange(sp, device=device).unsqueeze(0).expand(b, sp)
    if group is not None:
        ids, lab, pos = (split_for_context_parallel(x, group) for x in (ids, lab, pos))
        return ModelBatch(ids, lab, pos, None, None, (b, s), group, compact_ignored=compact)
    mask = None
    if device.type != "cuda":  # megatron builds its default causal mask on CUDA only
        mask = torch.triu(torch.ones(sp, sp, dtype=torch.bool, device=device), diagonal=1)[None, None]
    return ModelBatch(ids, lab, pos, mask, None, (b, s), compact_ignored=compact)


def packed_length(input_ids: torch.Tensor, labels: torch.Tensor, seq_multiple: int = 1,
                  ignore_index: int = -100) -> int:
    """Length of the packed row `prepare(pack=True)` builds for this micro-batch (host-side)."""
    return int(pack_rows(input_ids.cpu(), labels.cpu(), pad_to_multiple=seq_multiple,
                         ignore_index=ignore_index).input_ids.shape[1])


@contextlib.contextmanager
def per_token_rope(gpt_model, mb: ModelBatch):
    """For one call on a packed batch: GPTModel's rotary embedding hands megatron's THD RoPE the
    frequencies of every packed token's own position (restarting per sequence). Megatron's
    `_apply_rotary_pos_emb_thd` then takes its packed-frequencies branch (frequencies for all
    cu_seqlens[-1] tokens, CP chunks picked per sequence) and rotates the whole row in one op, instead of
    one sequence at a time (~6 kernels per sequence, per layer, for q and for k, plus two host reads).
    Same rotation either way: frequencies of position p are the table's row p."""
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    positions = mb.rope_positions()
    if rope is None or positions is None or "forward" in vars(rope):
        yield
        return
    table_rows = mb.packed.layout.max_seqlen

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        return rope.get_emb(table_rows, offset)[positions.to(rope.inv_freq.device)]

    with patching.patched(patching.Patch(rope, "forward", forward)):  # then RotaryEmbedding.forward again
        yield
