"""Tiny random transformers models and the fp64 oracle of the tests of areal_lce.integrations.transformers (tests/integrations/transformers/).

Oracle: the unpatched model's own logits (log_softmax / logsumexp of them, computed in fp64) and its own
transformers loss and gradients. Pass rule: fp32 agreement to ~1e-5 relative (both sides compute the
same fp32 GEMMs in a different order).
"""
from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from areal_lce.op import reference

V, H = 1000, 64
# initializer_range 0.2 (not the default 0.02) gives peaked next-token distributions (max prob up to
# ~0.9): flat logits hide entropy and label-indexing bugs.
_COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=V, max_position_embeddings=128, initializer_range=0.2,
               attn_implementation="eager")

FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def build(family: str, tied: bool, seed: int = 0, **extra):
    cfg_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**_COMMON, tie_word_embeddings=tied, **extra)
    model = model_cls(cfg).float().eval()  # eval: no dropout; gradients still flow
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    else:
        assert model.lm_head.weight is not model.get_input_embeddings().weight
    return model


def batch(b=2, s=16, seed=1, n_masked=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :n_masked] = -100  # prompt masking
    labels[-1, -3:] = -100  # right padding of the last row
    return ids, labels


def expected_from_logits(logits, shift_labels, temperature=1.0, ignore_index=-100):
    """fp64 per-token logprob, entropy, max/min raw logit, lse of the tempered logits; 0 where ignored
    (areal_lce.op.reference, the op's torch reference)."""
    return reference.from_logits(logits, shift_labels, temperature=temperature,
                                 ignore_index=ignore_index)._asdict()


def manual_shift(labels):
    shift = torch.full_like(labels, -100)
    shift[:, :-1] = labels[:, 1:]
    return shift


def assert_close(actual, expected, name, rtol=1e-5, atol=1e-5):
    err = (actual.double() - expected.double()).abs().max().item()
    assert torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=atol), f"{name}: max abs err {err:.3e}"


def assert_grads_close(model, ref_model, tol=2e-5):
    """Every parameter's gradient, to `tol` relative to that gradient's largest entry (fp32 rounding of
    GEMMs summed in another order; a wrong term gives errors of order 1)."""
    g_ref, g = grads(ref_model), grads(model)
    assert g_ref.keys() == g.keys()
    for n in g_ref:
        assert g[n] is not None and g_ref[n] is not None, n
        scale = g_ref[n].abs().max().item()
        err = (g[n].double() - g_ref[n].double()).abs().max().item()
        assert scale > 0 and err <= tol * scale, f"grad {n}: max abs err {err:.3e}, max |grad| {scale:.3e}"


def grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}

