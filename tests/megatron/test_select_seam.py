"""selected_ids / top_k through token_stats on a user's GPTModel (tests/helpers/gpt_builder.py): BSHD and packed THD
against the log_softmax of the model's own logits, THD equal to BSHD token by token, the materialised route's
refusal."""
from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

from helpers import gpt_builder as G  # noqa: E402
from helpers.bounds import assert_ranks_fixed  # noqa: E402
from helpers.gpt_builder import megatron_on_cpu  # noqa: E402,F401

from areal_lce.megatron import pack_rows, token_stats  # noqa: E402

ATOL = 2e-5  # fp32: the op and the oracle differ in summation order only (as tests/megatron/test_token_stats.py)


def _selected(labels, k=4, seed=0):
    sel = torch.randint(0, G.VOCAB, labels.shape + (k,), generator=torch.Generator().manual_seed(seed))
    sel[..., 0] = labels.clamp_min(0)
    sel[..., 1] = G.VOCAB - 1
    return sel


def _oracle_logp(model, ids, temperature):
    with torch.no_grad():
        logits = model(ids, None, None)  # [b, s, V_pad]
    return torch.log_softmax(logits[..., :G.VOCAB].double() / temperature, -1)


def test_bshd_and_thd_match_the_model_logits():
    model = G.build_gpt()
    ids, labels, _ = G.batch(0)
    sel = _selected(labels)
    st = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=0.8, backend="torch", selected_ids=sel,
                     top_k=5)
    logp = _oracle_logp(model, ids, 0.8)
    valid = labels != -100
    want = logp.gather(-1, sel)
    assert (st.selected_logprobs - want).abs()[valid].max() <= ATOL
    assert st.topk_ids.dtype == torch.int64 and st.topk_ids.shape == labels.shape + (5,)
    want_ids = logp.topk(5, -1).indices
    # the op's fp32 logprobs are within ATOL of the oracle's, and the oracle's top 6 lie more than 2·ATOL apart
    # (the op's and the THD call's within 2·ATOL of it: the check below), so the ids agree by the math
    assert_ranks_fixed("oracle logprobs", logp[valid], 5, 2 * ATOL)
    assert torch.equal(st.topk_ids[valid], want_ids[valid])
    assert (st.topk_logprobs - logp.gather(-1, want_ids)).abs()[valid].max() <= ATOL
    assert torch.all(st.topk_ids[~valid] == -100) and torch.all(st.selected_logprobs[~valid] == 0)
    # packed THD: every token's values equal its BSHD values
    rows = pack_rows(ids, labels)
    sel_p = sel.reshape(-1, sel.shape[-1])[rows.index][None]
    thd = token_stats(model, rows.input_ids, rows.labels, vocab_size=G.VOCAB, temperature=0.8, backend="torch",
                      position_ids=rows.position_ids, packed_seq_params=rows.packed_seq_params(), selected_ids=sel_p,
                      top_k=5)
    flat = valid.reshape(-1)[rows.index]
    for name in ("selected_logprobs", "topk_logprobs"):
        a = getattr(thd, name)[0][flat]
        b = getattr(st, name).reshape(-1, getattr(st, name).shape[-1])[rows.index][flat]
        assert (a - b).abs().max() <= ATOL, name
    assert torch.equal(thd.topk_ids[0][flat], st.topk_ids.reshape(-1, 5)[rows.index][flat])


def test_gradients_flow_and_the_materialised_route_refuses():
    model = G.build_gpt()
    ids, labels, _ = G.batch(1)
    st = token_stats(model, ids, labels, vocab_size=G.VOCAB, backend="torch", selected_ids=_selected(labels), top_k=3)
    (st.selected_logprobs.sum() + st.topk_logprobs.sum()).backward()
    w = model.output_layer.weight
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="fused route only"):
        token_stats(model, ids, labels, vocab_size=G.VOCAB, fused=False, top_k=3)
