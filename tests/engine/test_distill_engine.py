"""MegatronEngine's per-token extras (token_stats(selected_ids=, top_k=) and train_step on micro-batches
carrying selected_ids), right-padded and packed (THD), on a tiny CPU model.

The op's values are checked against a float64 oracle in the op's own tests; what the engine adds is the
layout: the [b, s, K] ids go through padding / packing like the labels and the outputs come back to the
caller's [b, s] rows. So the checks are consistency checks that fail on any misalignment: the logprob
selected at the label equals the engine's own logprobs, the selected top-k ids give the top-k logprobs,
the padded and packed engines agree, and ignored positions hold ignore_index / 0.
"""
from __future__ import annotations

import pytest
import torch

from areal_lce.engine.engine import MegatronEngine
from areal_lce.engine.microbatch import MicroBatch
from helpers.bounds import assert_ranks_fixed
from helpers.engines import tiny_engine

VOCAB, K = 259, 5
# fp32 on CPU; the packed and padded calls run the same rows through differently shaped GEMMs and attention
ATOL = 2e-5


def _engine(pack: bool) -> MegatronEngine:
    return tiny_engine(VOCAB, model=dict(max_seq_len=32), optim=dict(lr=1e-2), pack_sequences=pack)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, :3] = -100  # prompts
    labels[:, -1] = -100
    labels[1, 7:] = -100  # a shorter row: padding
    ids[1, 8:] = 0
    return ids, labels


@pytest.fixture(scope="module")
def engines():
    return {"padded": _engine(False), "packed": _engine(True)}


def test_token_stats_top_k_and_selected_ids_follow_the_labels(engines):
    ids, labels = _batch()
    mask = labels != -100
    out = {}
    for name, e in engines.items():
        st = e.token_stats(ids, labels, temperature=0.7, top_k=K)
        assert st.topk_ids.shape == (3, 12, K) and st.topk_ids.dtype == torch.int64
        assert (st.topk_ids[~mask] == -100).all() and (st.topk_logprobs[~mask] == 0).all()
        assert (st.topk_ids[mask] >= 0).all() and (st.topk_ids[mask] < VOCAB).all()
        sel = torch.cat([labels[..., None], st.topk_ids], -1)  # the label first, -100 where ignored
        st2 = e.token_stats(ids, labels, temperature=0.7, selected_ids=sel)
        assert st2.selected_logprobs.shape == (3, 12, K + 1)
        torch.testing.assert_close(st2.selected_logprobs[..., 0], st.logprobs, rtol=0, atol=1e-6)
        torch.testing.assert_close(st2.selected_logprobs[..., 1:], st.topk_logprobs, rtol=0, atol=1e-6)
        assert (st.topk_logprobs[..., :1] >= st.logprobs[..., None] - 1e-6).all()  # the top-1 beats the label
        out[name] = st
    torch.testing.assert_close(out["packed"].logprobs, out["padded"].logprobs, rtol=0, atol=ATOL)
    # the two layouts' logprobs differ by rounding only (within ATOL): the padded engine's K + 1 largest lie more
    # than 2·ATOL apart, so both give the same top-K ids in the same order
    top = engines["padded"].token_stats(ids, labels, temperature=0.7, top_k=K + 1).topk_logprobs
    assert_ranks_fixed("padded top-k logprobs", top[mask], K, ATOL)
    assert torch.equal(out["packed"].topk_ids, out["padded"].topk_ids)
    torch.testing.assert_close(out["packed"].topk_logprobs, out["padded"].topk_logprobs, rtol=0, atol=ATOL)


def test_train_step_passes_selected_ids_to_the_loss(engines):
    """The loss sees selected_logprobs aligned with the micro-batch's rows; padded and packed engines take
    the same step."""
    ids, labels = _batch()
    sel = torch.randint(0, VOCAB, (3, 12, 2), generator=torch.Generator().manual_seed(4))
    sel[..., 1] = -100  # ignore entries give 0
    seen = {}

    def loss_fn(stats, mb):
        seen["shape"] = tuple(stats.selected_logprobs.shape)
        assert (stats.selected_logprobs[..., 1] == 0).all()
        return -(stats.selected_logprobs[..., 0] * (mb.labels != -100)).sum(), {}

    norms = {}
    for name, e in engines.items():
        before = e.token_stats(ids, labels, selected_ids=sel).selected_logprobs[..., 0]
        norms[name] = e.train_step([MicroBatch(ids, labels, selected_ids=sel)], loss_fn)["grad_norm"]
        after = e.token_stats(ids, labels, selected_ids=sel).selected_logprobs[..., 0]
        assert seen["shape"] == (3, 12, 2)
        mask = labels != -100
        assert after[mask].sum() > before[mask].sum()  # the step raised the selected ids' logprobs
    assert norms["packed"] == pytest.approx(norms["padded"], rel=1e-4)


def test_microbatch_checks_selected_ids():
    ids, labels = _batch()
    with pytest.raises(ValueError, match="selected_ids"):
        MicroBatch(ids, labels, selected_ids=torch.zeros(3, 11, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="selected_ids"):
        MicroBatch(ids, labels, selected_ids=torch.zeros(3, 12, 2))
    mb = MicroBatch(ids, labels, selected_ids=torch.zeros(3, 12, 2, dtype=torch.long))
    assert mb.select([0, 2]).selected_ids.shape == (2, 12, 2)
