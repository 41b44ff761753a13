"""areal_lce.integrations.transformers: the patched transformers model against the unpatched one (CPU, fp32, tiny random models):
values, loss and gradients, and the label forms (packed rows, ignore_index, shift_labels, no labels).
The patch itself (remove, copies, saving, refusals): test_hf_patch.py; FSDP2 and DTensor: test_hf_fsdp.py.

Oracle: the unpatched model's own logits (log_softmax / logsumexp of them, computed in fp64) and its own
transformers loss and gradients. Pass rule: fp32 agreement to ~1e-5 relative (both sides compute the
same fp32 GEMMs in a different order).
"""
from __future__ import annotations

import copy

import pytest
import torch

import areal_lce.integrations.transformers as hf
from hf_models import V, assert_close, assert_grads_close, batch, build, expected_from_logits, manual_shift

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
