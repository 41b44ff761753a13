"""The backend harness: shard-level cases, their inputs, and the one pass rule every backend is held to.

A backend (areal_lce/op/backends/base.py) sees one vocabulary shard: hidden [N, H], weight [V_shard, H],
global labels, 1/T and LCEParams. `run_case` runs its forward and backward on a `ShardCase` and checks
every output against the fp64 oracle (ReferenceBackend on the same values upcast to fp64).

Pass rule (CCE / quack): for each output, max |backend − oracle| ≤ FACTOR · max |torch − oracle| +
atol · max(1, max |oracle|), where `torch` is torch's own computation at the input precision
(ReferenceBackend in fp32 on the same inputs for the forward statistics and fp32 gradients; for bf16 /
fp16 gradients, fp32 d_logits rounded to the input dtype, the rounding every half-precision GEMM route
takes). Infinite oracle entries (empty shards) must be matched exactly; NaN fails. Both errors are printed
on failure. Each path runs its backward on its own forward's (lse, entropy), as the Function does.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from areal_lce.op.backends import get_backend
from areal_lce.op.backends.reference import ReferenceBackend, grad_logits, shard_logits
from areal_lce.op.types import LCEParams

from .inputs import PER_TOKEN, peak_logits

FACTOR = 4.0
STATS = ("m", "s", "a", "zy", "mn", "mx")
REF = ReferenceBackend()


@dataclasses.dataclass(frozen=True)
class ShardCase:
    id: str
    why: str
    n: int = 17
    h: int = 32
    v: int = 1001  # V_shard: weight rows of this shard
    dtype: torch.dtype = torch.float32
    valid: Optional[int] = None  # shard_valid (default: every row is a real token)
    start: int = 0  # vocab_start: global id of row 0
    temperature: object = 0.7  # a float, or PER_TOKEN (a per-token inv_t)
    peaked: bool = False
    flat: bool = False
    labels: str = "edges"  # "edges": first / last real column, another shard's ids | "outside": a third
    #                        below the shard, a third above it
    grads: str = "both"  # "both" | "lp" | "ent": which upstream gradients are nonzero
    shift: float = 0.0  # added to every raw logit (hidden column 0 = 1, weight column 0 = shift)
    cache: bool = False  # a cache budget large enough for the shard's logits


# Why each case exists is its `why`; the ids are what pytest prints.
SHARD_CASES = [
    ShardCase("n1_v1001", "one token: the grid is vocab splits / tiles only", n=1),
    ShardCase("n17_v3007", "odd V, not a multiple of any block: several splits, a ragged last tile", v=3007),
    ShardCase("ragged_h", "H not a multiple of BLOCK_K; rows not 16-byte aligned (Triton: pointer loads)", h=30),
    ShardCase("peaked", "p ≈ 1 on a few rows, labels on and off the peak: entropy / padding bugs show",
              peaked=True),
    ShardCase("flat", "near-uniform logits: entropy ≈ log V", flat=True),
    ShardCase("pad_shard", "padding rows (shard_valid < V) act as -inf; vocab_start != 0", valid=990, start=2002),
    ShardCase("pad_negative", "all-negative logits: a padding column read as 0 instead of -inf would win the "
              "max and add to s and a", n=9, v=300, valid=201, temperature=0.8, shift=-6.0),
    ShardCase("outside", "labels below and above the shard: owned by no column here, zy = 0", n=20, v=150,
              start=300, labels="outside", peaked=True),
    ShardCase("tensor_temp", "per-token inv_t", temperature=PER_TOKEN, peaked=True),
    ShardCase("cache_fp32", "backward reads the cached fp32 logits (backends that keep them)", valid=999,
              cache=True),
    ShardCase("bf16", "bf16 inputs, fp32 logits (upcast right after the load)", dtype=torch.bfloat16,
              peaked=True),
    ShardCase("bf16_cache_tensor_temp", "bf16 with the cache and per-token inv_t", v=3007, dtype=torch.bfloat16,
              cache=True, temperature=PER_TOKEN),
    ShardCase("fp16_pad", "fp16 inputs with padding rows", dtype=torch.float16, valid=1000, start=1001, temperature=1.3),
    ShardCase("g_ent_zero", "logprob-only loss", peaked=True, grads="lp"),
    ShardCase("g_lp_zero", "entropy-only loss", peaked=True, grads="ent"),
    ShardCase("empty_shard", "shard_valid = 0: m = mx = -inf, s = a = 0, mn = +inf, zero gradients", n=5, v=64,
              valid=0),
]


def case_by_id(case_id: str) -> ShardCase:
    return next(c for c in SHARD_CASES if c.id == case_id)


def make_shard(c: ShardCase, backend: str, seed: int = 0, device="cpu"):
    """(hidden, weight, labels, inv_t or None, params, g_lp, g_ent) of a case for `backend`."""
    g = torch.Generator().manual_seed(seed)
    valid = c.v if c.valid is None else c.valid
    h = torch.randn(c.n, c.h, generator=g)
    w = torch.randn(c.v, c.h, generator=g) * (0.02 if c.flat else 3.0 / c.h ** 0.5)
    if c.shift:
        h[:, 0] = 1.0
        w[:, 0] = c.shift
    lo = c.start
    y = torch.randint(lo, lo + max(valid, 1), (c.n,), generator=g)
    if c.labels == "edges":  # first and last real column, ids of the next and the previous shard
        for i, label in enumerate([lo, lo + valid - 1, lo + c.v + 3, lo - 1 if lo > 0 else lo + 1][: c.n]):
            y[i] = label
    else:
        y[0::3] = torch.randint(0, max(lo, 1), (len(y[0::3]),), generator=g)  # below the shard
        y[1::3] = lo + c.v + torch.randint(0, 50, (len(y[1::3]),), generator=g)  # above the shard
    if c.peaked and valid > 0:
        k = min(c.n, valid, 6)
        peak_logits(w, h, range(k), range(k), 4.0 / c.h ** 0.5)
        y[0:k:2] = lo + torch.arange(0, k, 2)  # every other peaked row is labelled on its peak
    inv_t = (0.4 + torch.rand(c.n, generator=g)) if c.temperature == PER_TOKEN else None
    params = LCEParams(inv_t=None if inv_t is not None else 1.0 / c.temperature, vocab_size=lo + c.v, vocab_start=lo,
                       shard_valid=valid, cache_bytes=(1 << 30) if c.cache else 0, backend=get_backend(backend))
    g_lp, g_ent = torch.randn(c.n, generator=g), torch.randn(c.n, generator=g)
    if c.n > 2:
        g_lp[2] = g_ent[2] = 0.0  # a row without upstream gradient contributes nothing
    if c.grads == "lp":
        g_ent.zero_()
    elif c.grads == "ent":
        g_lp.zero_()
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    return to(h.to(c.dtype)), to(w.to(c.dtype)), to(y), to(inv_t), params, to(g_lp), to(g_ent)


def lse_ent(st):
    """(lse, entropy) of one shard's statistics, as the Function's finish_stats forms them."""
    log_s = torch.log(st.s)
    return st.m + log_s, log_s - st.a / st.s


def check(name: str, got, oracle, torch_val, atol: float) -> None:
    """The pass rule of the module docstring."""
    got, oracle, torch_val = got.double(), oracle.double(), torch_val.double()
    inf = torch.isinf(oracle)
    assert torch.equal(got[inf], oracle[inf]), f"{name}: infinite entries differ from the oracle"
    assert not torch.isnan(got).any(), f"{name}: NaN in the backend's output"
    fin = ~inf
    if not fin.any():
        return
    err = (got[fin] - oracle[fin]).abs().max().item()
    ref_err = (torch_val[fin] - oracle[fin]).abs().max().item()
    bound = FACTOR * ref_err + atol * max(1.0, oracle[fin].abs().max().item())
    assert err <= bound, f"{name}: backend err {err:.3e} > bound {bound:.3e} (torch's own err {ref_err:.3e})"


def _torch_grads(h, w, y, it, p, lse, ent, g_lp, g_ent):
    """torch's own gradients at the input precision (module docstring), on its own fp32 lse / entropy."""
    if h.dtype == torch.float32:
        return REF.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, True, True)
    z = shard_logits(h.float(), w.float(), it, p)
    dl = grad_logits(z, y, lse, ent, g_lp, g_ent, p)
    dl = (dl * (it[:, None] if it is not None else p.inv_t)).to(h.dtype).float()
    return dl @ w.float(), (dl.t() @ h.float()).to(w.dtype)


