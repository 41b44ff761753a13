"""Shared case list and input builders for the op's tests (CPU oracle: fp64 materialised reference)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    why: str
    n: int = 33
    h: int = 32
    v: int = 1001
    dtype: torch.dtype = torch.float32
    temperature: object = 1.0  # float, or "token" for a per-token tensor
    vocab_size: Optional[int] = None
    ignore_frac: float = 0.0
    peaked: bool = False
    flat: bool = False
    edge_labels: bool = False
    lead: tuple = ()  # leading shape instead of (n,)


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
    Case("t_token", "per-token temperature tensor", temperature="token"),
    Case("padded_vocab", "vocab_size < V: padding rows excluded from the softmax", v=1024, vocab_size=1000,
         peaked=True),
    Case("bf16", "bf16 inputs, fp32 logits in-kernel", n=29, v=999, dtype=torch.bfloat16, peaked=True),
    Case("bf16_t_ignore", "bf16 with temperature and ignored rows", n=26, v=515, dtype=torch.bfloat16,
         temperature=0.7, ignore_frac=0.25),
    Case("batch3d", "[B, S, H] hidden and [B, S] labels", lead=(3, 7), v=301),
]


def make_inputs(case: Case, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lead = case.lead or (case.n,)
    n = 1
    for d in lead:
        n *= d
    h = torch.randn(n, case.h, generator=g, dtype=torch.float64)
    scale = 0.02 if case.flat else 3.0 / case.h ** 0.5
    w = torch.randn(case.v, case.h, generator=g, dtype=torch.float64) * scale
    vs = case.vocab_size or case.v
    y = torch.randint(0, vs, (n,), generator=g)
    if case.peaked:  # label's weight row ≈ 2·hidden row: the label dominates the softmax
        k = min(n, 8)
        for i in range(k):
            w[y[i]] = 2.0 * h[i]
    if case.edge_labels:
        y[0], y[1], y[-1] = 0, vs - 1, vs - 1
    if case.ignore_frac:
        drop = torch.rand(n, generator=g) < case.ignore_frac
        drop[0] = True
        y = torch.where(drop, torch.full_like(y, -100), y)
    t = case.temperature
    if t == "token":
        t = (torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.5).reshape(lead)
    h = h.to(case.dtype).reshape(*lead, case.h).to(device)
    w = w.to(case.dtype).to(device)
    y = y.reshape(lead).to(device)
    if torch.is_tensor(t):
        t = t.to(device)
    return h, w, y, t


def available_backends():
    """Every backend that can run on these CPU tensors: reference and torch always; the Triton kernels
    through the interpreter (tests/conftest.py turns it on when there is no GPU). On a GPU machine the
    Triton backend's CUDA correctness run is `python -m benchmark.gpu_check`."""
    names = ["reference", "torch"]
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for name, mod in (("triton", "areal_lce.backends.triton.launch"),
                      ("triton_ascend", "areal_lce.backends.ascend.launch")):
        if importlib.util.find_spec(mod.rsplit(".", 1)[0]) is None:
            continue
        if importlib.util.find_spec(mod) is not None and interp:
            names.append(name)
    return names
