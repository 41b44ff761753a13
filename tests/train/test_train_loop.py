"""The run loop (areal_lce.train.loop) on a job without a model (the metric reduction the jobs use is
tests/engine/test_metrics.py's). One process, no Megatron: fast."""
from __future__ import annotations

import types
from pathlib import Path

import torch

from areal_lce.train import checkpoint as ckpt
from areal_lce.train import loop
from areal_lce.train.config import load_config
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
