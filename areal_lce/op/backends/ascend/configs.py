"""Tile sizes and launch limits of the Ascend backend, derived from a unified-buffer (UB) budget.

An Ascend AI core has no GPU-style register file / shared memory split: every tile a Triton program
keeps alive sits in the core's unified buffer, about 192 KB on 910B (1,572,864 bits). GPU tile
configs such as 128x256x32 overflow it, so block sizes here are not a fixed table but the largest
power-of-two tiles whose estimated footprint (`ub_bytes`) fits the budget (`pick_tiles`).

The estimate is deliberately conservative (it is a model, not a measurement on hardware):
  * operand tiles of the logits recompute, h [BN, BH] and W [BV, BH], are counted in the input dtype
    twice (the compiler's ping-pong multibuffering of loads inside loops) plus once as their fp32
    upcast;
  * [BN, BV] fp32 tiles alive in the softmax epilogue: 4 in the forward (logits accumulator, shifted
    logits, exp, the entropy product), 5 in the backward (the same plus d_logits);
  * backward only: the fp32 output tile being accumulated, [BN, BH] of d_hidden or [BV, BH] of
    d_weight, counted twice (the partial sum loaded back and the dot result);
  * a few fp32/int64 per-row vectors (stats, labels, temperature, masks).

Knobs (constructor arguments of `AscendBackend`, else environment variables):
  AREAL_LCE_ASCEND_UB_BYTES      budget in bytes (default 196608 = 192 KiB)
  AREAL_LCE_ASCEND_MAX_PROGRAMS  cap on programs per grid axis (default 65535, the Triton-Ascend limit);
                                 programs loop persistently over the tiles past the cap.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

DEFAULT_UB_BYTES = 192 * 1024
MAX_GRID_PROGRAMS = 65535  # Triton-Ascend rejects larger grids per axis
MIN_BLOCK = 16  # smallest tl.dot operand side we emit (cube fractal is 16x16)
MAX_BLOCK = 256
KINDS = ("fwd", "bwd_dh", "bwd_dw")

ENV_UB_BYTES = "AREAL_LCE_ASCEND_UB_BYTES"
ENV_MAX_PROGRAMS = "AREAL_LCE_ASCEND_MAX_PROGRAMS"


@dataclass(frozen=True)
class Tiles:
    block_n: int  # tokens per tile
    block_v: int  # vocabulary rows per tile
    block_h: int  # hidden columns per inner step
    ub_bytes: int  # estimated UB footprint of one program with these tiles


def ub_bytes(kind: str, block_n: int, block_v: int, block_h: int, elt_bytes: int) -> int:
    """Estimated peak unified-buffer bytes of one program of `kind` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    bn, bv, bh = block_n, block_v, block_h
    operands = (2 * elt_bytes + 4) * (bn + bv) * bh
    epilogue = 4 * bn * bv * (4 if kind == "fwd" else 5)
    if kind == "fwd":
        out = 0
    elif kind == "bwd_dh":
        out = 2 * 4 * bn * bh
    else:
        out = 2 * 4 * bv * bh
    rows = 8 * 8 * (bn + bv)
    return operands + epilogue + out + rows


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cap(extent: Optional[int]) -> int:
    """Largest useful block for a dimension of `extent` (no point in tiles past the problem)."""
    if extent is None or extent <= 0:
        return MAX_BLOCK
    return max(MIN_BLOCK, min(MAX_BLOCK, _pow2_ceil(extent)))


def _score(kind: str, bn: int, bv: int, bh: int):
    # Arithmetic intensity of the recompute GEMM per loaded element is bn*bv/(bn+bv). The backward
    # kernels re-read their fp32 output tile once per outer step, so d_hidden prefers wide vocab tiles
    # and d_weight wide token tiles; bh only splits the reduction loop and is shrunk first.
    intensity = bn * bv / (bn + bv)
    if kind == "bwd_dh":
        return (intensity, bv, bh, bn)
    if kind == "bwd_dw":
        return (intensity, bn, bh, bv)
    return (intensity, bh, bv, bn)


@functools.lru_cache(maxsize=256)
def pick_tiles(kind: str, *, hidden: int, elt_bytes: int, ub_budget: int = DEFAULT_UB_BYTES,
               n_tokens: Optional[int] = None, vocab: Optional[int] = None) -> Tiles:
    """Largest power-of-two (BLOCK_N, BLOCK_V, BLOCK_H) of `kind` whose `ub_bytes` fits `ub_budget`.

    `n_tokens` / `vocab` / `hidden` only cap the blocks at the problem's size. Raises ValueError when
    not even the minimal 16x16x16 tile fits the budget.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if elt_bytes not in (2, 4):
        raise ValueError(f"elt_bytes must be 2 (bf16/fp16) or 4 (fp32), got {elt_bytes}")
    if ub_budget <= 0:
        raise ValueError(f"ub_budget must be a positive byte count, got {ub_budget}")
    smallest = ub_bytes(kind, MIN_BLOCK, MIN_BLOCK, MIN_BLOCK, elt_bytes)
    if smallest > ub_budget:
        raise ValueError(
            f"unified-buffer budget of {ub_budget} bytes cannot hold the smallest {kind} tile "
            f"({MIN_BLOCK}x{MIN_BLOCK}x{MIN_BLOCK} needs {smallest} bytes); raise ub_bytes / {ENV_UB_BYTES}")
    sizes = [MIN_BLOCK << i for i in range((MAX_BLOCK // MIN_BLOCK).bit_length())]
    cap_n, cap_v, cap_h = _cap(n_tokens), _cap(vocab), _cap(hidden)
    best = None
    for bn in (s for s in sizes if s <= cap_n):
        for bv in (s for s in sizes if s <= cap_v):
            for bh in (s for s in sizes if s <= cap_h):
                need = ub_bytes(kind, bn, bv, bh, elt_bytes)
                if need > ub_budget:
                    continue
                key = _score(kind, bn, bv, bh)
                if best is None or key > best[0]:
                    best = (key, Tiles(bn, bv, bh, need))
    assert best is not None  # the minimal tile fits (checked above) and is always a candidate
    return best[1]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def resolve_ub_bytes(value: Optional[int] = None) -> int:
    """The UB budget: an explicit value, else $AREAL_LCE_ASCEND_UB_BYTES, else 192 KiB."""
    if value is None:
        return _env_int(ENV_UB_BYTES, DEFAULT_UB_BYTES)
    if int(value) <= 0:
        raise ValueError(f"ub_bytes must be positive, got {value}")
    return int(value)


def resolve_max_programs(value: Optional[int] = None) -> int:
    """Programs per grid axis: an explicit value, else $AREAL_LCE_ASCEND_MAX_PROGRAMS, else 65535."""
    if value is None:
        value = _env_int(ENV_MAX_PROGRAMS, MAX_GRID_PROGRAMS)
    if not 1 <= int(value) <= MAX_GRID_PROGRAMS:
        raise ValueError(f"max_programs must be in [1, {MAX_GRID_PROGRAMS}], got {value}")
    return int(value)
