"""Device-side next-token sampler (areal_lce/engine/generation/sampling.py) on CPU tensors: inverse-CDF
boundaries, empirical distribution vs the softmax, nucleus truncation, greedy, seeding."""
from __future__ import annotations

import pytest
import torch

from areal_lce.engine.generation.sampling import inverse_cdf, sample_tokens

N_DRAWS = 40000


def _peaked_logits(v: int = 12) -> torch.Tensor:
    # a few dominant tokens, a mid band and a tail of near-zero mass (flat logits hide truncation bugs)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(v, generator=g)
    logits[3], logits[7], logits[0] = 4.0, 3.5, 2.0
    return logits


def _draw(logits: torch.Tensor, temperature: float, top_p: float, seed: int = 123) -> torch.Tensor:
    """N_DRAWS tokens from one row of logits, as N_DRAWS rows of one call."""
    rows = logits.unsqueeze(0).expand(N_DRAWS, -1).contiguous()
    return sample_tokens(rows, temperature, top_p, torch.Generator().manual_seed(seed))


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    m = expected > 0
    assert counts[~m].sum() == 0, f"tokens of zero probability drawn: {counts[~m]}"
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())


# 99.99% quantiles of chi-square: df 11 -> 35.7, df 1 -> 15.1. A fixed seed makes the test deterministic;
# an off-by-one in the CDF search moves whole tokens' mass and gives a statistic in the thousands.
CHI2_9999 = {11: 35.7, 1: 15.1}


def test_inverse_cdf_boundaries():
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).expand(6, 4)
    u = torch.tensor([0.0, 0.05, 0.15, 0.35, 0.65, 0.999999])
    assert inverse_cdf(w, u).tolist() == [0, 0, 1, 2, 3, 3]
    # zero-weight columns (leading, inner, trailing) are never drawn, even at u = 0 or u -> 1
    z = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0]]).expand(4, 5)
    assert inverse_cdf(z, torch.tensor([0.0, 0.49, 0.5, 1.0 - 2 ** -24])).tolist() == [1, 1, 3, 3]
    # unnormalised weights: u is scaled by the row total
    assert inverse_cdf(torch.tensor([[3.0, 1.0]]), torch.tensor([0.74])).tolist() == [0]
    assert inverse_cdf(torch.tensor([[3.0, 1.0]]), torch.tensor([0.76])).tolist() == [1]


@pytest.mark.parametrize("temperature", [pytest.param(1.0, id="T1"), pytest.param(0.7, id="T0.7"),
                                         pytest.param(1.6, id="T1.6")])
def test_samples_follow_the_tempered_softmax(temperature):
    logits = _peaked_logits()
    probs = torch.softmax(logits / temperature, -1)
    tokens = _draw(logits, temperature, 1.0)
    chi2 = _chi_square(tokens, probs)
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / N_DRAWS
    print(f"T={temperature}: chi2 {chi2:.1f} (df 11), max |freq - p| {float((freq - probs).abs().max()):.4f}")
    assert chi2 < CHI2_9999[11], (chi2, freq, probs)


def test_top_p_keeps_the_nucleus_only():
    logits = _peaked_logits()
    probs = torch.softmax(logits, -1)
    sp, idx = probs.sort(descending=True)
    top_p = float(sp[0] + 0.5 * sp[1])  # nucleus = the two most likely tokens (3 and 7)
    nucleus = idx[:2]
    tokens = _draw(logits, 1.0, top_p)
    assert set(tokens.unique().tolist()) == set(nucleus.tolist())  # both drawn, the tail never
    renorm = torch.zeros_like(probs)
    renorm[nucleus] = probs[nucleus] / probs[nucleus].sum()
    chi2 = _chi_square(tokens, renorm)
    assert chi2 < CHI2_9999[1], chi2
    # a nucleus smaller than the top token still keeps the top token
    assert set(_draw(logits, 1.0, 1e-6).unique().tolist()) == {int(idx[0])}


def test_temperature_zero_is_argmax_and_draws_nothing():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(9)
    state = g.get_state()
    assert torch.equal(sample_tokens(logits, 0.0, 0.5, g), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)  # greedy consumes no randomness


def test_same_seed_same_tokens_and_rows_independent():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(2))
    a = sample_tokens(logits, 1.0, 0.9, torch.Generator().manual_seed(5))
    b = sample_tokens(logits, 1.0, 0.9, torch.Generator().manual_seed(5))
    c = sample_tokens(logits, 1.0, 0.9, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (64,) and a.dtype == torch.long