def run_case(c: ShardCase, backend, device="cpu", seed: int = 0):
    """Forward and backward of `backend` (a name or a Backend instance) on case `c`, held to the pass rule."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    h, w, y, it, p, g_lp, g_ent = make_shard(c, be.name, seed, device)
    st = be.forward(h, w, y, it, p, keep_cache=True)
    spec = be.cache_spec(h.shape[0], h.shape[1], w.shape[0], h.dtype, p, True)
    assert (st.cache is not None) == (spec is not None), "the cache is kept exactly when cache_spec says so"
    it64 = None if it is None else it.double()
    r64 = REF.forward(h.double(), w.double(), y, it64, p, False)
    r32 = REF.forward(h.float(), w.float(), y, it, p, False)
    for k in STATS:
        check(k, getattr(st, k), getattr(r64, k), getattr(r32, k), atol=2e-6)
    if p.shard_valid == 0:
        assert torch.equal(st.s, torch.zeros_like(st.s)) and torch.equal(st.a, torch.zeros_like(st.a))
        lse64 = lse32 = lse = ent64 = ent32 = ent = torch.zeros(c.n, device=h.device)
    else:
        (lse64, ent64), (lse32, ent32), (lse, ent) = lse_ent(r64), lse_ent(r32), lse_ent(st)
        check("lse", lse, lse64, lse32, atol=2e-6)
        check("entropy", ent, ent64, ent32, atol=1e-5)
    dh, dw = be.backward(h, w, y, it, p, st.cache, lse, ent, g_lp, g_ent, True, True)
    assert dh.dtype == torch.float32 and dh.shape == h.shape
    assert dw.dtype == w.dtype and dw.shape == w.shape
    rh, rw = REF.backward(h.double(), w.double(), y, it64, p, None, lse64.double(), ent64.double(),
                          g_lp.double(), g_ent.double(), True, True)
    th, tw = _torch_grads(h, w, y, it, p, lse32, ent32, g_lp, g_ent)
    check("d_hidden", dh, rh, th, atol=1e-5)
    check("d_weight", dw, rw, tw.to(w.dtype), atol=1e-5)
    if p.shard_valid < w.shape[0]:
        assert torch.equal(dw[p.shard_valid:], torch.zeros_like(dw[p.shard_valid:])), "padding rows get exactly 0"
    return st, dh, dw
