"""The float64 oracle of the op with soft-capped logits and first-order bounds of one fp32 evaluation's
error against it (the soft-capped counterpart of bounds.py, whose notation it keeps; u = 2^-24).

One fp32 capped logit c·tanh(r / c), r = h·w_j, is off by
    δr_j <= γ_(H+1)·Σ_k |h_k||w_jk| (the GEMM; tanh is 1-Lipschitz) + 12u·c (the Triton kernels'
            tanh is within 11u of tanh absolutely, kernel_common.soft_cap, torch's within 2 ulp; then the
            product by c, a value <= c in magnitude)
so δz_j <= t·δr_j and, with Δ = max_j δz_j, logprob = z_y - lse is off by <= 2Δ plus the V-term sums'
rounding γ_(V+8)·(1 + |lse| + max |log p|); the entropy by Δ·(2 Σ_j p_j |log p_j + H| + 2) plus that
rounding times (1 + Σ_j p_j |log p_j + H|). d_logits_j = t·s_j·(g_lp (1[j=y] - p_j) - g_ent p_j (log p_j + H))
with the slope s_j = 1 - tanh_j²: δs_j <= 2 (δr_j / c + 12u), δp_j <= 2Δ p_j, δ log p_j <= 2Δ, and the
products add 8u of |d_logits|; d_hidden and d_weight add their GEMMs' γ_V / γ_N of |d_logits|·|W| and
|d_logits|ᵀ·|h|. The vocabulary statistics of the capped logits: max / min off by <= max_j δr_j, the mean
by that plus γ_V·mean |r|, the L2 norm by (Σ_j |r_j| δr_j + γ_V Σ_j r_j²) / norm.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .bounds import EXP_ULPS, U32, gamma

TANH_ABS = 12 * U32  # |fl(c·tanh(r/c)) - c·tanh(r/c)| <= TANH_ABS·c for one evaluation (module docstring)


class SoftcapCheck(NamedTuple):
    """fp64 values (0 at ignored rows), gradients of Σ g_lp·logprob + g_ent·entropy, and their bounds."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    d_hidden: torch.Tensor  # [N, H]
    d_weight: torch.Tensor  # [V_rows, H], rows past vocab 0
    capped: torch.Tensor  # [N, V] the capped raw logits (before temperature)
    b_logprobs: torch.Tensor
    b_entropy: torch.Tensor
    b_d_hidden: torch.Tensor
    b_d_weight: torch.Tensor
    b_capped: torch.Tensor  # [N] max_j δr_j: the bound of max / min logit


def softcap_check(hidden, weight, labels, inv_t, cap: float, g_lp, g_ent, vocab: int, ignore_index: int = -100):
    """hidden [N, H], weight [V_rows >= vocab, H] (fp32), labels [N], inv_t a float or [N], g_lp, g_ent [N]."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    n, k = h.shape
    t = (inv_t.double() if torch.is_tensor(inv_t) else torch.full((n,), float(inv_t), dtype=torch.float64))[:, None]
    valid = labels != ignore_index
    y = torch.where(valid, labels, 0)
    th = torch.tanh((h @ w[:vocab].t()) / cap)
    z = cap * th * t
    logp = torch.log_softmax(z, -1)
    lp = torch.where(valid, logp.gather(1, y[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    with torch.no_grad():
        ha, wa = h.detach().abs(), w.detach()[:vocab].abs()
        dr = gamma(k + 1) * (ha @ wa.t()) + TANH_ABS * cap
        delta = (t * dr).amax(1)
        p, lse = logp.exp(), torch.logsumexp(z, -1)
        dev = (logp + (-(p * logp).sum(-1))[:, None]).abs()  # |log p_j + H|
        sens = (p * dev).sum(1)
        rnd = gamma(vocab + 8) * (1 + lse.abs() + logp.abs().amax(1)) + EXP_ULPS * U32
        b_lp = 2 * delta + rnd
        b_ent = delta * (2 * sens + 2) + rnd * (1 + sens)
        onehot = torch.zeros_like(p).scatter_(1, y[:, None], 1.0)
        a, b = g_lp.double().abs()[:, None], g_ent.double().abs()[:, None]
        slope = 1 - th * th
        inner = a * (onehot + p) + b * p * dev  # |d_logits| / (t·slope)
        dl_abs = t * slope * inner
        d_inner = a * 2 * delta[:, None] * p + b * p * (2 * delta[:, None] * (dev + 1) + b_ent[:, None])
        ddl = valid.double()[:, None] * (t * (2 * (dr / cap + TANH_ABS) * inner + slope * d_inner) + 8 * U32 * dl_abs)
        rows = weight.shape[0] - vocab
        b_dh = ddl @ wa + gamma(vocab) * (dl_abs @ wa)
        b_dw = torch.cat([ddl.t() @ ha + gamma(n) * (dl_abs.t() @ ha), torch.zeros(rows, k, dtype=torch.float64)])
    vz = valid.double()
    return SoftcapCheck(lp.detach(), ent.detach(), h.grad, w.grad, (cap * th).detach(), vz * b_lp, vz * b_ent,
                        b_dh, b_dw, dr.amax(1))
