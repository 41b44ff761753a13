"""RL losses against hand-computed cases (2 sequences x 3 tokens, explicit numbers).

The fused-vs-materialised comparison of the same losses through the Megatron engine lives in
tests/train/test_rl_job.py; here only the tensor math is checked.
"""
import math
from collections import namedtuple

import pytest
import torch

from areal_lce.train.rl_config import RLConfig
from areal_lce.train.rl_losses import (
    PolicyMicroBatch, aggregate, batch_advantages, group_advantages, kl_penalty, ppo_clip_loss, rl_loss,
)

Stats = namedtuple("Stats", "logprobs entropy max_logit min_logit")

# ratios r = exp(logprobs - old_logprobs) with old_logprobs = 0; advantages A = [+1, -1] per sequence.
# The last token of sequence 1 is masked out (a prompt/padding position).
RATIOS = [[1.0, 1.5, 0.5], [0.7, 4.0, 2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -1.0]
# clip_eps = 0.2 -> clip(r) in [0.8, 1.2]; per-token loss = max(-A r, -A clip(r)):
#   seq 0 (A=+1): r=1.0 -> -1.0 ;  r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped) ;  r=0.5 -> max(-0.5, -0.8) = -0.5
#   seq 1 (A=-1): r=0.7 -> max(0.7, 0.8) = 0.8 (clipped) ;  r=4.0 -> max(4.0, 1.2) = 4.0 ;  (masked r=2.0 -> 2.0)
TOKEN_LOSS = [[-1.0, -1.2, -0.5], [0.8, 4.0, 2.0]]
# token-mean:               (-1.0 - 1.2 - 0.5 + 0.8 + 4.0) / 5   = 2.1 / 5 = 0.42
# sequence-mean-token-mean: (-2.7 / 3 + 4.8 / 2) / 2 = (-0.9 + 2.4) / 2 = 0.75
# sequence-mean-token-sum:  (-2.7 + 4.8) / 2                     = 1.05
AGG = {"token-mean": 0.42, "sequence-mean-token-mean": 0.75, "sequence-mean-token-sum": 1.05}


def _case():
    lp = torch.tensor(RATIOS, dtype=torch.float64).log().requires_grad_(True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None]
    mask = torch.tensor(MASK, dtype=torch.bool)
    return lp, old, adv, mask


def test_ppo_clip_token_losses_and_clip_masks():
    lp, old, adv, mask = _case()
    loss, info = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor(TOKEN_LOSS, dtype=torch.float64))
    assert info["clipped"].tolist() == [[False, True, False], [True, False, False]]
    assert not info["dual_clipped"].any()


@pytest.mark.parametrize("mode", list(AGG))
def test_aggregation_modes(mode):
    lp, old, adv, mask = _case()
    loss, _ = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    assert aggregate(loss, mask, mode).item() == pytest.approx(AGG[mode], abs=1e-12)


def test_ppo_clip_gradient_token_mean():
    # d loss / d logprob = -A r / 5 on unclipped tokens, 0 on clipped and masked ones:
    #   seq 0: [-1.0/5, 0, -0.5/5] = [-0.2, 0, -0.1];  seq 1: [0, +4.0/5, 0] = [0, 0.8, 0]
    lp, old, adv, mask = _case()
    loss, _ = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    aggregate(loss, mask, "token-mean").backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.2, 0.0, -0.1], [0.0, 0.8, 0.0]], dtype=torch.float64))


def test_dual_clip_caps_negative_advantage_tokens():
    # c = 3: seq 1 token 1 (A=-1, r=4) has loss 4.0 > -A c = 3 -> capped to 3.0, and its gradient is 0.
    # token-mean becomes (-2.7 + 0.8 + 3.0) / 5 = 0.22. Positive-advantage tokens are untouched.
    lp, old, adv, mask = _case()
    loss, info = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert loss[1, 1].item() == pytest.approx(3.0)
    assert info["dual_clipped"].tolist() == [[False, False, False], [False, True, False]]  # masked r=2: loss 2 < 3
    total = aggregate(loss, mask, "token-mean")
    assert total.item() == pytest.approx(0.22, abs=1e-12)
    total.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.2, 0.0, -0.1], [0.0, 0.0, 0.0]], dtype=torch.float64))


def test_clip_higher_asymmetric_bounds():
    # clip_high = 0.6 -> upper bound 1.6: seq 0 token 1 (r=1.5, A=+1) is no longer clipped: loss -1.5.
    lp, old, adv, mask = _case()
    loss, info = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.6)
    assert loss[0, 1].item() == pytest.approx(-1.5)
    assert info["clipped"].tolist() == [[False, False, False], [True, False, False]]


