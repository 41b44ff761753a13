"""Framework adapters (areal_lce/integrations): verl's `linear_cross_entropy` and AReaL's
`chunked_lm_head_logprobs_entropy`, against the frameworks' own semantics.

* verl: against verl 0.9.1's own torch implementation of the op (FusedLinearForPPO, tests/helpers/adapter_oracles.py),
  values and gradients of hidden and weight, TP=1 in process and TP=2 on 2 gloo ranks through megatron's
  own SP gather. Skipped only when verl is not installed aside (.ci/setup.sh installs it).
* AReaL: against the fp64 materialised oracle of its documented semantics (logit_scale, temperature,
  detached entropy, the four vocab statistics), TP=1 in process and TP=2 with a real megatron
  ColumnParallelLinear as output_layer, with and without sequence parallel.
* Both: labels in hidden's leading shape only (other layouts of the same count refused), no ignore_index
  (-100 refused like an id >= vocab), and the check modes (sync at the call; deferred: NaN logprob and
  check_deferred()). AReaL: output layers whose logits the op does not compute exactly are refused; the
  allowed ones match their own forward.
* The patches: `apply()` / `remove()` on stand-in modules, and the patch point read from verl's source.
"""
from __future__ import annotations

import ast
import functools
import os
import sys
import types

import pytest
import torch

from helpers import adapter_oracles as I
import areal_lce
from areal_lce.integrations import areal as lce_areal
from areal_lce.integrations import verl as lce_verl

from helpers.bounds import assert_within, op_bounds
from helpers.inputs import available_backends

BACKENDS = [b for b in available_backends() if b != "triton_ascend"]
needs_verl = pytest.mark.skipif(
    not I.verl_available(), reason="verl 0.9.1 not installed aside: run .ci/setup.sh, or set AREAL_LCE_VERL_ASIDE "
    "to a `pip install --no-deps --target DIR verl==0.9.1` dir")
# fp32 against fp32 (verl's op) or fp64 (AReaL oracle); seen <= 7e-7 values, <= 6e-6 gradients
TOL_VALUES, TOL_GRADS = 1e-5, 5e-5


