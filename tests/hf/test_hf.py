"""areal_lce.hf: the patched transformers model against the unpatched one (CPU, fp32, tiny random models).

Oracle: the unpatched model's own logits (log_softmax / logsumexp of them, computed in fp64) and its own
transformers loss and gradients. Pass rule: fp32 agreement to ~1e-5 relative (both sides compute the
same fp32 GEMMs in a different order).
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
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

from helpers.paths import REPO
import areal_lce.hf as hf

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
    """fp64 per-token logprob, entropy, max/min raw logit, lse of the tempered logits; 0 where ignored."""
    raw = logits.double()
    z = raw / temperature
    logp = torch.log_softmax(z, -1)
    valid = shift_labels != ignore_index
    y = torch.where(valid, shift_labels, 0)
    lp = logp.gather(-1, y[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    vals = dict(logprobs=lp, entropy=ent, max_logit=raw.max(-1).values, min_logit=raw.min(-1).values,
                lse=torch.logsumexp(z, -1))
    return {k: torch.where(valid, v, torch.zeros_like(v)) for k, v in vals.items()}


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


# --------------------------------------------------------------------------------------------------
# patched == unpatched: values, loss, gradients of every parameter


# Each family tied (lm_head.weight is the embedding: its gradient gets both contributions) and untied.
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False)])
def test_matches_unpatched(family, tied, backend):
    ref_model = build(family, tied)
    model = copy.deepcopy(ref_model)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = batch()

    ref = ref_model(input_ids=ids, labels=labels)
    ref.loss.backward()
    hf.apply(model, backend=backend)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()

    assert out.logits is None
    assert torch.equal(out.shift_labels, manual_shift(labels))
    assert_close(out.loss, ref.loss, "loss")
    exp = expected_from_logits(ref.logits, out.shift_labels)
    for k, v in exp.items():
        assert getattr(out, k).shape == (2, 16) and getattr(out, k).dtype == torch.float32
        assert_close(getattr(out, k), v, k)
    # ignored positions (prompt, padding, last) hold exactly 0
    ignored = out.shift_labels == -100
    assert ignored.sum() > 0 and (out.logprobs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()

    assert_grads_close(model, ref_model)
    head_grad = model.lm_head.weight.grad
    assert head_grad.abs().sum() > 0


# Same forward template in more families (forward values only: the gradient path is shared).
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_verified_families(family):
    model = build(family, tied=False)
    ids, labels = batch()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        hf.apply(model, backend="torch")
        out = model(input_ids=ids, labels=labels)
    assert_close(out.loss, ref.loss, "loss")
    assert_close(out.logprobs, expected_from_logits(ref.logits, out.shift_labels)["logprobs"], "logprobs")


# RL use: gradients through logprobs and entropy themselves (not only the loss), at a temperature.
@pytest.mark.parametrize("tied", [True, False])
def test_grad_through_logprobs_and_entropy_with_temperature(tied):
    ref_model = build("qwen2", tied, seed=3)
    model = copy.deepcopy(ref_model)
    ids, labels = batch(seed=4)
    T = 0.7
    coef = torch.randn(2, 16, generator=torch.Generator().manual_seed(5))

    ref = ref_model(input_ids=ids)
    exp = expected_from_logits(ref.logits, manual_shift(labels), temperature=T)
    ((coef * exp["logprobs"]).sum() + 0.3 * exp["entropy"].sum()).backward()

    hf.apply(model, backend="torch", temperature=T)
    out = model(input_ids=ids, labels=labels)
    ((coef * out.logprobs).sum() + 0.3 * out.entropy.sum()).backward()

    for k in exp:
        assert_close(getattr(out, k), exp[k], k)
    # the loss is the mean NLL at the configured temperature
    n = (out.shift_labels != -100).sum()
    assert_close(out.loss, -exp["logprobs"].sum() / n, "loss at T")
    assert_grads_close(model, ref_model)


def test_temperature_per_call_override():
    model = build("llama", tied=True)
    ids, labels = batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hf.apply(model, backend="torch", temperature=2.0)
        at_apply = model(input_ids=ids, labels=labels)
        per_call = model(input_ids=ids, labels=labels, temperature=0.5)
    shift = manual_shift(labels)
    assert_close(at_apply.logprobs, expected_from_logits(logits, shift, 2.0)["logprobs"], "T=2")
    assert_close(per_call.logprobs, expected_from_logits(logits, shift, 0.5)["logprobs"], "T=0.5")
    assert not torch.allclose(at_apply.logprobs, per_call.logprobs)
    # per-sample temperatures [B, 1]
    with torch.no_grad():
        per_row = model(input_ids=ids, labels=labels, temperature=torch.tensor([[0.5], [2.0]]))
    assert_close(per_row.logprobs[0], expected_from_logits(logits, shift, 0.5)["logprobs"][0], "row 0 T=0.5")
    assert_close(per_row.logprobs[1], expected_from_logits(logits, shift, 2.0)["logprobs"][1], "row 1 T=2")


# --------------------------------------------------------------------------------------------------
# labels: packed sequences, ignore_index, num_items_in_batch, shift_labels, no labels


# Three documents packed in one row; position_ids restart at 0. The prediction made at the last token
# of a document (whose next token is the next document's first) must be ignored. The unpatched model
# gets the same thing by masking the label of each document's first token.
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_packed_sequences(backend):
    ref_model = build("qwen2", tied=True)
    model = copy.deepcopy(ref_model)
    lens = [7, 10, 7]
    s = sum(lens)
    ids = torch.randint(0, V, (1, s), generator=torch.Generator().manual_seed(7))
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    labels = ids.clone()
    labels[0, 8:10] = -100  # some masked tokens inside the second document
    starts = [0, 7, 17]
    ref_labels = labels.clone()
    ref_labels[0, starts] = -100

    ref = ref_model(input_ids=ids, position_ids=position_ids, labels=ref_labels)
    ref.loss.backward()
    hf.apply(model, backend=backend)
    out = model(input_ids=ids, position_ids=position_ids, labels=labels)
    out.loss.backward()

    boundary = [6, 16, 23]  # last token of each document
    assert (out.shift_labels[0, boundary] == -100).all()
    assert torch.equal(out.shift_labels, manual_shift(ref_labels))
    assert_close(out.loss, ref.loss, "packed loss")
    assert_close(out.logprobs, expected_from_logits(ref.logits, out.shift_labels)["logprobs"], "packed logprobs")
    assert_grads_close(model, ref_model)

    # Without position_ids the boundaries are invisible: the cross-document predictions count.
    with torch.no_grad():
        naive = model(input_ids=ids, labels=labels)
    assert (naive.shift_labels[0, boundary[:2]] != -100).all()


def test_packed_boundaries_off_and_custom_ignore_index():
    model = build("llama", tied=False)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(8))
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, -1)
    labels = ids.clone()
    labels[:, 2] = -1
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=position_ids).logits
        hf.apply(model, backend="torch", ignore_index=-1, packed_boundaries=False)
        out = model(input_ids=ids, position_ids=position_ids, labels=labels)
    shift = manual_shift(labels)
    shift[:, -1] = -1
    assert torch.equal(out.shift_labels, shift)  # position 4 (boundary) is counted: packed_boundaries off
    exp = expected_from_logits(logits, shift, ignore_index=-1)
    assert_close(out.logprobs, exp["logprobs"], "logprobs")
    assert_close(out.loss, -exp["logprobs"].sum() / (shift != -1).sum(), "loss")


def test_num_items_in_batch_and_shift_labels():
    ref_model = build("qwen2", tied=False)
    model = copy.deepcopy(ref_model)
    ids, labels = batch()
    hf.apply(model, backend="torch")
    with torch.no_grad():
        ref = ref_model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
        out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
        assert_close(out.loss, ref.loss, "loss / num_items_in_batch")
        # pre-shifted labels are used as given (no shift, no boundary rule)
        shift = manual_shift(labels)
        ref2 = ref_model(input_ids=ids, shift_labels=shift, labels=labels)
        out2 = model(input_ids=ids, shift_labels=shift)
    assert torch.equal(out2.shift_labels, shift)
    assert_close(out2.loss, ref2.loss, "loss with shift_labels")


def test_return_token_stats_without_labels():
    model = build("qwen2", tied=True)
    ids, _ = batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hf.apply(model, backend="reference")
        out = model(input_ids=ids, return_token_stats=True)
    assert out.loss is None and out.logits is None
    exp = expected_from_logits(logits, manual_shift(ids))
    for k in exp:
        assert_close(getattr(out, k), exp[k], k)
    assert (out.logprobs[:, -1] == 0).all() and (out.logprobs[:, :-1] != 0).all()


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


# Gemma2's soft-capped head is patched (the op applies the cap): tests/hf/test_softcap_hf.py.


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


# --------------------------------------------------------------------------------------------------
# distributed: FSDP2 and a vocab-sharded DTensor head, 2 gloo ranks on CPU (this file is the worker)


@pytest.mark.distributed
def test_fsdp2_and_dtensor_tp_two_ranks():
    """Launch `_dist_worker` on 2 CPU ranks (gloo); it raises on any mismatch."""
    import os

    from helpers.launch import torchrun

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torchrun(os.path.abspath(__file__), timeout=240, cwd=REPO)


def _dist_worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from areal_lce.hf.head import _resolve_dtensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def check(value, expected, what, tol=2e-5):
        err = (value.double() - expected.double()).abs().max().item()
        scale = max(expected.abs().max().item(), 1e-30)
        if not err <= tol * scale + 1e-7:
            raise AssertionError(f"rank {rank}: {what}: max abs err {err:.3e} (max |expected| {scale:.3e})")

    # FSDP2: (a) untied, lm_head its own FSDP unit (sharded DTensor outside its forward: its hooks
    # unshard it around the fused call); (b) tied, head and embedding in the root unit. Each rank has
    # its own data; patched and unpatched FSDP models must agree on the loss and every gradient.
    for tied in (False, True):
        base = build("qwen2", tied)
        ids, labels = batch(seed=10 + rank)
        runs = []
        for patched in (False, True):
            m = copy.deepcopy(base)
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            if not tied:
                fully_shard(m.lm_head, mesh=mesh)
            fully_shard(m, mesh=mesh)
            if patched:
                hf.apply(m, backend="torch")
            out = m(input_ids=ids, labels=labels)
            out.loss.backward()
            runs.append((m, out))
        (ref_m, ref), (m, out) = runs
        assert out.logits is None and isinstance(m.lm_head.weight, DTensor)
        check(out.loss, ref.loss, f"fsdp tied={tied} loss")
        for (n, p), (_, q) in zip(ref_m.named_parameters(), m.named_parameters()):
            check(q.grad.full_tensor(), p.grad.full_tensor(), f"fsdp tied={tied} grad {n}")

    # Tensor parallel: lm_head.weight a DTensor Shard(0) over the vocabulary, the rest replicated; same
    # data on every rank. The op's vocab-parallel path must reproduce the single-process model.
    base = build("llama", tied=False)
    ids, labels = batch(seed=20)
    ref_m = copy.deepcopy(base)
    ref = ref_m(input_ids=ids, labels=labels)
    ref.loss.backward()
    m = copy.deepcopy(base)
    m.lm_head.weight = nn.Parameter(distribute_tensor(m.lm_head.weight.detach(), mesh, [Shard(0)]))
    hf.apply(m, backend="torch")
    out = m(input_ids=ids, labels=labels)
    out.loss.backward()
    check(out.loss, ref.loss, "tp loss")
    exp = expected_from_logits(ref.logits, out.shift_labels)
    for k in exp:
        check(getattr(out, k), exp[k], f"tp {k}")
    assert m.lm_head.weight.grad.placements == (Shard(0),)
    check(m.lm_head.weight.grad.full_tensor(), ref_m.lm_head.weight.grad, "tp grad lm_head")
    for (n, p), (_, q) in zip(ref_m.named_parameters(), m.named_parameters()):
        if n != "lm_head.weight":
            check(q.grad, p.grad, f"tp grad {n}")

    # Layouts the op can't take are refused before any collective.
    for tensor, placement, match in [(torch.zeros(7, H), Shard(0), "unevenly"),
                                     (torch.zeros(8, H), Shard(1), "placements")]:
        try:
            _resolve_dtensor(distribute_tensor(tensor, mesh, [placement]), torch.zeros(2, H))
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"no error for placement {placement}")
    dist.barrier()  # both ranks done before either tears gloo down (a peer closing first can abort the other)
    dist.destroy_process_group()


if __name__ == "__main__":
    _dist_worker()
