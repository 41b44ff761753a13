"""areal_lce.integrations.transformers's patch itself: pass-through and remove, deep copies, save / load, double apply, output
forms, and the refusals (each names the option or module). Models and oracle: hf_models.py."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import areal_lce.integrations.transformers as hf
from hf_models import H, V, assert_close, batch, build, expected_from_logits

# --------------------------------------------------------------------------------------------------
# the patch itself: pass-through, remove, double apply, output forms


def test_passthrough_and_remove_restores_original():
    model = build("qwen2", tied=True)
    cls_forward = type(model).forward
    ids, labels = batch()
    with torch.no_grad():
        before = model(input_ids=ids, labels=labels)
        gen_before = model.generate(ids[:1, :6], max_new_tokens=3, do_sample=False)
        hf.apply(model, backend="torch")
        assert hf.is_patched(model) and "forward" in model.__dict__
        # signature readers (e.g. the Trainer's column filter) still see the named parameters
        params = inspect.signature(model.forward).parameters
        assert {"input_ids", "labels", "position_ids", "return_token_stats", "temperature"} <= set(params)
        plain = model(ids)  # no labels, no flag: the original forward, logits and all
        assert torch.equal(plain.logits, before.logits)
        gen = model.generate(ids[:1, :6], max_new_tokens=3, do_sample=False)  # generation is untouched
        assert torch.equal(gen[:, 6:], gen_before[:, 6:])
        assert model(input_ids=ids, labels=labels).logits is None
        hf.remove(model)
        after = model(input_ids=ids, labels=labels)
    assert "forward" not in model.__dict__ and not hf.is_patched(model)
    assert model.lm_head.__dict__.get("forward") is None
    assert model.forward.__func__ is cls_forward
    assert type(model).forward is cls_forward  # the class was never touched
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)
    # the head's forward is restored after every fused call too
    assert "forward" not in model.lm_head.__dict__


# copy.deepcopy is how RL code builds a reference policy: the copy's patch must run the copy (its own
# weights, its own gradients), never the model it was copied from.
def test_deepcopy_follows_the_copy():
    model = build("qwen2", tied=False)
    hf.apply(model, backend="torch")
    twin = copy.deepcopy(model)
    assert hf.is_patched(twin)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    unpatched = build("qwen2", tied=False)
    unpatched.load_state_dict(twin.state_dict())  # the copy's weights, never patched
    ids, labels = batch()
    out = twin(input_ids=ids, labels=labels)
    with torch.no_grad():
        ref = unpatched(input_ids=ids, labels=labels)
        orig = model(input_ids=ids, labels=labels)
    assert_close(out.loss, ref.loss, "copy's loss")
    exp = expected_from_logits(ref.logits, out.shift_labels)
    assert_close(out.logprobs, exp["logprobs"], "copy's logprobs")
    assert (out.logprobs - orig.logprobs).abs().max() > 1e-2  # the original's weights give other values
    out.loss.backward()
    assert all(p.grad is None for p in model.parameters())  # nothing lands in the original
    assert all(p.grad is not None for p in twin.parameters())
    assert twin.lm_head.weight.grad.abs().sum() > 0
    hf.remove(twin)  # the copy's patch is its own: removing it leaves the original patched
    assert hf.is_patched(model) and "forward" not in twin.__dict__


def test_save_load_round_trip():
    import io

    model = build("llama", tied=True)
    hf.apply(model, backend="torch", temperature=0.7)
    buf = io.BytesIO()
    torch.save(model, buf)  # pickles the whole patched module
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)  # a test-made file: trusted
    assert hf.is_patched(loaded)
    assert "temperature" in inspect.signature(loaded.forward).parameters
    ids, labels = batch()
    with torch.no_grad():
        for p in loaded.parameters():
            p.mul_(0.5)
        out = loaded(input_ids=ids, labels=labels)
        ref = hf.remove(copy.deepcopy(loaded))(input_ids=ids, labels=labels)
    exp = expected_from_logits(ref.logits, out.shift_labels, temperature=0.7)
    for k in ("logprobs", "entropy"):
        assert_close(getattr(out, k), exp[k], f"loaded {k}")
    hf.remove(loaded)
    assert "forward" not in loaded.__dict__


def test_fused_call_logs_no_cache_deprecation(monkeypatch):
    """transformers >= 5 renamed the output's `past_key_values` to `cache`; the old name logs a
    deprecation on use (once per process, so the logger itself is recorded here)."""
    from transformers.utils import generic

    said = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    model = build("qwen2", tied=True)
    hf.apply(model, backend="torch")
    ids, labels = batch()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, use_cache=True)
    assert not [m for m in said if "deprecated" in m], said
    field = "cache" if "cache" in out.keys() else "past_key_values"
    assert out[field] is not None  # the base model's cache is still handed back


def test_remove_restores_a_previous_instance_forward():
    model = build("llama", tied=True)
    wrapper_calls = []
    original = model.forward

    def wrapper(*a, **k):
        wrapper_calls.append(1)
        return original(*a, **k)

    model.forward = wrapper
    hf.apply(model, backend="torch")
    hf.remove(model)
    assert model.__dict__["forward"] is wrapper


def test_double_apply_is_an_error_and_remove_needs_apply():
    model = build("qwen2", tied=True)
    with pytest.raises(RuntimeError, match="not patched"):
        hf.remove(model)
    hf.apply(model, backend="torch")
    with pytest.raises(RuntimeError, match="already patched"):
        hf.apply(model, backend="torch")
    hf.remove(model)
    hf.apply(model, backend="reference")  # a fresh apply after remove is fine
    hf.remove(model)


def test_instance_level_only():
    a, b = build("qwen2", tied=True), build("qwen2", tied=True)
    ids, labels = batch()
    hf.apply(a, backend="torch")
    with torch.no_grad():
        assert a(input_ids=ids, labels=labels).logits is None
        assert b(input_ids=ids, labels=labels).logits is not None


def test_return_dict_false_gives_tuple():
    model = build("qwen2", tied=True)
    ids, labels = batch()
    hf.apply(model, backend="torch")
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.loss)


# --------------------------------------------------------------------------------------------------
# refusals: each names the option or module


def test_refuses_lm_head_bias():
    model = build("qwen2", tied=False)
    model.lm_head = nn.Linear(H, V, bias=True)
    with pytest.raises(ValueError, match=r"lm_head\.bias"):
        hf.apply(model)
    assert not hf.is_patched(model) and "forward" not in model.__dict__


@pytest.mark.parametrize("option,value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625),
                                          ("logits_scaling", 8.0)])
def test_refuses_logit_transforms(option, value):
    model = build("qwen2", tied=True)
    setattr(model.config, option, value)
    with pytest.raises(ValueError, match=option):
        hf.apply(model)
    assert not hf.is_patched(model)


# Gemma2's soft-capped head is patched (the op applies the cap): tests/integrations/transformers/test_softcap_hf.py.


def test_unverified_family_needs_opt_in():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, intermediate_size=128, vocab_size=V)
    model = GemmaForCausalLM(cfg)
    with pytest.raises(ValueError, match="allow_unverified"):
        hf.apply(model)
    hf.apply(model, allow_unverified=True)  # accepted on request
    hf.remove(model)


def test_bad_options_and_calls():
    model = build("qwen2", tied=True)
    with pytest.raises(TypeError, match="tp_group"):
        hf.apply(model, tp_group=None)
    with pytest.raises(ValueError, match="temperature"):
        hf.apply(model, temperature=0.0)
    assert not hf.is_patched(model)
    hf.apply(model, backend="torch")
    ids, labels = batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)
    bad = labels.clone()
    bad[0, 5] = V + 3
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, labels=bad)
    with pytest.raises(TypeError, match="temperature"):
        model(input_ids=ids, temperature=0.5)
