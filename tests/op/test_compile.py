"""torch.compile: the op is a torch.library custom op pair (library.py), so a model calling
`linear_logprobs_entropy` compiles with fullgraph=True, forward and backward, and gives exactly what
eager gives.

CPU CI compiles with the "aot_eager" backend: Dynamo (no graph break, the op one node of one graph)
and AOTAutograd (the fake implementation, the registered autograd formula, the backward op) without
Inductor's C++ build. The CUDA cases at the end (marked `gpu`) compile with Inductor and the Triton
backend, capture CUDA graphs and run with no host sync.
"""
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import areal_lce
from areal_lce.op.library import encode, lce_backward_op, lce_forward_op

from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank TP group)
from helpers.inputs import PER_TOKEN

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
    "tensor_temperature": {"temperature": PER_TOKEN},
    "cache": {"cache_bytes": 1 << 30},  # a budget that holds the logits (auto keeps none at this H)
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
    temperature = temp if kw.pop("temperature", None) == PER_TOKEN else 0.8
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


@pytest.mark.slow
def test_opcheck_forward_and_backward_ops(fake_group):  # noqa: F811
    """torch.library.opcheck: schema, fake implementation against the real one, autograd registration,
    AOT dispatch (static and dynamic shapes); the backward op's main_grad mutation; under sequence
    parallelism (the recording 2-rank group, by name) the fake shapes of a [N/2, H] hidden."""
    hidden, weight, _, labels, temp = _inputs(n=9, v=65)
    h = hidden.requires_grad_()
    w = weight.requires_grad_()

    def forward_args(hh, y, t, sel, **options):  # t: the per-token 1/T tensor or None
        return (hh, w, y, t, sel, None, "none", encode(**options), True)

    for inv_t, cache_bytes, compact, inv in ((None, 0, True, False), (1.0 / temp, 1 << 20, True, False),
                                             (None, 0, False, False), (None, 0, True, True)):
        opts = dict(inv_t=1 / 0.7 if inv_t is None else None, ignore_index=IGNORE, vocab_size=65, vocab_start=0,
                    shard_valid=65, cache_bytes=cache_bytes, backend="torch", compact_ignored=compact,
                    check_labels="off", invariant=inv, logits_precision="fp32")
        for sums in (False, True):  # logit_sums: stats [5, N]
            torch.library.opcheck(lce_forward_op, forward_args(h, labels, inv_t, None, **opts, logit_sums=sums))
    # selected ids, top-k and softcap: more outputs of the same op
    sel = torch.randint(0, 65, (9, 3), generator=torch.Generator().manual_seed(3))
    extra = dict(opts, invariant=True, compact_ignored=True)
    torch.library.opcheck(lce_forward_op, forward_args(h, labels, None, sel, **extra, logit_sums=False, top_k=4,
                                                       softcap=5.0))
    # sequence parallelism: this rank's [4, H] rows of a labels' [8] sequence, gathered inside the op
    sp = dict(opts, group_name=fake_group.group_name, tp_size=2, d_hidden="reduce_scatter", logit_sums=False)
    torch.library.opcheck(lce_forward_op, forward_args(hidden[:4].detach().requires_grad_(), labels[:8], None, None,
                                                       **sp))
    options = encode(**opts, logit_sums=False)
    diff, dstats, stats, _, _, topk_ids, h_c, lse_ent, cache = lce_forward_op(h, w, labels, None, None, None, "none",
                                                                              options, False)
    bargs = [torch.randn(2, 9), torch.randn(1, 9), None, None, hidden.detach(), weight.detach(), labels, None, None,
             topk_ids, lse_ent, cache, None, options, True, True]
    torch.library.opcheck(lce_backward_op, tuple(bargs), test_utils=("test_schema", "test_faketensor"))
    # main_grad: the fp32 d_weight added into the mutated argument, an empty d_weight returned
    bargs[12], bargs[13] = torch.zeros(65, 16), encode(**opts, logit_sums=False, d_weight_fp32=True)
    torch.library.opcheck(lce_backward_op, tuple(bargs), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("d_hidden", ["all_reduce", "reduce_scatter", "caller"])
def test_tensor_parallel_call_compiles_in_one_graph(fake_group, d_hidden):  # noqa: F811
    """The process group travels by name in the op's options: a TP call is one node of one graph too, its
    collectives inside the op (issued on the group passed); results equal eager (the recording group's
    collectives are identities, so both sides run the same kernels on the same values)."""
    n, v = 12, 10
    hidden, weight, proj, _, _ = _inputs(n=n, v=v)
    labels = torch.randint(0, 2 * v, (n,), generator=torch.Generator().manual_seed(1))
    labels[[2, 9]] = IGNORE
    if d_hidden == "reduce_scatter":  # this rank's sequence shard; labels cover the full sequence
        hidden = hidden[: n // 2]
    vp = areal_lce.VocabParallel(fake_group, d_hidden)
    f = _model(backend="torch", vocab_parallel=vp)
    eager = _step(f, hidden, weight, proj, labels, 0.9)
    calls = len(fake_group.calls)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = _step(torch.compile(f, fullgraph=True, backend=counter), hidden, weight, proj, labels, 0.9)
    assert counter.frame_count == 1 and "areal_lce.lce_forward" in "\n".join(gm.code for gm in counter.graphs)
    assert [c["kind"] for c in fake_group.calls[calls:]] == [c["kind"] for c in fake_group.calls[:calls]]
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


@pytest.mark.distributed
def test_tp2_gloo_compiles_fullgraph_equal_to_eager(tmp_path):
    """2 gloo ranks: a TP=2 call, a sequence-parallel call and the main_grad front end compile with
    fullgraph=True into one graph (the op one node, the group by name, its collectives inside), and every
    output and gradient (main_grad, its flag and placeholder) equals eager bitwise, on both ranks."""
    from pathlib import Path

    from helpers.launch import torchrun

    out = tmp_path / "compile_tp.json"
    res = torchrun(Path(__file__).with_name("compile_tp_worker.py"), out, result=out, timeout=300)
    assert not res["mismatches"], res["mismatches"]
    for per_rank in res["graphs"]:
        assert set(per_rank) == {"tp2", "sp", "tp2_main_grad"}, per_rank
        assert all(g == {"frames": 1, "op_in_graph": True} for g in per_rank.values()), per_rank


# --------------------------------------------------------------------------------------------------
# CUDA (marked `gpu`: skipped without a CUDA device)
# The public op's default options on CUDA under the ways models run it.
# Triton backend, bf16, N = 1000 (not a multiple of the 128-row blocks), a padded vocabulary, per-token
# temperatures, right padding and scattered ignored rows:
#
#   sync_debug          a default forward+backward (also cache_bytes="auto", compact_ignored=True,
#                       return_logit_sums=True and a no-grad forward) runs under
#                       torch.cuda.set_sync_debug_mode("error") after one warm-up call, with results bitwise
#                       equal to the warm-up's; a bad label passes silently there, gets a NaN logprob, and
#                       `areal_lce.check_deferred()` afterwards raises naming it.
#   cuda_graph          forward+backward captured once with torch.cuda.graph and replayed on new hidden,
#                       weight, labels (a different ignore pattern) and temperatures: equal to eager.
#   compile             torch.compile(fullgraph=True) (Inductor) of a loss over the op: no graph break; the
#                       op's outputs within 1e-4 of eager, the loss within 1e-5, the gradients within 1e-3.
#   compile_cudagraphs  the same with mode="reduce-overhead" (CUDA graphs through Inductor), no cudagraph skip.
#
# Run: `python -m pytest -q -m gpu tests/op/backends/test_backends.py tests/op/test_compile.py`, or
# `python -m benchmark.op.gpu_check` for the same with a JSON summary.

N, H, V, VOCAB = 1000, 512, 32000, 31900  # N not a multiple of the 128-row blocks; padded vocab


def _cuda_inputs(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * (4.0 / H ** 0.5)).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (N,), generator=g)
    y[700 + 50 * seed:] = -100  # right padding, a different length per seed
    y[torch.randint(0, 700, (40,), generator=g)] = -100  # and scattered ignored rows
    temp = 0.5 + torch.rand(N, generator=g)
    g_out = torch.randn(2, N, generator=g)
    return [t.cuda() for t in (h, w, y, temp, g_out)]


def _cuda_step(h, w, y, temp, g_out, **kw):
    """Default public op call + backward of sum(g_lp·logp + g_ent·entropy): (outputs..., dh, dw)."""
    from areal_lce import linear_logprobs_entropy

    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    o = linear_logprobs_entropy(hh, ww, y, temperature=temp, vocab_size=VOCAB, return_stats=True, **kw)
    loss = (o.logprobs * g_out[0]).sum() + (o.entropy * g_out[1]).sum()
    dh, dw = torch.autograd.grad(loss, (hh, ww))
    sums = [t for t in (o.sum_logit, o.sumsq_logit) if t is not None]  # with return_logit_sums=True
    return [o.logprobs, o.entropy, o.max_logit, o.min_logit, o.lse, *sums, dh, dw]


def _same(a_list, b_list):
    return all(torch.equal(a, b) for a, b in zip(a_list, b_list))


@pytest.mark.gpu
def test_no_host_sync_under_sync_debug_mode(record_property):
    import areal_lce

    h, w, y, temp, g_out = _cuda_inputs(0)
    variants = {"defaults": {}, "cache": {"cache_bytes": 1 << 30}, "compact": {"compact_ignored": True},
                "logit_sums": {"return_logit_sums": True}}
    warm = {k: _cuda_step(h, w, y, temp, g_out, **kw) for k, kw in variants.items()}
    with torch.no_grad():
        warm_nograd = areal_lce.linear_logprobs_entropy(h, w, y, temperature=temp, vocab_size=VOCAB).logprobs
    bad_y = y.clone()
    bad_y[3] = VOCAB + 5
    _cuda_step(h, w, bad_y, temp, g_out)  # warm the bad-label path too
    try:
        areal_lce.check_deferred()  # drain the warm-up's record
    except ValueError:
        pass
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = {k: _cuda_step(h, w, y, temp, g_out, **kw) for k, kw in variants.items()}
        with torch.no_grad():
            nograd = areal_lce.linear_logprobs_entropy(h, w, y, temperature=temp, vocab_size=VOCAB).logprobs
        bad = _cuda_step(h, w, bad_y, temp, g_out)
    except RuntimeError as e:  # what sync-debug mode raises on a synchronizing call
        pytest.fail(f"a host sync under set_sync_debug_mode('error'): {type(e).__name__}: {e}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    res = {"equal_to_warmup": {k: _same(warm[k], again[k]) for k in variants}}
    res["equal_to_warmup"]["no_grad"] = torch.equal(warm_nograd, nograd)
    res["bad_label_nan"] = bool(torch.isnan(bad[0][3])) and bool(torch.isfinite(bad[0][4:700]).all())
    try:
        areal_lce.check_deferred()
        res["deferred_error"] = None
    except ValueError as e:
        res["deferred_error"] = str(e)
    record_property("result", res)
    assert all(res["equal_to_warmup"].values()), res
    assert res["bad_label_nan"], res
    assert res["deferred_error"] and f"largest: {VOCAB + 5}" in res["deferred_error"], res


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(record_property):
    statics = _cuda_inputs(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            _cuda_step(*statics)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _cuda_step(*statics)
    replays = []
    for seed in (1, 2, 0):
        for dst, src in zip(statics, _cuda_inputs(seed)):
            dst.copy_(src)
        graph.replay()
        eager = _cuda_step(*statics)
        torch.cuda.synchronize()
        diff = max(((a.float() - b.float()).abs().max().item() if a.numel() else 0.0) for a, b in zip(captured, eager))
        n_valid = int((statics[2] != -100).sum())
        replays.append({"seed": seed, "n_valid": n_valid, "bitwise": _same(captured, eager), "max_abs_diff": diff})
    record_property("result", {"replays": replays})
    assert all(r["bitwise"] or r["max_abs_diff"] <= 1e-5 for r in replays), replays


@pytest.mark.gpu
@pytest.mark.distributed
def test_tp2_nccl_cuda_graph_replay_matches_eager(tmp_path, record_property):
    """TP=2 on NCCL, one GPU per rank: forward + backward (its collectives included) captured once with
    torch.cuda.graph, for d_hidden "all_reduce" and "reduce_scatter", and replayed on new inputs: every
    replay bitwise equal to an eager call on the same values, on both ranks."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from pathlib import Path

    from helpers.launch import torchrun

    out = tmp_path / "cuda_graph_tp.json"
    res = torchrun(Path(__file__).with_name("cuda_graph_tp_worker.py"), out, result=out, timeout=300)
    record_property("result", res)
    assert len(res["replays"]) == 12, res
    assert all(r["bitwise"] and r["finite"] for r in res["replays"]), res


def _loss_model(h, w, y, temp):
    from areal_lce import linear_logprobs_entropy

    o = linear_logprobs_entropy(h, w, y, temperature=temp, vocab_size=VOCAB, return_stats=True)
    mask = (y != -100).float()
    loss = -(o.logprobs * mask).sum() / mask.sum() - 0.01 * (o.entropy * mask).sum()
    return loss, o.logprobs, o.entropy, o.lse


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compile", "compile_cudagraphs"])
def test_compile_fullgraph_matches_eager(mode, record_property):
    from torch._dynamo.utils import counters

    h, w, y, temp, _ = _cuda_inputs(0)
    torch._dynamo.reset()
    compiled = torch.compile(_loss_model, fullgraph=True, mode=mode)
    counters.clear()

    def run(fn):
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss, lp, ent, lse = fn(hh, ww, y, temp)
        loss.backward()
        return [t.detach().clone() for t in (loss, lp, ent, lse, hh.grad, ww.grad)]

    got = None
    for _ in range(3):  # compile, then (reduce-overhead) record and replay
        got = run(compiled)
    eager = run(_loss_model)
    res = {"op_outputs_bitwise": _same(got[1:4], eager[1:4]),
           "op_outputs_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(got[1:4], eager[1:4])),
           "loss_rel": ((got[0] - eager[0]).abs() / eager[0].abs()).item(),
           "dh_rel": ((got[4].float() - eager[4].float()).norm() / eager[4].float().norm()).item(),
           "dw_rel": ((got[5].float() - eager[5].float()).norm() / eager[5].float().norm()).item(),
           "graph_breaks": sum(counters["graph_break"].values()),
           "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}
    record_property("result", res)
    # Inductor fuses and reorders the fp32 arithmetic around the opaque custom op (temperature, the stats'
    # finishing math, the loss), so compiled and eager agree to fp32 rounding, not bit for bit; the bf16
    # gradients then to bf16 rounding of those inputs (their floor against fp64 is ~2e-3, the CUDA cases of tests/op/backends/test_backends.py).
    assert res["graph_breaks"] == 0, res
    assert mode is None or res["cudagraph_skips"] == 0, res
    assert res["op_outputs_max_abs_diff"] <= 1e-4 and res["loss_rel"] <= 1e-5, res
    assert max(res["dh_rel"], res["dw_rel"]) <= 1e-3, res


@pytest.mark.gpu
def test_megatron_grad_norm_fallback_replaced_by_a_device_norm(record_property):
    """Without Apex / Transformer Engine, megatron-core's gradient clipping takes its L2 norm from a local
    fallback that reads each tensor's norm on the host; compat.use_device_grad_norm swaps in a device-side
    norm (the engine does so when it builds megatron's optimizer): same value, no host sync."""
    pytest.importorskip("megatron.core")
    from megatron.core import utils

    from areal_lce.megatron import compat

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", generator=g) * s for n, s in ((3, 1.0), (1000, 1e-3), (28672, 5.0))]
    ref, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [tensors], False)
    got, _ = compat._l2_norm_on_device(2048 * 32, None, [tensors], False)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again, _ = compat._l2_norm_on_device(2048 * 32, None, [tensors], False)
    except RuntimeError as e:
        pytest.fail(f"a host sync in the device-side grad norm: {e}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    res = {"ref": float(ref), "got": float(again), "rel": abs(float(again) - float(ref)) / float(ref)}
    record_property("result", res)
    assert res["rel"] < 1e-6 and torch.equal(got, again), res