def _inputs(lead=(13, 1), h=16, v=45, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    labels = torch.randint(0, v, (1, hidden[..., 0].numel()), generator=g)  # verl's THD labels: [1, T]
    labels[0, 0], labels[0, -1] = 0, v - 1
    n = labels.numel()
    return hidden, weight, labels, torch.randn(n, generator=g), torch.randn(n, generator=g)


# ---------------------------------------------------------------------------------------------- verl

@needs_verl
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_verl_matches_verl_torch_op(backend, reduction):
    hidden, weight, labels, g_lp, g_ent = _inputs()
    if reduction != "none":
        g_lp = g_lp[0]
    r_lp, r_ent, r_dh, r_dw = I.verl_reference(hidden, weight, labels, 0.7, g_lp, g_ent, reduction)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lce_verl.linear_cross_entropy(h, w, labels, 0.7, reduction, None, backend=backend)
    assert lp.dtype == ent.dtype == torch.float32 and ent.shape == (labels.numel(),)
    assert lp.shape == ((labels.numel(),) if reduction == "none" else ())
    lp_term = (lp * g_lp).sum() if reduction == "none" else g_lp * lp
    (lp_term + (ent * g_ent).sum()).backward()
    r_lp = {"none": r_lp, "sum": r_lp.sum(), "mean": r_lp.mean()}[reduction]
    assert I.scaled_err(lp, r_lp) <= TOL_VALUES and I.scaled_err(ent, r_ent) <= TOL_VALUES
    assert h.grad.shape == hidden.shape and w.grad.dtype == weight.dtype
    assert I.scaled_err(h.grad.reshape(r_dh.shape), r_dh) <= TOL_GRADS
    assert I.scaled_err(w.grad, r_dw) <= TOL_GRADS


@needs_verl
def test_verl_bf16_and_2d_hidden():
    """[N, H] hidden with [N] labels; bf16 operands: values to fp32 accuracy of the same bf16 inputs,
    gradients returned in bf16 as verl returns them."""
    hidden, weight, labels, g_lp, g_ent = _inputs(lead=(11,), seed=1)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    r_lp, r_ent, r_dh, r_dw = I.verl_reference(hb.float(), wb.float(), labels, 1.0, g_lp, g_ent)
    h, w = hb.clone().requires_grad_(), wb.clone().requires_grad_()
    lp, ent = lce_verl.linear_cross_entropy(h, w, labels.reshape(-1), 1.0, backend="torch")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert I.scaled_err(lp, r_lp) <= 1e-5 and I.scaled_err(ent, r_ent) <= 1e-5
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert I.scaled_err(h.grad.float(), r_dh) <= 2e-2 and I.scaled_err(w.grad.float(), r_dw) <= 2e-2


def test_verl_bad_input():
    hidden, weight, labels, _, _ = _inputs()
    call = lce_verl.linear_cross_entropy
    with pytest.raises(TypeError, match="temperature"):
        call(hidden, weight, labels, torch.tensor(0.7))
    with pytest.raises(ValueError, match="temperature"):
        call(hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match="reduction"):
        call(hidden, weight, labels, 1.0, "avg")
    with pytest.raises(ValueError, match="labels"):
        call(hidden, weight, labels[:, :-1], 1.0)
    with pytest.raises(TypeError, match="tp_group"):
        call(hidden, weight, labels, 1.0, tp_group=None)


# --------------------------------------------------------------------------------------------- AReaL

def _layer(h=16, v=45, **kw):
    """megatron-core's ColumnParallelLinear LM head at TP = 1, in process (TP = 2 in tests/integrations/integrations_worker.py)."""
    return I.output_layer(h, v, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature,logit_scale", [(1.0, 1.0), (0.6, 1.7)], ids=["plain", "t0.6_scale1.7"])
def test_areal_matches_oracle(backend, temperature, logit_scale):
    hidden, weight, labels, g_lp, _ = _inputs(lead=(17, 1), v=61, seed=2)
    labels = labels.reshape(-1, 1)  # AReaL's engine passes [T, 1]
    refs, r_dh, r_dw = I.areal_oracle(hidden, weight, labels, temperature, logit_scale, g_lp)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce_areal.chunked_lm_head_logprobs_entropy(_layer(v=61), h, w, labels, temperature=temperature,
                                                     chunk_size=4, logit_scale=logit_scale, backend=backend)
    assert type(out) is lce_areal.output_type() and out._fields == I.AREAL_FIELDS
    for name, o, r in zip(I.AREAL_FIELDS, out, refs):
        assert o.shape == (17,) and o.dtype == torch.float32, name
        assert I.scaled_err(o, r) <= TOL_VALUES, (name, I.scaled_err(o, r))
    assert out.logprobs.requires_grad and not out.entropy.requires_grad  # entropy is not differentiable in AReaL
    (out.logprobs * g_lp).sum().backward()
    assert I.scaled_err(h.grad.reshape(r_dh.shape), r_dh) <= TOL_GRADS and I.scaled_err(w.grad, r_dw) <= TOL_GRADS


def test_areal_fp32_operands():
    """AReaL's enable_fp32_lm_head: bf16 parameters, fp32 GEMM operands; gradients come back in bf16."""
    hidden, weight, labels, g_lp, _ = _inputs(lead=(9, 1), seed=3)
    hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    refs, r_dh, r_dw = I.areal_oracle(hb.float(), wb.float(), labels, 0.8, 1.0, g_lp)
    out = lce_areal.chunked_lm_head_logprobs_entropy(_layer(fp32_operands=True), hb, wb, labels, temperature=0.8,
                                                     chunk_size=16, backend="torch")
    assert all(I.scaled_err(o, r) <= TOL_VALUES for o, r in zip(out, refs))
    (out.logprobs * g_lp).sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    assert I.scaled_err(hb.grad.float().reshape(r_dh.shape), r_dh) <= 1e-2
    assert I.scaled_err(wb.grad.float(), r_dw) <= 1e-2


def test_areal_refusals():
    hidden, weight, labels, _, _ = _inputs()
    call = functools.partial(lce_areal.chunked_lm_head_logprobs_entropy, hidden_states=hidden, weight=weight,
                             labels=labels, temperature=1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        call(_layer(), chunk_size=0)
    with pytest.raises(ValueError, match="logit_scale"):
        call(_layer(), chunk_size=8, logit_scale=-1.0)
    with pytest.raises(NotImplementedError, match="bias"):
        call(_layer(bias=True), chunk_size=8)
    with pytest.raises(NotImplementedError, match="gather_output"):
        call(_layer(gather_output=True), chunk_size=8)
    with pytest.raises(NotImplementedError, match="defer_embedding_wgrad_compute"):
        call(_layer(config=types.SimpleNamespace(defer_embedding_wgrad_compute=True)), chunk_size=8)
    with pytest.raises(ValueError, match="dtypes"):
        lce_areal.chunked_lm_head_logprobs_entropy(_layer(), hidden.double(), weight, labels, temperature=1.0,
                                                   chunk_size=8)


# ----------------------------------------------------------------------------- labels: layout and values

def _verl_lp(hidden, weight, labels, **kw):
    return lce_verl.linear_cross_entropy(hidden, weight, labels, 0.9, **kw)[0]


def _areal_lp(hidden, weight, labels, **kw):
    return lce_areal.chunked_lm_head_logprobs_entropy(_layer(v=weight.shape[0]), hidden, weight, labels,
                                                      temperature=0.9, chunk_size=8, **kw).logprobs


ADAPTERS = {"verl": _verl_lp, "areal": _areal_lp}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_label_layouts(adapter):
    """Labels must have hidden's leading shape, size-1 dimensions aside (the frameworks' [T, 1, H] with [1, T],
    [T, 1] or [T]; [B, S, H] with [B, S]): each accepted layout gives the flat call's logprobs bitwise. The
    same tokens in another layout ([S, B] for [B, S, H], or flat) are refused: they were paired with the
    wrong rows (logprob errors up to ~11 here) because only the element count was checked."""
    call = ADAPTERS[adapter]
    hidden, weight, _, _, _ = _inputs(lead=(3, 4), seed=4)
    labels = torch.randint(0, 45, (3, 4), generator=torch.Generator().manual_seed(4))
    flat = call(hidden.reshape(12, 16), weight, labels.reshape(12))
    for h, y in [(hidden, labels), (hidden.reshape(12, 1, 16), labels.reshape(1, 12)),
                 (hidden.reshape(12, 1, 16), labels.reshape(12, 1)), (hidden.reshape(12, 1, 16), labels.reshape(12)),
                 (hidden.reshape(1, 12, 16), labels.reshape(12))]:
        assert torch.equal(call(h, weight, y), flat), (tuple(h.shape), tuple(y.shape))
    for y in (labels.t(), labels.t().contiguous(), labels.reshape(12), labels.reshape(2, 6)):
        with pytest.raises(ValueError, match=r"labels \(.*\) must have hidden's leading shape \(3, 4\)"):
            call(hidden, weight, y)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_negative_labels_refused(adapter):
    """Neither framework's contract has an ignore_index, so -100 is no longer a row that silently scores 0
    with no gradient: on CPU (check_labels=True is "sync" there) it raises at the call, saying why."""
    call = ADAPTERS[adapter]
    hidden, weight, labels, _, _ = _inputs(seed=5)
    labels[0, 3] = -100
    with pytest.raises(ValueError, match=r"1 negative value\(s\) \(first: -100\).*no ignore_index"):
        call(hidden, weight, labels)
    with pytest.raises(ValueError, match="negative"):
        call(hidden, weight, labels, check_labels="sync")


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-100, 45], ids=["minus100", "vocab"])
def test_deferred_label_check(adapter, backend, bad):
    """The accelerator default (check_labels=True is "deferred" there; forced here on CPU): no host sync, the
    bad token's logprob is NaN (the other tokens' are untouched) and only areal_lce.check_deferred() raises,
    naming the value. -100 included: it used to be an ignored row scoring 0."""
    call = ADAPTERS[adapter]
    hidden, weight, labels, _, _ = _inputs(seed=6)
    good = call(hidden, weight, labels, backend=backend)
    labels[0, 3] = bad
    lp = call(hidden, weight, labels, backend=backend, check_labels="deferred")
    assert torch.isnan(lp[3]) and torch.equal(torch.cat([lp[:3], lp[4:]]), torch.cat([good[:3], good[4:]]))
    with pytest.raises(ValueError, match=f"smallest: {bad}, largest: {bad}"):
        areal_lce.check_deferred()
    with pytest.raises(ValueError, match=f"first: {bad}"):  # the synchronous option
        call(hidden, weight, labels, backend=backend, check_labels="sync")
    areal_lce.check_deferred()  # nothing recorded by the sync call


def test_check_labels_through_apply(monkeypatch):
    """apply(check_labels="sync") reaches the op through the patched names of both frameworks."""
    for name in lce_verl.PATCH_TARGETS:
        _fake_module(monkeypatch, name, "linear_cross_entropy")
    _fake_module(monkeypatch, *lce_areal.PATCH_TARGET)
    hidden, weight, labels, _, _ = _inputs(seed=7)
    labels[0, 2] = 45
    try:
        lce_verl.apply(check_labels="deferred")
        lce_areal.apply(check_labels="deferred")
        verl_fn = sys.modules[lce_verl.PATCH_TARGETS[0]].linear_cross_entropy
        areal_fn = getattr(sys.modules[lce_areal.PATCH_TARGET[0]], lce_areal.PATCH_TARGET[1])
        assert torch.isnan(verl_fn(hidden, weight, labels, 1.0, "none", None)[0][2])
        out = areal_fn(_layer(), hidden, weight, labels, temperature=1.0, chunk_size=4)
        assert torch.isnan(out.logprobs[2])
        with pytest.raises(ValueError, match="2 value"):
            areal_lce.check_deferred()
    finally:
        lce_verl.remove()
        lce_areal.remove()


# ------------------------------------------------------------------- consistency options reach the op

def _op_lp(hidden, weight, labels, **kw):
    """The op as both adapters call it at TP = 1 (temperature 0.9; AReaL's logit_scale 1)."""
    return areal_lce.linear_logprobs_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                             temperature=0.9, **kw).logprobs


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_consistency_options_reach_the_op(adapter, backend):
    """invariant and logits_precision are passed to the op unchanged: the adapter's logprobs equal the op's
    with the same options bitwise, and bf16 logits are not the fp32 ones (the option is not dropped)."""
    call = ADAPTERS[adapter]
    as_called = dict(return_stats=True, return_logit_sums=True) if adapter == "areal" else {}
    hidden, weight, labels, _, _ = _inputs(lead=(17, 1), v=200, seed=10)
    hidden = hidden * 4  # logits of several units: their bf16 rounding moves the logprobs
    got = {}
    for invariant, precision in ((None, "fp32"), (None, "bf16"), (True, "bf16"), (False, "fp32")):
        kw = dict(invariant=invariant, logits_precision=precision, backend=backend)
        got[invariant, precision] = call(hidden, weight, labels, **kw)
        assert torch.equal(got[invariant, precision], _op_lp(hidden, weight, labels, **kw, **as_called)), kw
    assert not torch.equal(got[None, "bf16"], got[None, "fp32"])
    with pytest.raises(ValueError, match="invariant"):  # the op refuses invariant=True on fp64 inputs
        call(hidden.double(), weight.double(), labels, invariant=True, backend="torch")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_consistency_options_type_checked(adapter):
    call = ADAPTERS[adapter]
    hidden, weight, labels, _, _ = _inputs()
    with pytest.raises(TypeError, match="invariant must be None, True or False"):
        call(hidden, weight, labels, invariant="yes")
    with pytest.raises(TypeError, match="logits_precision must be a str"):
        call(hidden, weight, labels, logits_precision=torch.bfloat16)
    with pytest.raises(ValueError, match="logits_precision"):  # the value: the op's check
        call(hidden, weight, labels, logits_precision="fp16")


