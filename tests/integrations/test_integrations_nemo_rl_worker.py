"""NeMo-RL's Megatron worker wiring (areal_lce.integrations.nemo_rl_worker) and the packed seam it routes to.

In process: stand-ins of the NeMo-RL module attributes the wiring replaces, with the snapshot's signatures
(no NeMo-RL import), for what the wiring itself decides: which seam a micro-batch reaches, the temperature
taken off NeMo-RL's output into the op, the [B, S-1] layout handed to the loss wrappers, the refusals, and
apply / remove. Live, against NeMo-RL's real train.py, loss wrappers and losses on materialised logits:
tests/integrations/nemo_rl_worker_cases.py on 2 gloo ranks (skipped without the snapshot files).
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import types

import pytest
import torch

from helpers.paths import REPO
from areal_lce.integrations import nemo_rl as lce_nemo
from areal_lce.integrations import nemo_rl_packed as lce_packed
from areal_lce.integrations import nemo_rl_worker as lce_worker

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.environ.get("AREAL_LCE_PEERS", "") or str(REPO / ".carry" / "peers")
PEER_ROOT = os.path.join(PEERS, "nemo_rl", "full", "nemo_rl")
V, H = 16, 8


def sampling(temperature=1.0, top_k=None, top_p=1.0):
    return types.SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p)


@pytest.fixture
def nemo(monkeypatch):
    """Stand-ins of NeMo-RL's modules: only the attributes the wiring replaces or reads, their signatures as
    in the snapshot; the forward step calls the model, which calls the module global as NeMo-RL's patched
    GPTModel.forward does, then divides the output by the sampling temperature (apply_temperature_scaling)."""
    mods = {n: types.ModuleType(n) for n in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.megatron",
                                              "nemo_rl.distributed", lce_worker.TRAIN, lce_worker.MODEL_UTILS,
                                              lce_worker.SETUP)}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    train, mu, setup = mods[lce_worker.TRAIN], mods[lce_worker.MODEL_UTILS], mods[lce_worker.SETUP]

    def own_global(*args, **kwargs):
        raise AssertionError("NeMo-RL's own from_parallel_hidden_states_to_logprobs was called")

    def forward_with_post_processing_fn(data_iterator, model, post_processing_fn, defer_fp32_logits=False,
                                        global_valid_seqs=None, global_valid_toks=None, sampling_params=None,
                                        straggler_timer=None, draft_model=None, enable_hidden_capture=False,
                                        use_fused_linear_logprobs=False, use_router_replay=False,
                                        router_replay_train=False):
        out = model(next(data_iterator), mu)
        if sampling_params is not None and sampling_params.temperature != 1.0:
            out = out / sampling_params.temperature
        return out, post_processing_fn

    class SequencePackingLossWrapper:
        def __init__(self, loss_fn, prepare_fn, cu_seqlens_q, cu_seqlens_q_padded=None, vocab_parallel_rank=None,
                     vocab_parallel_group=None, context_parallel_group=None):
            self.loss_fn, self.cu_seqlens_q, self.cu_seqlens_q_padded = loss_fn, cu_seqlens_q, cu_seqlens_q_padded
            self.context_parallel_group = context_parallel_group

        def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
            return next_token_logits, self.context_parallel_group

    def prepare_packed_loss_input(logits, data, loss_fn, cu_seqlens_q, cu_seqlens_q_padded, vocab_parallel_rank=None,
                                  vocab_parallel_group=None, context_parallel_group=None, sampling_params=None,
                                  chunk_size=None):
        return "NeMo-RL's", data

    def _apply_parallelism_config(model_cfg, config):
        model_cfg.context_parallel_size = config["megatron_cfg"]["context_parallel_size"]
        if model_cfg.context_parallel_size > 1:
            assert config["sequence_packing"]["enabled"], "CP needs packing"
            assert not config["megatron_cfg"].get("use_fused_linear_logprobs", False), "fused + CP"

    mu.from_parallel_hidden_states_to_logprobs = own_global
    train.forward_with_post_processing_fn = forward_with_post_processing_fn
    train.SequencePackingLossWrapper = SequencePackingLossWrapper
    train.prepare_packed_loss_input = prepare_packed_loss_input
    for name in ("LossPostProcessor", "LogprobsPostProcessor", "TopkLogitsPostProcessor"):
        setattr(train, name, type(name, (), {}))
    setup._apply_parallelism_config = _apply_parallelism_config
    yield types.SimpleNamespace(train=train, mu=mu, setup=setup, own_global=own_global,
                                forward=forward_with_post_processing_fn)
    lce_worker.remove()


def packed_batch(lengths=(7, 12, 13), unpacked=13, seed=0):
    """A packed micro-batch as NeMo-RL's ProcessedMicrobatch holds it (CP = 1), its hidden [T, 1, H], weight."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.randint(0, V, (1, int(cu[-1])), generator=g)
    mb = types.SimpleNamespace(input_ids=ids, input_ids_cp_sharded=ids, cu_seqlens_padded=cu,
                               packed_seq_params=types.SimpleNamespace(cu_seqlens_q_padded=cu),
                               data_dict={"input_ids": torch.zeros(len(lengths), unpacked, dtype=torch.long)})
    return mb, torch.randn(int(cu[-1]), 1, H, generator=g), torch.randn(V, H, generator=g)


