"""What a job may do to the user's files and how a run ends: a fresh start overwrites no file it did not write,
a user's file inside a checkpoint costs nothing and is kept, the layout is checked at start-up, `job:` cannot
change on a resume, a non-finite loss or grad norm stops the run naming the step without saving it,
metrics.jsonl is strict JSON, a run ends with one summary line, and only known-noise warnings are hidden.
One process, the loop on model-free jobs: fast."""
from __future__ import annotations

import dataclasses
import json
import math
import types
import warnings

import pytest

from areal_lce import durable
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import loop
from areal_lce.train.config import ConfigError, load_config

from test_train_loop import CounterJob

ONE_RANK = types.SimpleNamespace(is_main=True)


def _cfg(out, *overrides):
    return load_config(None, [f"trainer.output_dir={out}", "trainer.progress=false", "trainer.plot=false",
                              "trainer.steps=5", "trainer.save_interval=1", *overrides])


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class StepsRecorded(CounterJob):
    def __init__(self):
        super().__init__()
        self.steps = []

    def step(self, step):
        self.steps.append(step)
        return super().step(step)


# ------------------------------------------------------------------------ the user's files

@pytest.mark.parametrize("resume", ["false", "auto"])
def test_a_fresh_start_overwrites_none_of_the_users_files(tmp_path, resume):
    run = tmp_path / "run"
    run.mkdir()
    mine = {"config.yaml": b"# my notes\ntrainer: {steps: 3}\n", "metrics.png": b"\x89PNG mine",
            "samples.jsonl": b'{"mine": 1}\n'}
    for name, data in mine.items():
        (run / name).write_bytes(data)
    job = StepsRecorded()
    with pytest.raises(ConfigError, match=rf"trainer.output_dir={run} .*\(config.yaml, metrics.png, samples.jsonl\); "
                                          r"nothing was deleted or overwritten.*another trainer.output_dir"):
        loop.train(job, _cfg(run, f"trainer.resume={resume}"), ONE_RANK)
    assert job.steps == [] and {k: v for k, v in _tree(run).items() if k != "run.lock"} == mine


def test_auto_without_a_checkpoint_starts_over_in_a_directory_an_earlier_run_used(tmp_path):
    run = tmp_path / "run"
    loop.train(CounterJob(), _cfg(run, "trainer.save_interval=0", "trainer.save_final=false"), ONE_RANK)
    assert (run / "config.yaml").is_file() and not ckpt.list_checkpoints(run)
    res = loop.train(CounterJob(), _cfg(run, "trainer.resume=auto", "trainer.steps=2"), ONE_RANK)
    assert res["step"] == 2 and len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_users_files_in_a_checkpoint_are_ignored_unlisted_and_kept(tmp_path):
    run = tmp_path / "run"
    loop.train(CounterJob(), _cfg(run, "trainer.stop_at=2"), ONE_RANK)
    step2 = ckpt.checkpoint_dir(run, 2)
    (step2 / "hf").mkdir()
    (step2 / "hf" / "model.safetensors").write_bytes(b"an export")
    (step2 / "eval.json").write_text('{"score": 1}')
    job = StepsRecorded()
    loop.train(job, _cfg(run, "trainer.resume=auto"), ONE_RANK)
    assert job.steps == [3, 4, 5]  # resumed from step 2: the user's files cost nothing
    # a re-save of a directory holding them does not list them
    ckpt.save_checkpoint(job.engine, run, 2, {"config": ""}, True)
    listed = json.loads((step2 / durable.MANIFEST).read_text())["files"]
    assert sorted(listed) == ["engine/rank00000.pt", ckpt.STATE_FILE]
    assert (step2 / "hf" / "model.safetensors").read_bytes() == b"an export"
    # an unknown file in the engine/ part, which the engine's reader opens, is still refused (for a sealed
    # engine/ by its own manifest: test_checkpoint_integrity.py)
    (ckpt.checkpoint_dir(run, 5) / "engine" / "extra.pt").write_bytes(b"x")
    with pytest.raises(durable.IntegrityError, match=r"engine/extra.pt: not listed"):
        ckpt.load_checkpoint(job.engine, ckpt.checkpoint_dir(run, 5))


