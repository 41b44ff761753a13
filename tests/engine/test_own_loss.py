"""use_fused_linear_ce=false: the SFT loss runs through megatron-core's own `labels=` loss
(areal_lce/engine/own_loss.py), equals the fused route's loss, and the RL losses stay on areal_lce's
materialised route. Cases in tests/engine/own_loss_worker.py."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pathlib import Path
from areal_lce.engine.engine import MegatronEngine
from areal_lce.engine.own_loss import check_temperature_one
from areal_lce.megatron.stats import TokenStats
from areal_lce.train.losses import SFTLoss

# fp32 end to end on CPU: the fused route's and megatron's CE differ only in fp32 summation order
FP32_REL = 1e-5
# megatron-core's fused_vocab_parallel_cross_entropy returns the logits' gradient in bf16 whatever the
# model's dtype (fusions/fused_cross_entropy.py, calculate_gradients): every d_logit carries one bf16
# rounding, relative error <= 2^-8 (bf16 unit roundoff), and so, relative to each tensor's largest entry,
# do the parameter gradients summed from them. The loss itself is fp32 (FP32_REL).
BF16_GRAD_REL = 2.0 ** -8


def _check(res: dict, fusions) -> None:
    n = res["microbatches"]
    fused = res["fused"]
    # the fused route never reaches megatron's loss
    assert fused["calls"] == {"compute_language_model_loss": 0, "vocab_parallel_cross_entropy": 0,
                              "fused_vocab_parallel_cross_entropy": 0}, fused
    assert not fused["uses"]
    for fusion in fusions:
        got = res[f"megatron_fusion{int(fusion)}"]
        ce = "fused_vocab_parallel_cross_entropy" if fusion else "vocab_parallel_cross_entropy"
        other = "vocab_parallel_cross_entropy" if fusion else "fused_vocab_parallel_cross_entropy"
        # one GPTModel labels= loss per micro-batch, through the CE that cross_entropy_loss_fusion picks
        assert got["calls"]["compute_language_model_loss"] == n and got["calls"][ce] == n, got
        assert got["calls"][other] == 0, got
        assert got["uses"] and got["record_keys"] == ["nll", "tokens"], got  # no entropy / logit extremes
        assert got["loss"] == pytest.approx(fused["loss"], rel=FP32_REL), (fusion, got["loss"], fused["loss"])
        assert got["grad_rel"] <= (BF16_GRAD_REL if fusion else FP32_REL), (fusion, got["grad_rel"])


@pytest.mark.slow
def test_sft_loss_goes_through_megatrons_own_loss_and_equals_the_fused_route():
    from own_loss_worker import parity

    # right-padded rows (BSHD), megatron's CE with and without cross_entropy_loss_fusion (both run on CPU)
    _check(parity(tp=1, pack=False, fusions=(False, True)), (False, True))


@pytest.mark.distributed
def test_tp2_sequence_parallel_packed(tmp_path):
    from helpers.launch import torchrun

    res = torchrun(Path(__file__).with_name("own_loss_worker.py"), tmp_path / "res.json", result=tmp_path / "res.json", timeout=300)
    _check(res["tp2-sp-packed"], (False,))


def test_only_a_logprobs_only_loss_leaves_the_materialised_route():
    def rl_like_loss(stats, mb):  # reads entropy: no logprobs_only attribute
        return stats.logprobs.sum() + stats.entropy.sum(), {}

    for fused, loss_fn, expected in ((False, SFTLoss(1.0), True), (False, rl_like_loss, False),
                                     (True, SFTLoss(1.0), False)):
        engine = SimpleNamespace(route=SimpleNamespace(fused=fused))
        assert MegatronEngine.uses_megatron_loss(engine, loss_fn) is expected, (fused, loss_fn)


def test_sft_loss_records_only_what_megatrons_loss_gives():
    labels = torch.tensor([[5, -100, 7]])
    mb = SimpleNamespace(labels=labels)
    loss_fn = SFTLoss(2.0)
    lp = torch.tensor([[-1.0, 0.0, -3.0]], requires_grad=True)
    loss, metrics = loss_fn(TokenStats(lp, None, None, None), mb)
    assert loss.item() == pytest.approx(2.0) and metrics["token_nll"].item() == pytest.approx(2.0)
    assert loss_fn.sums() == {"nll": 4.0, "tokens": 2}
    full = SFTLoss(2.0)
    full(TokenStats(lp, torch.ones(1, 3), torch.full((1, 3), 4.0), torch.full((1, 3), -4.0)), mb)
    assert full.sums() == {"nll": 4.0, "entropy": 2.0, "tokens": 2, "max_logit": 4.0, "min_logit": -4.0}
    assert SFTLoss(1.0).sums()["max_logit"] == -math.inf  # no records (a non-last pipeline stage)


@pytest.mark.parametrize("temperature", [0.7, torch.tensor(1.0)], ids=["float", "tensor"])
def test_megatrons_loss_refuses_a_temperature(temperature):
    check_temperature_one(1.0)
    with pytest.raises(ValueError, match="megatron-core's own loss.*has no temperature"):
        check_temperature_one(temperature)
