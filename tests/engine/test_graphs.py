"""CPU side of the engine's CUDA graphs (graphs.py): when they apply, the bookkeeping of keys, the
fallback when a capture fails, and the host-read-free paths the capture relies on (attention's captured
plan, RoPE's per-token angles); and, marked `gpu` (at the end), the graphs themselves on CUDA against
the eager engine."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from areal_lce.engine import graphs as G  # noqa: E402
from areal_lce.engine.model.attention import captured_plan  # noqa: E402
from areal_lce.engine.batch import prepare  # noqa: E402
from areal_lce.engine.config import EngineConfig, LCEConfig  # noqa: E402
from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from areal_lce.engine.model.rope import thd_rows  # noqa: E402
from areal_lce.train.rl_losses import PolicyMicroBatch  # noqa: E402

CUDA = torch.device("cuda", 0)
OK = dict(device=CUDA, dtype=torch.bfloat16, tp=1, pp=1, cp=1, packed=True, te=False,
          config=types.SimpleNamespace(attention_dropout=0.0, hidden_dropout=0.0, num_moe_experts=None,
                                       mtp_num_layers=None))


@pytest.mark.parametrize("change, reason", [
    ({}, ""),
    ({"device": torch.device("cpu")}, "CUDA graphs need CUDA"),
    ({"dtype": torch.float32}, "bf16 / fp16"),
    ({"tp": 2}, "tensor/pipeline/context parallel = 2/1/1"),
    ({"cp": 2}, "tensor/pipeline/context parallel = 1/1/2"),
    ({"packed": False}, "pack_sequences"),
    ({"te": True}, "Transformer Engine"),
    ({"config": types.SimpleNamespace(attention_dropout=0.1)}, "dropout"),
    ({"config": types.SimpleNamespace(mtp_num_layers=1)}, "MTP"),
], ids=["usable", "cpu", "fp32", "tp", "cp", "unpacked", "te", "dropout", "mtp"])
def test_why_not_graphed(change, reason):
    why = G.why_not_graphed(**{**OK, **change})
    assert (why == "") if not reason else (reason in why), why


def test_config_options():
    assert EngineConfig().model_cuda_graphs == "auto" and EngineConfig().cuda_graph_token_multiple == 512
    for ok in (True, False, "auto"):
        assert EngineConfig(model_cuda_graphs=ok).model_cuda_graphs == ok
    with pytest.raises(ValueError, match="model_cuda_graphs"):
        EngineConfig(model_cuda_graphs="on")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cuda_graph_token_multiple"):
            EngineConfig(cuda_graph_token_multiple=bad)


def test_cpu_engine_has_no_graphs():
    from helpers.engines import tiny_engine

    e = tiny_engine(100, model=dict(dtype="fp32", max_seq_len=32), lce=LCEConfig())
    assert e.graphs is None


def test_microbatch_to_keeps_type_and_values():
    ids = torch.randint(0, 50, (2, 6))
    mb = PolicyMicroBatch(ids, ids.clone(), 0.7, old_logprobs=torch.randn(2, 6), advantages=torch.randn(2),
                          num_tokens=9)
    moved = mb.to("cpu")
    assert type(moved) is PolicyMicroBatch and moved.temperature == 0.7 and moved.num_tokens == 9
    for f in ("input_ids", "labels", "old_logprobs", "advantages"):
        assert torch.equal(getattr(moved, f), getattr(mb, f))
    assert moved.ref_logprobs is None


def _packed(lengths, multiple=16):
    ids = torch.randint(0, 50, (len(lengths), 12))
    labels = torch.full_like(ids, -100)
    for r, n in enumerate(lengths):
        labels[r, : n - 1] = ids[r, 1:n]
    return prepare(ids, labels, device=torch.device("cpu"), max_seq_len=32, pack=True, seq_multiple=multiple)


def test_graph_keys_eager_first_then_capture_and_failure(monkeypatch):
    """First sighting of a key runs eagerly, the second captures; a capture that fails raises naming the
    option that turns graphs off; keys beyond MAX_GRAPHS drop the least recently used."""
    calls = []
    graphs = G.ModelCallGraphs(lambda mb, t: calls.append(mb) or torch.zeros(1, mb.input_ids.shape[1], 4),
                               [torch.nn.Parameter(torch.zeros(2))], torch.device("cpu"))

    class NoCapture:
        def __init__(self):
            raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", NoCapture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    a, b = _packed([5, 7]), _packed([9, 3])  # same packed length (16) and sequence count: one key
    graphs(a, 1.0, grad=False)
    assert calls == [a] and list(graphs.entries.values()) == [G._SEEN]
    with pytest.raises(RuntimeError, match=r"packed length 16 \(3 sequences.*capture refused.*"
                                           r"engine.model_cuda_graphs: false"):
        graphs(b, 1.0, grad=False)
    assert calls == [a] and graphs.replays == 0
    graphs(a, 0.5, grad=False)  # another temperature: another key, eager at first sight
    assert len(graphs.entries) == 2 and len(calls) == 2
    monkeypatch.setattr(G, "MAX_GRAPHS", 2)
    graphs(_packed([5, 7], multiple=32), 1.0, grad=False)
    assert len(graphs.entries) == 2 and (16, 4, 1.0, False, None) not in graphs.entries
    assert (32, 4, 1.0, False, None) in graphs.entries and (16, 4, 0.5, False, None) in graphs.entries


def test_static_batch_carries_the_bound_layout():
    """A key's static batch: its layout is the static cu tensor with the bound on the host (max_seqlen =
    the packed length T, what the captured plan and the per-token RoPE table need), one layout value that
    the rows, the batch and its PackedSeqParams share; loading another batch refills the tensor."""
    from areal_lce.megatron.packing import PackedLayout

    a, b = _packed([5, 7]), _packed([9, 3])  # one key: 16 tokens in 3 sequences (two kept rows, then padding)
    entry = G._Entry(a)
    layout = entry.mb.layout
    assert layout is entry.mb.packed.layout and layout.cu_seqlens is entry.cu and entry.cu is not a.layout.cu_seqlens
    assert (layout.max_seqlen, layout.total, len(layout.lengths)) == (16, 16, 3)
    psp = entry.mb.packed_seq_params
    assert psp.cu_seqlens_q is psp.cu_seqlens_kv is entry.cu and psp.cu_seqlens_q_padded is None
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 16 and entry.cu.tolist() == a.layout.cu_seqlens.tolist()
    entry.load(b)
    assert entry.cu.tolist() == b.layout.cu_seqlens.tolist() == [0, 8, 10, 16]
    assert PackedLayout.of(psp).lengths == (8, 2, 6)  # written since: the tensor is read again


def test_captured_plan_reads_nothing_on_host_and_refuses_what_it_cannot_take():
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    psp = types.SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
                                cu_seqlens_kv_padded=None, max_seqlen_q=16, max_seqlen_kv=16)
    with pytest.raises(ValueError, match="one CP rank"):
        captured_plan(psp, 16, cp_size=2)
    with pytest.raises(ValueError, match="1-D int32 CUDA tensor"):
        captured_plan(psp, 16, cp_size=1)  # a host tensor: a graph would freeze its values


def test_thd_rows_per_token_angles_read_no_cu_seqlens():
    class Unreadable:
        def __getattr__(self, name):
            raise AssertionError(f"cu_seqlens was read ({name})")

        def __array__(self, *a, **k):
            raise AssertionError("cu_seqlens was read")

    assert thd_rows(Unreadable(), 24, 1, 0, 24, torch.device("cpu")) is None
    with pytest.raises((AssertionError, RuntimeError)):  # a table (fewer rows than tokens) reads them
        thd_rows(Unreadable(), 8, 1, 0, 24, torch.device("cpu"))


# --------------------------------------------------------------------------------------------------
# CUDA (marked `gpu`: skipped without a CUDA device)
# The engine's packed model calls replayed from CUDA graphs (marked `gpu`: skipped without CUDA).
#
# Two bf16 engines built alike (same seed, so the same weights), one with `engine.model_cuda_graphs: true`
# and one without; packed rows padded to a multiple of 64 tokens, so micro-batches of three
# rows of different lengths share one graphed shape (128 tokens, four sequences with the padding one)
# while their layouts differ. What must hold:
#   graphs_train      four train_step calls of two micro-batches, each a different layout, of two shapes
#                     (128 and 64 tokens; steps 2-4 mix them): each shape replays from its second
#                     micro-batch on, and the graphed engine's per-step loss, grad norm and
#                     every parameter's finalised gradient equal the eager engine's (lr 0, so the weights
#                     stay equal; the loss to 1e-6, gradients within flash-attention's non-deterministic
#                     backward: rel-L2 <= 1e-2 per parameter). A graph that kept the captured layout would
#                     miss by O(1): the layouts put sequence boundaries at different tokens.
#   graphs_logprobs   token_stats(grad=False) of four layouts of the same shape: replayed from the second
#                     on, equal to the eager engine's statistics.
# Untied (Qwen2-shaped) and tied (Llama-shaped) tiny presets. The padded rows leave about a third of each
# micro-batch without a target, so `engine.lce.compact_ignored: auto` compacts them (the op's partition
# runs inside the graphs); `false` keeps the rows in place (the Triton kernels skip ignored blocks).
#
# Run: `python -m pytest -q -m gpu tests/engine/test_graphs.py`, or through `python -m benchmark.op.gpu_check`.

LAYOUTS = ([40, 25, 30], [12, 40, 33], [38, 38, 20], [5, 40, 40])  # kept tokens per row: 82-93, padded to 128
SHORT = ([10, 20, 15], [20, 8, 19], [15, 15, 15])  # 42-44 tokens, padded to 64: a second graphed shape
# per step, the two micro-batches: one shape, then the two shapes mixed (two graphs share one memory pool)
STEPS = ((LAYOUTS[0], LAYOUTS[1]), (LAYOUTS[2], SHORT[0]), (SHORT[1], LAYOUTS[3]), (SHORT[2], LAYOUTS[0]))


def _engines(preset: str, compact="auto"):
    pytest.importorskip("megatron.core")
    from helpers.engines import tiny_engine

    out = {}
    for graphs in (True, False):
        out[graphs] = tiny_engine(500, model=dict(preset=preset, dtype="bf16", attention="sdpa"),
                                  optim=dict(lr=0.0, clip_grad=0.0), pack_sequences=True, seed=7,
                                  model_cuda_graphs=graphs, cuda_graph_token_multiple=64,
                                  lce=LCEConfig(compact_ignored=compact))
    assert out[True].graphs is not None and out[False].graphs is None
    return out


def _batch(lengths, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (len(lengths), 40), generator=g)
    labels = torch.full_like(ids, -100)
    for r, n in enumerate(lengths):
        labels[r, : n - 1] = ids[r, 1:n]
    return MicroBatch(ids, labels)


def _loss(stats, mb):
    mask = mb.labels != -100
    assert mask.is_cuda  # train_step hands loss_fn the micro-batch on the device
    lp = (stats.logprobs * mask).sum() / mask.sum()
    return -lp, {"entropy": ((stats.entropy * mask).sum() / mask.sum()).detach()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


COMPACT = [pytest.param("auto", id="compact"), pytest.param(False, id="in_place")]


def _check_choice(eng, mb, compact) -> None:
    assert eng._prepare(mb.input_ids, mb.labels).compact_ignored is (True if compact == "auto" else False)


@pytest.mark.gpu
@pytest.mark.parametrize("preset, compact", [("tiny", "auto"), ("tiny-llama", "auto"), ("tiny", False)],
                         ids=["tiny", "tiny-llama", "tiny-in_place"])
def test_graphs_train(preset, compact, record_property):
    eng = _engines(preset, compact)
    res, worst = [], 0.0
    for step, layouts in enumerate(STEPS):
        mbs = [_batch(lengths, 100 * step + i) for i, lengths in enumerate(layouts)]
        _check_choice(eng[True], mbs[0], compact)
        out = {g: e.train_step(mbs, _loss) for g, e in eng.items()}
        grads = {g: e.grads() for g, e in eng.items()}
        rels = {n: _rel(grads[True][n], grads[False][n]) for n in grads[False]}
        worst = max(worst, max(rels.values()))
        res.append({"loss": (out[True]["loss"], out[False]["loss"]), "grad_norm": (out[True]["grad_norm"],
                    out[False]["grad_norm"]), "worst_grad_rel": max(rels.values())})
        assert abs(out[True]["loss"] - out[False]["loss"]) <= 1e-6 * abs(out[False]["loss"]), res
        assert abs(out[True]["grad_norm"] - out[False]["grad_norm"]) <= 1e-2 * out[False]["grad_norm"], res
        assert max(rels.values()) <= 1e-2, (step, sorted(rels.items(), key=lambda kv: -kv[1])[:3])
    record_property("result", {"steps": res, "replays": eng[True].graphs.replays, "worst_grad_rel": worst})
    # each shape's first micro-batch runs eagerly: 128 tokens at step 1, 64 tokens at step 2
    assert eng[True].graphs.replays == 6, eng[True].graphs.replays


@pytest.mark.gpu
@pytest.mark.parametrize("compact", COMPACT)
def test_graphs_logprobs(compact, record_property):
    eng = _engines("tiny", compact)
    worst = 0.0
    for i, lengths in enumerate(LAYOUTS):
        mb = _batch(lengths, 7 + i)
        _check_choice(eng[True], mb, compact)
        st = {g: e.token_stats(mb.input_ids, mb.labels) for g, e in eng.items()}
        for a, b in zip(st[True], st[False]):
            worst = max(worst, float((a - b).abs().max()))
    record_property("result", {"replays": eng[True].graphs.replays, "max_abs_diff": worst})
    assert eng[True].graphs.replays == 3
    assert worst <= 1e-5, worst
