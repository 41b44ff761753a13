"""areal_lce.integrations.transformers on a soft-capped head: a tiny random Gemma2 (config.final_logit_softcapping, local config,
offline) patched, against the unpatched model's own soft-capped logits.

Oracle: log_softmax / entropy of the unpatched model's logits in fp64. Both sides run the same base model
(bitwise the same hidden states h) and differ only in the head: one fp32 evaluation of a capped logit
c·tanh(h·w_j / c) is off by at most γ_(H+1)·Σ|h||w_j| (the GEMM; tanh is 1-Lipschitz) + 4u·c (tanh, the
division and the product by c, each within an ulp or two of |value| <= c). With Δ = twice that (two
evaluations), logprob = z_y - lse moves by <= 2Δ and the entropy by <= Δ·Σ_j p_j |log p_j + H|
(its first-order sensitivity), plus the V-term sums' own rounding, γ_(V+8)·(1 + |values|).
Gradients of every parameter: hf_models.assert_grads_close (fp32 GEMMs summed in another order, 2e-5 of each gradient's
largest entry)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

import areal_lce.integrations.transformers as hf
from helpers.bounds import U32, gamma
from hf_models import assert_grads_close, batch, manual_shift

V, H, CAP = 1000, 64, 2.0  # CAP small against the logits' spread: most rows have saturated logits


def gemma2(seed=0, tied=True, cap=CAP):
    torch.manual_seed(seed)
    cfg = Gemma2Config(hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, intermediate_size=128, vocab_size=V, max_position_embeddings=128,
                       initializer_range=0.2, final_logit_softcapping=cap, tie_word_embeddings=tied,
                       attn_implementation="eager")
    return Gemma2ForCausalLM(cfg).float().eval()


def _bounds(model, ids, logits, valid):
    with torch.no_grad():
        h = hf.patch.get_base_model(model)(input_ids=ids).last_hidden_state.double()
    w = model.lm_head.weight.detach().double()
    dz = 2 * (gamma(H + 1) * (h.abs() @ w.abs().t()) + 4 * U32 * CAP)  # [B, S, V]
    delta = dz.amax(-1)
    z = logits.double()
    lse = torch.logsumexp(z, -1)
    logp = z - lse[..., None]
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    sens = (p * (logp + ent[..., None]).abs()).sum(-1)
    r = gamma(V + 8)
    b_lp = 2 * delta + r * (1 + lse.abs() + (z - lse[..., None]).abs().amax(-1))
    b_ent = delta * sens + r * (1 + ent.abs() + (z - z.amax(-1, keepdim=True)).abs().amax(-1))
    return torch.where(valid, b_lp, 0.0), torch.where(valid, b_ent, 0.0), ent, logp


def test_gemma2_softcap_matches_unpatched():
    ref_model = gemma2(tied=True)  # Gemma2's default: lm_head.weight is the embedding (both gradients meet)
    model = copy.deepcopy(ref_model)
    ids, labels = batch()
    shift = manual_shift(labels)
    valid = shift != -100
    y = shift.clamp_min(0)
    coef = torch.randn(shift.shape, generator=torch.Generator().manual_seed(5))

    ref_logits = ref_model(input_ids=ids).logits
    assert ref_logits.abs().max() <= CAP and (ref_logits.abs() > 0.9 * CAP).any()  # the cap bites
    b_lp, b_ent, ent6, logp6 = _bounds(ref_model, ids, ref_logits, valid)
    lp6 = torch.where(valid, logp6.gather(-1, y[..., None]).squeeze(-1), 0.0)
    ent6 = torch.where(valid, ent6, 0.0)
    # the same loss through autograd of the unpatched model's logits (fp32 log_softmax, as a trainer does)
    lp32 = torch.log_softmax(ref_logits, -1)
    ref_lp = torch.where(valid, lp32.gather(-1, y[..., None]).squeeze(-1), 0.0)
    ref_ent = torch.where(valid, -(lp32.exp() * lp32).sum(-1), 0.0)
    ((coef * ref_lp).sum() + 0.3 * ref_ent.sum()).backward()

    hf.apply(model, backend="torch")
    out = model(input_ids=ids, labels=labels)
    ((coef * out.logprobs).sum() + 0.3 * out.entropy.sum()).backward()

    assert torch.equal(out.shift_labels, shift)
    for name, got, want, bound in (("logprobs", out.logprobs, lp6, b_lp), ("entropy", out.entropy, ent6, b_ent)):
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"{name}: max err {err.max():.3e}, bound there {bound[err.argmax() // 16, err.argmax() % 16]:.3e}"
    assert torch.all(out.max_logit[valid].abs() <= CAP)
    # without the cap the logprobs would be far off: the comparison above can fail
    raw = torch.log_softmax((ref_logits / CAP).atanh().clamp(-30, 30).double() * CAP, -1)
    assert (torch.where(valid, raw.gather(-1, y[..., None]).squeeze(-1), 0.0) - lp6).abs().max() > 100 * b_lp.max()
    assert_grads_close(model, ref_model)


def test_softcap_options_refused_where_the_forward_ignores_them():
    from hf_models import build

    model = build("qwen2", tied=True)  # qwen2's forward never reads final_logit_softcapping
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is set, but model_type 'qwen2'"):
        hf.apply(model)
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="final_logit_softcapping must be one finite number"):
            hf.apply(gemma2(cap=bad))
    off = gemma2(cap=None)
    hf.apply(off)  # gemma2 without a cap: the plain op
    assert off.__dict__["_areal_lce_patch"].options.softcap is None
