"""areal_lce/op/reference.py, the one torch reference of the op's math: the same numbers as the torch backend's
oracle (bitwise, fp64) and the materialised route, 0 at ignored rows, per-token temperatures, and refusals
of mismatched shapes. Tiny CPU tensors: fast."""
from __future__ import annotations

import pytest
import torch

from areal_lce import logprobs_entropy_from_logits
from areal_lce.op import reference
from areal_lce.op.reference import logprobs_entropy as reference_logprobs_entropy


def _case(seed=0, n=(3, 5), h=16, v=41, vocab=37):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(*n, h, generator=g), torch.randn(v, h, generator=g)
    labels = torch.randint(0, vocab, n, generator=g)
    labels[0, 1] = -100
    return hidden, weight, labels, vocab


@pytest.mark.parametrize("temperature", [0.7, "per-token", "one-element"])
def test_matches_the_backends_oracle_bitwise(temperature):
    hidden, weight, labels, vocab = _case()
    t = {"per-token": torch.rand(labels.shape) + 0.5, "one-element": torch.tensor([0.9])}.get(temperature, temperature)
    ref = reference.logprobs_entropy(hidden, weight, labels, temperature=t, vocab_size=vocab)
    for got, want in zip(ref, reference_logprobs_entropy(hidden, weight, labels, temperature=t, vocab_size=vocab)):
        assert got.dtype == torch.float64 and torch.equal(got, want)
    assert all(float(x[0, 1]) == 0.0 for x in ref)  # the ignored row


def test_from_logits_agrees_with_the_materialised_route():
    hidden, weight, labels, vocab = _case(1)
    logits = hidden @ weight.t()
    ref = reference.from_logits(logits, labels, temperature=0.8, vocab_size=vocab)
    route = logprobs_entropy_from_logits(logits, labels, temperature=0.8, vocab_size=vocab)
    for name in ("logprobs", "entropy", "max_logit", "min_logit"):
        # fp32 route against the fp64 reference: a few fp32 ulps of logits of size ~10 (V = 37 terms)
        torch.testing.assert_close(getattr(route, name).double(), getattr(ref, name), rtol=0, atol=1e-5)


def test_differentiable_and_refuses_mismatched_shapes():
    hidden, weight, labels, vocab = _case(2)
    h = hidden.double().requires_grad_()
    ref = reference.logprobs_entropy(h, weight, labels, vocab_size=vocab)
    (ref.logprobs.sum() + ref.entropy.sum()).backward()
    assert h.grad is not None and torch.isfinite(h.grad).all() and not h.grad[0, 1].any()  # ignored row
    with pytest.raises(ValueError, match="must be labels' shape"):
        reference.from_logits(torch.zeros(4, 7), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="one value per label"):
        reference.from_logits(torch.zeros(4, 7), torch.zeros(4, dtype=torch.long), temperature=torch.ones(3))