def test_consistency_options_through_apply(monkeypatch):
    """apply(invariant=..., logits_precision=...) reaches the op through the patched names."""
    for name in lce_verl.PATCH_TARGETS:
        _fake_module(monkeypatch, name, "linear_cross_entropy")
    _fake_module(monkeypatch, *lce_areal.PATCH_TARGET)
    hidden, weight, labels, _, _ = _inputs(seed=11)
    hidden = hidden * 4
    want = _op_lp(hidden, weight, labels, invariant=False, logits_precision="bf16", backend="torch")
    try:
        lce_verl.apply(invariant=False, logits_precision="bf16", backend="torch")
        lce_areal.apply(invariant=False, logits_precision="bf16", backend="torch")
        verl_fn = sys.modules[lce_verl.PATCH_TARGETS[0]].linear_cross_entropy
        areal_fn = getattr(sys.modules[lce_areal.PATCH_TARGET[0]], lce_areal.PATCH_TARGET[1])
        assert torch.equal(verl_fn(hidden, weight, labels, 0.9, "none", None)[0], want)
        assert torch.equal(areal_fn(_layer(), hidden, weight, labels, temperature=0.9, chunk_size=4).logprobs, want)
    finally:
        lce_verl.remove()
        lce_areal.remove()


# ------------------------------------------------------------------------------- AReaL: output layers

