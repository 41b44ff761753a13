"""engine/metrics.py: a step's per-rank share and the one reduction of it, on recorded collectives (no
process group, no model: fast). The engine's `train_step` is `reduce_step(train_step_local(...))`; the
jobs reduce the share once, with their own metrics."""
from __future__ import annotations

import types

import pytest
import torch

from areal_lce.op import comms
from areal_lce.engine.metrics import StepShare, last_stage_share, reduce_metrics, reduce_step


class _Group:
    """A 2-rank group whose other rank holds `sum_other(t)` for SUM and `max_other(t)` for MAX."""

    def __init__(self, name, sum_other, max_other=None):
        self.name, self.sum_other, self.max_other = name, sum_other, max_other or sum_other


@pytest.fixture
def calls(monkeypatch):
    log = []

    def all_reduce_sum_(t, group):
        log.append((group.name, "sum", t.numel()))
        return t.add_(group.sum_other(t))

    def all_reduce_max_(t, group):
        log.append((group.name, "max", t.numel()))
        return torch.maximum(t, group.max_other(t), out=t)

    monkeypatch.setattr(comms, "all_reduce_sum_", all_reduce_sum_)
    monkeypatch.setattr(comms, "all_reduce_max_", all_reduce_max_)
    return log


def _dist(pp_rank, other_dp):
    pp = _Group("pp", torch.zeros_like, lambda t: torch.full_like(t, -float("inf")))  # the identities
    dp = _Group("dp", other_dp)
    return types.SimpleNamespace(pp_group=pp, pp_size=2, pp_rank=pp_rank, is_last_stage=pp_rank == 1,
                                 dp_group=dp, dp_size=2)


def test_step_share_reduces_as_the_engine_always_did(calls):
    # last stage: loss summed over 4 micro-batches, a metric's sum over them; the other DP rank holds 3x
    share = StepShare({"loss": torch.tensor(2.0, dtype=torch.float64), "kl": torch.tensor(0.8, dtype=torch.float64)},
                      microbatches=4, tokens=10, extra={"grad_norm": 1.5, "lr": 1e-3})
    out = reduce_step(share, _dist(1, lambda t: 3 * t))
    # DP mean of the loss sum and of each metric's mean over micro-batches; tokens summed over DP ranks
    assert out == {"loss": (2.0 + 6.0) / 2, "tokens": 40.0, "kl": (0.2 + 0.6) / 2, "grad_norm": 1.5, "lr": 1e-3}
    assert calls == [("pp", "sum", 3), ("dp", "sum", 3)]  # one SUM per group, no MAX: nothing extreme
    # a stage before the last holds the identities: only the last stage ran loss_fn
    assert share.values(_dist(0, torch.zeros_like)) == {"loss": 0.0, "tokens": 0.0, "kl": 0.0}


def test_last_stage_share_counts_values_every_stage_holds_once(calls):
    values = {"reward": 0.5, "max_logit": 3.0, "min_logit": -2.0, "tokens": 7.0}
    ops = {"max_logit": "max", "min_logit": "min", "tokens": "sum"}
    first = _dist(0, torch.zeros_like)
    assert last_stage_share(values, ops, first) == {"reward": 0.0, "max_logit": -float("inf"),
                                                     "min_logit": float("inf"), "tokens": 0.0}
    last = _dist(1, lambda t: t.clone())  # the other DP rank: the same values
    out = reduce_metrics(last_stage_share(values, ops, last), ops, last, over_pipeline=True)
    assert out == {"reward": 0.5, "max_logit": 3.0, "min_logit": -2.0, "tokens": 14.0}
    one = types.SimpleNamespace(pp_size=1, dp_size=1, pp_group=None, dp_group=None)
    assert last_stage_share(values, ops, one) == values


def test_device_values_reach_the_host_after_the_reduction(calls):
    """Values may be 0-d tensors (the step's sums stay on the device until the reduction)."""
    one = types.SimpleNamespace(pp_size=1, dp_size=1, pp_group=None, dp_group=None)
    out = reduce_metrics({"a": torch.tensor(1.25, dtype=torch.float64), "b": 2.0, "c": torch.tensor(-1.0)},
                         {"c": "min"}, one)
    assert out == {"a": 1.25, "b": 2.0, "c": -1.0} and all(type(v) is float for v in out.values()) and not calls


def test_reduce_metrics_sum_mean_max_min_over_pipeline_then_data_parallel(calls):
    # the other pipeline stage did not run the loss: zeros and -inf / +inf (MAX of the negated min: -inf)
    pp = _Group("pp", torch.zeros_like, lambda t: torch.full_like(t, -float("inf")))
    # the other data-parallel rank: the same sums and means, extremes one further out
    dp = _Group("dp", lambda t: t.clone(), lambda t: t + 1)
    dist = types.SimpleNamespace(pp_group=pp, pp_size=2, dp_group=dp, dp_size=2)
    values = {"nll": 3.0, "ent": 1.5, "max_logit": 2.0, "min_logit": -1.0, "tokens": 5.0}
    ops = {"nll": "sum", "tokens": "sum", "max_logit": "max", "min_logit": "min"}  # ent: mean by default

    out = reduce_metrics(values, ops, dist, over_pipeline=True)
    assert out == {"nll": 6.0, "ent": 1.5, "max_logit": 3.0, "min_logit": -2.0, "tokens": 10.0}
    assert list(out) == list(values)  # the caller's key order
    # one SUM and one MAX per group, the pipeline first: 3 summed and 2 extreme values each
    assert calls == [("pp", "sum", 3), ("pp", "max", 2), ("dp", "sum", 3), ("dp", "max", 2)]

    calls.clear()
    assert reduce_metrics(values, ops, dist) == out  # without the pipeline group: the same here
    assert [c[0] for c in calls] == ["dp", "dp"]
    calls.clear()
    one = types.SimpleNamespace(pp_group=pp, pp_size=1, dp_group=dp, dp_size=1)
    assert reduce_metrics(values, ops, one, over_pipeline=True) == values and not calls
    with pytest.raises(ValueError, match="unknown op"):
        reduce_metrics(values, {"nll": "median"}, dist)
