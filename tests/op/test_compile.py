"""torch.compile: the op is a torch.library custom op pair (library.py), so a model calling
`linear_logprobs_entropy` compiles with fullgraph=True, forward and backward, and gives exactly what
eager gives.

CPU CI compiles with the "aot_eager" backend: Dynamo (no graph break, the op one node of one graph)
and AOTAutograd (the fake implementation, the registered autograd formula, the backward op) without
Inductor's C++ build. `tests/op/test_gpu_capture.py` compiles with Inductor on CUDA with the Triton backend.
"""
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import areal_lce
from areal_lce.library import encode, lce_backward_op, lce_forward_op

from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank TP group)

IGNORE = -100


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(n=23, h=16, v=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.4
    proj = torch.randn(h, h, generator=g) * 0.3
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[i for i in (0, 5, 6, 19) if i < n]] = IGNORE
    temp = torch.rand(n, generator=g) + 0.5
    return hidden, weight, proj, labels, temp


def _model(**op_kw):
    """A small 'model': a projection, the LM-head op, a masked loss that uses every output."""

    def f(hidden, weight, proj, labels, temperature):
        out = areal_lce.linear_logprobs_entropy(torch.tanh(hidden @ proj), weight, labels, temperature=temperature,
                                                return_stats=True, **op_kw)
        mask = (labels != IGNORE).float()
        loss = -(out.logprobs * mask).sum() / mask.sum() - 0.01 * (out.entropy * mask).sum()
        stats = [out.lse, out.max_logit] + [t for t in (out.sum_logit, out.sumsq_logit) if t is not None]
        return loss, torch.stack(stats)
    return f


def _step(fn, hidden, weight, proj, labels, temperature):
    h, w, p = (t.clone().requires_grad_() for t in (hidden, weight, proj))
    loss, stats = fn(h, w, p, labels, temperature)
    loss.backward()
    return [loss.detach(), stats, h.grad, w.grad, p.grad]


OPTIONS = {
    "defaults": {},
    "tensor_temperature": {"temperature": "tensor"},
    "cache_auto": {"cache_bytes": "auto"},
    "deferred_check": {"check_labels": "deferred"},
    "no_compact_no_check": {"compact_ignored": False, "check_labels": False},
    "reference_backend": {"backend": "reference"},
    "logit_sums": {"return_logit_sums": True},
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fullgraph_compile_equals_eager(name):
    kw = dict(OPTIONS[name])
    kw.setdefault("backend", "torch")
    hidden, weight, proj, labels, temp = _inputs()
    temperature = temp if kw.pop("temperature", None) == "tensor" else 0.8
    f = _model(**kw)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    eager = _step(f, hidden, weight, proj, labels, temperature)
    got = _step(compiled, hidden, weight, proj, labels, temperature)
    assert counter.frame_count == 1, "one graph: no graph break"
    code = "\n".join(gm.code for gm in counter.graphs)
    assert "areal_lce.lce_forward" in code, "the op is one node of the graph"
    for a, b in zip(got, eager):
        assert torch.equal(a, b), (a - b).abs().max()
    # a second call with new values reuses the graph
    hidden2 = hidden + 0.1
    assert all(torch.equal(a, b) for a, b in zip(_step(compiled, hidden2, weight, proj, labels, temperature),
                                                 _step(f, hidden2, weight, proj, labels, temperature)))
    assert counter.frame_count == 1


def test_compiled_sync_check_still_raises_with_the_value():
    """The CPU default checks label values at the call; inside the compiled graph too (the check runs in
    the op's real implementation, which the graph calls)."""
    hidden, weight, proj, labels, _ = _inputs()
    labels = labels.clone()
    labels[3] = 257
    compiled = torch.compile(_model(backend="torch"), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=r"vocab_size=257\) and not ignore_index=-100 \(first: 257\)"):
        compiled(hidden, weight, proj, labels, 1.0)


def test_opcheck_forward_and_backward_ops():
    """torch.library.opcheck: schema, fake implementation against the real one, autograd registration,
    AOT dispatch (static and dynamic shapes)."""
    hidden, weight, _, labels, temp = _inputs(n=9, v=65)
    h = hidden.requires_grad_()
    w = weight.requires_grad_()
    for inv_t, cache_bytes, compact, inv in ((None, 0, True, False), (1.0 / temp, 1 << 20, True, False),
                                             (None, 0, False, False), (None, 0, True, True)):
        opts = dict(inv_t=1 / 0.7 if inv_t is None else None, ignore_index=IGNORE, vocab_size=65, vocab_start=0,
                    shard_valid=65, cache_bytes=cache_bytes, backend="torch", compact_ignored=compact,
                    check_labels="off", invariant=inv, logits_precision="fp32")
        for sums in (False, True):  # logit_sums: stats [5, N]
            torch.library.opcheck(lce_forward_op, (h, w, labels, inv_t, None, encode(**opts, logit_sums=sums), True))
    # selected ids, top-k and softcap: more outputs of the same op
    sel = torch.randint(0, 65, (9, 3), generator=torch.Generator().manual_seed(3))
    extra = dict(opts, invariant=True, compact_ignored=True)
    torch.library.opcheck(lce_forward_op, (h, w, labels, None, sel, encode(**extra, logit_sums=False, top_k=4,
                                                                            softcap=5.0), True))
    options = encode(**opts, logit_sums=False)
    diff, dstats, stats, _, _, topk_ids, h_c, lse_ent, cache = lce_forward_op(h, w, labels, None, None, options, False)
    bargs = (torch.randn(2, 9), torch.randn(1, 9), None, None, hidden.detach(), weight.detach(), labels, None, None,
             topk_ids, lse_ent, cache, options, True, True)
    torch.library.opcheck(lce_backward_op, bargs, test_utils=("test_schema", "test_faketensor"))


def test_tensor_parallel_call_compiles_with_a_graph_break(fake_group):  # noqa: F811
    """A process group is not an operator argument: TP calls run the autograd.Function, which
    torch.compile leaves to eager (one graph break); results stay equal to eager."""
    hidden, weight, proj, labels, _ = _inputs(n=12, v=10)
    labels = torch.randint(0, 20, (12,), generator=torch.Generator().manual_seed(1))
    labels[[2, 9]] = IGNORE
    f = _model(backend="torch", vocab_parallel=areal_lce.VocabParallel(fake_group))
    eager = _step(f, hidden, weight, proj, labels, 0.9)
    got = _step(torch.compile(f, backend="aot_eager"), hidden, weight, proj, labels, 0.9)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