def _scaled_impl_class():
    class ScaledImpl(I.column_parallel_linear()):  # a head that scales its GEMM inside _forward_impl
        def _forward_impl(self, input, weight, *args, **kwargs):
            return 2.0 * super()._forward_impl(input, weight, *args, **kwargs)

    return ScaledImpl


REFUSED_LAYERS = {  # id -> (build the layer, the reason the error must give)
    "gemma2_softcap": (lambda: _layer(cls=I.softcap_layer_class(5.0)), "overrides ColumnParallelLinear.forward"),
    "areal_marked_softcap": (lambda: _layer(cls=I.areal_promoted(I.softcap_layer_class(5.0)),
                                            chunked_loss_supported=False), "chunked_loss_supported=False"),
    "areal_softcap_unmarked": (lambda: _layer(cls=I.areal_promoted(I.softcap_layer_class(5.0))),
                               "overrides ColumnParallelLinear.forward"),
    "forward_on_instance": (lambda: _layer(forward=lambda *a, **k: None), "forward is replaced on the instance"),
    "scaled_forward_impl": (lambda: _layer(cls=_scaled_impl_class()), "overrides _forward_impl"),
    "bias_added": (lambda: _layer(bias=True), "adds a bias"),
    "torch_linear": (lambda: torch.nn.Linear(16, 45, bias=False), "not megatron-core's ColumnParallelLinear"),
}