def test_group_advantages_hand_computed():
    # group 0 rewards [1, 0, 0, 0]: mean 0.25, population std sqrt(0.25 * 0.75) = 0.4330127
    #   -> [0.75, -0.25, -0.25, -0.25] / 0.4330127 = [1.7320508, -0.5773503, ...]
    # group 1 rewards [1, 1, 1, 1]: all advantages 0 (no NaN from a zero std)
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])
    s3 = math.sqrt(3.0)
    expect = torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3, 0, 0, 0, 0])
    torch.testing.assert_close(group_advantages(r, 4, eps=0.0 + 1e-12), expect, atol=1e-6, rtol=0)
    torch.testing.assert_close(group_advantages(r, 4, std_norm=False),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    # eps enters the denominator: std 0.4330127 + 0.1
    torch.testing.assert_close(group_advantages(r, 4, eps=0.1)[0], torch.tensor(0.75 / (0.4330127 + 0.1)))
    # batch advantages: the 8 rewards as one group, mean 0.625, std sqrt(0.625 * 0.375) = 0.4841229
    torch.testing.assert_close(batch_advantages(r, eps=0.0)[0], torch.tensor(0.375 / 0.4841229), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r[:7], 4)


def test_kl_estimators_hand_computed():
    # p = 0.5, p_ref = 0.25: k1 = log 2 = 0.693147; k3: d = -log 2 -> 0.5 + 0.693147 - 1 = 0.193147
    # p = 0.25, p_ref = 0.5: k1 = -0.693147;        k3: d = +log 2 -> 2 - 0.693147 - 1 = 0.306853
    lp = torch.tensor([0.5, 0.25]).log()
    ref = torch.tensor([0.25, 0.5]).log()
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([0.693147, -0.693147]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.193147, 0.306853]))
    assert kl_penalty(lp, lp, "k3").abs().max() == 0
    with pytest.raises(ValueError, match="k2"):
        kl_penalty(lp, ref, "k2")


def _mb(lp, mask, **extra):
    labels = torch.where(mask, torch.ones_like(mask, dtype=torch.long), torch.full_like(mask, -100, dtype=torch.long))
    return PolicyMicroBatch(input_ids=torch.zeros_like(labels), labels=labels, old_logprobs=torch.zeros_like(lp),
                            advantages=torch.tensor(ADV, dtype=lp.dtype), **extra)


def test_rl_loss_combines_terms_and_reports_metrics():
    # entropy H = [[1, 2, 3], [4, 5, 6]]: token mean over the mask = (1+2+3+4+5) / 5 = 3.0
    # reference logprobs = logprobs - 0.1 -> k1 = 0.1 per token, kl term token mean 0.1
    # loss = 0.42 + 0.5 * 0.1 - 0.01 * 3.0 = 0.44
    lp, old, adv, mask = _case()
    lp32 = lp.detach().float().requires_grad_(True)
    ent = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    stats = Stats(lp32, ent, torch.tensor([[1.0, 7, 2], [3, 4, 99]]), torch.tensor([[-1.0, -2, -3], [-4, -5, -99]]))
    cfg = RLConfig(entropy_coef=0.01, kl_coef=0.5, kl_estimator="k1")
    loss, m = rl_loss(stats, _mb(lp32, mask, ref_logprobs=lp32.detach() - 0.1), cfg)
    assert loss.item() == pytest.approx(0.44, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.4)  # 2 of 5 tokens clipped
    assert m["entropy"] == pytest.approx(3.0)
    assert m["kl"] == pytest.approx(0.1, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(4.0, rel=1e-6) and m["ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert m["max_logit"] == 7.0 and m["min_logit"] == -5.0  # masked token's 99 / -99 excluded
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(stats, _mb(lp32, mask), cfg)


@pytest.mark.parametrize("mode", list(AGG))
def test_microbatch_shares_sum_to_minibatch_loss(mode):
    # The RL loop passes minibatch totals (num_tokens=5, num_seqs=2) to each microbatch; the engine sums.
    lp, old, adv, mask = _case()
    cfg = RLConfig(loss_agg=mode)
    lp32 = lp.detach().float()
    parts = []
    for i in range(2):
        st = Stats(lp32[i:i + 1], torch.zeros(1, 3), None, None)
        mb = _mb(lp32, mask, num_tokens=5, num_seqs=2)
        mb = mb.select(slice(i, i + 1))
        parts.append(rl_loss(st, mb, cfg)[0].item())
    assert sum(parts) == pytest.approx(AGG[mode], abs=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(loss_agg="mean"), "rl.loss_agg"),
    (dict(kl_estimator="k2"), "rl.kl_estimator"),
    (dict(dual_clip=0.5), "rl.dual_clip"),
    (dict(advantage="group", group_size=1), "rl.group_size"),
    (dict(prompts_per_step=3, group_size=2, minibatches=4), "rl.minibatches"),
    (dict(top_p=0.0), "rl.top_p"),
])
def test_config_errors_name_the_option(bad, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(**bad)
