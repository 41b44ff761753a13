"""The distill job end to end on CPU: the SFT job makes a small teacher on the embedded data, then
configs/distill_tiny.yaml distils it into a fresh 1-layer student (both in this process, seeded).

What must hold at this size: the forward KL on the teacher's top-k support falls by more than half, and
the student's task score moves from a fresh model's (random bytes: ~0.01) towards the teacher's. The
full-size run (the embedded sft_tiny teacher, 100 steps) is docs/results/distill_tiny_*.
"""
from __future__ import annotations

import math

import pytest
import torch


from helpers.paths import REPO
from areal_lce.train import distill, sft  # noqa: E402
from areal_lce.train.config import ConfigError, load_config  # noqa: E402
from areal_lce.train.logging_utils import read_metrics  # noqa: E402

QUIET = ["trainer.progress=false", "trainer.log_interval=1000", "trainer.plot=false"]
# a teacher of ~20 s on 2 cores: the embedded SFT config, shorter, at twice its learning rate
TEACHER = ["trainer.steps=100", "trainer.sample_prompts=0", "trainer.save_interval=0", "engine.optim.lr=0.01",
           "engine.optim.min_lr=0.001"]


@pytest.fixture
def one_thread():
    """As the CLI runs on a CPU (__main__.limit_cpu_threads): tiny models gain nothing from a second
    intra-op thread, and on a loaded machine its busy-waiting makes the run several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_distill_tiny_closes_the_gap_to_an_sft_teacher(tmp_path, one_thread):
    teacher_dir = tmp_path / "teacher"
    sft.run(load_config(REPO / "configs" / "sft_tiny.yaml", [f"trainer.output_dir={teacher_dir}", *QUIET, *TEACHER]))
    cfg = load_config(REPO / "configs" / "distill_tiny.yaml",
                      [f"trainer.output_dir={tmp_path / 'distill'}", f"distill.teacher_checkpoint={teacher_dir}",
                       "trainer.steps=24", "trainer.save_final=false", *QUIET])
    records = distill.run(cfg)["records"]
    print({k: [round(r[k], 3) for r in records] for k in ("kl_fwd", "score", "teacher_score", "step_time_s")})
    assert records == read_metrics(tmp_path / "distill" / "metrics.jsonl")
    for key in ("kl_fwd", "score", "teacher_score", "entropy", "reverse_kl", "grad_norm", "lr", "step_time_s"):
        assert key in records[0], key

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    first, last = records[:2], records[-6:]
    assert mean("kl_fwd", last) < 0.5 * mean("kl_fwd", first), [r["kl_fwd"] for r in records]
    # the teacher is far above a fresh student, and the student gains on it
    assert mean("teacher_score", records) > 3 * mean("score", first), [r["teacher_score"] for r in records]
    # seeds 1, 2, 3 and 1234: first 2 steps 0.002-0.008, last 6 steps 0.037-0.058
    assert mean("score", last) > max(2 * mean("score", first), 0.02), [r["score"] for r in records]


@pytest.mark.distributed
def test_torchrun_context_parallel_matches_single_process(tmp_path, one_thread):
    """job distill at engine.parallel.context_parallel=2: the teacher's top-k ids and the student's selected
    ids go through the CP split and gather (megatron/per_token.py) and give the single process's metrics;
    and the same teacher as an HF export (distill.teacher.hf_checkpoint_dir) gives them too."""
    from helpers.launch import torchrun

    teacher_dir = tmp_path / "teacher"  # a 6-step teacher: parity needs weights, not a good teacher
    sft.run(load_config(REPO / "configs" / "sft_tiny.yaml", [f"trainer.output_dir={teacher_dir}", *QUIET,
                                                             "trainer.steps=6", "trainer.sample_prompts=0"]))
    common = [f"distill.teacher_checkpoint={teacher_dir}", "trainer.steps=2", "trainer.save_final=false", *QUIET]
    out = tmp_path / "cp2"
    proc = torchrun("areal_lce.train", REPO / "configs" / "distill_tiny.yaml", "engine.parallel.context_parallel=2",
                    f"trainer.output_dir={out}", *common, module=True, timeout=240, cwd=REPO,
                    env={"PYTHONWARNINGS": "ignore"})
    assert "TP 1 x PP 1 x CP 2 x DP 1" in proc.stdout
    ref = distill.run(load_config(REPO / "configs" / "distill_tiny.yaml",
                                  [f"trainer.output_dir={tmp_path / 'cp1'}", *common]))["records"]
    from areal_lce.export.__main__ import export_checkpoint

    hf_dir = export_checkpoint(teacher_dir / "checkpoints" / "step_00000006", tmp_path / "teacher_hf")
    from_hf = distill.run(load_config(REPO / "configs" / "distill_tiny.yaml",
                                      [f"trainer.output_dir={tmp_path / 'hf'}", *common, "distill.teacher_checkpoint=",
                                       f"distill.teacher.hf_checkpoint_dir={hf_dir}"]))["records"]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and len(from_hf) == 2
    for a, b in [*zip(rows, ref), *zip(from_hf, ref)]:
        assert a["sample"] == b["sample"]
        for k in ("kl_fwd", "reverse_kl", "entropy", "score", "teacher_score", "grad_norm"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


def test_distill_config_refuses_ppo_options_and_a_teacher_without_weights():
    path = REPO / "configs" / "distill_tiny.yaml"
    with pytest.raises(ConfigError, match="rl.clip_eps"):
        load_config(path, ["rl.clip_eps=0.3"])
    with pytest.raises(ConfigError, match="no weights"):
        load_config(path, ["distill.teacher_checkpoint="])
    with pytest.raises(ConfigError, match="use_fused_linear_ce"):
        load_config(path, ["engine.use_fused_linear_ce=false"])
    with pytest.raises(ConfigError, match="distill.teacher.max_seq_len"):
        load_config(path, ["distill.teacher.max_seq_len=64"])
    cfg = load_config(path, [])
    assert cfg.job == "distill" and cfg.distill.top_k == 8 and cfg.distill.teacher.preset == "tiny"


def test_teacher_checkpoint_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="distill.teacher_checkpoint"):
        distill.load_teacher_weights(None, tmp_path)