@pytest.mark.parametrize("case", REFUSED_LAYERS)
def test_areal_refuses_layers_whose_logits_differ(case):
    """Every output layer whose logits are not (h·Wᵀ)·logit_scale is refused with the reason. A Gemma2-style
    soft-capped head used to get the un-capped logits' logprobs."""
    build, reason = REFUSED_LAYERS[case]
    hidden, weight, labels, _, _ = _inputs(seed=8)
    with pytest.raises(NotImplementedError, match=reason):
        lce_areal.chunked_lm_head_logprobs_entropy(build(), hidden, weight, labels, temperature=1.0, chunk_size=4)


EXACT_LAYERS = {
    "column_parallel_linear": lambda: _layer(),
    "bias_skipped": lambda: _layer(bias=True, skip_bias_add=True),  # the bias is returned, not added
    "areal_lm_head": lambda: _layer(cls=I.areal_promoted(I.column_parallel_linear())),
}


@pytest.mark.parametrize("case", EXACT_LAYERS)
def test_areal_exact_layers_match_their_own_forward(case):
    """The allowed layers: the adapter's logprobs are those of the layer's own forward (its logits run in fp64
    through the module, times logit_scale, over temperature), within one fp32 evaluation's rounding bound."""
    layer = EXACT_LAYERS[case]()
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    hidden, weight, labels, _, _ = _inputs(seed=9)
    out = lce_areal.chunked_lm_head_logprobs_entropy(layer, hidden, weight, labels, temperature=0.8, chunk_size=4,
                                                     logit_scale=1.5, backend="torch")
    with torch.no_grad():
        logits = layer.double()(hidden.double(), weight=weight.double())[0].reshape(-1, weight.shape[0])
    ref = torch.log_softmax(logits * 1.5 / 0.8, -1).gather(1, labels.reshape(-1, 1)).squeeze(1)
    assert_within("logprobs", out.logprobs, ref, op_bounds(hidden, weight, labels, 1.5 / 0.8).logprobs)


# ------------------------------------------------------------------------------------- TP = 2 (gloo)

@functools.lru_cache(maxsize=1)
def worker_results() -> dict:
    import tempfile

    from helpers.launch import torchrun

    out = os.path.join(tempfile.mkdtemp(), "integrations.json")
    return torchrun(os.path.join(os.path.dirname(os.path.abspath(__file__)), "integrations_worker.py"), out, timeout=300, result=out)


@needs_verl
@pytest.mark.parametrize("case", [f"verl-{r}-{b}" for r in ("none", "sum", "mean") for b in ("torch", "reference")])
@pytest.mark.distributed
def test_verl_tp2_through_megatron_sp_gather(case):
    r = worker_results()[case]
    assert "error" not in r, r.get("error")
    assert r["logprobs"] <= TOL_VALUES and r["entropy"] <= TOL_VALUES, r
    # d_hidden reduced exactly once (by the gather's reduce-scatter): a second reduction gives ~1
    assert r["d_hidden"] <= TOL_GRADS and r["d_weight"] <= TOL_GRADS, r


