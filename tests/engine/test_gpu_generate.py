"""KV-cache decoding on CUDA, replayed from CUDA graphs (marked `gpu`: skipped without CUDA).

A tiny fp32 engine (megatron-core, SDPA core attention) generates from eight prompts of 1-11 tokens
(left-padded in the cache) three ways: the cache with graph-replayed decode steps (the default), the
cache with the same steps run eagerly (`engine.decode_cuda_graphs: false`) and full recompute
(`engine.kv_cache: false`). Greedy and seeded sampling, once without EOS and once with an EOS that
stops sequences at different steps (the decode batch shrinks; one graph per batch size): identical
tokens on the three routes, the graphs were captured and replayed, and the fp32 logits of a graphed
step equal the eager step's bitwise (same kernels, same inputs).

Run: `python -m pytest -q -m gpu tests/engine/test_gpu_generate.py` (megatron-core importable), or through
`python -m benchmark.gpu_check`.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 10, 11], [17, 3, 1], [400], [21, 22, 23, 24, 25, 26], [7, 7, 7, 7],
           [300, 2], [9, 9, 9, 9, 9, 9, 9, 9], [123]]


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("megatron.core")
    from areal_lce.engine.config import EngineConfig, ModelConfig, OptimConfig
    from areal_lce.engine.engine import MegatronEngine

    cfg = EngineConfig(model=ModelConfig(preset="tiny", dtype="fp32", max_seq_len=64, attention="sdpa"),
                       optim=OptimConfig(lr=0.0), pack_sequences=True)
    return MegatronEngine(cfg, vocab_size=500)


def _generate(e, route: str, n: int, **kw):
    e.cfg.kv_cache, e.cfg.decode_cuda_graphs = {"graphs": (True, True), "eager": (True, False),
                                                "recompute": (False, True)}[route]
    return e.generate(PROMPTS, n, generator=torch.Generator().manual_seed(5), **kw)


def test_graphed_decode_matches_eager_and_recompute(engine, monkeypatch, record_property):
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: (replays.append(1), real(g))[1])
    res, bad = {}, []
    for temp in (0.0, 1.0):
        free = _generate(engine, "recompute", 16, temperature=temp)
        eos = free[0][3]  # the first prompt stops at its 4th token, the others where they meet it
        for eos_id in (None, eos):
            out = {r: _generate(engine, r, 16, temperature=temp, eos_id=eos_id) for r in ("graphs", "eager", "recompute")}
            key = f"t{temp:g}-{'eos' if eos_id is not None else 'full'}"
            res[key] = {"same_tokens": out["graphs"] == out["eager"] == out["recompute"],
                        "lengths": sorted(len(x) for x in out["graphs"])}
            if not res[key]["same_tokens"]:
                bad.append((key, out))
    res["replays"] = len(replays)
    record_property("result", res)
    assert not bad, bad
    assert res["replays"] >= 2 * 14, res  # without EOS: 15 decode steps per call, the first one eager
    assert any(len(set(v["lengths"])) > 1 for k, v in res.items() if k.endswith("eos")), res


def test_graph_replay_logits_equal_eager_step(engine):
    """One decode step at batch 8: the graph's logits equal the eager step's bitwise, and after the
    replay the cache holds what the eager step wrote (same slot, same values)."""
    from areal_lce.engine.generation import decode as D

    gm = engine.generation_model()
    engine.model.eval()
    with torch.no_grad(), D.CachedSteps(gm, PROMPTS, 8, cuda_graphs=True) as step:
        step(list(range(len(PROMPTS))), [[] for _ in PROMPTS])  # prefill
        step.ids.copy_(torch.arange(len(PROMPTS), device="cuda").view(-1, 1) + 30)
        t0 = step.t.clone()
        caches = [tuple(b.clone() for b in kv) for kv in step.ctx.key_value_memory_dict.values()]
        eager = step._step(len(PROMPTS)).logits.clone()
        eager_caches = [tuple(b.clone() for b in kv) for kv in step.ctx.key_value_memory_dict.values()]
        # back to the state before the eager step, then capture + replay the same step
        step.t.copy_(t0)
        for kv, saved in zip(step.ctx.key_value_memory_dict.values(), caches):
            for b, s in zip(kv, saved):
                b.copy_(s)
        step.graphs[len(PROMPTS)] = None  # warmed up: the next _decode captures
        graphed = step._decode(len(PROMPTS)).logits.clone()
        torch.testing.assert_close(graphed, eager, rtol=1e-6, atol=1e-6)
        assert int(step.t) == int(t0) + 1
        for kv, want in zip(step.ctx.key_value_memory_dict.values(), eager_caches):
            for b, w in zip(kv, want):
                torch.testing.assert_close(b, w, rtol=1e-6, atol=1e-6)
    engine.model.train()
