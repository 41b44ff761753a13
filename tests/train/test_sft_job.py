"""The SFT job end to end on the real Megatron engine (CPU, tiny model): both LM-head routes, metrics,
checkpoint/resume reproducing the uninterrupted run, and a TP=2 torchrun launch."""
from __future__ import annotations

import json
import math

import pytest

from helpers.paths import REPO
from areal_lce.megatron import capture
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import sft
from areal_lce.train.config import load_config
from areal_lce.train.logging_utils import read_metrics

TINY = REPO / "configs" / "sft_tiny.yaml"
FIELDS = ("step", "loss", "entropy", "max_logit", "min_logit", "grad_norm", "lr", "tokens", "input_tokens",
          "tokens_per_s", "peak_mem_gib")


def _cfg(out, *overrides):
    # Small batches and few steps: a few seconds per run on a 2-core CPU.
    return load_config(TINY, [f"trainer.output_dir={out}", "trainer.global_batch_size=4",
                              "trainer.micro_batch_size=2", "trainer.progress=false", "trainer.log_interval=100",
                              "engine.optim.warmup_steps=1", "trainer.sample_prompts=0", *overrides])


@pytest.mark.slow
def test_sft_runs_on_both_routes_and_writes_metrics(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_run_fused = capture.run_fused

    def counting_run_fused(*args, **kwargs):
        calls["n"] += 1
        return real_run_fused(*args, **kwargs)

    monkeypatch.setattr(capture, "run_fused", counting_run_fused)
    losses = {}
    for fused in (True, False):
        out = tmp_path / f"fused_{fused}"
        before = calls["n"]
        # a 512-id model vocabulary: not padded, so megatron's own loss (flag off) and the fused route take
        # their softmax over the same columns
        res = sft.run(_cfg(out, "trainer.steps=3", f"engine.use_fused_linear_ce={str(fused).lower()}",
                           "engine.model.vocab_size=512"))
        # the flag picks the route: only the fused run goes through the capture seam (2 microbatches x 3 steps)
        assert (calls["n"] - before) == (6 if fused else 0)
        rows = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        # flag off: megatron-core's own loss builds no entropy or logit extremes, and the metrics say so
        fields = FIELDS if fused else tuple(f for f in FIELDS if f not in sft.STATS_KEYS)
        for r in rows:
            missing = [f for f in fields if f not in r]
            assert not missing, f"metrics.jsonl lacks {missing}"
            assert all(math.isfinite(r[f]) for f in fields), r
            if fused:
                assert r["max_logit"] >= r["min_logit"] and 0 < r["entropy"] < math.log(512) + 1e-4
            else:
                assert not set(sft.STATS_KEYS) & set(r), r
        assert (out / "metrics.png").stat().st_size > 1000
        assert (out / "config.yaml").is_file()
        assert ckpt.latest_checkpoint(out).name == "step_00000003"
        assert res["step"] == 3
        losses[fused] = [r["loss"] for r in rows]
    # same init, same data: the two routes agree to fp32 rounding step after step
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-5), losses


@pytest.mark.slow
def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path):
    common = ("trainer.steps=6", "trainer.save_interval=3", "engine.use_fused_linear_ce=true")
    full = sft.run(_cfg(tmp_path / "full", *common))
    full_loss = {r["step"]: r["loss"] for r in full["records"]}

    run_dir = tmp_path / "killed"
    # "killed" after step 4: the checkpoint of step 3 exists, step 4's work is lost
    sft.run(_cfg(run_dir, *common, "trainer.stop_at=4"))
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [3]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]

    resumed = sft.run(_cfg(run_dir, *common, "trainer.resume=auto"))
    assert [r["step"] for r in resumed["records"]] == [4, 5, 6]
    for r in resumed["records"]:  # model, optimizer, lr schedule, RNG and data order all restored
        assert r["loss"] == pytest.approx(full_loss[r["step"]], rel=1e-6, abs=1e-7), (r["step"], r["loss"],
                                                                                     full_loss[r["step"]])
    # the run directory reads as one uninterrupted run
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [3, 6]

    with pytest.raises(FileNotFoundError, match="trainer.resume=true"):
        sft.run(_cfg(tmp_path / "empty", "trainer.steps=2", "trainer.resume=true"))


def test_incomplete_checkpoint_is_ignored(tmp_path):
    (tmp_path / "checkpoints" / "step_00000009").mkdir(parents=True)  # no COMPLETE marker
    done = tmp_path / "checkpoints" / "step_00000004"
    done.mkdir(parents=True)
    (done / ckpt.MARKER).write_text("ok\n")
    assert ckpt.latest_checkpoint(tmp_path) == done
    assert ckpt.resolve_resume(False, tmp_path) is None
    assert ckpt.resolve_resume("auto", tmp_path / "nothing") is None


# One launch per layout: TP=2 (vocab-sharded LM head through the fused op), DP=2 (each rank takes
# half of the global batch) and CP=2 (each rank takes the zigzag half of every sequence); with DP and CP
# the token-mean loss must equal the single-process run's.
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 1), (1, 2)], ids=["tp2", "dp2", "cp2"])
@pytest.mark.distributed
def test_torchrun_launch(tmp_path, tp, cp):
    out = tmp_path / f"tp{tp}_cp{cp}"
    overrides = [f"engine.parallel.tensor_parallel={tp}", f"engine.parallel.context_parallel={cp}",
                 "trainer.steps=4", "engine.optim.warmup_steps=1",
                 "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.save_interval=0",
                 f"trainer.output_dir={out}", "trainer.progress=false", "trainer.log_interval=1",
                 "trainer.sample_prompts=2"]
    from helpers.launch import torchrun

    proc = torchrun("areal_lce.train", TINY, *overrides, module=True, timeout=180, cwd=REPO,
                    env={"PYTHONWARNINGS": "ignore"})
    assert f"TP {tp} x PP 1 x CP {cp} x DP {2 // tp // cp}" in proc.stdout and "fused linear op" in proc.stdout
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["loss"] < 6.0 for r in rows)
    # every rank wrote its engine file of the final checkpoint
    assert len(list((out / "checkpoints" / "step_00000004" / "engine").glob("rank*.pt"))) == 2
    assert (out / "metrics.png").is_file()
    # greedy completions after the last step (generation runs on every rank, printed by rank 0)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == ["Upper: robot\n", "Reverse: north\n"]
    assert all(s["reference"] for s in samples) and proc.stdout.count(" -> ") == 2
    if tp == 1:  # data / context parallel: same global batches, same init -> the single-process run's losses
        single_overrides = [o.replace(str(out), str(tmp_path / "single")) for o in overrides]
        single_overrides[1] = "engine.parallel.context_parallel=1"
        single = sft.run(load_config(TINY, single_overrides))
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in single["records"]], rel=1e-5)
