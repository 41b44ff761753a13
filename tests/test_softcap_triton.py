"""softcap on the Triton kernels (CPU interpreter): the in-kernel tanh against float64, and the paths that
tests/test_select.py's triton rows do not take (those run the default invariant kernels without a logits
cache): the online-softmax kernels, and the logits cache, whose backward reads the capped logits instead
of recomputing them.

Bounds (first order, on the test's own tensors; u = 2^-24). One fp32 capped logit is off by
δr_j <= γ_(H+1)·Σ_k |h_k||w_jk| (the GEMM; tanh is 1-Lipschitz) + 4u·c (tanh within 2 ulp, the scaling by
1/c and by c), so δz_j <= t·δr_j and, with Δ = max_j δz_j, logprob = z_y - lse is off by <= 2Δ plus
the V-term sums' rounding γ_(V+8)·(1 + |lse| + |logp|); the entropy by Δ·(2 Σ_j p_j |log p_j + H| + 2)
plus the same rounding. d_logits_j = t·s_j·(g_lp (1[j=y] - p_j) - g_ent p_j (log p_j + H)) with the slope
s_j = 1 - tanh_j²: δs_j <= 2(δr_j / c + 4u), δp_j <= 2Δ p_j, and each product adds a few u; d_hidden and
d_weight then add their GEMMs' γ_(V) / γ_(N) times |d_logits|·|W| / |d_logits|ᵀ·|h|.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from areal_lce import linear_logprobs_entropy as lce
from areal_lce.backends.triton.kernel_common import soft_cap

from helpers.bounds import EXP_ULPS, U32, gamma

pytestmark = pytest.mark.slow  # the Triton interpreter

IGNORE, H, V, V_PAD, CAP = -100, 40, 300, 384, 3.0


@triton.jit
def cap_kernel(x_ptr, out_ptr, t_ptr, n, softcap, inv_softcap, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    c, t = soft_cap(tl.load(x_ptr + o, mask=m, other=0.0), softcap, inv_softcap)
    tl.store(out_ptr + o, c, mask=m)
    tl.store(t_ptr + o, t, mask=m)


def test_in_kernel_tanh_is_within_a_few_ulps():
    """kernel_common.soft_cap against float64 tanh: small |x| (where 1 - 2/(e^2x + 1) would cancel), the
    polynomial / exp2 switch at 0.55, saturation, ±inf and NaN; odd symmetry exact."""
    grid = torch.cat([torch.linspace(0, 1, 20001), torch.logspace(-38, 1.5, 4001),
                      torch.tensor([0.55, math.nextafter(0.55, 0), math.nextafter(0.55, 1), 1e-45, 9.0, 40.0])])
    x = torch.cat([grid, -grid, torch.tensor([float("inf"), -float("inf"), float("nan")])]).float()
    out, t = torch.empty_like(x), torch.empty_like(x)
    cap_kernel[(triton.cdiv(x.numel(), 1024),)](x * CAP, out, t, x.numel(), CAP, 1 / CAP, BLOCK=1024)
    # the inputs are x·CAP: soft_cap scales them back by 1/CAP (one more rounding: |δx| <= u·|x|)
    xs = (x * CAP).double() * (1 / CAP)
    fin = torch.isfinite(x)
    want = torch.tanh(xs[fin])
    ulp = torch.finfo(torch.float32).eps * 2.0 ** torch.floor(torch.log2(want.abs().clamp_min(1e-38)))
    slack = 4 * ulp + U32 * xs[fin].abs() * (1 - want * want)  # 4 ulp + the scaling's rounding times tanh'
    err = (t[fin].double() - want).abs()
    assert (err <= slack).all(), f"max {float((err / ulp).max()):.2f} ulp at x={float(xs[fin][(err / ulp).argmax()])}"
    assert torch.equal(t[: grid.numel()], -t[grid.numel(): 2 * grid.numel()])
    assert (t[fin].abs() <= 1).all() and torch.equal(out[fin], t[fin] * CAP)  # one fp32 product
    assert t[-3:-1].tolist() == [1.0, -1.0] and out[-3:-1].tolist() == [CAP, -CAP] and t[-1].isnan()


def _inputs(n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(V_PAD, H, generator=g) * 0.4
    weight[[5, 128, 299]] = hidden[:3] * 0.7  # peaked rows: their label logits saturate the cap
    labels = torch.randint(0, V, (n,), generator=g)
    labels[:3] = torch.tensor([5, 128, 299])
    labels[[6, 13, 20]] = IGNORE
    return hidden, weight, labels


def _oracle_and_bounds(hidden, weight, labels, inv_t, g_lp, g_ent):
    """fp64 (logprobs, entropy, d_hidden, d_weight) of Σ g_lp·logprob + g_ent·entropy, and their bounds."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    n = h.shape[0]
    t = (inv_t.double() if torch.is_tensor(inv_t) else torch.full((n,), inv_t, dtype=torch.float64))[:, None]
    valid = labels != IGNORE
    y = labels.clamp_min(0)
    r_raw = h @ w[:V].t()
    th = torch.tanh(r_raw / CAP)
    z = CAP * th * t
    logp = torch.log_softmax(z, -1)
    lp = torch.where(valid, logp.gather(1, y[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    with torch.no_grad():
        ha, wa = hidden.double().abs(), weight[:V].double().abs()
        dr = gamma(H + 1) * (ha @ wa.t()) + 4 * U32 * CAP
        dz = t * dr
        delta = dz.amax(1)
        p, lse = logp.exp(), torch.logsumexp(z, -1)
        ent_all = -(p * logp).sum(-1)
        dev = (logp + ent_all[:, None]).abs()
        rnd = gamma(V + 8) * (1 + lse.abs() + logp.abs().amax(1)) + EXP_ULPS * U32
        b_lp = 2 * delta + rnd
        b_ent = delta * (2 * (p * dev).sum(1) + 2) + rnd * (1 + (p * dev).sum(1))
        onehot = torch.zeros_like(p).scatter_(1, y[:, None], 1.0)
        a, b = g_lp.double()[:, None], g_ent.double()[:, None]
        slope = 1 - th * th
        A = a.abs() * (onehot + p) + b.abs() * p * dev  # |d_logits| / (t·slope)
        dl_abs = t * slope * A
        d_slope = 2 * (dr / CAP + 4 * U32)
        d_inner = a.abs() * 2 * delta[:, None] * p + b.abs() * p * (2 * delta[:, None] * (dev + 1) + b_ent[:, None])
        ddl = valid.double()[:, None] * (t * (d_slope * A + slope * d_inner) + 8 * U32 * dl_abs)
        b_dh = ddl @ wa + gamma(V) * (dl_abs @ wa)
        b_dw = torch.cat([ddl.t() @ ha + gamma(n) * (dl_abs.t() @ ha), torch.zeros(V_PAD - V, H, dtype=torch.float64)])
    return lp.detach(), ent.detach(), h.grad, w.grad, valid * b_lp, valid * b_ent, b_dh, b_dw


@pytest.mark.parametrize("kw", [
    dict(invariant=False, temperature="per_token"),  # the online-softmax kernels (lce_fwd_kernel)
    dict(invariant=False, temperature=0.7, cache_bytes="auto"),  # backward reads the capped cache
    dict(invariant=True, temperature=0.7, cache_bytes="auto"),  # the segment kernels' cache
], ids=["online", "online-cache", "invariant-cache"])
def test_online_and_cached_paths_match_the_float64_oracle(kw):
    hidden, weight, labels = _inputs()
    n = hidden.shape[0]
    temperature = torch.linspace(0.5, 1.5, n) if kw["temperature"] == "per_token" else kw["temperature"]
    inv_t = 1 / temperature
    g = torch.Generator().manual_seed(5)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce(h, w, labels, vocab_size=V, backend="triton", softcap=CAP, return_stats=True,
              **dict(kw, temperature=temperature))
    ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    lp, ent, dh, dw, b_lp, b_ent, b_dh, b_dw = _oracle_and_bounds(hidden, weight, labels, inv_t, g_lp, g_ent)
    for name, got, want, bound in (("logprobs", out.logprobs, lp, b_lp), ("entropy", out.entropy, ent, b_ent),
                                   ("d_hidden", h.grad, dh, b_dh), ("d_weight", w.grad, dw, b_dw)):
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"{name}: max err {float(err.max()):.3e}, worst err/bound {float((err / bound).max()):.2f}"
    assert (out.max_logit[labels != IGNORE] <= CAP).all() and torch.all(w.grad[V:] == 0)
    # the cap bites: the peaked rows' label logits sit near CAP, where the slope is far below 1
    assert (out.max_logit[:3] > 0.9 * CAP).all()
