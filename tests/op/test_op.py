"""The fused op end to end (api -> Function -> backend) against the fp64 materialised oracle.

Pass rule: a backend's error against fp64 must be no worse than torch's own fp32 materialised error
times a small factor, plus a small atol; both errors are printed on failure.
"""
import math

import pytest
import torch

import areal_lce
from areal_lce.op.reference import logprobs_entropy as reference_logprobs_entropy

from helpers.bounds import assert_within, op_bounds
from helpers.inputs import CASES, available_backends, case_by_id, make_inputs

BACKENDS = available_backends()
FIELDS = ("logprobs", "entropy", "max_logit", "min_logit", "lse")


def _grads(outs, h, w, g_lp, g_ent):
    loss = (outs[0] * g_lp).sum() + (outs[1] * g_ent).sum()
    return torch.autograd.grad(loss, (h, w), allow_unused=True)


def _run(case, backend, h, w, y, t, **kw):
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    out = areal_lce.linear_logprobs_entropy(hh, ww, y, temperature=t, vocab_size=case.vocab_size,
                                            return_stats=True, backend=backend, **kw)
    return out, hh, ww


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_against_fp64_oracle(case, backend):
    h, w, y, t = make_inputs(case)
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(y.shape, generator=g, dtype=torch.float64)
    g_ent = torch.randn(y.shape, generator=g, dtype=torch.float64)
    # oracle: fp64 on the same (possibly bf16-rounded) values; torch's own error: fp32 materialised
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_logprobs_entropy(h64, w64, y, temperature=t, vocab_size=case.vocab_size)
    rh, rw = _grads(ref, h64, w64, g_lp, g_ent)
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    tt = t.float() if torch.is_tensor(t) else t
    r32 = reference_logprobs_entropy(h32, w32, y, temperature=tt, vocab_size=case.vocab_size, dtype=torch.float32)
    th, tw = _grads(r32, h32, w32, g_lp.float(), g_ent.float())

    out, hh, ww = _run(case, backend, h, w, y, t)
    gh, gw = _grads(out, hh, ww, g_lp.float(), g_ent.float())
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == y.shape
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    for name, o, r, r_torch in zip(FIELDS, out, ref, r32):
        e, e_t = _err(o, r), _err(r_torch, r)
        assert e <= 4 * e_t + 1e-5 * (1 + r.abs().max().item()), f"{name}: {backend} err {e:.3g} vs torch fp32 {e_t:.3g}"
    # gradients: fp32 inputs -> compare to torch fp32 error; bf16 -> the output's own rounding bound
    for name, a, r, r_torch in (("d_hidden", gh, rh, th), ("d_weight", gw, rw, tw)):
        e, e_t = _rel(a, r), _rel(r_torch, r)
        bound = 4 * e_t + 1e-5 if case.dtype == torch.float32 else 1e-2
        assert e <= bound, f"{name}: {backend} rel-L2 {e:.3g} vs torch fp32 {e_t:.3g} (bound {bound:.3g})"
    valid = y != -100
    assert torch.all(out.logprobs[~valid] == 0) and torch.all(out.entropy[~valid] == 0)
    if (~valid).any():
        assert torch.all(gh.reshape(-1, gh.shape[-1])[(~valid).reshape(-1)] == 0)
    assert torch.all(out.logprobs[valid] <= 1e-6), "a log-probability must be <= 0"
    assert torch.all(out.entropy[valid] >= -1e-5)
    assert torch.all(out.entropy[valid] <= math.log(case.vocab_size or case.v) + 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["logprobs_only", "entropy_only", "zero", "expanded", "noncontig"])
