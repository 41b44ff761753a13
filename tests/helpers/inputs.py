"""Inputs of the op's tests: the one peaked-logits builder, the API-level case list and its builder.

Oracle everywhere: the fp64 materialised reference (areal_lce/op/backends/reference.py).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Iterable, Optional

import torch

from .kernel_device import interpreter_on


def peak_logits(weight: torch.Tensor, hidden: torch.Tensor, rows: Iterable[int], cols: Iterable[int],
                scale: float) -> torch.Tensor:
    """Make a few softmax rows peaked: weight[cols[k]] = scale · hidden[rows[k]], so row rows[k] has the
    logit scale·|h|² at column cols[k], far above the rest (p ≈ 1 there, entropy ≈ 0). Flat random logits
    hide entropy-cancellation, padding and label-ownership bugs; these rows expose them. In place, pair by
    pair (a later pair wins a column two pairs share); returns `weight`."""
    for i, j in zip(rows, cols):
        weight[int(j)] = scale * hidden[int(i)]
    return weight


PER_TOKEN = "per_token"  # a case's temperature: a float, or PER_TOKEN for a tensor of one per token


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    why: str
    n: int = 33
    h: int = 32
    v: int = 1001
    dtype: torch.dtype = torch.float32
    temperature: object = 1.0  # a float, or PER_TOKEN
    vocab_size: Optional[int] = None
    ignore_frac: float = 0.0
    peaked: bool = False
    flat: bool = False
    edge_labels: bool = False
    lead: tuple = ()  # leading shape instead of (n,)
    block_rows: int = 0  # the materialised route: >0 sets CHUNK_ELEMENTS so that a row block holds this many rows


CASES = [
    Case("n1", "a single token: grid and reduction edge", n=1),
    Case("n17_v1001", "odd N and V, neither a multiple of any block", n=17, v=1001),
    Case("v3007", "3×1000+7 columns: last vocab block mostly masked", n=20, v=3007),
    Case("peaked", "a few columns copy hidden rows: near one-hot softmax, exposes padding/entropy bugs",
         n=40, v=777, peaked=True),
    Case("flat", "near-uniform logits: entropy ≈ log V", n=24, v=640, flat=True),
    Case("ignore", "ignore_index rows: zero outputs and zero gradient", n=31, ignore_frac=0.3),
    Case("edges", "labels 0 and V-1", n=16, v=513, edge_labels=True),
    Case("t0.5", "temperature 0.5", temperature=0.5),
    Case("t2", "temperature 2.0", temperature=2.0),
    Case("t_token", "per-token temperature tensor", temperature=PER_TOKEN),
    Case("padded_vocab", "vocab_size < V: padding rows excluded from the softmax", v=1024, vocab_size=1000,
         peaked=True),
    Case("bf16", "bf16 inputs, fp32 logits in-kernel", n=29, v=999, dtype=torch.bfloat16, peaked=True),
    Case("bf16_t_ignore", "bf16 with temperature and ignored rows", n=26, v=515, dtype=torch.bfloat16,
         temperature=0.7, ignore_frac=0.25),
    Case("batch3d", "[B, S, H] hidden and [B, S] labels", lead=(3, 7), v=301),
]


def case_by_id(case_id: str) -> Case:
    """The case of CASES with this id (tests name the case they need, never its list position)."""
    for c in CASES:
        if c.id == case_id:
            return c
    raise KeyError(f"no case {case_id!r} in {[c.id for c in CASES]}")


def make_inputs(c: Case, seed: int = 0, device="cpu"):
    """(hidden, weight, labels, temperature) of a case; hidden/weight in the case dtype (fp64-drawn)."""
    g = torch.Generator().manual_seed(seed)
    lead = c.lead or (c.n,)
    n = 1
    for d in lead:
        n *= d
    h = torch.randn(n, c.h, generator=g, dtype=torch.float64)
    scale = 0.02 if c.flat else 3.0 / c.h ** 0.5
    w = torch.randn(c.v, c.h, generator=g, dtype=torch.float64) * scale
    vs = c.vocab_size or c.v
    y = torch.randint(0, vs, (n,), generator=g)
    if c.peaked:  # the first rows' labels get weight rows 2·hidden row: the label dominates the softmax
        k = min(n, 8)
        peak_logits(w, h, range(k), y[:k].tolist(), 2.0)
    if c.edge_labels:
        y[0], y[1], y[-1] = 0, vs - 1, vs - 1
    if c.ignore_frac:
        drop = torch.rand(n, generator=g) < c.ignore_frac
        drop[0] = True
        y = torch.where(drop, torch.full_like(y, -100), y)
    t = c.temperature
    if t == PER_TOKEN:
        t = (torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.5).reshape(lead)
    h = h.to(c.dtype).reshape(*lead, c.h).to(device)
    w = w.to(c.dtype).to(device)
    y = y.reshape(lead).to(device)
    if torch.is_tensor(t):
        t = t.to(device)
    return h, w, y, t


def available_backends():
    """Every backend that can run on CPU tensors: reference and torch always; the Triton kernels through the
    interpreter (helpers/kernel_device.py turns it on where there is no CUDA device). On a GPU machine the
    Triton backends' CUDA cases are the tests that take `kernel_device()` and `python -m benchmark.op.gpu_check`."""
    names = ["reference", "torch"]
    for name, mod in (("triton", "areal_lce.op.backends.triton.launch"),
                      ("triton_ascend", "areal_lce.op.backends.ascend.launch")):
        if importlib.util.find_spec(mod.rsplit(".", 1)[0]) is None:
            continue
        if importlib.util.find_spec(mod) is not None and interpreter_on():
            names.append(name)
    return names
