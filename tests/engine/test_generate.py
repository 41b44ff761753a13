"""Generation through megatron-core's KV cache (static inference context) vs the full-recompute route.

- `cached_attention` (the core attention's decode / per-sequence-mask path) against an fp64 softmax;
- TP=1 in process: greedy and seeded sampling give the same tokens on both routes (fp32), with prompts
  of different lengths and sequences stopping at EOS, for both core attentions (SDPA; megatron's
  DotProductAttention, an independent implementation of the same contract) and both LM-head seams;
- TP=2 (sequence parallel off and on) and PP=2 in the shared 2-rank launch (tests/helpers/megatron_worker.py);
- the grpo_tiny job gives identical metrics with engine.kv_cache true and false;
- on CUDA (marked `gpu`, at the end): decode steps replayed from CUDA graphs against eager and recompute.
"""
from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

from helpers import megatron_worker as W  # noqa: E402
from helpers.engines import tiny_engine  # noqa: E402
from helpers.megatron_worker import results as worker_results  # noqa: E402
from helpers.paths import REPO  # noqa: E402

from areal_lce.engine.generation import decode as D  # noqa: E402
from areal_lce.engine.generation import generate as G  # noqa: E402
from areal_lce.engine.config import EngineConfig, LCEConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402
from areal_lce.engine.model.kv_attention import cached_attention  # noqa: E402

# 1 to 11 tokens: the longest prompt sets the cache's prompt width, the others are left-padded
PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 10, 11], [17, 3, 1], [400], [21, 22, 23, 24, 25, 26], [7, 7, 7, 7]]


def _engine(attention: str = "sdpa", seam: str = "auto", max_seq_len: int = 64) -> MegatronEngine:
    return tiny_engine(W.VOCAB, model=dict(max_seq_len=max_seq_len, attention=attention), optim=dict(lr=0.0),
                       capture_seam=seam,
                       pack_sequences=attention == "sdpa")  # megatron's attention takes no packed rows


def _both(e: MegatronEngine, prompts, n: int, **kw):
    out = {}
    for kv in (True, False):
        e.cfg.kv_cache = kv
        out[kv] = e.generate(prompts, n, generator=torch.Generator().manual_seed(3), **kw)
    return out


@pytest.fixture
def decode_batches(monkeypatch):
    """Batch size of every KV-cache forward (prefill first), to see the cache route ran and shrank."""
    seen = []
    real = D.CachedSteps._forward

    def spy(self, ids, mask):
        seen.append(ids.shape[0])
        return real(self, ids, mask)

    monkeypatch.setattr(D.CachedSteps, "_forward", spy)
    return seen


# ------------------------------------------------------------------------------------ core attention


