"""fp32 rounding bounds of the op's outputs, computed from a test's own tensors.

Two fp32 computations of the same quantity that differ only in summation order (other tiles, another
backend, a cached vs a recomputed logit, compacted vs in-place rows) both lie within the rounding bound
B of the exact value, so they differ by at most 2·B. B comes from the standard bound of a sum of K
fp32 terms, |fl(Σ x) − Σ x| ≤ γ_K · Σ |x| with γ_K = K·u / (1 − K·u) and u = 2⁻²⁴, carried through
the op's stages to first order (each γ below names the reduction it bounds):

    z_ij   = t_i · Σ_k h_ik w_jk                      |δz_ij|   ≤ γ_(H+1) · t_i · Σ_k |h_ik w_jk|
    s_i    = Σ_j exp(z_ij − m_i), online over tiles    rel       ≤ γ_V + per-term exp error
             per-term exp error: EXP_ULPS·u per exp() (the argument's own rounding, u·|z − m|, included),
             once for the term and once per tile merge (rescale by exp(m_old − m_new))
    lse_i  = m_i + log s_i                             |δlse_i|  ≤ Σ_j p_ij |δz_ij| + rel(s_i) + EXP_ULPS·u + u·(|log s_i| + |lse_i|)
    log p_ij = z_ij − lse_i                            |δ|       ≤ |δz_ij| + |δlse_i|   (= λ_ij)
    ent_i  = log s_i − a_i / s_i,  a_i = Σ_j e_ij (z_ij − m_i)
             |δent_i| ≤ Σ_j p_ij |log p_ij + ent_i| |δz_ij|      (d ent / d z_j = −p_j (log p_j + ent))
                        + the rounding of log s and of a / s: rel(s_i)·(1 + Σ_j p_ij |z_ij − m_i|)
                        + Σ_j p_ij |z_ij − m_i| (exp error + 2u + γ_V) + EXP_ULPS·u + u·(|log s_i| + |ent_i|)
    dl_ij  = t_i·[g_lp·(1[j=y] − p_ij) − g_ent·p_ij·(log p_ij + ent_i)]
             |δdl_ij| ≤ t_i·p_ij·[|g_lp|·ρ_ij + |g_ent|·(ρ_ij·|log p_ij + ent_i| + λ_ij + |δent_i|)]
                        + 4u·|each term|,   ρ_ij = λ_ij + 2u (relative error of p_ij)
    d_hidden_ik = Σ_j dl_ij w_jk                      ≤ Σ_j |δdl_ij| |w_jk| + γ_V · Σ_j |dl_ij w_jk|
    d_weight_jk = Σ_i dl_ij h_ik                      ≤ Σ_i |δdl_ij| |h_ik| + γ_N · Σ_i |dl_ij h_ik|

Rows whose label is ignore_index have dl = 0 and outputs 0 (both exact); columns ≥ vocab_size are padding
(p = 0). Everything is evaluated in fp64 from the fp32 inputs. `assert_within` prints the largest error, the
bound where it occurs and the tightest ratio, so a failure shows both numbers.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

U32 = 2.0 ** -24  # unit roundoff of fp32
U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significant bits): round-to-nearest moves a value by <= U_BF16·|x|
FP32_TINY = 2.0 ** -126  # smallest normal fp32: what a flush of a subnormal to zero (DAZ / FTZ) moves a value by
EXP_ULPS = 4  # exp/log accuracy allowed per call (libdevice and numpy are within 1-2 ulp; fast exp2 paths within 4)
MIN_TILE = 16  # no backend folds the vocabulary in tiles narrower than this: tile merges <= ceil(V / 16)


def gamma(k: int, u: float = U32) -> float:
    """γ_k: relative bound of a k-term floating-point sum (or a k-factor product)."""
    return k * u / (1 - k * u)


def gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of |fl(a·b) − a·b| for a [M, K] · b [K, N] accumulated in fp32 in any order and
    blocking (any vendor kernel: MKL, oneDNN, OpenBLAS, cuBLAS): γ_K · Σ_k |a_ik||b_kj|, the products exact
    (bf16 / fp16 operands: their products fit fp32; fp32 operands: one more rounding, inside γ_(K+1)), plus
    the flushes of subnormals to zero (oneDNN's bf16 dot products run with DAZ / FTZ): per k, a flushed
    operand moves its product by < 2⁻¹²⁶ · the other operand, a flushed product or partial sum by < 2⁻¹²⁶.
    fp64."""
    a, b = a.detach().double().abs(), b.detach().double().abs()
    k = a.shape[-1]
    top = max(float(a.max()), float(b.max())) if a.numel() and b.numel() else 0.0
    flush = (k + 1) * FP32_TINY * (2 + 2 * top)
    return gamma(k + 1) * (a @ b) + flush


def rounded_gemm_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, out_u: float = U_BF16) -> torch.Tensor:
    """Elementwise bound of |r − ref| where r is a·b accumulated in fp32 by one kernel and then rounded to a
    dtype of unit roundoff `out_u` (a bf16 `mm`: oneDNN or MKL's bf16 GEMM, or an fp32 GEMM rounded), and
    ref is a·b accumulated in fp32 by another kernel (another order, blocking or ISA). Each accumulation is
    within e = gemm_bound(a, b) of the exact a·b, so the unrounded r is within 2e of ref and its rounding
    moves it by at most out_u · (|ref| + 2e): |r − ref| <= 2e + out_u · (|ref| + 2e). fp64."""
    e = gemm_bound(a, b)
    return 2 * e + out_u * (ref.detach().double().abs() + 2 * e)