def fused_model(hidden, weight):
    """What NeMo-RL's patched GPTModel.forward does with the fused flag: the module global on this rank's
    decoder output, labels = the micro-batch's (CP-sharded) input ids."""
    def model(mb, mu):
        return mu.from_parallel_hidden_states_to_logprobs(hidden, weight, False, mb.input_ids_cp_sharded, 0, V, None,
                                                          False, None, 5)
    return model


def step(nemo, mb, model, post=None, **kwargs):
    post = post if post is not None else nemo.train.LossPostProcessor()
    return nemo.train.forward_with_post_processing_fn(iter([mb]), model, post, use_fused_linear_logprobs=True,
                                                      **kwargs)[0]


def test_packed_microbatch_reaches_the_packed_seam_with_the_temperature(nemo):
    # NeMo-RL's own fused route would roll labels across the packed sequences and divide its logprobs by the
    # temperature; the wiring gives the packed seam the micro-batch's layout and the op the temperature
    mb, hidden, weight = packed_batch()
    lce_worker.apply(backend="torch")
    got = step(nemo, mb, fused_model(hidden, weight), sampling_params=sampling(0.7))
    want = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences(
        hidden, weight, mb.input_ids, mb.cu_seqlens_padded, 13, 0, V, None, temperature=0.7, backend="torch")
    assert got.shape == (3, 12) and torch.equal(got, want)


def test_unpacked_microbatch_reaches_the_dropin_with_the_temperature(nemo):
    g = torch.Generator().manual_seed(1)
    hidden, weight, ids = torch.randn(6, 2, H, generator=g), torch.randn(V, H, generator=g), torch.randint(0, V, (2, 6))
    mb = types.SimpleNamespace(input_ids=ids, input_ids_cp_sharded=ids, packed_seq_params=None)
    lce_worker.apply(backend="torch")
    got = step(nemo, mb, fused_model(hidden, weight), sampling_params=sampling(0.7))
    assert torch.equal(got, lce_nemo.from_parallel_hidden_states_to_logprobs_at_temperature(
        0.7, hidden, weight, False, ids, 0, V, None, backend="torch"))
    # the drop-in's temperature divides the logits: (h / T)·Wᵀ at T = 1
    scaled = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden / 0.7, weight, False, ids, 0, V, None)
    torch.testing.assert_close(got, scaled, rtol=0, atol=1e-5)


