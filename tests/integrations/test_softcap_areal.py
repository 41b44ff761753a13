"""The AReaL adapter on a soft-capped output layer: Megatron-Bridge's / NeMo's Gemma2OutputLayer (megatron-core's
ColumnParallelLinear forward, then c·tanh(logits / c) with c = layer.config.final_logit_softcapping), stood in
for by classes of the same module and name. AReaL's materialised answer is the layer's own forward run in
float64 (its logits, over temperature, log_softmax; entropy and the four vocab statistics of the same logits)
and the gradients of Σ g·logprobs through it; bounds: tests/helpers/softcap_bounds.py."""
from __future__ import annotations

import functools

import pytest
import torch

from helpers import adapter_oracles as I
from areal_lce.integrations import areal as lce_areal

from helpers.inputs import available_backends
from helpers.softcap_bounds import softcap_check

CAP, H, V = 2.0, 16, 45


@functools.lru_cache(maxsize=None)
def gemma2_output_layer_class(module: str):
    """Gemma2OutputLayer as Megatron-Bridge's gemma2_provider / NeMo's gemma2 define it."""
    class Gemma2OutputLayer(I.column_parallel_linear()):
        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            cap = self.config.final_logit_softcapping
            return (cap * torch.tanh(output / cap) if cap else output), bias

    Gemma2OutputLayer.__module__, Gemma2OutputLayer.__qualname__ = module, "Gemma2OutputLayer"
    return Gemma2OutputLayer


BRIDGE, NEMO = "megatron.bridge.models.gemma.gemma2_provider", "nemo.collections.llm.gpt.model.gemma2"


def _layer(kind: str, cap=CAP):
    if kind == "nemo_extend_instance":  # NeMo mixes the class into the instance's: type(name, (mixin, cls), {})
        layer = I.output_layer(H, V)
        layer.__class__ = type(type(layer).__name__, (gemma2_output_layer_class(NEMO), type(layer)), {})
    elif kind == "areal_promoted_marked":  # AReaL's LM-head mixin on it, marked chunked_loss_supported=False
        layer = I.output_layer(H, V, cls=I.areal_promoted(gemma2_output_layer_class(BRIDGE)),
                               chunked_loss_supported=False)
    else:
        layer = I.output_layer(H, V, cls=gemma2_output_layer_class(BRIDGE))
    layer.config.final_logit_softcapping = cap
    return layer


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(17, 1, H, generator=g)
    weight = torch.randn(V, H, generator=g)  # logits of several units: the cap bites
    weight[3] = hidden[0, 0] * 2  # a saturated label logit
    labels = torch.randint(0, V, (17, 1), generator=g)
    labels[0, 0] = 3
    return hidden, weight, labels, torch.randn(17, generator=g)


@pytest.mark.parametrize("kind", ["bridge", "nemo_extend_instance", "areal_promoted_marked"])
@pytest.mark.parametrize("backend", [b for b in available_backends() if b in ("torch", "reference")])
def test_soft_capped_layer_matches_its_own_forward(kind, backend):
    layer = _layer(kind)
    hidden, weight, labels, g_lp = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce_areal.chunked_lm_head_logprobs_entropy(layer, h, w, labels, temperature=0.8, chunk_size=4,
                                                     backend=backend)
    (out.logprobs * g_lp).sum().backward()
    # AReaL's materialised answer: the layer's own logits in fp64 through the same formulas
    with torch.no_grad():
        logits = layer.double()(hidden.double(), weight=weight.double())[0].reshape(-1, V)
    want_lp = torch.log_softmax(logits / 0.8, -1).gather(1, labels.reshape(-1, 1)).squeeze(1)
    c = softcap_check(hidden.reshape(-1, H), weight, labels.reshape(-1), 1 / 0.8, CAP, g_lp, torch.zeros(17), V)
    assert torch.allclose(c.capped, logits, rtol=1e-12, atol=1e-12) and torch.allclose(c.logprobs, want_lp)
    assert (c.capped.abs().amax(1) > 0.9 * CAP).any()  # the cap bites
    n = (c.capped * c.capped).sum(1).sqrt()
    b_norm = ((c.capped.abs() * c.b_capped[:, None]).sum(1) + 1e-6 * n * n) / n
    checks = (("logprobs", out.logprobs, c.logprobs, c.b_logprobs), ("entropy", out.entropy, c.entropy, c.b_entropy),
              ("vocab_min_logits", out.vocab_min_logits, logits.amin(1), c.b_capped),
              ("vocab_max_logits", out.vocab_max_logits, logits.amax(1), c.b_capped),
              ("vocab_mean_logits", out.vocab_mean_logits, logits.mean(1), c.b_capped + 1e-6 * CAP),
              ("vocab_norm_logits", out.vocab_norm_logits, n, b_norm),
              ("d_hidden", h.grad.reshape(-1, H), c.d_hidden, c.b_d_hidden), ("d_weight", w.grad, c.d_weight, c.b_d_weight))
    for name, got, want, bound in checks:
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"{name}: max err {float(err.max()):.3e}, worst err/bound {float((err / bound).max()):.2f}"


def test_soft_capped_layer_options():
    hidden, weight, labels, _ = _inputs()
    call = functools.partial(lce_areal.chunked_lm_head_logprobs_entropy, hidden_states=hidden, weight=weight,
                             labels=labels, temperature=1.0, chunk_size=4, backend="torch")
    with pytest.raises(NotImplementedError, match="logit_scale=1.5 with a soft-capped output layer"):
        call(_layer("bridge"), logit_scale=1.5)
    with pytest.raises(ValueError, match="final_logit_softcapping must be a finite number > 0"):
        call(_layer("bridge", cap=-1.0))
    # an unset cap: Gemma2OutputLayer leaves the logits alone, and so does the op
    plain = call(_layer("bridge", cap=None)).logprobs
    assert torch.equal(plain, call(I.output_layer(H, V)).logprobs)
    # a Gemma2OutputLayer subclass that overrides forward once more is not read: refused
    sub = type("Wrapped", (gemma2_output_layer_class(BRIDGE),), {"forward": lambda self, *a, **k: None})
    with pytest.raises(NotImplementedError, match="Wrapped overrides ColumnParallelLinear.forward"):
        call(I.output_layer(H, V, cls=sub))
