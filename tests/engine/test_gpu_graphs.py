"""The engine's packed model calls replayed from CUDA graphs (marked `gpu`: skipped without CUDA).

Two bf16 engines built alike (same seed, so the same weights), one with `engine.model_cuda_graphs: true`
and one without; packed rows padded to a multiple of 64 tokens, so micro-batches of three
rows of different lengths share one graphed shape (128 tokens, four sequences with the padding one)
while their layouts differ. What must hold:
  graphs_train      four train_step calls of two micro-batches, each a different layout, of two shapes
                    (128 and 64 tokens; steps 2-4 mix them): each shape replays from its second
                    micro-batch on, and the graphed engine's per-step loss, grad norm and
                    every parameter's finalised gradient equal the eager engine's (lr 0, so the weights
                    stay equal; the loss to 1e-6, gradients within flash-attention's non-deterministic
                    backward: rel-L2 <= 1e-2 per parameter). A graph that kept the captured layout would
                    miss by O(1): the layouts put sequence boundaries at different tokens.
  graphs_logprobs   token_stats(grad=False) of four layouts of the same shape: replayed from the second
                    on, equal to the eager engine's statistics.
Untied (Qwen2-shaped) and tied (Llama-shaped) tiny presets. The padded rows leave about a third of each
micro-batch without a target, so `engine.lce.compact_ignored: auto` compacts them (the op's partition
runs inside the graphs); `false` keeps the rows in place (the Triton kernels skip ignored blocks).

Run: `python -m pytest -q -m gpu tests/engine/test_gpu_graphs.py`, or through `python -m benchmark.gpu_check`.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYOUTS = ([40, 25, 30], [12, 40, 33], [38, 38, 20], [5, 40, 40])  # kept tokens per row: 82-93, padded to 128
SHORT = ([10, 20, 15], [20, 8, 19], [15, 15, 15])  # 42-44 tokens, padded to 64: a second graphed shape
# per step, the two micro-batches: one shape, then the two shapes mixed (two graphs share one memory pool)
STEPS = ((LAYOUTS[0], LAYOUTS[1]), (LAYOUTS[2], SHORT[0]), (SHORT[1], LAYOUTS[3]), (SHORT[2], LAYOUTS[0]))


def _engines(preset: str, compact="auto"):
    pytest.importorskip("megatron.core")
    from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig, OptimConfig
    from areal_lce.engine.engine import MegatronEngine

    out = {}
    for graphs in (True, False):
        cfg = EngineConfig(model=ModelConfig(preset=preset, dtype="bf16", max_seq_len=64, attention="sdpa"),
                           optim=OptimConfig(lr=0.0, clip_grad=0.0), pack_sequences=True, seed=7,
                           model_cuda_graphs=graphs, cuda_graph_token_multiple=64, lce=LCEConfig(compact_ignored=compact))
        out[graphs] = MegatronEngine(cfg, vocab_size=500)
    assert out[True].graphs is not None and out[False].graphs is None
    return out


def _batch(lengths, seed: int):
    from areal_lce.engine import MicroBatch

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