def test_upstream_gradient_forms(backend, which):
    case = case_by_id("n17_v1001")
    h, w, y, t = make_inputs(case, seed=3)
    out, hh, ww = _run(case, backend, h, w, y, t)
    n = y.numel()
    if which == "logprobs_only":
        loss = out.logprobs.sum() * 0.5
    elif which == "entropy_only":
        loss = (out.entropy * torch.linspace(-1, 1, n)).sum()
    elif which == "zero":
        loss = (out.logprobs * 0).sum() + (out.entropy * 0).sum()
    elif which == "expanded":
        loss = (out.logprobs * torch.tensor(0.3).expand(n)).sum()
    else:
        big = torch.randn(n, 2)
        loss = (out.entropy * big[:, 1]).sum() + (out.logprobs * big[:, 0]).sum()  # strided upstream
    gh, gw = torch.autograd.grad(loss, (hh, ww))
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_logprobs_entropy(h64, w64, y, temperature=t)
    if which == "logprobs_only":
        rloss = ref[0].sum() * 0.5
    elif which == "entropy_only":
        rloss = (ref[1] * torch.linspace(-1, 1, n, dtype=torch.float64)).sum()
    elif which == "zero":
        rloss = ref[0].sum() * 0
    elif which == "expanded":
        rloss = (ref[0] * 0.3).sum()
    else:
        rloss = (ref[1] * big[:, 1].double()).sum() + (ref[0] * big[:, 0].double()).sum()
    rh, rw = torch.autograd.grad(rloss, (h64, w64))
    if which == "zero":
        assert torch.all(gh == 0) and torch.all(gw == 0)
    else:
        assert _rel(gh, rh) < 1e-4 and _rel(gw, rw) < 1e-4, (_rel(gh, rh), _rel(gw, rw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_inputs(backend):
    case = case_by_id("n17_v1001")
    h, w, y, t = make_inputs(case, seed=4)
    h_nc = h.t().contiguous().t()  # same values, column-major strides
    w_nc = torch.cat([w, w], dim=1)[:, : w.shape[1]]  # a strided view
    y_nc = torch.stack([y, y], 1)[:, 0]
    assert not h_nc.is_contiguous() and not w_nc.is_contiguous() and not y_nc.is_contiguous()
    a = areal_lce.linear_logprobs_entropy(h_nc, w_nc, y_nc, backend=backend)
    b = areal_lce.linear_logprobs_entropy(h, w, y, backend=backend)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend):
    case = case_by_id("peaked")
    h, w, y, t = make_inputs(case, seed=5)
    runs = []
    for _ in range(2):
        out, hh, ww = _run(case, backend, h, w, y, t)
        gh, gw = _grads(out, hh, ww, torch.ones(y.shape), torch.full(y.shape, 0.1))
        runs.append((out.logprobs, out.entropy, gh, gw))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_and_compaction_agree(backend):
    case = case_by_id("ignore")
    h, w, y, t = make_inputs(case, seed=6)
    results = []
    for kw in ({}, {"cache_bytes": 1 << 30}, {"compact_ignored": False}):
        out, hh, ww = _run(case, backend, h, w, y, t, **kw)
        gh, gw = _grads(out, hh, ww, torch.ones(y.shape), torch.full(y.shape, -0.2))
        results.append((out.logprobs, out.entropy, gh, gw))
    g_one, g_ent = torch.ones(y.shape), torch.full(y.shape, -0.2)
    b = op_bounds(h, w, y, 1 / t, g_one, g_ent, vocab_size=case.vocab_size)  # fp32 order-only: 2 x the bound
    for other in results[1:]:
        for name, a, c, bound in zip(("logprobs", "entropy", "d_hidden", "d_weight"), results[0], other, b):
            assert_within(f"{backend} {name}", c, a, 2 * bound)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_poison_only_their_rows(backend):
    case = case_by_id("n17_v1001")
    h, w, y, t = make_inputs(case, seed=7)
    h = h.clone()
    h[2, 3] = float("nan")
    h[5, 0] = float("inf")
    out = areal_lce.linear_logprobs_entropy(h, w, y, backend=backend, return_stats=True)
    for row in (2, 5):
        assert torch.isnan(out.logprobs[row]) and torch.isnan(out.entropy[row]), row
    ok = torch.ones(y.shape, dtype=torch.bool)
    ok[2] = ok[5] = False
    assert torch.isfinite(out.logprobs[ok]).all() and torch.isfinite(out.entropy[ok]).all()


def test_all_rows_ignored():
    case = case_by_id("n17_v1001")
    h, w, y, t = make_inputs(case)
    y = torch.full_like(y, -100)
    out, hh, ww = _run(case, "torch", h, w, y, t)
    gh, gw = _grads(out, hh, ww, torch.ones(y.shape), torch.ones(y.shape))
    assert torch.all(out.logprobs == 0) and torch.all(gh == 0) and torch.all(gw == 0)


def test_materialised_route_matches_oracle():
    case = case_by_id("padded_vocab")  # peaked too
    h, w, y, t = make_inputs(case, seed=8)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    logits = (h64 @ w64.t()).float()
    out = areal_lce.logprobs_entropy_from_logits(logits, y, temperature=0.8, vocab_size=case.vocab_size)
    ref = reference_logprobs_entropy(h64, w64, y, temperature=0.8, vocab_size=case.vocab_size)
    for name, o, r in zip(FIELDS, out, ref):
        assert _err(o, r) < 1e-4, name
    ga = torch.autograd.grad((out.logprobs + out.entropy).sum(), h64)[0]
    gr = torch.autograd.grad((ref[0] + ref[1]).sum(), h64)[0]
    assert _rel(ga, gr) < 1e-4


# ---- bad input: a clear error naming the argument -------------------------------------------------

def _ok():
    return torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 9, -100])


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda h, w, y: (torch.randn(4, 7), w, y), ValueError, "H"),
    (lambda h, w, y: (h, torch.randn(10), y), ValueError, "weight"),
    (lambda h, w, y: (h, w, torch.tensor([0, 1, 2])), ValueError, "labels shape"),
    (lambda h, w, y: (h, w.double(), y), TypeError, "same dtype"),
    (lambda h, w, y: (h, w, y.float()), TypeError, "labels"),
    (lambda h, w, y: (h.long(), w, y), TypeError, "floating"),
    (lambda h, w, y: (h, w, torch.tensor([0, 1, 10, -100])), ValueError, "labels"),
    (lambda h, w, y: (h, w, torch.tensor([0, -5, 1, 2])), ValueError, "labels"),
    (lambda h, w, y: (h, w.to("meta"), y), ValueError, "same device"),
], ids=["H_mismatch", "weight_1d", "lead_shape", "dtype_mismatch", "label_dtype", "int_hidden",
        "label_too_big", "label_negative", "device_mismatch"])
