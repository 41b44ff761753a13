"""Block sizes and workspace budgets of the Triton backend (the kernels hold none).

GPU tiles were picked by `python -m benchmark.op.bench_lce --sweep` on an H100 (benchmark/results/archive/
h100_op_run3_tma_sweep); the interpreter gets one small tile that keeps CPU tests fast (fewer, larger programs).
`tuning()` lets a benchmark sweep swap tiles and load options for a block of calls, without touching
the launcher.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Iterator, Optional


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_k: int
    group_n: int = 8  # token blocks that walk the same vocab tiles together (L2 reuse of W)
    num_warps: int = 8
    num_stages: int = 3
    maxnreg: int = 0  # >0: cap registers per thread (e.g. 128 lets two 8-warp programs share an SM)


# Hopper (sm_90) bf16/fp16 defaults, from the H100 TMA-load sweep in results/archive/h100_op_run3_tma_sweep:
# at 8192x4096x151936 the forward kernel ran 14.24 ms (0.995x the cuBLAS logits GEMM) and the backward
# recompute kernel 15.87 ms with 128x256x64 tiles, 8 warps, 3 stages; 128x128 tiles were 6-10% slower.
FWD_GPU = TileConfig(block_n=128, block_v=256, block_k=64, group_n=16, num_warps=8, num_stages=3)
BWD_GPU = TileConfig(block_n=128, block_v=256, block_k=64, group_n=16, num_warps=8, num_stages=3)
# fp32 inputs use IEEE fp32 dots (no TF32): smaller K step keeps shared memory within budget.
FWD_GPU_FP32 = TileConfig(block_n=64, block_v=128, block_k=32, group_n=8, num_warps=8, num_stages=3)
BWD_GPU_FP32 = TileConfig(block_n=64, block_v=128, block_k=32, group_n=8, num_warps=8, num_stages=3)
# The interpreter runs programs one after another with numpy: fewer, larger programs are faster.
INTERPRET = TileConfig(block_n=32, block_v=128, block_k=32, group_n=4, num_warps=4, num_stages=1)

SPLIT_UNIT = 256  # vocab split widths are multiples of this (every block_v divides it)
MIN_PROGRAMS_PER_SM = 4  # forward: split the vocabulary until the grid has this many programs per SM
MAX_SPLIT = 8192  # forward: cap on split width, so large N still gets a few splits (tail balance)
BWD_PROGRAMS_PER_SM = 1  # backward: resident programs per SM of the persistent recompute kernel (one
#                          128x256x64 program fills an SM's shared memory)
MERGE_BLOCK_N = 128
FOLD_SEGMENTS = 32  # invariant mode's fold: segments per program (the grid spans row blocks x segment chunks)
LABEL_FIX_BLOCK_N = 256  # backward one-hot term
CHECK_BLOCK = 1024  # deferred label / temperature check: labels per program
LOCAL_LABELS_BLOCK = 1024  # global label ids -> the shard's int32 label columns: labels per program
CACHE_COLS = 256  # logits-cache column slab (kernels.py): one [BLOCK_N, 256] tile is contiguous

# Backward d_logits workspace [N, V_chunk] budget (bytes): at most WORKSPACE_BYTES, and shrunk so that
# workspace + fp32 d_hidden (4·N·H) stay within BACKWARD_BYTES (never below MIN_WORKSPACE_BYTES).
# At N=32768, H=2048 that keeps the backward's extra memory at most 0.5 GiB: 4096-column chunks there
# (BACKWARD_BYTES was 480 MiB, 3584 columns: fwd+bwd 2.7% slower in benchmark/results/archive/h100_op_chunk_budget).
WORKSPACE_BYTES = int(os.environ.get("AREAL_LCE_TRITON_WORKSPACE_MB", "256")) * (1 << 20)
BACKWARD_BYTES = 512 * (1 << 20)
MIN_WORKSPACE_BYTES = 64 * (1 << 20)

# Load GEMM operands with TMA tensor descriptors where the layout allows (else pointer loads).
USE_TMA = os.environ.get("AREAL_LCE_TRITON_TMA", "1") == "1"

_OVERRIDES: dict = {}  # 'fwd' / 'bwd' -> TileConfig, set only inside tuning()


@contextlib.contextmanager
def tuning(*, fwd: Optional[TileConfig] = None, bwd: Optional[TileConfig] = None, use_tma: Optional[bool] = None,
           bwd_programs_per_sm: Optional[int] = None) -> Iterator[None]:
    """Tile and load options of the launcher for the calls inside the block, restored on exit.

        with configs.tuning(bwd=TileConfig(128, 128, 64), use_tma=False, bwd_programs_per_sm=2):
            TritonBackend().backward(...)

    fwd / bwd replace the forward / backward tile whatever the dtype and H; use_tma and
    bwd_programs_per_sm replace USE_TMA and BWD_PROGRAMS_PER_SM; None keeps the current value.
    The settings are process-wide (not per thread): meant for tuning sweeps (`python -m
    benchmark.op.bench_lce --sweep`), not for training.
    """
    for name, cfg in (("fwd", fwd), ("bwd", bwd)):
        if cfg is not None and not isinstance(cfg, TileConfig):
            raise TypeError(f"configs.tuning: {name} must be a TileConfig, got {type(cfg).__name__}")
    pps = bwd_programs_per_sm
    if pps is not None and (type(pps) is not int or pps < 1):
        raise ValueError(f"configs.tuning: bwd_programs_per_sm must be an int >= 1, got {pps!r}")
    global USE_TMA, BWD_PROGRAMS_PER_SM
    saved = dict(_OVERRIDES), USE_TMA, BWD_PROGRAMS_PER_SM
    _OVERRIDES.update({k: v for k, v in (("fwd", fwd), ("bwd", bwd)) if v is not None})
    USE_TMA = USE_TMA if use_tma is None else bool(use_tma)
    BWD_PROGRAMS_PER_SM = BWD_PROGRAMS_PER_SM if pps is None else pps
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved[0])
        USE_TMA, BWD_PROGRAMS_PER_SM = saved[1], saved[2]


def tile(kind: str, *, fp32: bool, interpret: bool, H: int) -> TileConfig:
    if kind in _OVERRIDES:
        return _OVERRIDES[kind]
    if interpret:
        cfg = INTERPRET
    elif kind == "fwd":
        cfg = FWD_GPU_FP32 if fp32 else FWD_GPU
    else:
        cfg = BWD_GPU_FP32 if fp32 else BWD_GPU
    # tiny H: a K step larger than H only wastes masked lanes
    while cfg.block_k > 16 and cfg.block_k // 2 >= H:
        cfg = replace(cfg, block_k=cfg.block_k // 2)
    return cfg
