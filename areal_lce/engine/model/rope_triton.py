"""Launcher of rope_kernel: rotary position embedding of a [S, B, H, D] tensor in one launch per call.

What it replaces (megatron-core's unfused RoPE, the path it takes without Transformer Engine): cos and
sin of the angles, two casts, rotate_half's chunk / neg / cat, two multiplies, an add and a cat -- about
eleven launches and as many [S, B, H, D] round trips per call, for q and for k in every layer, each one
an autograd node. The kernel takes cos / sin once per row for all heads and writes each output once.
"""
from __future__ import annotations

import contextlib

import torch
import triton

from ...op.backends import interpreter_on
from .rope_kernel import rope_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def why_unsupported(t: torch.Tensor, freqs: torch.Tensor) -> str:
    """'' when rotate() takes these inputs, else what it does not take (the caller's unfused fallback runs).

    t [S, B, H, D] in bf16 / fp16 / fp32 with a contiguous last dim; freqs the fp32 angles [S, 1 or B, 1, R]
    (contiguous last dim, no grad), R even, R / 2 a power of two, R <= D; on CUDA (CPU under the interpreter)."""
    if t.dim() != 4 or freqs.dim() != 4:
        return f"t {tuple(t.shape)} and freqs {tuple(freqs.shape)} must both be 4-D"
    s, b, _, d = t.shape
    r = freqs.shape[-1]
    if t.device != freqs.device or not (t.is_cuda or (t.device.type == "cpu" and interpreter_on())):
        return f"t on {t.device}, freqs on {freqs.device}: both on one CUDA device"
    if t.dtype not in _DTYPES or freqs.dtype != torch.float32 or freqs.requires_grad:
        return f"t {t.dtype} (bf16/fp16/fp32), freqs {freqs.dtype} (fp32, no grad)"
    if freqs.shape[0] != s or freqs.shape[1] not in (1, b) or freqs.shape[2] != 1:
        return f"freqs {tuple(freqs.shape)} does not broadcast as [S, 1 or B, 1, R] over t {tuple(t.shape)}"
    if r % 2 or r > d or (r // 2) & (r // 2 - 1) or t.stride(-1) != 1 or freqs.stride(-1) != 1:
        return f"rotary dims {r} of head dim {d}: even, half a power of two, contiguous"
    return ""


def rotate(t: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """out = t cos f + rotate_half(t) sin f on the first R dims of t's last axis (megatron's non-interleaved
    RoPE; dims past R copied), or with `inverse` its transpose (the backward: the same rotation with the
    angles negated). A new contiguous tensor of t's dtype; inputs as `why_unsupported` says."""
    s, b, h, d = t.shape
    half = freqs.shape[-1] // 2
    out = torch.empty((s, b, h, d), dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    rest = d - 2 * half
    sf_b = freqs.stride(1) if freqs.shape[1] > 1 else 0  # one row of angles for every b
    with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
        rope_kernel[(s * b,)](
            t, freqs, out, b, h, t.stride(0), t.stride(1), t.stride(2), freqs.stride(0), sf_b,
            out.stride(0), out.stride(1), out.stride(2), HALF=half, PASS=rest,
            BLOCK_H=triton.next_power_of_2(h), BLOCK_P=triton.next_power_of_2(max(rest, 1)),
            INVERSE=inverse, num_warps=4)
    return out