def test_bad_input(mutate, exc, words):
    h, w, y = mutate(*_ok())
    with pytest.raises(exc, match=words):
        areal_lce.linear_logprobs_entropy(h, w, y, backend="torch")


@pytest.mark.parametrize("kw, words", [
    ({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": torch.tensor([1.0, 0.0, 1.0, 1.0])}, "temperature"),
    ({"temperature": torch.ones(3)}, "temperature"),
    ({"vocab_size": 11}, "vocab_size"), ({"vocab_size": 0}, "vocab_size"),
    ({"vocab_size": 5}, "labels"),  # label 9 >= vocab_size
    ({"backend": "nope"}, "backend"), ({"cache_bytes": -1}, "cache_bytes"),
])
def test_bad_options(kw, words):
    h, w, y = _ok()
    with pytest.raises(ValueError, match=words):
        areal_lce.linear_logprobs_entropy(h, w, y, **{"backend": "torch", **kw})


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, w, y = _ok()
    with pytest.raises(ValueError, match="CUDA"):
        areal_lce.linear_logprobs_entropy(h, w, y, backend="triton")


def test_env_var_selects_backend(monkeypatch):
    from areal_lce.op.backends import resolve_backend
    monkeypatch.setenv("AREAL_LCE_BACKEND", "reference")
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    monkeypatch.delenv("AREAL_LCE_BACKEND")
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
