"""The run loop (areal_lce.train.loop) on a job without a model, and the jobs' metric reduction
(areal_lce.train.job.reduce_metrics) on recorded collectives. One process, no Megatron: fast."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from areal_lce import comms
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import loop
from areal_lce.train.config import load_config
from areal_lce.train.job import reduce_metrics
from areal_lce.train.logging_utils import read_metrics

ONE_RANK = types.SimpleNamespace(is_main=True)


class CounterEngine:
    """Stands for the engine: its whole state is one number, saved and loaded like the engine's files."""

    def __init__(self):
        self.value = 0.0

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({"value": self.value, "rng": torch.get_rng_state()}, f"{path}/rank00000.pt")

    def load(self, path: str) -> None:
        state = torch.load(f"{path}/rank00000.pt")
        self.value = state["value"]
        torch.set_rng_state(state["rng"])


class CounterJob:
    """A Job whose step adds a torch-RNG draw to the engine's number: a resumed run reproduces the
    uninterrupted one only if the loop restores the engine and the step, and seeds as it should."""

    name, log_keys, plot_keys, plot_title = "count", ("step", "value"), ("value",), "count"
    postfix = (("value", ".3f"),)

    def __init__(self):
        self.engine, self.finished = None, 0

    def build_engines(self):
        self.engine = CounterEngine()

    def banner(self):
        return "counting"

    def step(self, step):
        self.engine.value += float(torch.rand(()))
        return {"value": self.engine.value}

    def finish(self, output_dir):
        self.finished += 1


def _cfg(out, *overrides):
    return load_config(None, [f"trainer.output_dir={out}", "trainer.progress=false", "trainer.plot=false",
                              "trainer.steps=5", "trainer.save_interval=2", *overrides])


def test_loop_resumes_a_stopped_run_exactly(tmp_path, capsys):
    full = loop.train(CounterJob(), _cfg(tmp_path / "full"), ONE_RANK)
    assert [r["step"] for r in full["records"]] == [1, 2, 3, 4, 5]

    run = tmp_path / "stopped"
    job = CounterJob()
    first = loop.train(job, _cfg(run, "trainer.stop_at=3"), ONE_RANK)  # checkpoint of step 2, step 3 lost
    assert first["step"] == 3 and job.finished == 0  # finish() only after the last step of the run
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    job = CounterJob()
    resumed = loop.train(job, _cfg(run, "trainer.resume=auto"), ONE_RANK)
    assert [r["step"] for r in resumed["records"]] == [3, 4, 5] and job.finished == 1
    assert [r["value"] for r in resumed["records"]] == [r["value"] for r in full["records"][2:]]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert (run / "config.yaml").is_file()
    out = capsys.readouterr().out
    assert "[count] counting, resumed from" in out and "step=5  value=" in out


class _RecordedGroup:
    """A 2-rank group whose other rank holds `sum_other(t)` for SUM and `max_other(t)` for MAX."""

    def __init__(self, name, sum_other, max_other):
        self.name, self.sum_other, self.max_other = name, sum_other, max_other


def test_reduce_metrics_sum_mean_max_min_over_pipeline_then_data_parallel(monkeypatch):
    calls = []

    def all_reduce_sum_(t, group):
        calls.append((group.name, "sum", t.numel()))
        return t.add_(group.sum_other(t))

    def all_reduce_max_(t, group):
        calls.append((group.name, "max", t.numel()))
        return torch.maximum(t, group.max_other(t), out=t)

    monkeypatch.setattr(comms, "all_reduce_sum_", all_reduce_sum_)
    monkeypatch.setattr(comms, "all_reduce_max_", all_reduce_max_)
    # the other pipeline stage did not run the loss: zeros and -inf / +inf (MAX of the negated min: -inf)
    pp = _RecordedGroup("pp", torch.zeros_like, lambda t: torch.full_like(t, -float("inf")))
    # the other data-parallel rank: the same sums and means, extremes one further out
    dp = _RecordedGroup("dp", lambda t: t.clone(), lambda t: t + 1)
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