def test_without_the_flag_nemo_rls_own_step_runs(nemo):
    mb, hidden, weight = packed_batch()
    lce_worker.apply()
    model = lambda mb, mu: torch.ones(2)  # noqa: E731  (the logits route: no module global)
    out = nemo.train.forward_with_post_processing_fn(iter([mb]), model, nemo.train.LossPostProcessor(),
                                                     sampling_params=sampling(0.5))[0]
    assert torch.equal(out, torch.full((2,), 2.0))  # NeMo-RL's temperature scaling, untouched


@pytest.mark.parametrize("what", ["top_k", "top_p", "topk_logits", "labels"])
def test_refusals(nemo, what):
    mb, hidden, weight = packed_batch()
    lce_worker.apply()
    kwargs, post = {}, None
    if what in ("top_k", "top_p"):
        kwargs["sampling_params"] = sampling(top_k=20) if what == "top_k" else sampling(top_p=0.9)
        err, match = NotImplementedError, "top-k / top-p"
    elif what == "topk_logits":
        post, err, match = nemo.train.TopkLogitsPostProcessor(), NotImplementedError, "only the loss and logprob"
    else:
        mb.input_ids_cp_sharded = mb.input_ids[:, :-2]
        err, match = ValueError, "not this CP rank's share"
    with pytest.raises(err, match=match):
        step(nemo, mb, fused_model(hidden, weight), post=post, **kwargs)


def test_loss_wrapper_reads_the_rows_as_at_cp1(nemo):
    # NeMo-RL's per-sequence loop slices the fused output at seq_start // cp; the subclass hands it the rows laid
    # out at the packed positions and hides the CP group for the call (the rows are gathered over CP already)
    lce_worker.apply()
    fused, plain = types.SimpleNamespace(use_fused_linear_logprobs=True), types.SimpleNamespace()
    cu = torch.tensor([0, 4, 12, 16])
    rows = torch.arange(1.0, 19.0).view(3, 6).requires_grad_()
    wrapper = nemo.train.SequencePackingLossWrapper(fused, None, cu, cu, 0, None, context_parallel_group="cp")
    packed, group = wrapper(rows, {}, None, None)
    assert group is None and wrapper.context_parallel_group == "cp"
    want = torch.tensor([[1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 0, 0, 13, 14, 15, 16]], dtype=torch.float32)
    assert torch.equal(packed.detach(), want)
    packed.sum().backward()
    assert rows.grad.sum() == 14  # each placed value once
    untouched = nemo.train.SequencePackingLossWrapper(plain, None, cu, cu, 0, None, context_parallel_group="cp")
    assert untouched(rows, {}, None, None) == (rows, "cp")


def test_prepare_packed_takes_the_rows_as_logprobs(nemo):
    lce_worker.apply()
    fused = types.SimpleNamespace(use_fused_linear_logprobs=True, input_type=types.SimpleNamespace(name="LOGPROB"))
    rows, data = torch.randn(3, 12, dtype=torch.float64), {"input_ids": torch.zeros(3, 10, dtype=torch.long)}
    out, same = nemo.train.prepare_packed_loss_input(logits=rows, data=data, loss_fn=fused, cu_seqlens_q=None,
                                                     cu_seqlens_q_padded=None)
    assert same is data and out["next_token_logprobs"].dtype == torch.float32
    assert torch.equal(out["next_token_logprobs"], rows[:, :9].float())
    assert nemo.train.prepare_packed_loss_input(rows, data, types.SimpleNamespace(), None, None)[0] == "NeMo-RL's"
    with pytest.raises(NotImplementedError, match="top-k / top-p"):
        nemo.train.prepare_packed_loss_input(rows, data, fused, None, None, sampling_params=sampling(top_k=5))


