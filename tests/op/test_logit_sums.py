"""Per-token raw-logit sums (`return_logit_sums=True`): Σ_j r_j and Σ_j r_j² of r = h·Wᵀ over the true
vocabulary, accumulated in each backend's forward pass. Oracle: the fp64 materialised logits.

Pass rule (as tests/op/test_op.py): a backend's error against fp64 must be no worse than torch's own fp32
materialised error times a small factor, plus an atol scaled by the row's Σ|r| (resp. Σ r²), which is
what an fp32 running sum over the vocabulary can be expected to lose.
"""
import pytest
import torch

import areal_lce
from areal_lce.op.backends import get_backend
from areal_lce.op.types import LCEParams

from helpers.inputs import CASES, available_backends, case_by_id, make_inputs

BACKENDS = available_backends()
# why each: ragged last vocab tile, padding rows with huge logits (must not be summed), per-token T (the
# sums are before temperature), ignored rows (0), bf16 inputs, a [B, S] lead shape, a single token.
SUM_CASES = [c for c in CASES if c.id in ("n1", "v3007", "padded_vocab", "t_token", "ignore", "bf16_t_ignore",
                                          "batch3d")]


def oracle_sums(h, w, y, vocab_size, dtype=torch.float64):
    v = vocab_size or w.shape[0]
    raw = h.reshape(-1, h.shape[-1]).to(dtype) @ w[:v].to(dtype).t()
    keep = (y.reshape(-1) != -100).to(dtype)
    return ((raw.sum(1) * keep).reshape(y.shape), ((raw * raw).sum(1) * keep).reshape(y.shape),
            (raw.abs().sum(1)).reshape(y.shape))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SUM_CASES, ids=[c.id for c in SUM_CASES])
def test_sums_against_fp64(case, backend):
    h, w, y, t = make_inputs(case)
    s64, q64, abs64 = oracle_sums(h, w, y, case.vocab_size)
    s32, q32, _ = oracle_sums(h, w, y, case.vocab_size, torch.float32)
    out = areal_lce.linear_logprobs_entropy(h, w, y, temperature=t, vocab_size=case.vocab_size, backend=backend,
                                            return_logit_sums=True)
    assert out.sum_logit.dtype == torch.float32 and out.sum_logit.shape == y.shape
    assert out.max_logit is None and out.lse is None  # return_stats stays independent
    for name, o, r, r32, scale in (("sum_logit", out.sum_logit, s64, s32, abs64),
                                   ("sumsq_logit", out.sumsq_logit, q64, q32, q64)):
        e = (o.double() - r).abs()
        e_t = (r32.double() - r).abs().max().item()
        bound = 4 * e_t + 1e-6 * scale + 1e-6
        assert torch.all(e <= bound), f"{name}: {backend} err {e.max().item():.3g} vs torch fp32 {e_t:.3g}"
    ignored = y == -100
    assert torch.all(out.sum_logit[ignored] == 0) and torch.all(out.sumsq_logit[ignored] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sums_leave_everything_else_bitwise_unchanged(backend):
    """The sums are extra accumulators: logprobs, entropy, stats and both gradients are the same bits
    with and without them, and the sums carry no gradient."""
    h, w, y, t = make_inputs(case_by_id("n17_v1001"), seed=5)
    res = []
    for sums in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = areal_lce.linear_logprobs_entropy(hh, ww, y, temperature=0.8, backend=backend, return_stats=True,
                                                return_logit_sums=sums)
        (out.logprobs.sum() - 0.3 * out.entropy.sum()).backward()
        res.append((out, hh.grad, ww.grad))
    (a, ah, aw), (b, bh, bw) = res
    for x, z in zip(a[:5], b[:5]):
        assert torch.equal(x, z)
    assert torch.equal(ah, bh) and torch.equal(aw, bw)
    assert a.sum_logit is None and a.sumsq_logit is None
    assert b.sum_logit.requires_grad and not b.sumsq_logit.requires_grad  # sum_logit: differentiable (label smoothing)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_shard_and_all_ignored(backend):
    """A shard with no valid column (the last TP rank under heavy padding) contributes exactly 0; a batch
    whose every row is ignored returns zeros without running the backend."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(5, 16, generator=g), torch.randn(64, 16, generator=g)
    y = torch.randint(0, 64, (5,), generator=g)
    params = LCEParams(inv_t=1.0, vocab_size=64, vocab_start=64, shard_valid=0, backend=get_backend(backend),
                       logit_sums=True)
    st = get_backend(backend).forward(h, w, y, None, params, keep_cache=False)
    assert torch.all(st.lsum == 0) and torch.all(st.lsq == 0) and torch.all(st.s == 0)
    out = areal_lce.linear_logprobs_entropy(h, w, torch.full_like(y, -100), backend=backend, return_logit_sums=True)
    assert torch.all(out.sum_logit == 0) and torch.all(out.sumsq_logit == 0)


def test_sums_without_compaction_zero_ignored_rows():
    h, w, y, t = make_inputs(case_by_id("ignore"))  # 30% ignored rows
    a = areal_lce.linear_logprobs_entropy(h, w, y, backend="torch", return_logit_sums=True)
    b = areal_lce.linear_logprobs_entropy(h, w, y, backend="torch", return_logit_sums=True, compact_ignored=False)
    assert torch.allclose(a.sum_logit, b.sum_logit, rtol=1e-6, atol=1e-5)
    assert torch.all(b.sumsq_logit[y == -100] == 0)
