"""Materialised torch reference: the spec, the test oracle and the fallback route.

Everything here builds the full [N, V] logits, so it is only for small shapes, for checking and for
devices no other backend covers. `ReferenceBackend` implements the backend contract (base.py) on one vocab
shard, in fp32 (or fp64 when the inputs are fp64), so the Function's communication can be tested against it.
The end-to-end oracle on the full vocabulary, differentiable by torch autograd in the dtype you give it, is
areal_lce.op.reference.logprobs_entropy.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..types import LCEParams
from .base import Backend, ShardStats, cap_slope, head_transform


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def shard_logits(hidden, weight, inv_t, params: LCEParams, raw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 (fp64 for fp64 inputs) tempered logits of this shard, padding columns set to -inf.
    `raw`: this shard's raw logits h·Wᵀ when already computed (else computed here)."""
    acc = _acc_dtype(hidden)
    z = _raw(hidden, weight, params) if raw is None else raw
    z = z * (inv_t.to(acc)[:, None] if inv_t is not None else params.inv_t)
    if params.shard_valid < weight.shape[0]:
        z[:, params.shard_valid:] = float("-inf")
    return z


def _raw(hidden, weight, params: LCEParams) -> torch.Tensor:
    """Raw logits h·Wᵀ in the accumulation dtype, through head_transform (bf16 rounding, softcap)."""
    acc = _acc_dtype(hidden)
    return head_transform(hidden.to(acc) @ weight.to(acc).t(), params)


def label_onehot_index(labels: torch.Tensor, params: LCEParams) -> Tuple[torch.Tensor, torch.Tensor]:
    """(local column of each label clamped into range, mask of labels owned by this shard)."""
    local = labels - params.vocab_start
    owned = (local >= 0) & (local < params.shard_valid)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def stats_from_logits(z: torch.Tensor, raw: torch.Tensor, labels: torch.Tensor, params: LCEParams) -> ShardStats:
    """ShardStats (base.py) of tempered logits z and raw logits r = h·Wᵀ of one shard, materialised."""
    n = z.shape[0]
    if params.shard_valid == 0:
        inf = torch.full((n,), float("inf"), dtype=z.dtype, device=z.device)
        zero = torch.zeros(n, dtype=z.dtype, device=z.device)
        return ShardStats(m=-inf, s=zero, a=zero.clone(), zy=zero.clone(), mn=inf, mx=-inf)
    zv = z[:, : params.shard_valid]
    rv = raw[:, : params.shard_valid]
    m = zv.max(dim=1).values
    # NaN must poison the row: max() already propagates NaN in torch; keep the shifted values as is.
    d = zv - m[:, None]
    e = torch.exp(d)
    s = e.sum(dim=1)
    a = torch.where(e > 0, d * e, torch.zeros_like(e)).sum(dim=1)  # (-inf)·0 -> 0 for exp-underflow
    a = a + torch.where(torch.isnan(d), d, torch.zeros_like(d)).sum(dim=1)  # keep NaN visible
    col, owned = label_onehot_index(labels, params)
    zy = torch.where(owned, zv.gather(1, col[:, None]).squeeze(1), torch.zeros_like(m))
    return ShardStats(m=m, s=s, a=a, zy=zy, mn=rv.min(dim=1).values, mx=rv.max(dim=1).values)


def grad_logits(z, labels, lse, ent, g_lp, g_ent, params: LCEParams) -> torch.Tensor:
    """dL/dz of the tempered logits (padding columns give exactly 0)."""
    acc = z.dtype
    lse, ent = lse.to(acc)[:, None], ent.to(acc)[:, None]
    logp = z - lse
    p = torch.exp(logp)
    logp = torch.where(p > 0, logp, torch.zeros_like(logp))  # -inf·0 at padding -> 0
    dz = -g_lp.to(acc)[:, None] * p - g_ent.to(acc)[:, None] * p * (logp + ent)
    col, owned = label_onehot_index(labels, params)
    dz.scatter_add_(1, col[:, None], torch.where(owned, g_lp.to(acc), torch.zeros_like(g_lp, dtype=acc))[:, None])
    return dz


class ReferenceBackend(Backend):
    name = "reference"

    def segment_logits(self, hidden, weight, rows, segs, params) -> torch.Tensor:
        from .torch_chunked import segment_logits  # the blocks of the invariant forward below
        return segment_logits(hidden, weight, rows, segs, params)

    def cache_spec(self, n, h, v_shard, dtype, params, keep_cache):
        """The materialised logits themselves, whenever backward will run (cache_bytes is not consulted)."""
        if not keep_cache or params.invariant or params.softcap:
            return None
        return (n, v_shard), torch.float64 if dtype == torch.float64 else torch.float32

    def forward(self, hidden, weight, labels, inv_t, params, keep_cache) -> ShardStats:
        if params.invariant:  # the fixed-shape blocks of the torch backend (the logits are not kept)
            from .torch_chunked import invariant_forward
            return invariant_forward(hidden, weight, labels, inv_t, params)
        raw = _raw(hidden, weight, params)
        z = shard_logits(hidden, weight, inv_t, params, raw=raw)
        st = stats_from_logits(z, raw, labels, params)
        if params.logit_sums:  # raw logits of the valid columns only
            rv = raw[:, : params.shard_valid]
            st.lsum, st.lsq = rv.sum(dim=1), (rv * rv).sum(dim=1)
        st.cache = z if keep_cache and not params.softcap else None
        return st

    takes_sparse = True  # backward(..., sparse=(cols, coef)): base.py

    def backward(self, hidden, weight, labels, inv_t, params, cache: Any, lse, ent, g_lp, g_ent,
                 need_d_hidden, need_d_weight, sparse=None):
        raw = None if cache is not None else _raw(hidden, weight, params)
        z = cache if cache is not None else shard_logits(hidden, weight, inv_t, params, raw=raw)
        dz = grad_logits(z, labels, lse, ent, g_lp, g_ent, params)
        dl = dz * (inv_t.to(dz.dtype)[:, None] if inv_t is not None else params.inv_t)
        if params.softcap:
            dl = dl * cap_slope(raw, params)
        if sparse is not None:
            from .torch_chunked import add_sparse_columns
            add_sparse_columns(dl, sparse, 0, dl.shape[0], 0, dl.shape[1])
        acc = dl.dtype
        dh = (dl @ weight.to(acc)).to(torch.float32 if acc == torch.float32 else acc) if need_d_hidden else None
        dw = (dl.t() @ hidden.to(acc)).to(params.d_weight_dtype(weight.dtype)) if need_d_weight else None
        return dh, dw
