"""engine.lce.compact_ignored: the engine's per-micro-batch choice of the fused op's `compact_ignored`.

RL batches mask their prompts, so most rows the LM head sees have no target; the op cannot count them
without a host sync, but the engine builds its batches on the host and can. Checked here: the policy
(`batch.compact_choice`, its threshold at both sides), that `prepare` records it for packed and padded
batches, that the engine hands it to `linear_logprobs_entropy` on every call (token_stats and
train_step), that it is part of a CUDA graph's key, that it changes no statistic or gradient, and the
config's validation. The speed of either choice: benchmark/op/bench_ignored.py (GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from areal_lce.engine import batch as B  # noqa: E402
from areal_lce.megatron import capture  # noqa: E402
from areal_lce.engine import graphs as G  # noqa: E402
from areal_lce.engine.config import EngineConfig, LCEConfig  # noqa: E402
from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from areal_lce.train.config import JobConfig  # noqa: E402
from areal_lce.train.config_io import load_config  # noqa: E402

CPU = torch.device("cpu")


def _rl_rows(prompt: int, response: int, rows: int = 3, vocab: int = 90, seed: int = 0):
    """Right-padded RL-like rows: labels only on the response tokens (the prompts masked), ragged ends."""
    g = torch.Generator().manual_seed(seed)
    s = prompt + response + 2
    ids = torch.randint(0, vocab, (rows, s), generator=g)
    labels = torch.full_like(ids, -100)
    for r in range(rows):
        end = prompt + response - r  # each row one token shorter
        labels[r, prompt - 1:end - 1] = ids[r, prompt:end]
    return ids, labels


@pytest.mark.parametrize("ignored, positions, expect", [
    (0, 64, None),    # every row has a target (SFT): the backend's in-place skipping
    (3, 64, None),    # just under 1/16 ignored
    (4, 64, True),    # exactly 1/16: compact
    (60, 64, True),   # prompt-masked RL batch
    (64, 64, True),   # nothing to compute at all
    (0, 0, None),     # empty batch
], ids=["none", "under", "at", "rl", "all", "empty"])
def test_auto_threshold(ignored, positions, expect):
    labels = torch.arange(positions)
    labels[:ignored] = -100
    assert B.AUTO_COMPACT_SHARE == 1 / 16
    assert B.compact_choice("auto", labels, positions) is expect


def test_explicit_options_pass_through_without_counting():
    class NoCount:  # an explicit choice never reads the labels (they may live on a device)
        def __ne__(self, other):
            raise AssertionError("labels were counted")

    for option in (True, False, None):
        assert B.compact_choice(option, NoCount(), 8) is option


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_prepare_records_the_choice(pack):
    kw = dict(device=CPU, max_seq_len=256, pack=pack, seq_multiple=4)
    rl_ids, rl_labels = _rl_rows(prompt=20, response=4)
    sft_ids, sft_labels = _rl_rows(prompt=1, response=200)
    assert B.prepare(rl_ids, rl_labels, compact_ignored="auto", **kw).compact_ignored is True
    assert B.prepare(sft_ids, sft_labels, compact_ignored="auto", **kw).compact_ignored is None
    assert B.prepare(rl_ids, rl_labels, compact_ignored=False, **kw).compact_ignored is False
    assert B.prepare(sft_ids, sft_labels, compact_ignored=True, **kw).compact_ignored is True
    assert B.prepare(rl_ids, rl_labels, **kw).compact_ignored is None  # not asked: the op's default


def test_padding_counts_as_ignored_rows():
    """The rows the head sees include the padding a multiple adds (ignored, but computed in place unless
    a whole block is free of targets): 60 targets in 61 tokens padded to 64 rows is 1/16 ignored."""
    ids = torch.arange(61).unsqueeze(0)
    labels = ids.clone()
    labels[0, -1] = -100  # 60 targets in 61 tokens
    mb = B.prepare(ids, labels, device=CPU, max_seq_len=64, pack=True, seq_multiple=64, compact_ignored="auto")
    assert mb.input_ids.shape[1] == 64 and mb.compact_ignored is True
    mb = B.prepare(ids, labels, device=CPU, max_seq_len=64, pack=True, seq_multiple=1, compact_ignored="auto")
    assert mb.compact_ignored is None


def test_graph_key_holds_the_choice():
    calls = []
    graphs = G.ModelCallGraphs(lambda mb, t: calls.append(mb.compact_ignored) or torch.zeros(1, 8, 4),
                               [torch.nn.Parameter(torch.zeros(2))], CPU)
    ids, labels = _rl_rows(prompt=20, response=4)
    for option in ("auto", False):
        graphs(B.prepare(ids, labels, device=CPU, max_seq_len=64, pack=True, seq_multiple=8,
                         compact_ignored=option), 1.0, grad=False)
    assert calls == [True, False]  # two keys: each first sighting runs eagerly with its own choice
    assert sorted(k[-1] for k in graphs.entries) == [False, True]


def test_config_validation():
    assert EngineConfig().lce.compact_ignored == "auto"
    for ok in (True, False, "auto"):
        assert EngineConfig(lce=LCEConfig(compact_ignored=ok)).lce.compact_ignored == ok
    for bad in ("on", 1, None):
        with pytest.raises(ValueError, match="lce.compact_ignored"):
            LCEConfig(compact_ignored=bad)
    assert load_config(None, ["engine.lce.compact_ignored=false"], cls=JobConfig).engine.lce.compact_ignored is False


def _engine(option, fused=True):
    from helpers.engines import tiny_engine

    return tiny_engine(90, model=dict(dtype="fp32", max_seq_len=256), optim=dict(lr=1e-3), use_fused_linear_ce=fused,
                       lce=dict(compact_ignored=option), seed=5)


@pytest.fixture
def seen(monkeypatch):
    """compact_ignored of every call the seam makes to the fused op."""
    calls = []
    op = capture.linear_logprobs_entropy

    def spy(*a, **kw):
        calls.append(a[3].compact_ignored)  # the call's LCEOptions
        return op(*a, **kw)

    monkeypatch.setattr(capture, "linear_logprobs_entropy", spy)
    return calls


def _loss(stats, mb):
    mask = mb.labels != -100
    return -(stats.logprobs * mask).sum() / mask.sum(), {}


def test_engine_passes_the_choice_and_it_changes_no_number(seen):
    """token_stats and train_step of a prompt-masked batch: compacted under auto, in place under false;
    the same statistics and the same updated weights (the rows' math does not depend on their order)."""
    ids, labels = _rl_rows(prompt=20, response=4)
    sft_ids, sft_labels = _rl_rows(prompt=1, response=200, seed=1)
    results = {}
    for option in ("auto", False):
        e = _engine(option)
        st = e.token_stats(ids, labels)
        st_sft = e.token_stats(sft_ids, sft_labels)
        out = e.train_step([MicroBatch(ids, labels)], _loss)
        results[option] = (st, st_sft, out["grad_norm"], [p.detach().clone() for p in e.gpt.parameters()])
    assert seen == [True, None, True, False, False, False]
    (a, a_sft, gn_a, w_a), (b, b_sft, gn_b, w_b) = results["auto"], results[False]
    for x, y in ((a, b), (a_sft, b_sft)):
        for k in ("logprobs", "entropy", "max_logit", "min_logit"):
            torch.testing.assert_close(getattr(x, k), getattr(y, k), rtol=0, atol=1e-6)
    assert a.logprobs[labels == -100].abs().max() == 0 and a.logprobs[labels != -100].abs().min() > 0
    assert gn_a == pytest.approx(gn_b, rel=1e-6)
    for p, q in zip(w_a, w_b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_materialised_route_is_not_asked(seen):
    e = _engine("auto", fused=False)
    ids, labels = _rl_rows(prompt=20, response=4)
    assert e._prepare(ids, labels).compact_ignored is None
    e.token_stats(ids, labels)
    assert seen == []


def test_token_stats_takes_the_callers_choice(seen):
    """The public call passes compact_ignored through to the op; the statistics do not depend on it."""

    from helpers import gpt_builder as G

    from areal_lce.megatron import token_stats
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():  # megatron-core's model on a CPU-only host
        model = G.build_gpt(tied=False)
        ids, labels, _ = G.batch(0)
        out = {c: token_stats(model, ids, labels, vocab_size=G.VOCAB, backend="torch", compact_ignored=c)
               for c in (None, True, False)}
    assert seen == [None, True, False]
    for c in (True, False):
        for k in ("logprobs", "entropy"):
            torch.testing.assert_close(getattr(out[c], k), getattr(out[None], k), rtol=0, atol=1e-6)
