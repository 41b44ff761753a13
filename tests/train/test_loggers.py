"""trainer.loggers (areal_lce.train.loggers) through the run loop on a job without a model: the TensorBoard
event files and the W&B run hold the scalars of metrics.jsonl, a resume hides the interrupted run's tail,
a missing package is a config error naming trainer.loggers. One process, no Megatron: fast."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import signal
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_lce.train import loggers, loop
from areal_lce.train.config import ConfigError, load_config
from areal_lce.train.logging_utils import read_metrics
from areal_lce.train.ranks import Interrupted
from test_train_loop import CounterEngine  # the engine whose whole state is one number

ONE_RANK = types.SimpleNamespace(is_main=True)


class MetricsJob:
    """Records like the jobs' own: floats, an int, plus a bool and a string that are no scalars."""

    name, log_keys, plot_keys, plot_title = "metrics", ("step", "loss"), ("loss",), "metrics"
    postfix = (("loss", ".3f"),)

    def __init__(self):
        self.engine = None

    def build_engines(self):
        self.engine = CounterEngine()

    def banner(self):
        return "metrics"

    def step(self, step):
        self.engine.value += float(torch.rand(()))
        return {"loss": self.engine.value / 3.0, "lr": 1e-3 / step, "tokens": 17 * step, "ok": True,
                "note": "text"}

    def finish(self, output_dir):
        pass


SCALARS = ("loss", "lr", "tokens")


def _cfg(out, *overrides):
    return load_config(None, [f"trainer.output_dir={out}", "trainer.progress=false", "trainer.plot=false",
                              "trainer.steps=5", "trainer.save_interval=2", *overrides])


