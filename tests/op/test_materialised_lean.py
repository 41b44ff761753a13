"""The lean materialised route (areal_lce/op/materialised_lean.py): values and every gradient against float64
within the fp32 rounding bounds of tests/helpers/bounds.py, bf16 logits in (gradient out in bf16), vocab-
parallel logits over two in-process ranks, ignored rows and padding columns (exact 0 gradient), per-token
temperature, and the memory claim: no fp32 tensor of the [N, V] logits' size is ever created.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import areal_lce.op.materialised_lean as lean
from areal_lce.op.materialised import logprobs_entropy_from_logits
from benchmark.op.materialised_autograd import logprobs_entropy_autograd
from areal_lce.op.types import VocabParallel
from helpers.bounds import EXP_ULPS, U32, assert_within, op_bounds
from helpers.inputs import PER_TOKEN, Case, peak_logits

IGNORE = -100


SIZE = dict(n=24, h=16, v=203)  # v: columns of the logits (odd: no power-of-two blocks)
CASES = [
    Case("plain", "one block, T = 1", **SIZE, vocab_size=203),
    Case("blocks_t08", "several row blocks (the last one short), scalar T", **SIZE, vocab_size=203,
         temperature=0.8, block_rows=5),
    Case("pad_token_t", "padding columns >= vocab_size, labels at the last true id, per-token T", **SIZE,
         vocab_size=150, temperature=PER_TOKEN, block_rows=7),
]


def _case_inputs(c: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(c.n, c.h, generator=g)
    w = torch.randn(c.v, c.h, generator=g) * 0.5
    peak_logits(w, h, rows=[0, 1, 2], cols=[3, c.vocab_size - 1, 100], scale=1.5)  # p ~ 1: entropy ~ 0
    y = torch.randint(0, c.vocab_size, (c.n,), generator=g)
    y[0], y[1], y[4] = 3, c.vocab_size - 1, c.vocab_size - 1
    y[[5, 11]] = IGNORE
    t = torch.rand(c.n, generator=g) + 0.5 if c.temperature == PER_TOKEN else c.temperature
    return h, w, y, t


def _inv_t(t):
    return 1.0 / t if torch.is_tensor(t) else 1.0 / t


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_values_and_gradients_within_fp32_bounds(c, monkeypatch):
    """logits = h·Wᵀ by an fp32 GEMM, then the route: logprob, entropy against float64 within bounds.py's fp32
    bounds, and d_hidden, d_weight (through the GEMM, i.e. d_logits) too; max/min exactly the logits'."""
    if c.block_rows:
        monkeypatch.setattr(lean, "CHUNK_ELEMENTS", c.block_rows * c.vocab_size)
    h, w, y, t = _case_inputs(c)
    h.requires_grad_(), w.requires_grad_()
    g = torch.Generator().manual_seed(7)
    g_lp, g_ent = torch.randn(c.n, generator=g), torch.randn(c.n, generator=g)
    logits = h @ w.t()
    out = logprobs_entropy_from_logits(logits, y, temperature=t, vocab_size=c.vocab_size)
    ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()

    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = (hd @ wd[:c.vocab_size].t()) * (_inv_t(t).double()[:, None] if torch.is_tensor(t) else _inv_t(t))
    logp = torch.log_softmax(z, -1)
    live = y != IGNORE
    lp = torch.where(live, logp.gather(1, y.clamp_min(0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(live, -(logp.exp() * logp).sum(-1), 0.0)
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()

    b = op_bounds(h, w, y, _inv_t(t), g_lp, g_ent, vocab_size=c.vocab_size)
    assert_within("logprobs", out.logprobs, lp, b.logprobs)
    assert_within("entropy", out.entropy, ent, b.entropy)
    assert_within("lse", out.lse, torch.where(live, torch.logsumexp(z, -1), 0.0), b.logprobs)  # lp's bound holds lse's
    assert_within("d_hidden", h.grad, hd.grad, b.d_hidden)
    assert_within("d_weight", w.grad, wd.grad, b.d_weight)
    raw = logits.detach()[:, :c.vocab_size]
    assert torch.equal(out.max_logit, torch.where(live, raw.amax(-1), 0.0))
    assert torch.equal(out.min_logit, torch.where(live, raw.amin(-1), 0.0))


def _identity_bounds(x, y, inv_t, g_lp, g_ent, vocab_size):
    """bounds.py's bounds for logits given as values: hidden = the logits, weight = the identity (its GEMM
    bound only loosens the logits' error); d_hidden is then the bound of d_logits."""
    v = x.shape[1]
    return op_bounds(x.detach().double(), torch.eye(v, dtype=torch.float64), y, inv_t, g_lp, g_ent,
                     vocab_size=vocab_size)


def _oracle(x, y, inv_t, vocab_size, g_lp, g_ent, g_lse=None):
    """float64 logprob, entropy, lse and d_logits of the logits' own values."""
    xd = x.detach().double().requires_grad_()
    z = xd[:, :vocab_size] * (inv_t.double()[:, None] if torch.is_tensor(inv_t) else inv_t)
    logp = torch.log_softmax(z, -1)
    live = y != IGNORE
    lp = torch.where(live, logp.gather(1, y.clamp_min(0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(live, -(logp.exp() * logp).sum(-1), 0.0)
    lse = torch.where(live, torch.logsumexp(z, -1), 0.0)
    loss = (lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()
    if g_lse is not None:
        loss = loss + (lse * g_lse.double()).sum()
    loss.backward()
    return lp, ent, lse, xd.grad


def test_bf16_logits_in_bf16_gradient_out():
    """bf16 logits from a bf16 GEMM: values against float64 of those logits; d_logits comes back in bf16,
    within the fp32 bound plus one bf16 rounding; fp32 logits under logits_precision="bf16" give the same
    values bit for bit and the gradient whose bf16 rounding is the bf16 route's."""
    c = CASES[2]
    h, w, y, t = _case_inputs(c, seed=3)
    x = (h.bfloat16() @ w.bfloat16().t()).requires_grad_()
    g = torch.Generator().manual_seed(8)
    g_lp, g_ent = torch.randn(c.n, generator=g), torch.randn(c.n, generator=g)
    out = logprobs_entropy_from_logits(x, y, temperature=t, vocab_size=c.vocab_size)
    ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    lp, ent, lse, dx = _oracle(x, y, _inv_t(t), c.vocab_size, g_lp, g_ent)
    b = _identity_bounds(x, y, _inv_t(t), g_lp, g_ent, c.vocab_size)
    assert_within("logprobs", out.logprobs, lp, b.logprobs)
    assert_within("entropy", out.entropy, ent, b.entropy)
    bf16_u = 2.0 ** -8  # the bf16 rounding of d_logits, relative
    assert_within("d_logits", x.grad, dx, b.d_hidden * (1 + bf16_u) + bf16_u * dx.abs())

    x32 = x.detach().float().requires_grad_()
    out32 = logprobs_entropy_from_logits(x32, y, temperature=t, vocab_size=c.vocab_size, logits_precision="bf16")
    ((out32.logprobs * g_lp).sum() + (out32.entropy * g_ent).sum()).backward()
    for name in ("logprobs", "entropy", "max_logit", "min_logit", "lse"):
        assert torch.equal(getattr(out32, name), getattr(out, name)), name
    assert torch.equal(x32.grad.bfloat16(), x.grad)


def test_lse_and_logit_sum_gradients():
    """lse is differentiable (d lse / d x_j = p_j / T), sum_logit too (d / d x_j = 1 on the true vocabulary);
    sumsq_logit is not. Poisoned ignored rows (inf logits) still get an exact 0."""
    c = CASES[2]
    h, w, y, t = _case_inputs(c, seed=4)
    x = (h @ w.t()).detach()
    x[5] = float("inf")  # an ignored row: its values must not reach anything
    x.requires_grad_()
    g = torch.Generator().manual_seed(9)
    g_lse, g_sum = torch.randn(c.n, generator=g), torch.randn(c.n, generator=g)
    out = logprobs_entropy_from_logits(x, y, temperature=t, vocab_size=c.vocab_size, return_logit_sums=True)
    assert not out.sumsq_logit.requires_grad
    live = y != IGNORE
    xs = x.detach()[:, :c.vocab_size].double()
    assert torch.allclose(out.sumsq_logit.double(), torch.where(live, (xs * xs).sum(-1), 0.0), rtol=1e-5)
    (out.sum_logit * g_sum).sum().backward()
    want = torch.where(live[:, None], g_sum[:, None], 0.0).expand(-1, c.vocab_size)
    assert torch.equal(x.grad[:, :c.vocab_size], want) and not x.grad[:, c.vocab_size:].any()
    x.grad = None
    out = logprobs_entropy_from_logits(x, y, temperature=t, vocab_size=c.vocab_size)
    (out.lse * g_lse).sum().backward()
    zero = torch.zeros(c.n)
    keep = live.clone()
    xo = torch.where(live[:, None], x.detach(), 0.0)
    lp, ent, lse, dx = _oracle(xo, y, _inv_t(t), c.vocab_size, zero, zero, g_lse)
    b = _identity_bounds(xo, y, _inv_t(t), zero, zero, c.vocab_size)
    assert_within("lse", out.lse[keep], lse[keep], b.logprobs[keep])
    # p_j's relative error: the logit's scaling (u·|z|), lse's error, exp's ulps, the products' roundings
    z = xo[:, :c.vocab_size].double() * _inv_t(t).double()[:, None]
    p = torch.softmax(z, -1)
    bound = (_inv_t(t).double()[:, None] * g_lse.double().abs()[:, None] * p
             * (U32 * (z.abs() + lse.abs()[:, None]) + b.logprobs[:, None] + (EXP_ULPS + 4) * U32))
    assert_within("d_logits (lse)", x.grad[keep, :c.vocab_size], dx[keep, :c.vocab_size], bound[keep])
    assert not x.grad[~live].any() and not x.grad[:, c.vocab_size:].any()


# ------------------------------------------------------------------ TP = 2: two ranks as two threads

class _ThreadGroup:
    """Stands for a 2-rank TP group inside one process: rank = the calling thread's, all_reduce combines the
    two threads' tensors (a barrier on each side), so the vocab-parallel path runs for real."""

    def __init__(self):
        self.local = threading.local()
        self.barrier = threading.Barrier(2)
        self.slots = [None, None]
        self.calls = []


@pytest.fixture
def thread_group(monkeypatch):
    g = _ThreadGroup()

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert group is g
        r = g.local.rank
        g.slots[r] = t.clone()
        if r == 0:
            g.calls.append((op, t.numel()))
        g.barrier.wait()
        a, b = g.slots
        t.copy_(torch.maximum(a, b) if op == dist.ReduceOp.MAX else a + b)
        g.barrier.wait()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: g.local.rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    return g


def test_tp2_matches_unsharded(thread_group, monkeypatch):
    """Two vocab shards (the second holds the padding), per-token T, ignored rows: each rank's outputs within
    the fp32 bounds of the float64 values of the whole vocabulary, its d_logits within the bound of its columns
    of the whole gradient; forward: MAX 2·N then one SUM 5·N (with the logit sums), backward: none."""
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 6 * 102)  # blocks of 6 rows
    c = CASES[2]
    h, w, y, t = _case_inputs(c, seed=5)
    x = h @ w.t()
    x = torch.cat([x, torch.randn(c.n, 1)], 1).detach()  # 204 columns: two shards of 102
    shards = list(x.split(102, 1))
    g = torch.Generator().manual_seed(10)
    g_lp, g_ent = torch.randn(c.n, generator=g), torch.randn(c.n, generator=g)
    res, errors = [None, None], []

    def rank(r):
        try:
            thread_group.local.rank = r
            xr = shards[r].clone().requires_grad_()
            out = logprobs_entropy_from_logits(xr, y, temperature=t, vocab_size=c.vocab_size,
                                               vocab_parallel=VocabParallel(thread_group), return_logit_sums=True)
            ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
            res[r] = (out, xr.grad)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread
            errors.append(e)
            thread_group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    assert thread_group.calls == [(dist.ReduceOp.MAX, 2 * c.n), (dist.ReduceOp.SUM, 5 * c.n)]
    lp, ent, lse, dx = _oracle(x, y, _inv_t(t), c.vocab_size, g_lp, g_ent)
    b = _identity_bounds(x, y, _inv_t(t), g_lp, g_ent, c.vocab_size)
    bound = b.d_hidden  # [N, 204]: 0 in the padding columns, where dx is 0 too
    live = y != IGNORE
    for r, (out, grad) in enumerate(res):
        assert_within(f"rank {r} logprobs", out.logprobs, lp, b.logprobs)
        assert_within(f"rank {r} entropy", out.entropy, ent, b.entropy)
        assert_within(f"rank {r} lse", out.lse, lse, b.logprobs)
        assert torch.equal(out.max_logit, torch.where(live, x[:, :c.vocab_size].amax(-1), 0.0))
        assert torch.equal(out.min_logit, torch.where(live, x[:, :c.vocab_size].amin(-1), 0.0))
        sums = x[:, :c.vocab_size].double().sum(-1)
        assert torch.allclose(out.sum_logit.double(), torch.where(live, sums, 0.0), atol=1e-4)
        cols = slice(102 * r, 102 * (r + 1))
        assert_within(f"rank {r} d_logits", grad, dx[:, cols], bound[:, cols])
    assert not res[1][1][:, c.vocab_size - 102:].any()  # padding columns


# ------------------------------------------------------------------ memory

class _LargestFp32(TorchDispatchMode):
    """Records the element count of the largest fp32 tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_fp32_copy_of_the_logits(monkeypatch):
    """bf16 logits [256, 1000], forward + backward of logprob + entropy with blocks of 16 rows: no fp32 tensor
    larger than one block; the torch-autograd route it replaced builds several of [N, V] (the probe works)."""
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 16 * 1000)
    n, v = 256, 1000
    x = (torch.randn(n, v) * 2).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,))
    y[::7] = IGNORE
    for route, limit in ((logprobs_entropy_from_logits, 16 * 1000), (logprobs_entropy_autograd, None)):
        with _LargestFp32() as probe:
            out = route(x, y, temperature=0.9)
            (out.logprobs.sum() + out.entropy.sum()).backward()
        if limit is None:
            assert probe.largest >= n * v, probe.largest
        else:
            assert probe.largest <= limit, probe.largest
            assert x.grad.dtype == torch.bfloat16
        x.grad = None


def test_second_order_gradient_is_refused():
    """The backward is not differentiable: a gradient taken with create_graph=True equals the plain one, and
    differentiating it again raises (the torch-autograd route gave a second order; none is given silently)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 10, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.tensor([1, 2, -100, 4, 9, 0])
    out = logprobs_entropy_from_logits(x, y)
    first, = torch.autograd.grad((out.logprobs + out.entropy).sum(), x, retain_graph=True)
    second, = torch.autograd.grad((out.logprobs + out.entropy).sum(), x, create_graph=True)
    assert torch.equal(first, second)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad((second ** 2).sum(), x)
