"""The public op's default options on CUDA under the ways models run it (marked `gpu`: skipped without CUDA).
Triton backend, bf16, N = 1000 (not a multiple of the 128-row blocks), a padded vocabulary, per-token
temperatures, right padding and scattered ignored rows:

  sync_debug          a default forward+backward (also cache_bytes="auto", compact_ignored=True,
                      return_logit_sums=True and a no-grad forward) runs under
                      torch.cuda.set_sync_debug_mode("error") after one warm-up call, with results bitwise
                      equal to the warm-up's; a bad label passes silently there, gets a NaN logprob, and
                      `areal_lce.check_deferred()` afterwards raises naming it.
  cuda_graph          forward+backward captured once with torch.cuda.graph and replayed on new hidden,
                      weight, labels (a different ignore pattern) and temperatures: equal to eager.
  compile             torch.compile(fullgraph=True) (Inductor) of a loss over the op: no graph break; the
                      op's outputs within 1e-4 of eager, the loss within 1e-5, the gradients within 1e-3.
  compile_cudagraphs  the same with mode="reduce-overhead" (CUDA graphs through Inductor), no cudagraph skip.

Run with tests/op/test_gpu.py: `python -m pytest -q -m gpu tests/op/test_gpu.py tests/op/test_gpu_capture.py`,
or `python -m benchmark.gpu_check` for the same with a JSON summary.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

N, H, V, VOCAB = 1000, 512, 32000, 31900  # N not a multiple of the 128-row blocks; padded vocab


def _inputs(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * (4.0 / H ** 0.5)).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (N,), generator=g)
    y[700 + 50 * seed:] = -100  # right padding, a different length per seed
    y[torch.randint(0, 700, (40,), generator=g)] = -100  # and scattered ignored rows
    temp = 0.5 + torch.rand(N, generator=g)
    g_out = torch.randn(2, N, generator=g)
    return [t.cuda() for t in (h, w, y, temp, g_out)]


def _step(h, w, y, temp, g_out, **kw):
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


def test_no_host_sync_under_sync_debug_mode(record_property):
    import areal_lce

    h, w, y, temp, g_out = _inputs(0)
    variants = {"defaults": {}, "cache_auto": {"cache_bytes": "auto"}, "compact": {"compact_ignored": True},
                "logit_sums": {"return_logit_sums": True}}
    warm = {k: _step(h, w, y, temp, g_out, **kw) for k, kw in variants.items()}
    with torch.no_grad():
        warm_nograd = areal_lce.linear_logprobs_entropy(h, w, y, temperature=temp, vocab_size=VOCAB).logprobs
    bad_y = y.clone()
    bad_y[3] = VOCAB + 5
    _step(h, w, bad_y, temp, g_out)  # warm the bad-label path too
    try:
        areal_lce.check_deferred()  # drain the warm-up's record
    except ValueError:
        pass
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = {k: _step(h, w, y, temp, g_out, **kw) for k, kw in variants.items()}
        with torch.no_grad():
            nograd = areal_lce.linear_logprobs_entropy(h, w, y, temperature=temp, vocab_size=VOCAB).logprobs
        bad = _step(h, w, bad_y, temp, g_out)
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


def test_cuda_graph_replay_matches_eager(record_property):
    statics = _inputs(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            _step(*statics)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(*statics)
    replays = []
    for seed in (1, 2, 0):
        for dst, src in zip(statics, _inputs(seed)):
            dst.copy_(src)
        graph.replay()
        eager = _step(*statics)
        torch.cuda.synchronize()
        diff = max(((a.float() - b.float()).abs().max().item() if a.numel() else 0.0) for a, b in zip(captured, eager))
        n_valid = int((statics[2] != -100).sum())
        replays.append({"seed": seed, "n_valid": n_valid, "bitwise": _same(captured, eager), "max_abs_diff": diff})
    record_property("result", {"replays": replays})
    assert all(r["bitwise"] or r["max_abs_diff"] <= 1e-5 for r in replays), replays


def _loss_model(h, w, y, temp):
    from areal_lce import linear_logprobs_entropy

    o = linear_logprobs_entropy(h, w, y, temperature=temp, vocab_size=VOCAB, return_stats=True)
    mask = (y != -100).float()
    loss = -(o.logprobs * mask).sum() / mask.sum() - 0.01 * (o.entropy * mask).sum()
    return loss, o.logprobs, o.entropy, o.lse


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compile", "compile_cudagraphs"])
def test_compile_fullgraph_matches_eager(mode, record_property):
    from torch._dynamo.utils import counters

    h, w, y, temp, _ = _inputs(0)
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
    # gradients then to bf16 rounding of those inputs (their floor against fp64 is ~2e-3, test_gpu.py).
    assert res["graph_breaks"] == 0, res
    assert mode is None or res["cudagraph_skips"] == 0, res
    assert res["op_outputs_max_abs_diff"] <= 1e-4 and res["loss_rel"] <= 1e-5, res
    assert max(res["dh_rel"], res["dw_rel"]) <= 1e-3, res


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
