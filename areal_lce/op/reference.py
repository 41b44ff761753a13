"""The materialised torch math of the op, written once: the spec, and the oracle tests and benchmarks compare
against (in fp64 by default).

    from areal_lce.op.reference import logprobs_entropy, from_logits

    ref = logprobs_entropy(hidden, weight, labels, temperature=0.7, vocab_size=V)   # h·Wᵀ built here
    ref = from_logits(logits, labels, temperature=0.7)                             # logits given

For raw logits r (soft-capped or scaled as the caller's model makes them) and z = r / T, per token:
    logprobs   log softmax(z)[label]
    entropy    -Σ_j p_j log p_j, p = softmax(z)
    max_logit, min_logit   max / min of r over the vocabulary (before temperature)
    lse        logsumexp(z)
All five are 0 at rows whose label is `ignore_index` (the op's `LCEOutput` conventions), shaped like the
labels, in `dtype`, and differentiable through torch autograd. Columns at or past `vocab_size` (padding
rows of a weight) are not part of the vocabulary.

The op's backends keep their own kernels (backends/reference.py is the torch backend's, chunked and with a
hand-written backward); this module is what they are checked against, and needs nothing but torch.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch


class Reference(NamedTuple):
    """The five per-token values, each shaped like the labels (a tuple: `ref[:4]` and unpacking work)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    max_logit: torch.Tensor
    min_logit: torch.Tensor
    lse: torch.Tensor


def _per_row(temperature, rows: int, dtype: torch.dtype, device):
    """A float, or a per-token tensor as a [rows, 1] column (a one-element tensor broadcast to every row)."""
    if not torch.is_tensor(temperature):
        return temperature
    t = temperature.reshape(-1).to(device=device, dtype=dtype)[:, None]
    if t.shape[0] == 1:
        return t.expand(rows, 1)
    if t.shape[0] != rows:
        raise ValueError(f"temperature: a per-token tensor needs one value per label ({rows}), got {t.shape[0]}")
    return t


def from_logits(logits: torch.Tensor, labels: torch.Tensor, *, temperature: Union[float, torch.Tensor] = 1.0,
                ignore_index: int = -100, vocab_size: Optional[int] = None,
                dtype: torch.dtype = torch.float64) -> Reference:
    """The five values (module docstring) of raw logits [..., V] for labels [...] (the logits' leading shape)."""
    lead = tuple(labels.shape)
    if tuple(logits.shape[:-1]) != lead:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels' shape {lead} plus the vocabulary")
    raw = logits.reshape(-1, logits.shape[-1]).to(dtype)
    if vocab_size is not None:
        raw = raw[:, :vocab_size]
    y = labels.reshape(-1)
    z = raw / _per_row(temperature, raw.shape[0], dtype, raw.device)
    lse = torch.logsumexp(z, dim=-1)
    logp_all = z - lse[:, None]
    ent = -(torch.softmax(z, dim=-1) * logp_all).sum(-1)
    valid = y != ignore_index
    lp = logp_all.gather(1, torch.where(valid, y, torch.zeros_like(y))[:, None]).squeeze(1)
    zero = torch.zeros_like(lp)
    out = (lp, ent, raw.max(-1).values, raw.min(-1).values, lse)
    return Reference(*(torch.where(valid, o, zero).reshape(lead) for o in out))


def logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                     temperature: Union[float, torch.Tensor] = 1.0, ignore_index: int = -100,
                     vocab_size: Optional[int] = None, dtype: torch.dtype = torch.float64) -> Reference:
    """The five values of the logits h·Wᵀ (hidden [..., H], weight [V, H], labels hidden's leading shape),
    the product formed in `dtype` over the first `vocab_size` rows of the weight."""
    v = weight.shape[0] if vocab_size is None else vocab_size
    h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    raw = h @ weight[:v].to(dtype).t()
    return from_logits(raw.reshape(*labels.shape, v), labels, temperature=temperature,
                       ignore_index=ignore_index, dtype=dtype)