@pytest.mark.parametrize("case", [f"areal-sp{s}-{b}" for s in (0, 1) for b in ("torch", "reference")])
@pytest.mark.distributed
def test_areal_tp2_with_megatron_column_parallel_linear(case):
    r = worker_results()[case]
    assert "error" not in r, r.get("error")
    assert r["allreduce_dgrad"] == 0 and r["entropy_grad"] == 0, r
    assert all(r[f] <= TOL_VALUES for f in I.AREAL_FIELDS), r
    assert r["d_hidden"] <= TOL_GRADS and r["d_weight"] <= TOL_GRADS, r


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_areal_tp2_sequence_parallel_batch_layout(backend):
    """b = 2 under sequence parallel: [s/tp, b, H] shards with [s, b] labels match the oracle; the same labels
    transposed ([b, s], the same count) are refused."""
    r = worker_results()[f"areal-sp1-b2-{backend}"]
    assert "error" not in r, r.get("error")
    assert r["transposed_accepted"] == 0, r
    assert all(r[f] <= TOL_VALUES for f in I.AREAL_FIELDS) and r["d_hidden"] <= TOL_GRADS, r


@pytest.mark.distributed
def test_tp2_negative_labels_refused_on_every_rank():
    """Under TP the op's own synchronous check refuses -100 on every rank together (no rank left waiting)."""
    r = worker_results()["negative-labels"]
    assert "error" not in r, r.get("error")
    assert r == {"areal_accepted": 0.0, "verl_accepted": 0.0}, r


@pytest.mark.distributed
def test_tp2_invariant_equals_tp1_through_the_adapters():
    """invariant=True reaches the op under TP as well: with megatron-padded 128-id shards, TP = 2 (verl through
    megatron's SP gather; AReaL with and without sequence parallel) gives the TP = 1 outputs bitwise."""
    r = worker_results()["invariant"]
    assert "error" not in r, r.get("error")
    assert r == {"areal_sp0": 0.0, "areal_sp1": 0.0, "verl": 0.0}, r


# ------------------------------------------------------------------------------------------ patches

def _fake_module(monkeypatch, name: str, attr: str):
    sentinel = object()
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**{attr: sentinel}))
    return sentinel


def test_verl_apply_and_remove(monkeypatch):
    originals = {n: _fake_module(monkeypatch, n, "linear_cross_entropy") for n in lce_verl.PATCH_TARGETS}
    assert lce_verl.apply() == [f"{n}.linear_cross_entropy" for n in lce_verl.PATCH_TARGETS]
    assert all(sys.modules[n].linear_cross_entropy is lce_verl.linear_cross_entropy for n in originals)
    assert len(lce_verl.apply(backend="torch")) == len(originals)  # re-apply with options: originals kept
    fn = sys.modules[lce_verl.PATCH_TARGETS[0]].linear_cross_entropy
    hidden, weight, labels, _, _ = _inputs()
    lp, ent = fn(hidden, weight, labels, 0.9, "none", None)  # verl's positional call
    assert lp.shape == ent.shape == (labels.numel(),)
    assert len(lce_verl.remove()) == len(originals) and lce_verl.remove() == []
    assert all(sys.modules[n].linear_cross_entropy is o for n, o in originals.items())


def test_areal_apply_and_remove(monkeypatch):
    module, attr = lce_areal.PATCH_TARGET
    original = _fake_module(monkeypatch, module, attr)
    assert lce_areal.apply(backend="torch") == [f"{module}.{attr}"]
    assert sys.modules[module].chunked_lm_head_logprobs_entropy.keywords == {"backend": "torch"}
    assert lce_areal.remove() == [f"{module}.{attr}"]
    assert sys.modules[module].chunked_lm_head_logprobs_entropy is original
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace())  # a version without the name
    with pytest.raises(RuntimeError, match="has no attribute"):
        lce_areal.apply()


@needs_verl
def test_verl_patch_point_in_verl_source():
    """In the installed verl, model_forward_fused binds `linear_cross_entropy` at module level and calls it
    by that global name with verl's six positional arguments: replacing the module attribute is enough."""
    with open(I.VERL_FUSED_FILE) as f:
        tree = ast.parse(f.read())
    imports = [n for n in tree.body
               if isinstance(n, ast.ImportFrom) and n.module == "verl.utils.kernel.linear_cross_entropy"]
    assert [a.name for n in imports for a in n.names] == ["linear_cross_entropy"]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "linear_cross_entropy"]
    assert len(calls) >= 2 and all(len(c.args) == 6 for c in calls)
    rebinds = [n for n in ast.walk(tree)
               if (isinstance(n, ast.FunctionDef) and n.name == "linear_cross_entropy")
               or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "linear_cross_entropy"
                                                     for t in n.targets))]
    assert rebinds == []
