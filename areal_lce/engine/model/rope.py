"""Fused rotary position embedding for megatron-core without Transformer Engine.

megatron-core applies RoPE through two module slots, `rope_utils.fused_apply_rotary_pos_emb` ([s, b,
heads, dim]) and `fused_apply_rotary_pos_emb_thd` (packed [t, heads, dim] with cu_seqlens), whenever
`TransformerConfig.apply_rope_fusion` is set. Transformer Engine fills both; without it they are None
and megatron runs its unfused torch RoPE: about eleven kernels and autograd nodes per call, for q and
for k in every layer -- on a 0.5B model at 8k tokens per micro-batch that is about a fifth of the
training step's kernel launches, on a step the host already limits (docs/benchmarks.md).

`install_rope_fusion()` fills the empty slots with `fused_rope_sbhd` / `fused_rope_thd` until
`remove_rope_fusion()` empties them again (areal_lce.patching): one Triton launch per call
(backends/triton/rope.py: cos and sin once per row for all heads, fp32 math rounded once, as
Transformer Engine's fused kernel computes) and one for the backward (the transposed rotation). Megatron's unfused path instead rounds cos / sin and each product to the activation dtype,
so bf16 outputs differ from it by bf16 rounding (tests/engine/test_rope.py bounds it; fp32 agrees to 1e-6).

THD semantics are megatron's `_apply_rotary_pos_emb_thd`: `freqs` with cu_seqlens[-1] rows holds the
angles of every packed token (what the engine's `per_token_rope` hands it; a whole row is then one
launch); any other `freqs` is a table indexed by the position within each sequence. Under context
parallelism this rank's tokens are chunks r and 2cp-1-r of every sequence (context_parallel.py). The
token-to-row index is computed on the host from cu_seqlens once per layout and reused by every layer.
Inputs the kernel does not take (interleaved RoPE, a head dim whose rotary half is not a power of two,
CPU tensors) go to megatron's unfused functions, with one warning per reason.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Optional

import torch

from ... import patching
from ...megatron.context_parallel import zigzag_positions
from ...megatron.packing import PackedLayout, host_to_device

_WARNED = set()
_INDEX_CACHE: dict = {}


class FusedRotary(torch.autograd.Function):
    """out = t cos f + rotate_half(t) sin f (rope_kernel); backward: the transposed rotation of the
    output gradient. The angles get no gradient (megatron derives them from a buffer)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        from .rope_triton import rotate

        ctx.save_for_backward(freqs)
        return rotate(t, freqs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from .rope_triton import rotate

        (freqs,) = ctx.saved_tensors
        return rotate(grad if grad.stride(-1) == 1 else grad.contiguous(), freqs, inverse=True), None


def _unsupported(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> str:
    from .rope_triton import why_unsupported

    return "interleaved rotary dims" if interleaved else why_unsupported(t, freqs)


def _fall_back(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"areal_lce fused RoPE: {reason}; megatron's unfused RoPE runs instead", stacklevel=3)


def fused_rope_sbhd(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                    interleaved: bool = False) -> torch.Tensor:
    """megatron-core's `fused_apply_rotary_pos_emb` slot: t [s, b, heads, dim], freqs [s, 1 or b, 1, rot]."""
    reason = _unsupported(t, freqs, interleaved)
    if reason:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        _fall_back(reason)
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return FusedRotary.apply(t, freqs)


class _CPRank:
    """What megatron's unfused THD RoPE reads of its cp_group: size() and rank()."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def thd_rows(cu_seqlens, freq_rows: int, cp_size: int, cp_rank: int, tokens: int,
             device) -> Optional[torch.Tensor]:
    """Row of `freqs` for each of this rank's `tokens` packed tokens (None: row i for token i), as
    megatron's `_apply_rotary_pos_emb_thd` picks them. Host reads of cu_seqlens (a device tensor costs
    one sync, as in megatron's own THD RoPE); cached per layout, so the layers of one forward share it.
    Without CP, angles with one row per packed token need no index and cu_seqlens is not read (megatron
    takes its per-token branch when freqs has cu_seqlens[-1] rows, which is then the token count): the
    call is then free of host reads, as CUDA-graph capture needs. `cu_seqlens`: the cumulative lengths
    megatron passes, or a PackedLayout (its padded slots, read from its host copy)."""
    if cp_size == 1 and freq_rows == tokens:  # angles of every packed token, in order: nothing to read
        return None
    lengths = list(PackedLayout.of(cu_seqlens, "packed_seq_params.cu_seqlens").padded_lengths)
    total = sum(lengths)
    key = (tuple(lengths), freq_rows == total, cp_size, cp_rank, str(device))
    if key in _INDEX_CACHE:
        rows = _INDEX_CACHE[key]
    else:
        lens = torch.tensor(lengths, dtype=torch.int64)
        packed = torch.arange(total) if cp_size == 1 else zigzag_positions(lengths, cp_size, cp_rank)
        if freq_rows == total:  # angles of every packed token: the row is the global packed position
            rows = None if cp_size == 1 else packed
        else:  # a table by position within the sequence
            seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # sequence of each packed token
            rows = packed - (torch.cumsum(lens, 0) - lens)[seq[packed]]
            if len(rows) and int(rows.max()) >= freq_rows:
                raise ValueError(f"rotary table has {freq_rows} rows but a packed sequence is "
                                 f"{max(lengths)} tokens long")
        rows = None if rows is None else host_to_device(rows, device)
        _INDEX_CACHE.clear()  # one layout at a time: every layer of a forward uses the same
        _INDEX_CACHE[key] = rows
    expect = total // cp_size
    if tokens != expect:
        raise ValueError(f"packed tensor has {tokens} tokens, cu_seqlens[-1] / cp = {expect}")
    return rows


def fused_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
                   cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """megatron-core's `fused_apply_rotary_pos_emb_thd` slot: t [t, heads, dim] packed by cu_seqlens."""
    rows = thd_rows(cu_seqlens, freqs.shape[0], cp_size, cp_rank, t.shape[0], t.device)
    per_token = freqs if rows is None else freqs.index_select(0, rows)
    reason = "" if t.dim() != 3 else _unsupported(t.unsqueeze(1), per_token, interleaved)
    if t.dim() != 3 or reason:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

        _fall_back(reason or f"packed tensor {tuple(t.shape)} is not [t, heads, dim]")
        return _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=interleaved,
                                         cp_group=_CPRank(cp_size, cp_rank))
    return FusedRotary.apply(t.unsqueeze(1), per_token).squeeze(1)


def fusion_usable() -> bool:
    """The kernel runs on CUDA with Triton installed (CPU tensors take megatron's unfused RoPE; tests
    drive the kernel there through the Triton interpreter)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


_installed = None  # the areal_lce.patching handle of install_rope_fusion, None when not installed


def install_rope_fusion() -> bool:
    """Fill megatron-core's empty fused-RoPE slots with this module's functions, until
    `remove_rope_fusion()`. True when the slots hold them afterwards; False when something else
    (Transformer Engine) filled them first, left as it is. Idempotent."""
    global _installed
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None:
        previous, _installed = _installed, patching.apply(
            patching.Patch(rope_utils, "fused_apply_rotary_pos_emb", fused_rope_sbhd),
            patching.Patch(rope_utils, "fused_apply_rotary_pos_emb_thd", fused_rope_thd))
        if previous is not None:  # the slots were emptied by something else since: the new patch replaces it
            previous.restore()
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope_sbhd


def remove_rope_fusion() -> bool:
    """Empty the slots `install_rope_fusion` filled (megatron's unfused RoPE runs again for models built
    with apply_rope_fusion=False; a model built with it set needs the slots filled). False when they were
    not filled here."""
    global _installed
    handle, _installed = _installed, None
    return handle is not None and handle.restore()