def assert_ranks_fixed(name: str, values: torch.Tensor, k: int, tol: float) -> None:
    """Every tensor within `tol` of `values` [..., V] elementwise has the same top-k ids in the same order:
    each gap between consecutive ones of the k + 1 largest values exceeds 2·tol, so no two of them can swap
    and nothing outside can enter. Asserted before comparing the top-k ids of two computations that differ
    by rounding only (other summation orders): their ids are then equal by the math, not by luck."""
    top = values.detach().double().topk(min(k + 1, values.shape[-1]), dim=-1).values
    gap = top[..., :-1] - top[..., 1:]
    i = int(gap.argmin())
    assert (gap > 2 * tol).all(), (
        f"{name}: two of the top-{k} values lie {gap.flatten()[i].item():.3e} apart, within 2·tol = {2 * tol:.3e}: "
        "rounding alone may reorder them (the test's inputs must separate them)")


class OpBounds(NamedTuple):
    """Elementwise bounds of one fp32 evaluation's error against the exact value (fp64 tensors)."""
    logprobs: torch.Tensor  # [N]
    entropy: torch.Tensor  # [N]
    d_hidden: torch.Tensor  # [N, H]
    d_weight: torch.Tensor  # [V, H]


def op_bounds(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
              inv_t: Union[float, torch.Tensor], g_lp: Optional[torch.Tensor] = None,
              g_ent: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None,
              ignore_index: int = -100) -> OpBounds:
    """The module docstring's bounds for hidden [N, H], weight [V, H], labels [N], 1/T (a float or [N]),
    upstream gradients g_lp, g_ent [N] (None: zero)."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    y = labels.reshape(-1)
    n, k = h.shape
    v = w.shape[0] if vocab_size is None else vocab_size
    w = w[:v]
    t = (inv_t.detach().double().reshape(-1, 1) if torch.is_tensor(inv_t)
         else torch.full((n, 1), float(inv_t), dtype=torch.float64))
    g_lp = torch.zeros(n, dtype=torch.float64) if g_lp is None else g_lp.detach().double().reshape(-1)
    g_ent = torch.zeros(n, dtype=torch.float64) if g_ent is None else g_ent.detach().double().reshape(-1)
    live = (y != ignore_index).double().reshape(-1, 1)
    u = U32

    z = t * (h @ w.t())
    dz = gamma(k + 1) * t * (h.abs() @ w.abs().t())  # logits
    m = z.max(1, keepdim=True).values
    lse = torch.logsumexp(z, 1, keepdim=True)
    logp = z - lse
    p = logp.exp()
    ent = -(p * logp).sum(1, keepdim=True)
    tiles = math.ceil(v / MIN_TILE)
    exp_err = EXP_ULPS * u * (1 + tiles) + 2 * u * (z - m).abs()  # per term: its exp, the tile rescales
    rel_s = gamma(v) + (p * exp_err).sum(1, keepdim=True)  # p_j = e_j / s: the terms' share of s
    round_lse = rel_s + EXP_ULPS * u + u * ((lse - m).abs() + lse.abs())
    dlse = (p * dz).sum(1, keepdim=True) + round_lse  # d lse / d z_j = p_j
    lam = dz + dlse
    round_ent = (rel_s + EXP_ULPS * u + u * ((lse - m).abs() + ent.abs())
                 + (p * (z - m).abs() * (exp_err + 2 * u + gamma(v))).sum(1, keepdim=True)
                 + rel_s * (p * (z - m).abs()).sum(1, keepdim=True))  # log s, then a / s with a = Σ e_j (z_j − m)
    dent = (p * (logp + ent).abs() * dz).sum(1, keepdim=True) + round_ent  # d ent / d z_j = −p_j (log p_j + ent)
    rho = lam + 2 * u

    onehot = torch.zeros_like(z)
    y_col = y.clamp(0, v - 1).reshape(-1, 1)
    owned = ((y >= 0) & (y < v)).double().reshape(-1, 1)
    onehot.scatter_(1, y_col, owned)
    a_lp, a_ent = g_lp.reshape(-1, 1), g_ent.reshape(-1, 1)
    dl = live * t * (a_lp * (onehot - p) - a_ent * p * (logp + ent))
    dl_abs = live * t * (a_lp.abs() * (onehot + p) + a_ent.abs() * p * (logp + ent).abs())
    ddl = live * t * p * (a_lp.abs() * rho + a_ent.abs() * (rho * (logp + ent).abs() + lam + dent))
    ddl = ddl + 4 * u * dl_abs

    d_hidden = ddl @ w.abs() + gamma(v) * (dl.abs() @ w.abs())
    d_weight = ddl.t() @ h.abs() + gamma(n) * (dl.abs().t() @ h.abs())
    if weight.shape[0] > v:  # padding rows: d_weight exactly 0
        d_weight = torch.cat([d_weight, torch.zeros(weight.shape[0] - v, k, dtype=torch.float64)])
    lp = live.reshape(-1) * ((dz * onehot).sum(1) + dlse.reshape(-1) + u * logp.abs().max(1).values)
    return OpBounds(lp, live.reshape(-1) * (dent.reshape(-1) + u * ent.reshape(-1).abs()),
                    d_hidden.reshape(*hidden.shape), d_weight)


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """|got − want| <= bound elementwise; on failure print the worst error, its bound and the tightest ratio."""
    got, want, bound = got.detach().double().cpu(), want.detach().double().cpu(), bound.double().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"{name}: non-finite values"
    err = (got - want).abs()
    ratio = err / bound.clamp_min(1e-300)
    i = int(ratio.argmax())
    worst = int(err.argmax())
    assert (err <= bound).all(), (
        f"{name}: |Δ| {err.flatten()[i].item():.3e} > bound {bound.flatten()[i].item():.3e} at flat index {i} "
        f"(largest |Δ| {err.flatten()[worst].item():.3e}, bound there {bound.flatten()[worst].item():.3e})")
