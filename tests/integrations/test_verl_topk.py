"""The verl top-k adapter (`areal_lce.integrations.verl.linear_topk_log_probs`, the signature of verl's fused
top-k distillation op): values and gradients against the float64 log_softmax, shapes, refusals."""
from __future__ import annotations

import pytest
import torch

from areal_lce.integrations import verl as lce_verl

from helpers.bounds import U32, gamma


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 24, generator=g).to(dtype)
    weight = (torch.randn(300, 24, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, 300, (3, 7, 5), generator=g)
    ids[0, 0] = torch.tensor([0, 299, 128, 128, 127])  # edges and a repeat
    return hidden, weight, ids


def test_values_and_gradients_match_float64():
    hidden, weight, ids = _inputs()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = lce_verl.linear_topk_log_probs(h, w, ids, temperature=0.8)
    assert out.shape == ids.shape and out.dtype == torch.float32
    c = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    (out * c).sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax((h64 @ w64.t()) / 0.8, -1)
    want = logp.gather(-1, ids)
    (want * c).sum().backward()
    # |δz| <= γ_(H+1)·Σ|h w|/T per logit; a logprob carries its logit's error and lse's (<= the row's max)
    bz = gamma(25) * (hidden.double().abs() @ weight.double().abs().t()) / 0.8
    bound = bz.gather(-1, ids) + bz.amax(-1, keepdim=True) + 4 * U32 * (want.abs() + 1)
    assert ((out.double() - want).abs() <= bound).all()
    for got, ref, name in ((h.grad, h64.grad, "hidden"), (w.grad, w64.grad, "weight")):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err <= 1e-5, f"d_{name}: {err:.2e}"  # fp32 sums of <= 300 terms: γ_300 ≈ 1.8e-5 of the largest


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=1), None),  # an int temperature reads as a float
    (dict(temperature="1"), "temperature must be a float"),
    (dict(temperature=0.0), "temperature"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_options(kw, match):
    hidden, weight, ids = _inputs()
    if match is None:
        assert lce_verl.linear_topk_log_probs(hidden, weight, ids, **kw).shape == ids.shape
        return
    with pytest.raises((TypeError, ValueError), match=match):
        lce_verl.linear_topk_log_probs(hidden, weight, ids, **kw)


def test_refuses_ids_outside_the_vocabulary_and_mismatched_shapes():
    hidden, weight, ids = _inputs()
    with pytest.raises(ValueError, match="negative"):
        lce_verl.linear_topk_log_probs(hidden, weight, ids.masked_fill(ids == 0, -100))
    with pytest.raises(ValueError, match="outside"):
        lce_verl.linear_topk_log_probs(hidden, weight, ids + 300)
    with pytest.raises(ValueError, match="same tokens"):
        lce_verl.linear_topk_log_probs(hidden[:2], weight, ids)
    with pytest.raises(TypeError, match="int32 / int64"):
        lce_verl.linear_topk_log_probs(hidden, weight, ids.float())
