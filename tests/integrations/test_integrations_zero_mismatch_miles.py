"""NeMo-RL's packed THD / CP seam (areal_lce.integrations.nemo_rl_packed) and the miles adapter
(areal_lce.integrations.miles), in this process against the fp64 reference of their documented semantics.
The multi-rank cases (CP=2, TP=2) and the live comparisons with NeMo-RL's and miles' own functions run in
tests/integrations/zero_mismatch_worker.py, launched by tests/integrations/test_integrations_zero_mismatch.py."""
from __future__ import annotations

import sys
import types
from argparse import Namespace

import pytest
import torch

import zero_mismatch_packed_cases as P  # noqa: E402
import zero_mismatch_worker as W  # noqa: E402
from areal_lce.integrations import miles as lce_miles  # noqa: E402
from areal_lce.integrations import nemo_rl_packed as lce_packed  # noqa: E402


def check(case: str, metrics: dict) -> None:
    bad = {m: v for m, v in metrics.items() if v[0] > v[1]}
    assert not bad, f"{case}: [error, bound] over the bound: {bad} (all: {metrics})"


# ------------------------------------------------------------------------------ NeMo-RL packed THD seam

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "entropy"])
def test_nemo_rl_packed_matches_reference(dtype, entropy):
    # 3 packed sequences (8, 12, 4), unpacked_seqlen 11 (the 12-long one cut as NeMo-RL cuts it),
    # temperature 0.7, peaked rows and shard-edge labels; per-sequence roll, [B, unpacked_seqlen - 1] layout
    check(str(entropy), P.nemo_packed_case(W.reference, W.err, W.bounds, dtype, 1, 1, None, None, 0,
                                           entropy=entropy))


def _packed_args():
    hidden, weight, target, cu, _ = P.packed_inputs(torch.float32)
    return hidden, weight, target, cu


def test_nemo_rl_packed_layout_and_pre_rolled_target():
    hidden, weight, target, cu = _packed_args()
    fn = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences
    lp = fn(hidden, weight, target, cu, 13, 0, weight.shape[0], None, backend="torch")
    assert lp.shape == (3, 12) and lp.dtype == torch.float32
    assert torch.all(lp[0, 7:] == 0) and torch.all(lp[2, 3:] == 0) and torch.all(lp[1, :11] < 0)  # zero past len-1
    rolled = torch.cat([s.roll(-1) for s in target[0].split(P.LENGTHS)]).unsqueeze(0)  # NeMo-RL's pre-rolled form
    pre = fn(hidden, weight, rolled, cu, 13, 0, weight.shape[0], None, target_is_pre_rolled=True, backend="torch")
    assert torch.equal(lp, pre)


def test_nemo_rl_packed_refusals(monkeypatch):
    hidden, weight, target, cu = _packed_args()
    fn = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences
    v = weight.shape[0]
    with pytest.raises(NotImplementedError, match="top-k / top-p"):
        fn(hidden, weight, target, cu, 11, 0, v, None, sampling_params=Namespace(top_k=20, top_p=1.0))
    with pytest.raises(ValueError, match=r"target must be the packed \[1, T\]"):
        fn(hidden, weight, target[:, :-1], cu, 11, 0, v, None)
    with pytest.raises(ValueError, match=r"\[T/\(cp·tp\), 1, H\]"):
        fn(hidden[:-1], weight, target, cu, 11, 0, v, None)
    with pytest.raises(ValueError, match="vocab range"):
        fn(hidden, weight, target, cu, 11, 0, v - 1, None)
    with pytest.raises(ValueError, match="cumulative lengths"):
        fn(hidden, weight, target, torch.tensor([1, 24]), 11, 0, v, None)
    with pytest.raises(TypeError, match="set by the adapter"):
        fn(hidden, weight, target, cu, 11, 0, v, None, vocab_parallel=None)
    # at CP = 2 a padded length that is not a multiple of 2·cp is refused (megatron's load-balanced split)
    monkeypatch.setattr(lce_packed.comms, "checked_group_size", lambda g, what: 2 if "cp_group" in what else 1)
    monkeypatch.setattr(lce_packed.comms, "group_rank", lambda g: 0)
    with pytest.raises(ValueError, match="multiple of 2·cp = 4"):
        fn(hidden[:12], weight, target, torch.tensor([0, 6, 24]), 11, 0, v, None, cp_group=object())


def test_zigzag_index_is_megatrons_split():
    # per sequence chunks r and 2cp-1-r of 2cp; the two ranks together cover every position once
    idx = [lce_packed.zigzag_index(torch.tensor([8, 4]), 2, r).tolist() for r in range(2)]
    assert idx == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]