def _tensorboard_scalars(log_dir: Path) -> dict:
    """tag -> [(step, value)] as TensorBoard's own reader shows them (purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_scalars_of_metrics_jsonl_and_a_resume_purges_the_lost_tail(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (extra 'tensorboard')")
    run = tmp_path / "run"
    both = "trainer.loggers=jsonl,tensorboard"
    # steps 1-3 logged, checkpoint of step 2: step 3 is the tail a resume must hide, then steps 3-5 again
    loop.train(MetricsJob(), _cfg(run, both, "trainer.stop_at=3"), ONE_RANK)
    loop.train(MetricsJob(), _cfg(run, both, "trainer.resume=auto"), ONE_RANK)
    assert f"logging to {run / 'tensorboard'}" in capsys.readouterr().out

    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per invocation
    got = _tensorboard_scalars(run / "tensorboard")
    assert sorted(got) == sorted(SCALARS)  # the bool and the string are no scalars
    for tag in SCALARS:
        # an event holds a float32: the JSONL value rounded once to float32, at the same step
        want = [(r["step"], float(np.float32(r[tag]))) for r in records]
        assert got[tag] == want, tag


def test_jsonl_left_out_writes_no_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (extra 'tensorboard')")
    run = tmp_path / "run"
    result = loop.train(MetricsJob(), _cfg(run, "trainer.loggers=[tensorboard]"), ONE_RANK)
    assert not (run / "metrics.jsonl").exists()
    got = _tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in got["loss"]] == [r["step"] for r in result["records"]] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("logger, package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_missing_logger_package_is_a_config_error_naming_trainer_loggers(tmp_path, monkeypatch, logger,
                                                                           package):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real_find_spec(name, *a))
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        loop.train(MetricsJob(), _cfg(run, f"trainer.loggers=jsonl,{logger}"), ONE_RANK)
    assert f"trainer.loggers includes '{logger}'" in str(e.value)
    assert f"pip install 'areal-lce[{logger}]'" in str(e.value)
    assert not run.exists()  # refused before the run directory is touched


@pytest.mark.parametrize("overrides, message", [
    (["trainer.loggers=jsonl,mlflow"], "expected distinct names"),
    (["trainer.loggers=jsonl,jsonl"], "expected distinct names"),
    (["trainer.loggers=[tensorboard]", "trainer.plot=true"], "add jsonl or set trainer.plot=false"),
])
def test_bad_trainer_loggers_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match="trainer.loggers") as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_trainer_loggers_default_and_command_line_forms():
    assert load_config(None, []).trainer.loggers == ["jsonl"]
    for text in ("jsonl,tensorboard,wandb", "[jsonl, tensorboard, wandb]"):
        assert load_config(None, [f"trainer.loggers={text}"]).trainer.loggers == ["jsonl", "tensorboard", "wandb"]


class _FakeWandbRun:
    def __init__(self, calls, kwargs):
        self.calls, self.kwargs = calls, kwargs
        self.dir = str(Path(kwargs["dir"]) / "wandb" / f"offline-run-{kwargs['id']}" / "files")

    def define_metric(self, name, **kw):
        self.calls.append(("define_metric", name, kw))

    def log(self, data):
        self.calls.append(("log", data))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code))


def _fake_wandb(calls: list) -> types.ModuleType:
    """A stand-in `wandb` module recording the calls the W&B logger makes (its API as of wandb 0.17+)."""
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found by importlib.util.find_spec
    def init(**kwargs):
        calls.append(("init", kwargs))
        return _FakeWandbRun(calls, kwargs)

    mod.init = init
    return mod


def test_wandb_logger_logs_each_record_at_its_step_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    run = tmp_path / "run"
    both = "trainer.loggers=jsonl,wandb"
    first = loop.train(MetricsJob(), _cfg(run, both, "trainer.stop_at=3"), ONE_RANK)
    resumed = loop.train(MetricsJob(), _cfg(run, both, "trainer.resume=auto"), ONE_RANK)

    inits = [c[1] for c in calls if c[0] == "init"]
    run_id = (run / "wandb" / "run_id").read_text().strip()
    assert [i["id"] for i in inits] == [run_id, run_id]  # the resume continues the same W&B run
    assert all(i["dir"] == str(run) and i["resume"] == "allow" and i["project"] == "areal_lce" for i in inits)
    assert inits[0]["config"]["trainer"]["loggers"] == ["jsonl", "wandb"]
    assert ("define_metric", "*", {"step_metric": "step"}) in calls
    logged = [c[1] for c in calls if c[0] == "log"]
    want = [{"step": r["step"], **{k: float(r[k]) for k in SCALARS}} for r in first["records"] + resumed["records"]]
    assert logged == want
    assert [c for c in calls if c[0] == "finish"] == [("finish", 0), ("finish", 0)]


def test_off_rank_0_no_logger_opens_or_writes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    with loggers.RunLoggers(list(loggers.LOGGERS), tmp_path / "run", enabled=False) as off:
        off.write({"step": 1, "loss": 1.0})
    assert calls == [] and not (tmp_path / "run").exists()


def test_an_interrupt_reaches_wandb_as_its_exit_status(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    with pytest.raises(Interrupted):
        with loggers.RunLoggers(["wandb"], tmp_path / "run"):
            raise Interrupted(signal.SIGTERM, 3)
    assert calls[-1] == ("finish", 143)


@pytest.mark.slow  # W&B's service process: about 5 s on 2 loaded cores
def test_wandb_offline_writes_its_run_directory(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb package is not installed (extra 'wandb')")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    result = loop.train(MetricsJob(), _cfg(run, "trainer.loggers=jsonl,wandb"), ONE_RANK)
    wandb.teardown()  # ends W&B's service process, which writes the log
    run_id = (run / "wandb" / "run_id").read_text().strip()
    (run_dir,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    log = run_dir / f"run-{run_id}.wandb"  # W&B's record log, what `wandb sync` uploads
    last = result["records"][-1]
    # each history item holds its key and its value as JSON text (the loss: a float whose shortest repr
    # is the same in Python and in W&B's Go service); that service may write the log after run.finish()
    # returns: wait up to 30 s
    wanted = [key.encode() for key in SCALARS] + [repr(last["loss"]).encode()]
    deadline = time.monotonic() + 30
    while not all(w in log.read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.1)
    data = log.read_bytes()
    assert [w for w in wanted if w not in data] == []