def _reference(q, k, v, mask, scale):
    """fp64 softmax attention; query i = position sk - sq + i; mask True = hidden."""
    sq, b, h, d = q.shape
    sk, g = k.shape[0], k.shape[2]
    k, v = (t.double().repeat_interleave(h // g, dim=2) for t in (k, v))
    s = torch.einsum("qbhd,kbhd->bhqk", q.double(), k) * scale
    hide = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not()[None, None]
    if mask is not None:
        hide = hide | mask
    hide = hide & ~hide.all(-1, keepdim=True)  # a query with every key hidden sees them all (finite)
    s = s.masked_fill(hide, -math.inf)
    return torch.einsum("bhqk,kbhd->qbhd", s.softmax(-1), v).reshape(sq, b, h * d)


@pytest.mark.parametrize("sq,sk,heads,groups", [
    pytest.param(1, 9, 4, 2, id="decode-gqa"),
    pytest.param(1, 1, 4, 4, id="decode-first-slot"),
    pytest.param(3, 9, 6, 2, id="chunk-after-prefix"),  # causal offset sk - sq
    pytest.param(7, 7, 4, 1, id="prefill-mqa"),
])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
def test_cached_attention_matches_fp64_reference(sq, sk, heads, groups, masked):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    b, d = 3, 8
    q = torch.randn(sq, b, heads, d, generator=g)
    k, v = (torch.randn(sk, b, groups, d, generator=g) for _ in range(2))
    mask = None
    if masked:  # left padding of 0, 2 and sk - 1 slots; the last row's early queries see nothing
        pad = torch.tensor([0, 2, sk - 1])
        mask = (torch.arange(sk)[None, :] < pad[:, None])[:, None, None, :].expand(b, 1, sq, sk)
    out = cached_attention(q, k, v, mask, d ** -0.5)
    ref = _reference(q, k, v, mask, d ** -0.5)
    assert out.shape == (sq, b, heads * d) and torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= 1e-5, (out.double() - ref).abs().max()


def test_cached_attention_mask_reuse_follows_the_mask():
    """The SDPA-form mask is reused across the layers of one forward (same mask object) and rebuilt for
    a new object or after an in-place change."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=g)
    k, v = torch.randn(5, 2, 2, 8, generator=g), torch.randn(5, 2, 2, 8, generator=g)
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    full = cached_attention(q, k, v, mask, 0.3)
    mask[1, ..., :3] = True  # in place: row 1 now hides its first three keys
    hidden = cached_attention(q, k, v, mask, 0.3)
    assert torch.equal(hidden[:, 0], full[:, 0]) and not torch.allclose(hidden[:, 1], full[:, 1])
    assert torch.allclose(hidden, cached_attention(q, k, v, mask.clone(), 0.3))
    assert (hidden.double() - _reference(q, k, v, mask, 0.3)).abs().max() <= 1e-5


def test_cached_attention_refuses_more_queries_than_keys():
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="must not exceed the key length"):
        cached_attention(q, torch.zeros(3, 1, 2, 8), torch.zeros(3, 1, 2, 8), None, 1.0)


# ------------------------------------------------------------------------------------ TP=1 engine


@pytest.mark.parametrize("attention,seam", [
    pytest.param("sdpa", "auto", id="sdpa-output_processor"),
    pytest.param("sdpa", "output_layer", id="sdpa-legacy_seam"),
    pytest.param("megatron", "auto", id="megatron_attention"),
])
@pytest.mark.slow
def test_kv_cache_matches_recompute(attention, seam, decode_batches):
    e = _engine(attention, seam)
    e.model.train()  # generate switches to eval and back
    greedy = _both(e, PROMPTS, 12, temperature=0.0)
    assert greedy[True] == greedy[False] and all(len(x) == 12 for x in greedy[True])
    assert decode_batches == [len(PROMPTS)] * 12  # prefill + 11 decode steps, nobody stopped
    sampled = _both(e, PROMPTS, 12, temperature=1.0, top_p=0.9)
    assert sampled[True] == sampled[False] and sampled[True] != greedy[True]
    # EOS: the first prompt's 2nd sampled token; that sequence stops there, the batch shrinks
    decode_batches.clear()
    eos = sampled[True][0][1]
    stopped = _both(e, PROMPTS, 12, temperature=1.0, top_p=0.9, eos_id=eos)
    lengths = [len(x) for x in stopped[True]]
    assert stopped[True] == stopped[False] and lengths[0] <= 2 and max(lengths) == 12
    live = [sum(n > t for n in lengths) for t in range(12)]  # sequences still generating at step t
    assert live[-1] < len(PROMPTS) and decode_batches == [D.decode_batch(k, len(PROMPTS)) for k in live]
    assert decode_batches[-1] < len(PROMPTS)  # the decode batch shrank
    assert e.model.training


def test_equal_prompts_prefill_without_padding_mask(monkeypatch):
    masks = []
    real = D.CachedSteps._forward

    def spy(self, ids, mask):
        masks.append(None if mask is None else tuple(mask.shape))
        return real(self, ids, mask)

    monkeypatch.setattr(D.CachedSteps, "_forward", spy)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5, 5]]
    out = _both(_engine(), prompts, 5, temperature=1.0)
    assert out[True] == out[False]
    # causal prefill [1, 1, 4, 4] (no padding rows), then fixed-shape decode steps: one key mask per row
    # over the 4 + 5 slots (the last one the staging slot)
    assert masks == [(1, 1, 4, 4)] + [(3, 1, 1, 9)] * 4


def test_decode_batch_sizes():
    assert [D.decode_batch(k, 5) for k in range(1, 6)] == [1, 2, 4, 4, 5]
    assert [D.decode_batch(k, 64) for k in (64, 33, 32, 17, 9, 3, 1)] == [64, 64, 32, 32, 16, 4, 1]
    assert D.decode_batch(1, 1) == 1


def test_kv_cache_rows_finishing_inside_a_decode_batch(decode_batches):
    """Eight prompts, greedy, an EOS that stops sequences at different steps: rows in the middle of the
    decode batch finish while it keeps its size (the live rows' logits are picked out of it), batch
    sizes follow `decode_batch`, same tokens as recompute (the shrinking batch: the test above)."""
    e = _engine()
    prompts = [[3 + i, 40 + 2 * i, 7] for i in range(8)]
    free = _both(e, prompts, 10, temperature=0.0)[False]

    def stops(eos):  # greedy: each sequence runs as without EOS up to its first eos
        return {x.index(eos) + 1 if eos in x else len(x) for x in free}

    eos = max({t for x in free for t in x[:8]}, key=lambda t: len(stops(t)))
    decode_batches.clear()
    out = _both(e, prompts, 10, temperature=0.0, eos_id=eos)
    lengths = sorted({len(x) for x in out[True]})
    assert out[True] == out[False] and len(lengths) >= 3, (eos, out[True])
    assert decode_batches == [D.decode_batch(sum(len(x) > t for x in out[True]), 8) for t in range(max(lengths))]


def test_decode_cuda_graphs_option():
    assert EngineConfig().decode_cuda_graphs is True
    assert "CUDA graph" in EngineConfig.__dataclass_fields__["decode_cuda_graphs"].metadata["help"]


def test_max_seq_len_stops_both_routes_alike():
    # the 11-token prompt reaches max_seq_len=16 after 5 new tokens; generation stops for all there
    out = _both(_engine(max_seq_len=16), PROMPTS, 12, temperature=0.0)
    assert out[True] == out[False] and [len(x) for x in out[True]] == [5] * len(PROMPTS)


def test_unsupported_core_attention_falls_back_with_a_warning(monkeypatch, decode_batches):
    e = _engine()
    ref = _both(e, PROMPTS, 4, temperature=1.0)[False]
    decode_batches.clear()
    monkeypatch.setattr(G, "CACHE_ATTENTIONS", ("DotProductAttention",))
    e.cfg.kv_cache = True
    with pytest.warns(RuntimeWarning, match="full recompute"):
        assert e.generate(PROMPTS, 4, generator=torch.Generator().manual_seed(3)) == ref
    assert decode_batches == []


# Each refused before anything runs, the error naming the argument. Before: float ids and
# max_new_tokens=True went through. (The temperature: tests/op/test_temperature.py, with every other
# entry point of the one rule.)
@pytest.mark.parametrize("change,match", [
    pytest.param(dict(top_p=float("nan")), "top_p", id="top_p-nan"),
    pytest.param(dict(top_p=0.0), "top_p", id="top_p-zero"),
    pytest.param(dict(max_new_tokens=True), "max_new_tokens", id="max_new_tokens-bool"),
    pytest.param(dict(max_new_tokens=4.0), "max_new_tokens", id="max_new_tokens-float"),
    pytest.param(dict(max_new_tokens=-1), "max_new_tokens", id="max_new_tokens-negative"),
    pytest.param(dict(prompts=[[1, 2], [3.0, 4.0]]), r"prompts\[1\] holds 3.0", id="float-ids"),
    pytest.param(dict(prompts=[[1, True]]), r"prompts\[0\] holds True", id="bool-id"),
    pytest.param(dict(prompts=[[1, 2], []]), r"prompts\[1\]", id="empty-prompt"),
    pytest.param(dict(prompts=[]), "prompts", id="no-prompts"),
    pytest.param(dict(prompts=torch.ones(2, 3, dtype=torch.long)), "prompts", id="tensor-prompts"),
])
def test_check_request_refuses(change, match):
    request = dict(prompts=[[1, 2, 3]], max_new_tokens=4, temperature=1.0, top_p=1.0) | change
    with pytest.raises(ValueError, match=match):
        G.check_request(**request)


def test_generate_refuses_prompts_the_model_cannot_take():
    e = _engine(max_seq_len=16)
    # before: one prompt at max_seq_len silently emptied every sequence's generation
    with pytest.raises(ValueError, match=r"prompts\[1\] has 16 tokens.*engine.model.max_seq_len=16"):
        e.generate([[1, 2, 3], list(range(1, 17))], 4, temperature=0.0)
    with pytest.raises(ValueError, match=rf"prompts\[0\] holds token id {W.VOCAB}.*\[0, {W.VOCAB}\)"):
        e.generate([[1, W.VOCAB]], 4, temperature=0.0)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds token id -1"):
        e.generate([[-1, 2]], 4, temperature=0.0)
    out = e.generate([[1, 2, 3], list(range(1, 16))], 4, temperature=0.0)  # 15 tokens: room for one
    assert [len(x) for x in out] == [1, 1]


# generate(return_logprobs=True): the same tokens as without, and each token's logprob as the trainer
# computes it (token_stats on prompt + response at the sampling temperature). fp32 on CPU: the two differ
# by the rounding of the trunk's forwards in other shapes (the KV cache's steps vs one full forward);
# a token scored at the wrong position or temperature is off by O(1).
@pytest.mark.parametrize("kv", [True, False], ids=["kv_cache", "recompute"])
def test_generate_returns_the_trainers_logprobs(kv):
    e = _engine()
    e.cfg.kv_cache = kv
    plain = e.generate(PROMPTS, 6, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(4))
    out = e.generate(PROMPTS, 6, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(4),
                     return_logprobs=True)
    assert isinstance(out, G.Generation) and out.tokens == plain
    assert [len(x) for x in out.logprobs] == [len(x) for x in out.tokens]
    width = max(len(p) + len(r) for p, r in zip(PROMPTS, out.tokens))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, (p, r) in enumerate(zip(PROMPTS, out.tokens)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(r)
    trained = e.token_stats(ids, labels, temperature=0.7, grad=False).logprobs
    for i, (p, lp) in enumerate(zip(PROMPTS, out.logprobs)):
        ref = trained[i, len(p) - 1:len(p) - 1 + len(lp)]
        assert torch.allclose(torch.tensor(lp), ref, rtol=0, atol=1e-4), (i, lp, ref.tolist())
    greedy = e.generate(PROMPTS, 3, temperature=0.0, return_logprobs=True)
    assert all(x == 0.0 for lp in greedy.logprobs for x in lp)  # greedy picks with probability 1


def test_sampling_follows_the_heads_logits_precision():
    """logits_precision="bf16": the sampler draws from the logits rounded to bf16, as the head computes
    them; "fp32" (and None, the op's default) from the fp32 logits as they are."""
    from areal_lce.engine.generation.sampling import sampling_logits

    logits = torch.tensor([[1.0 + 2 ** -12, 3.0, -0.3]])
    assert torch.equal(sampling_logits(logits, None), logits) and torch.equal(sampling_logits(logits, "fp32"), logits)
    assert torch.equal(sampling_logits(logits, "bf16"), logits.bfloat16().float())
    assert not torch.equal(logits.bfloat16().float(), logits)


def test_kv_cache_option():
    assert EngineConfig().kv_cache is True
    assert "KV cache" in EngineConfig.__dataclass_fields__["kv_cache"].metadata["help"]


# ------------------------------------------------------------------------------------ 2 ranks, RL job


@pytest.mark.distributed
def test_kv_cache_tp2_sp_and_pp2():
    """TP=2 without and with sequence parallelism, PP=2: same tokens as recompute on every rank,
    finished sequences dropped, SP restored after generating (statistics unchanged)."""
    r = worker_results()["kv-cache"]
    assert "error" not in r, r.get("error")
    for k, v in r.items():
        want = 0.0 if k.endswith(("differs", "differ", "stats_changed")) else 1.0
        assert v == want, (k, v)
    assert len(r) == 3 * (2 * 4 + 2)


@pytest.mark.slow
def test_grpo_tiny_same_metrics_with_and_without_kv_cache(tmp_path, decode_batches):
    from areal_lce.train import rl
    from areal_lce.train.config import load_config

    records, forwards = {}, []
    for kv in (True, False):
        overrides = [f"trainer.output_dir={tmp_path / str(kv)}", "trainer.progress=false", "trainer.steps=3",
                     "trainer.save_interval=0", "trainer.save_final=false", f"engine.kv_cache={str(kv).lower()}"]
        cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", overrides)
        assert cfg.engine.kv_cache is kv
        records[kv] = rl.run(cfg)["records"]
        forwards.append(len(decode_batches))
    assert forwards[0] >= 3 and forwards[1] == forwards[0]  # the cache ran with kv_cache=true only
    machine = {"gen_time_s", "step_time_s", "peak_mem_gib"}  # wall clock and process RSS
    # the rollout's logprobs come from the cache's hidden states or the recomputed ones: equal to rounding
    machine |= {"train_rollout_logprob_abs_diff_max", "train_rollout_logprob_abs_diff_mean",
                "importance_ratio_abs_dev_max"}
    assert [r["step"] for r in records[True]] == [1, 2, 3]
    for a, b in zip(records[True], records[False]):
        assert {k: v for k, v in a.items() if k not in machine} == {k: v for k, v in b.items() if k not in machine}


@pytest.mark.slow
def test_rollout_benchmark_smoke(tmp_path, monkeypatch):
    """benchmark/engine/bench_rollout.py on the tiny preset (the GPU run uses the same code path)."""
    import json

    from benchmark.engine import bench_rollout

    argv = ["--preset", "tiny", "--new-tokens", "6", "--recompute-tokens", "2", "--eager-tokens", "3", "--prompt-len", "9",
            "--prompt-spread",
            "5", "--prompts", "2", "--group", "2", "--micro-batch", "2", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["bench_rollout", *argv])
    bench_rollout.main()
    (path,) = tmp_path.glob("rollout_tiny_tp1.json")
    r = json.loads(path.read_text())["results"]
    assert r["kv_cache"]["new_tokens"] == 6 and r["recompute_at_end"]["new_tokens"] == 2
    assert r["kv_cache_eager_steps"]["new_tokens"] == 3
    assert r["recompute_tokens_same_as_kv_fraction"] == 1.0  # fp32 on CPU: the routes agree
    assert set(r["step_phases_s"]) == {"behaviour_logprobs", "reference_logprobs", "update"}


# --------------------------------------------------------------------------------------------------
# CUDA (marked `gpu`: skipped without a CUDA device)
# KV-cache decoding on CUDA, replayed from CUDA graphs.
#
# A tiny fp32 engine (megatron-core, SDPA core attention) generates from eight prompts of 1-11 tokens
# (left-padded in the cache) three ways: the cache with graph-replayed decode steps (the default), the
# cache with the same steps run eagerly (`engine.decode_cuda_graphs: false`) and full recompute
# (`engine.kv_cache: false`). Greedy and seeded sampling, once without EOS and once with an EOS that
# stops sequences at different steps (the decode batch shrinks; one graph per batch size): identical
# tokens on the three routes, the graphs were captured and replayed, and the fp32 logits of a graphed
# step equal the eager step's bitwise (same kernels, same inputs).
#
# Run: `python -m pytest -q -m gpu tests/engine/test_generate.py` (megatron-core importable), or through
# `python -m benchmark.op.gpu_check`.

GRAPH_PROMPTS = PROMPTS + [[300, 2], [9, 9, 9, 9, 9, 9, 9, 9], [123]]  # eight: a decode batch of 8


@pytest.fixture(scope="module")
def cuda_engine():
    pytest.importorskip("megatron.core")
    return tiny_engine(500, model=dict(dtype="fp32", attention="sdpa"), optim=dict(lr=0.0), lce=LCEConfig(),
                       pack_sequences=True)


def _generate(e, route: str, n: int, **kw):
    e.cfg.kv_cache, e.cfg.decode_cuda_graphs = {"graphs": (True, True), "eager": (True, False),
                                                "recompute": (False, True)}[route]
    return e.generate(GRAPH_PROMPTS, n, generator=torch.Generator().manual_seed(5), **kw)


@pytest.mark.gpu
def test_graphed_decode_matches_eager_and_recompute(cuda_engine, monkeypatch, record_property):
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: (replays.append(1), real(g))[1])
    res, bad = {}, []
    for temp in (0.0, 1.0):
        free = _generate(cuda_engine, "recompute", 16, temperature=temp)
        eos = free[0][3]  # the first prompt stops at its 4th token, the others where they meet it
        for eos_id in (None, eos):
            out = {r: _generate(cuda_engine, r, 16, temperature=temp, eos_id=eos_id) for r in ("graphs", "eager", "recompute")}
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


@pytest.mark.gpu
def test_graph_replay_logits_equal_eager_step(cuda_engine):
    """One decode step at batch 8: the graph's logits equal the eager step's bitwise, and after the
    replay the cache holds what the eager step wrote (same slot, same values)."""
    from areal_lce.engine.generation import decode as D

    gm = cuda_engine.generation_model()
    cuda_engine.model.eval()
    with torch.no_grad(), D.CachedSteps(gm, GRAPH_PROMPTS, 8, cuda_graphs=True) as step:
        step(list(range(len(GRAPH_PROMPTS))), [[] for _ in GRAPH_PROMPTS])  # prefill
        step.ids.copy_(torch.arange(len(GRAPH_PROMPTS), device="cuda").view(-1, 1) + 30)
        t0 = step.t.clone()
        caches = [tuple(b.clone() for b in kv) for kv in step.ctx.key_value_memory_dict.values()]
        eager = step._step(len(GRAPH_PROMPTS)).logits.clone()
        eager_caches = [tuple(b.clone() for b in kv) for kv in step.ctx.key_value_memory_dict.values()]
        # back to the state before the eager step, then capture + replay the same step
        step.t.copy_(t0)
        for kv, saved in zip(step.ctx.key_value_memory_dict.values(), caches):
            for b, s in zip(kv, saved):
                b.copy_(s)
        step.graphs[len(GRAPH_PROMPTS)] = None  # warmed up: the next _decode captures
        graphed = step._decode(len(GRAPH_PROMPTS)).logits.clone()
        torch.testing.assert_close(graphed, eager, rtol=1e-6, atol=1e-6)
        assert int(step.t) == int(t0) + 1
        for kv, want in zip(step.ctx.key_value_memory_dict.values(), eager_caches):
            for b, w in zip(kv, want):
                torch.testing.assert_close(b, w, rtol=1e-6, atol=1e-6)
    cuda_engine.model.train()
