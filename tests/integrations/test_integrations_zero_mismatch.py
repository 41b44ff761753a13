"""NeMo-RL, slime and miles adapters (areal_lce.integrations.nemo_rl / .nemo_rl_packed / .slime / .miles).

Oracle without the stacks' code (CI): the fp64 materialised computation of the documented semantics
(tests/integrations/zero_mismatch_worker.py `reference`), TP=1 in this process, TP=2 / CP=2 on gloo ranks.
Live comparison with the stacks' real functions (NeMo-RL's `from_parallel_hidden_states_to_logprobs` and
`from_parallel_logits_to_logprobs_packed_sequences`, slime's `calculate_log_probs_and_entropy` and
`get_log_probs_and_entropy`, miles' kernel and step), from snapshots extracted by file into .carry/peers
(git-ignored; see docs/integrations.md "Validation against the real code"), loaded by path in the worker's
ranks only, never in this process. Skipped, saying so, when the folder is absent (CI has no network).
In-process tests of the packed seam and of miles: tests/integrations/test_integrations_zero_mismatch_miles.py.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile

import pytest
import torch

import zero_mismatch_worker as W  # noqa: E402  (its peers load only in its own main)
from helpers.paths import REPO
from areal_lce.integrations import nemo_rl as lce_nemo  # noqa: E402
from areal_lce.integrations import slime as lce_slime  # noqa: E402

PEERS = os.environ.get("AREAL_LCE_PEERS", "") or str(REPO / ".carry" / "peers")
PEER_FILES = ("nemo_rl/model_utils.py", "nemo_rl/logits_sampling_utils.py", "slime/ppo_utils.py",
              "miles/full/miles/backends/training_utils/loss_hub/logit_processors.py")


def peers_present() -> bool:
    return all(os.path.isfile(os.path.join(PEERS, f)) for f in PEER_FILES)


def check(case: str, metrics: dict) -> None:
    bad = {m: v for m, v in metrics.items() if v[0] > v[1]}
    assert not bad, f"{case}: [error, bound] over the bound: {bad} (all: {metrics})"


# ----------------------------------------------------------------------- TP = 1, fp64 oracle, in process

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["default", "exact", "entropy"])
def test_nemo_rl_matches_reference(dtype, mode):
    # default: softmax over every column of the shard, logits rounded to bf16 for bf16 inputs (NeMo-RL's);
    # exact: vocab_size excludes the padding rows, fp32 logits; entropy: the documented companion function
    check(mode, W.nemo_case(lce_nemo.from_parallel_hidden_states_to_logprobs, dtype, 1, None, 0,
                            exact=mode == "exact", entropy=mode == "entropy"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entropy", ["grad", "no-grad", "none", "exact"])
def test_slime_matches_reference(dtype, entropy):
    # temperature 0.7; entropy with gradient, detached (with_entropy_grad=False), absent, and exact mode
    check(entropy, W.slime_case(dtype, 1, None, 0, exact=entropy == "exact", with_entropy=entropy != "none",
                                with_entropy_grad=entropy != "no-grad"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_slime_step_matches_reference(dtype):
    # the log-prob step on 3 packed samples: slime's shift and per-sample response spans (a stand-in of its
    # loss module at CP = 1), temperature 0.7, entropy gradient on (entropy_coef != 0)
    check("step", W.slime_step_case(dtype, 1, None, 0, False))


def test_slime_step_refusals():
    step = lce_slime.log_probs_step(W.ContractLoss(None), lambda: torch.randn(16, 8))
    from argparse import Namespace
    kw = dict(args=Namespace(allgather_cp=False, rollout_temperature=1.0), unconcat_tokens=[torch.arange(4)],
              total_lengths=[4], response_lengths=[2])
    with pytest.raises(NotImplementedError, match="top-p replay"):
        step(torch.randn(4, 1, 8), top_p_token_ids=[[1]], top_p_token_offsets=[[0]], **kw)
    with pytest.raises(ValueError, match=r"\[T, 1, H\]"):
        step(torch.randn(4, 8), **kw)
    with pytest.raises(TypeError, match="weight_fn"):
        lce_slime.log_probs_step(W.ContractLoss(None), torch.randn(16, 8))
    with pytest.raises(TypeError, match="set by the adapter"):
        lce_slime.log_probs_step(W.ContractLoss(None), lambda: None, temperature=2.0)


def test_slime_apply_and_remove(monkeypatch):
    import types
    mods = {}
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils", *lce_slime.STEP_TARGETS):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    originals = {}
    for name in lce_slime.STEP_TARGETS:
        originals[name] = mods[name].get_log_probs_and_entropy = object()
    loss = mods[lce_slime.LOSS_MODULE]
    loss.mpu, loss._build_shifted_tokens = W.StubMPU(None), W.ContractLoss._build_shifted_tokens
    loss._extract_per_sample = W.ContractLoss._extract_per_sample
    weight = torch.randn(16, 8)
    names = [f"{n}.get_log_probs_and_entropy" for n in lce_slime.STEP_TARGETS]
    assert lce_slime.apply(lambda: weight, backend="torch") == names
    try:
        from argparse import Namespace
        _, res = loss.get_log_probs_and_entropy(
            torch.randn(1, 6, 8), args=Namespace(allgather_cp=False), unconcat_tokens=[torch.arange(6) % 16],
            total_lengths=[6], response_lengths=[3], with_entropy=True)
        assert [t.shape for t in res["log_probs"]] == [(3,)] and [t.shape for t in res["entropy"]] == [(3,)]
        assert mods[lce_slime.STEP_TARGETS[1]].get_log_probs_and_entropy is loss.get_log_probs_and_entropy
    finally:
        assert lce_slime.remove() == names
    assert all(mods[n].get_log_probs_and_entropy is originals[n] for n in lce_slime.STEP_TARGETS)
    from argparse import Namespace
    assert lce_slime.megatron_init(Namespace(sequence_parallel=False)) == names  # the init-hook spelling
    assert lce_slime.remove() == names


def _nemo_args(s=4, b=2, h=8, v=16, dtype=torch.float32):
    return torch.randn(s, b, h, dtype=dtype), torch.randn(v, h, dtype=dtype), torch.randint(0, v, (b, s))


def test_nemo_rl_shape_and_roll():
    hidden, weight, target = _nemo_args()
    lp = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden, weight, False, target, 0, 16, None)
    assert lp.shape == (2, 3) and lp.dtype == torch.float32
    ref = torch.log_softmax(hidden.transpose(0, 1) @ weight.t(), -1)  # [B, S, V]: position s scores token s+1
    expected = ref[:, :-1].gather(-1, target[:, 1:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-5)


def test_nemo_rl_inference_only_builds_no_graph():
    hidden, weight, target = _nemo_args()
    lp = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden.requires_grad_(), weight, False, target, 0, 16,
                                                          None, inference_only=True)
    assert not lp.requires_grad


def test_nemo_rl_refusals():
    hidden, weight, target = _nemo_args()
    fn = lce_nemo.from_parallel_hidden_states_to_logprobs
    with pytest.raises(ValueError, match="vocab range"):  # a layout other than rank·V/tp
        fn(hidden, weight, False, target, 0, 15, None)
    with pytest.raises(ValueError, match=r"target .* must be \[B, S\]"):
        fn(hidden, weight, False, target.t(), 0, 16, None)
    with pytest.raises(TypeError, match="logits_precision='fp32'"):  # no fp16 rounding in the op
        fn(hidden.half(), weight.half(), False, target, 0, 16, None)
    bad = target.clone()
    bad[0, 1] = 16  # NeMo-RL scores an out-of-range id 0 silently; the op refuses it
    with pytest.raises(ValueError):
        fn(hidden, weight, False, bad, 0, 16, None)
    with pytest.raises(TypeError, match="set by the adapter"):
        fn(hidden, weight, False, target, 0, 16, None, temperature=2.0)


def test_nemo_rl_refuses_context_parallel(monkeypatch):
    hidden, weight, target = _nemo_args()
    monkeypatch.setattr(lce_nemo.comms, "checked_group_size", lambda g, what: 1 if g is None else 2)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        lce_nemo.from_parallel_hidden_states_to_logprobs(hidden, weight, False, target, 0, 16, None,
                                                         cp_group=object())


def test_slime_refusals_and_empty():
    hidden, weight, tokens = torch.randn(5, 8), torch.randn(16, 8), torch.randint(0, 16, (5,))
    fn = lce_slime.calculate_log_probs_and_entropy
    with pytest.raises(NotImplementedError, match="log_prob_keep_mask"):
        fn(hidden, weight, tokens, None, log_prob_keep_mask=torch.ones(5, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="negative"):
        fn(hidden, weight, torch.tensor([1, -100, 2, 3, 4]), None)
    with pytest.raises(ValueError, match="temperature"):
        fn(hidden, weight, tokens, None, temperature=0.0)
    lp, ent = fn(hidden[:0], weight, tokens[:0], None, with_entropy=True)  # slime: [0] tensors, no [0, 1]
    assert lp.shape == (0,) and ent.shape == (0,) and lp.dtype == torch.float32
    assert fn(hidden[:0], weight, tokens[:0], None)[1] is None


def test_nemo_rl_apply_and_remove(monkeypatch):
    import types
    mod = types.ModuleType("nemo_rl.distributed.model_utils")
    original = object()
    mod.from_parallel_hidden_states_to_logprobs = original
    for name in ("nemo_rl", "nemo_rl.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "nemo_rl.distributed.model_utils", mod)
    assert lce_nemo.apply(vocab_size=14, logits_precision="fp32") == [".".join(lce_nemo.PATCH_TARGET)]
    try:
        hidden, weight, target = _nemo_args()
        target = target.clamp(max=13)
        lp = mod.from_parallel_hidden_states_to_logprobs(hidden, weight, False, target, 0, 16, None)
        ref = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden, weight, False, target, 0, 16, None,
                                                               vocab_size=14, logits_precision="fp32")
        assert torch.equal(lp, ref)  # the options reached the patched call (vocab_size 14 changes the values)
        assert not torch.equal(lp, lce_nemo.from_parallel_hidden_states_to_logprobs(
            hidden, weight, False, target, 0, 16, None))
    finally:
        assert lce_nemo.remove() == [".".join(lce_nemo.PATCH_TARGET)]
    assert mod.from_parallel_hidden_states_to_logprobs is original
    assert lce_nemo.remove() == []


def test_nemo_rl_apply_refuses_reserved_options():
    with pytest.raises(TypeError, match="set by the adapter"):
        lce_nemo.apply(temperature=2.0)


# -------------------------------------------------------------------------- gloo ranks (TP = 1 and TP = 2)

@functools.lru_cache(maxsize=1)
def worker_results() -> dict:
    from helpers.launch import torchrun

    out = os.path.join(tempfile.mkdtemp(), "zero_mismatch.json")
    args = (out, PEERS) if peers_present() else (out,)
    return torchrun(os.path.join(W.HERE, "zero_mismatch_worker.py"), *args,
                    timeout=300, result=out)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_matches_reference_and_is_invariant():
    # the SP shard of d_hidden (NeMo-RL), the reduced d_hidden (slime), d_weight per shard; padding rows on
    # rank 1 in exact mode; the slime step with and without sequence parallel; NeMo-RL's packed seam at CP=2
    # and TP=2; a token's logprob bitwise equal at TP=1 and TP=2 through each adapter (miles' included)
    res = worker_results()
    cases = [c for c in res if ("-ref-" in c and "tp1" not in c) or c.startswith("invariant")]
    assert len(cases) == 25, sorted(res)
    for case in cases:
        check(case, res[case])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not peers_present(), reason=f"NeMo-RL / slime / miles snapshot files not in {PEERS} (no network in CI; "
                    "docs/integrations.md 'Validation against the real code' says how to extract them)")
def test_matches_the_stacks_real_functions():
    # NeMo-RL's and slime's own functions, loaded by path in the ranks: outputs and gradients, TP=1 and TP=2;
    # slime's get_log_probs_and_entropy (packed THD, 3 samples, temperature 0.7) against the log-prob step,
    # also at CP=2 (zigzag and all-gather); NeMo-RL's packed function at CP=2 and TP=2; miles' kernel and step
    # (normal and true-on-policy modes, CP=2 zigzag / all-gather)
    res = worker_results()
    cases = [c for c in res if "-peer-" in c]
    assert len(cases) == 44, sorted(res)
    for case in cases:
        check(case, res[case])


@pytest.mark.slow  # megatron-core's import and a GPTModel build: ~7 s on 2 cores
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_slime_hidden_states_provider_on_a_megatron_gpt(tied):
    # a real megatron-core GPTModel (TP=1, CPU): the wrapped provider's hidden states through the step give
    # the logprobs, entropy and parameter gradients of slime's path on the model's own logits
    from helpers import gpt_builder as G
    from argparse import Namespace

    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():
        model = G.build_gpt(tied=tied)
        total, resp = [7, 5, 6], [3, 2, 4]
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, G.VOCAB, (1, 18), generator=g)
        pos = torch.cat([torch.arange(n) for n in total]).unsqueeze(0)
        unconcat = list(ids[0].split(total))
        args = Namespace(rollout_temperature=0.8, allgather_cp=False, entropy_coef=0.01)
        kw = dict(args=args, unconcat_tokens=unconcat, total_lengths=total, response_lengths=resp, with_entropy=True)
        contract = W.ContractLoss(None)

        def loss_and_grads(res):
            loss = sum((t * (i + 1)).sum() for i, t in enumerate(res["log_probs"] + res["entropy"]))
            params = [p for p in model.parameters() if p.requires_grad]
            return [torch.cat(res["log_probs"]), torch.cat(res["entropy"])], torch.autograd.grad(loss, params)

        logits = model(ids, pos, None)  # [1, 18, V]: materialised path, fp32
        tokens = contract._build_shifted_tokens(18, None, unconcat, total, resp, False)
        z = torch.log_softmax(logits[0] / 0.8, -1)
        lp_full, ent_full = z.gather(1, tokens[:, None])[:, 0], -(z.exp() * z).sum(-1)
        lps, ents = contract._extract_per_sample(lp_full, ent_full, total, resp, False)
        ref, ref_grads = loss_and_grads({"log_probs": lps, "entropy": ents})

        wrapped = lce_slime.hidden_states_provider(lambda pre, post: model)(True, True)
        try:
            head = model.embedding.word_embeddings.weight if tied else model.output_layer.weight
            assert wrapped is model and lce_slime.output_weight() is head
            hidden = model(ids, pos, None)
            assert hidden.shape == (1, 18, G.H)
            step = lce_slime.log_probs_step(contract, lce_slime.output_weight, backend="torch")
            out, grads = loss_and_grads(step(hidden, **kw)[1])
        finally:
            assert lce_slime.restore_output_layers() == 1
        assert "forward" not in vars(model.output_layer) and model(ids, pos, None).shape == logits.shape
    for name, a, b in zip(("log_probs", "entropy"), out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)  # fp32 logits both ways
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("what", ["mup", "mtp"])
def test_slime_hidden_states_provider_refusals(what):
    from types import SimpleNamespace
    model = SimpleNamespace(config=SimpleNamespace(use_mup=what == "mup"), mtp_process=what == "mtp",
                            output_layer=SimpleNamespace())
    provider = lce_slime.hidden_states_provider(lambda pre, post: model)
    assert provider(True, False) is model  # not the last stage: untouched
    with pytest.raises(NotImplementedError, match="MuP logit scaling and multi-token prediction"):
        provider(True, True)
    assert not vars(model.output_layer)