def test_lift_config_checks(nemo):
    cfg = {"megatron_cfg": {"context_parallel_size": 2, "use_fused_linear_logprobs": True},
           "sequence_packing": {"enabled": True}}
    with pytest.raises(AssertionError, match="fused"):
        nemo.setup._apply_parallelism_config(types.SimpleNamespace(), cfg)
    lce_worker.lift_config_checks()
    model_cfg = types.SimpleNamespace()
    nemo.setup._apply_parallelism_config(model_cfg, cfg)
    assert model_cfg.context_parallel_size == 2 and cfg["megatron_cfg"]["use_fused_linear_logprobs"]
    with pytest.raises(AssertionError, match="CP needs packing"):  # NeMo-RL's other check stays
        nemo.setup._apply_parallelism_config(model_cfg, dict(cfg, sequence_packing={"enabled": False}))


def test_apply_remove_idempotent_and_all_or_none(nemo):
    originals = {(m, a): getattr(sys.modules[m], a) for m, a in lce_worker.PATCH_TARGETS + lce_worker.CHECK_TARGETS}
    names = lce_worker.apply()
    assert len(names) == 5 and lce_worker.apply() == names  # a second apply replaces, does not stack
    assert nemo.mu.from_parallel_hidden_states_to_logprobs is not nemo.own_global
    assert sorted(lce_worker.remove()) == sorted(names) and lce_worker.remove() == []
    assert all(getattr(sys.modules[m], a) is f for (m, a), f in originals.items())
    del nemo.train.prepare_packed_loss_input  # NeMo-RL moved it: refused, nothing patched
    with pytest.raises(RuntimeError, match="prepare_packed_loss_input"):
        lce_worker.apply()
    assert nemo.train.forward_with_post_processing_fn is nemo.forward
    with pytest.raises(TypeError, match="set by the adapter"):
        lce_worker.apply(temperature=2.0)


def test_packed_seam_odd_lengths_at_cp1():
    # without context parallelism a packed sequence may have any length (NeMo-RL pads to 2·cp only at CP > 1);
    # each packed sequence equals the drop-in on that sequence alone
    mb, hidden, weight = packed_batch(lengths=(7, 12, 13))
    got = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences(
        hidden, weight, mb.input_ids, mb.cu_seqlens_padded, 13, 0, V, None, backend="torch")
    for i, (s, e) in enumerate(zip(mb.cu_seqlens_padded[:-1].tolist(), mb.cu_seqlens_padded[1:].tolist())):
        alone = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden[s:e], weight, False, mb.input_ids[:, s:e],
                                                                 0, V, None, backend="torch")
        torch.testing.assert_close(got[i, :e - s - 1], alone[0], rtol=0, atol=1e-6)
        assert not got[i, e - s - 1:].any()


@functools.lru_cache(maxsize=1)
def worker_results() -> dict:
    from helpers.launch import torchrun

    out = os.path.join(tempfile.mkdtemp(), "nemo_rl_worker.json")
    return torchrun(os.path.join(HERE, "nemo_rl_worker_cases.py"), out, PEERS, timeout=300, result=out)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(PEER_ROOT, "models", "megatron", "train.py")),
                    reason=f"NeMo-RL snapshot files not in {PEERS}/nemo_rl/full (no network in CI; "
                    "docs/integrations.md 'Validation against the real code' says how to extract them)")
def test_matches_nemo_rls_worker_path_on_logits():
    # NeMo-RL's forward step + LogprobsPostProcessor / LossPostProcessor (GRPO per-sequence and fuse_loss, SFT)
    # on materialised logits vs the wiring on hidden states: logprobs, loss, d_hidden, d_weight; unpacked and
    # packed at TP=1, packed at CP=2 and TP=2 (sequence parallel), temperature 0.7; TP=1 vs TP=2 bitwise
    # (invariant mode); setup.py's fused + CP check lifted and restored
    res = worker_results()
    assert len(res) == 17, sorted(res)
    for case, metrics in res.items():
        bad = {m: v for m, v in metrics.items() if v[0] > v[1]}
        assert not bad, f"{case}: [error, bound] over the bound: {bad} (all: {metrics})"
