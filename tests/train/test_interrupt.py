"""SIGINT / SIGTERM during a run: the handler only records the signal; at the step boundary the ranks agree
on it, save that step's checkpoint, print the resume line and stop (exit 130 / 143 from the entry point).
One process with a model-free job (test_train_loop's CounterJob), then two gloo ranks of the real SFT job."""
from __future__ import annotations

import json
import os
import signal

import pytest

from pathlib import Path
from areal_lce.train import __main__ as entry
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import loop
from areal_lce.train.ranks import Interrupted

from helpers.launch import torchrun
from helpers.paths import REPO
from test_train_loop import ONE_RANK, CounterJob, _cfg

RESUME_LINE = "interrupted at step {}; resume with trainer.resume=auto"


class SignalledJob(CounterJob):
    """CounterJob that sends this process `signals` while it runs step `at` (before the step's work)."""

    def __init__(self, at: int, *signals):
        super().__init__()
        self.at, self.signals = at, signals

    def step(self, step):
        if step == self.at:
            for sig in self.signals:
                os.kill(os.getpid(), sig)  # the handler runs right away, in this thread
        return super().step(step)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_during_a_step_saves_that_step_and_stops(tmp_path, capsys, sig, code):
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as info:
        loop.train(SignalledJob(3, sig), _cfg(tmp_path / "run"), ONE_RANK)  # steps=5, save_interval=2
    assert (info.value.step, info.value.signum, info.value.exit_code) == (3, sig, code)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [2, 3]  # step 3 finished, then saved
    assert RESUME_LINE.format(3) in capsys.readouterr().out
    assert signal.getsignal(sig) is before  # the loop's handler is gone again
    # the saved step resumes exactly: steps 4-5 equal the uninterrupted run's
    resumed = loop.train(CounterJob(), _cfg(tmp_path / "run", "trainer.resume=auto"), ONE_RANK)["records"]
    full = loop.train(CounterJob(), _cfg(tmp_path / "full"), ONE_RANK)["records"]
    assert [r["step"] for r in resumed] == [4, 5] and resumed == full[3:]


def test_a_second_signal_stops_at_once_without_saving(tmp_path):
    with pytest.raises(Interrupted) as info:
        loop.train(SignalledJob(3, signal.SIGINT, signal.SIGINT), _cfg(tmp_path / "run"), ONE_RANK)
    assert info.value.step is None and info.value.exit_code == 130
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [2]


def test_entry_point_exits_130_after_the_resume_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(entry, "limit_cpu_threads", lambda: None)
    monkeypatch.setattr(entry, "run_job", lambda cfg: loop.train(SignalledJob(2, signal.SIGINT), cfg, ONE_RANK))
    argv = [f"trainer.output_dir={tmp_path}", "trainer.steps=5", "trainer.progress=false", "trainer.plot=false",
            "engine.optim.warmup_steps=1"]
    assert entry.main(argv) == 130
    assert RESUME_LINE.format(2) in capsys.readouterr().out

    def interrupted_before_the_loop(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(entry, "run_job", interrupted_before_the_loop)
    assert entry.main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted before the first step; nothing was saved" in err and "Traceback" not in err


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_on_one_rank_stops_both_after_a_checkpoint(tmp_path):
    """Rank 1 alone gets SIGTERM during step 2; both ranks finish step 2, save it and exit 143."""
    out, run = tmp_path / "res", tmp_path / "run"
    proc = torchrun(Path(__file__).with_name("ranks_worker.py"), "sigterm", out, REPO / "configs" / "sft_tiny.yaml",
                    f"trainer.output_dir={run}", "trainer.steps=6", "engine.optim.warmup_steps=1",
                    "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.save_interval=0",
                    "trainer.progress=false", "trainer.sample_prompts=0", "trainer.plot=false",
                    timeout=300, cwd=REPO, env={"PYTHONWARNINGS": "ignore"}, check_returncode=False)
    rcs = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["rc"] for p in out.glob("rank*.json")}
    assert rcs == {0: 143, 1: 143}, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    assert len(list((ckpt.checkpoint_dir(run, 2) / "engine").glob("rank*.pt"))) == 2  # both ranks' files
    assert proc.stdout.count(RESUME_LINE.format(2)) == 1  # printed once, by rank 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