# ------------------------------------------------------------------------------------------------ miles

def _miles_inputs(dtype, v=80, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(12, 16, generator=g)
    weight = torch.randn(v, 16, generator=g) * 0.5
    weight[[3, v - 5]] = hidden[[1, 4]] * 1.5  # peaked rows, one in the padding columns
    tokens = torch.randint(0, v - 10, (12,), generator=g)
    return hidden.to(dtype), weight.to(dtype), tokens, torch.randn(12, generator=g), torch.randn(12, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy-grad", "entropy-observed"])
def test_miles_matches_reference(dtype, entropy_grad):
    # miles' normal mode: softmax over the whole shard, bf16 logits for bf16 inputs, temperature 0.7;
    # log_prob [R, 1] (megatron's cross entropy's shape); entropy detached unless entropy_requires_grad
    hidden, weight, tokens, g_lp, g_ent = _miles_inputs(dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lce_miles.calculate_log_probs_and_entropy(h, w, tokens, None, True, entropy_grad, 5,
                                                        temperature=0.7, backend="torch")
    assert lp.shape == (12, 1) and ent.shape == (12,) and ent.requires_grad == entropy_grad
    ((lp[:, 0] * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0)).backward()
    ref = W.reference(hidden, weight, tokens, g_lp, g_ent if entropy_grad else torch.zeros(12), dtype, False, 0.7)
    b = W.bounds(dtype)
    check("miles", {"logprobs": [W.err(lp[:, 0], ref[0]), b["out"]], "entropy": [W.err(ent, ref[1]), b["out"]],
                    "d_hidden": [W.err(h.grad, ref[2]), b["grad"]], "d_weight": [W.err(w.grad, ref[3]), b["grad"]]})


def test_miles_true_on_policy_matches_reference():
    # miles' true-on-policy: bf16 logits, the softmax over the first vocab_size ids, bf16 outputs [R];
    # against fp64 on the bf16-rounded logits: one bf16 rounding of the outputs (U = 2^-8 relative)
    hidden, weight, tokens, g_lp, g_ent = _miles_inputs(torch.bfloat16, v=256)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lce_miles.calculate_log_probs_and_entropy(h, w, tokens, None, True, True, -1, True, 246,
                                                        backend="torch")
    assert lp.shape == (12,) and lp.dtype == ent.dtype == torch.bfloat16
    ((lp.float() * g_lp).sum() + (ent.float() * g_ent).sum()).backward()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = hd @ wd.t()
    z = (z + (z.detach().to(torch.bfloat16).double() - z.detach()))[:, :246]  # rounded forward, identity backward
    logp = torch.log_softmax(z, -1)
    ref_lp, ref_ent = logp.gather(1, tokens[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    b = W.bounds(torch.bfloat16)
    check("true-on-policy", {"logprobs": [W.err(lp, ref_lp), b["out"]], "entropy": [W.err(ent, ref_ent), b["out"]],
                             "d_hidden": [W.err(h.grad, hd.grad), b["grad"]],
                             "d_weight": [W.err(w.grad, wd.grad), b["grad"]]})
    assert torch.all(w.grad[246:] == 0)  # the truncated padding rows take no gradient


class ContractMiles:
    """A stand-in of miles' logit_processors / cp_utils at CP = 1, THD (no snapshot): its documented slicing
    (sample i's response logits at rows [end - R - 1, end - 1), its tokens the last R) and TP state."""

    @staticmethod
    def get_responses(logits, *, args, unconcat_tokens, total_lengths, response_lengths, max_seq_lens=None):
        assert args.rollout_temperature == 1.0 and not args.true_on_policy_mode  # the step applies both itself
        rows, end = logits.squeeze(0), 0
        for tokens, n, r in zip(unconcat_tokens, total_lengths, response_lengths):
            end += n
            yield rows[end - r - 1:end - 1], tokens[-r:]

    @staticmethod
    def get_parallel_state():
        return Namespace(tp=Namespace(group=None))


def test_miles_step_matches_reference():
    hidden, weight, _, _, _ = _miles_inputs(torch.float32)
    total, resp = [5, 4, 3], [2, 3, 1]
    g = torch.Generator().manual_seed(9)
    unconcat = [torch.randint(0, 70, (n,), generator=g) for n in total]
    args = Namespace(rollout_temperature=0.7, log_probs_chunk_size=-1, allgather_cp=False, qkv_format="thd",
                     true_on_policy_mode=False)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    step = lce_miles.log_probs_step(lambda: w, logit_processors=ContractMiles, cp_utils=ContractMiles,
                                    backend="torch")
    res = step(h.unsqueeze(0), args=args, unconcat_tokens=unconcat, total_lengths=total, response_lengths=resp,
               with_entropy=True, entropy_requires_grad=False)
    assert [t.shape for t in res["log_probs"]] == [(2,), (3,), (1,)] and not res["entropy"][0].requires_grad
    torch.cat(res["log_probs"]).sum().backward()
    rows = torch.tensor([2, 3, 5, 6, 7, 10])  # end - R - 1 .. end - 2 per sample
    labels = torch.cat([t[-r:] for t, r in zip(unconcat, resp)])
    ref = W.reference(hidden[rows], weight, labels, torch.ones(6), torch.zeros(6), torch.float32, False, 0.7)
    d_h = torch.zeros(12, 16, dtype=torch.float64).index_copy(0, rows, ref[2])
    check("step", {"logprobs": [W.err(torch.cat(res["log_probs"]), ref[0]), 1e-5],
                   "entropy": [W.err(torch.cat(res["entropy"]), ref[1]), 1e-5],
                   "d_hidden": [W.err(h.grad, d_h), 1e-4], "d_weight": [W.err(w.grad, ref[3]), 1e-4]})


def test_miles_refusals():
    hidden, weight, tokens, _, _ = _miles_inputs(torch.float32)
    fn = lce_miles.calculate_log_probs_and_entropy
    with pytest.raises(NotImplementedError, match="bf16 hidden states"):  # true-on-policy is bf16 only
        fn(hidden, weight, tokens, None, true_on_policy=True)
    with pytest.raises(NotImplementedError, match="logits_precision 'bf16'"):
        fn(hidden.bfloat16(), weight.bfloat16(), tokens, None, true_on_policy=True, logits_precision="fp32")
    with pytest.raises(TypeError, match="chunk_size"):
        fn(hidden, weight, tokens, None, chunk_size=None)
    with pytest.raises(ValueError, match="negative"):  # miles has no ignore_index either
        fn(hidden, weight, torch.where(tokens == tokens[0], -100, tokens), None)
    with pytest.raises(TypeError, match="set by the adapter"):
        fn(hidden, weight, tokens, None, sequence_parallel=True)
    lp, ent = fn(hidden[:0], weight, tokens[:0], None, with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    step = lce_miles.log_probs_step(lambda: weight, logit_processors=ContractMiles, cp_utils=ContractMiles)
    kw = dict(unconcat_tokens=[tokens[:4]], total_lengths=[4], response_lengths=[2])
    with pytest.raises(NotImplementedError, match="sequence parallel"):
        step(hidden[None, :4], args=Namespace(sequence_parallel=True), **kw)
    with pytest.raises(ValueError, match=r"\[1, T, H\]"):
        step(hidden[:4], args=Namespace(), **kw)
    with pytest.raises(TypeError, match="weight_fn"):
        lce_miles.log_probs_step(weight, logit_processors=ContractMiles, cp_utils=ContractMiles)


def test_miles_apply_and_remove(monkeypatch):
    names = ("miles", "miles.backends", "miles.backends.training_utils", "miles.backends.training_utils.loss_hub",
             "miles.backends.megatron_utils", lce_miles.LOGIT_PROCESSORS, lce_miles.CP_UTILS, *lce_miles.STEP_TARGETS)
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    mods[lce_miles.LOGIT_PROCESSORS].get_responses = ContractMiles.get_responses
    mods[lce_miles.LOGIT_PROCESSORS].get_parallel_state = ContractMiles.get_parallel_state
    originals = {n: object() for n in lce_miles.STEP_TARGETS}
    for n, o in originals.items():
        mods[n].get_log_probs_and_entropy = o
    patched = [f"{n}.get_log_probs_and_entropy" for n in lce_miles.STEP_TARGETS]
    assert lce_miles.apply(lambda: torch.randn(80, 16), backend="torch") == patched
    try:
        step = mods[lce_miles.STEP_TARGETS[0]].get_log_probs_and_entropy
        assert all(mods[n].get_log_probs_and_entropy is step for n in lce_miles.STEP_TARGETS)
        res = step(torch.randn(1, 6, 16), args=Namespace(rollout_temperature=1.0, allgather_cp=False,
                                                         true_on_policy_mode=False, qkv_format="thd"),
                   unconcat_tokens=[torch.arange(6)], total_lengths=[6], response_lengths=[3])
        assert [t.shape for t in res["log_probs"]] == [(3,)] and "entropy" not in res
    finally:
        assert lce_miles.remove() == patched
    assert all(mods[n].get_log_probs_and_entropy is originals[n] for n in lce_miles.STEP_TARGETS)
    assert lce_miles.remove() == []