# ------------------------------------------------------------------------ checks at start-up

@pytest.mark.parametrize("what", ["output_dir", "checkpoints"])
def test_a_bad_layout_is_refused_at_start_naming_the_option(tmp_path, what):
    run = tmp_path / "run"
    if what == "output_dir":
        run.write_text("a file")
    else:
        run.mkdir()
        (run / "checkpoints").write_text("a file")
    job = StepsRecorded()
    with pytest.raises(ConfigError, match=rf"trainer.output_dir={run}.* is a file"):
        loop.train(job, _cfg(run), ONE_RANK)
    assert job.steps == []


def test_a_changed_job_on_resume_is_refused(tmp_path):
    run = tmp_path / "run"
    loop.train(CounterJob(), _cfg(run, "trainer.stop_at=2"), ONE_RANK)
    before = (run / "metrics.jsonl").read_bytes()
    other = dataclasses.replace(_cfg(run, "trainer.resume=auto"), job="grpo")
    with pytest.raises(ConfigError, match=r"resuming .*step_00000002 with a changed job \(job: 'sft' -> 'grpo'\).*"
                                          r"another trainer.output_dir"):
        loop.train(StepsRecorded(), other, ONE_RANK)
    assert (run / "metrics.jsonl").read_bytes() == before


# ------------------------------------------------------------------------ non-finite training, metrics, the end

class Diverging(CounterJob):
    """Loss NaN from step `at` on (as lr=1e12 gives); grad_norm not computed (None) at step 1."""

    def __init__(self, at, key="loss"):
        super().__init__()
        self.at, self.key = at, key

    def step(self, step):
        rec = {**super().step(step), "loss": 1.0, "grad_norm": None if step == 1 else 2.0}
        if step >= self.at:
            rec[self.key] = float("nan") if self.key == "loss" else float("inf")
        return rec


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_a_non_finite_step_stops_the_run_unsaved_and_metrics_stay_strict_json(tmp_path, key):
    run = tmp_path / "run"
    with pytest.raises(loop.NonFiniteError, match=rf"step 3: {key}=(nan|inf): training diverged.*without saving "
                                                  r"this step \(the newest checkpoint is .*step_00000002\)"):
        loop.train(Diverging(3, key), _cfg(run), ONE_RANK)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1, 2]

    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")

    records = [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["grad_norm"] is None


def test_metrics_jsonl_writes_a_non_finite_value_as_null(tmp_path):
    from areal_lce.train.logging_utils import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "max_logit": -math.inf, "lr": math.nan, "tokens": 3})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "max_logit": null, "lr": null, "tokens": 3}\n'


def test_a_run_ends_with_a_summary_line(tmp_path, capsys):
    run = tmp_path / "run"
    res = loop.train(CounterJob(), _cfg(run, "trainer.steps=3"), ONE_RANK)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"[count] done: steps 1-3 of 3; last value={res['records'][-1]['value']:.4f}; wrote {run} "
                    f"(config.yaml, metrics.jsonl); newest checkpoint {ckpt.checkpoint_dir(run, 3)}")


def test_only_known_noise_is_hidden_and_warnings_print_without_source_lines():
    from areal_lce.train.__main__ import one_line_warning, quiet_known_warnings

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_known_warnings()
        for module, text, category in [
                ("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm", UserWarning),
                ("torch.jit._script", "`torch.jit.script_method` is deprecated. Please switch", DeprecationWarning),
                ("my_project.train", "my_option is deprecated", DeprecationWarning),  # the user's own
                ("areal_lce.engine.config", "engine.x is deprecated and will be removed", FutureWarning),
                ("my_project.ops", "Apex is not installed", UserWarning)]:  # not megatron's: shown
            warnings.warn_explicit(text, category, f"{module.replace('.', '/')}.py", 1, module=module)
    assert [str(w.message) for w in shown] == ["my_option is deprecated", "engine.x is deprecated and will be removed",
                                               "Apex is not installed"]
    assert one_line_warning("m", RuntimeWarning, __file__, 1) == f"{__file__}:1: RuntimeWarning: m\n"
