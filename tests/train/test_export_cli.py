"""`python -m areal_lce.export` on what a user may give it: a path that does not exist, a checkpoint that
matches its manifests but cannot be decoded (one line naming it, exit 1, no traceback), and a good one,
whose exported files all share one mode. One 1-step CPU SFT run of the tiny config."""
from __future__ import annotations

import os
import stat

import pytest

from helpers.paths import REPO
from areal_lce.export.__main__ import main
from areal_lce.train import checkpoint as ckpt

from test_checkpoint_integrity import _point_past_the_data


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    from areal_lce.train import sft
    from areal_lce.train.config import load_config

    run = tmp_path_factory.mktemp("export") / "run"
    sft.run(load_config(REPO / "configs" / "sft_tiny.yaml", [
        f"trainer.output_dir={run}", "trainer.steps=1", "trainer.global_batch_size=2", "trainer.micro_batch_size=2",
        "trainer.progress=false", "trainer.sample_prompts=0", "trainer.plot=false", "engine.optim.warmup_steps=0"]))
    return ckpt.latest_checkpoint(run)


def test_a_missing_path_is_named_as_missing(tmp_path, capsys):
    assert main([str(tmp_path / "nonexistent"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"config error: {tmp_path / 'nonexistent'} does not exist: give a "
                                               "checkpoint directory, RUN_DIR/checkpoints/step_N (traceback: --debug "
                                               "or AREAL_LCE_DEBUG=1)")


def test_exported_files_share_one_mode(step_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main([str(step_dir), str(out)]) == 0
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in out.iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_an_undecodable_checkpoint_ends_in_one_line(step_dir, tmp_path, capsys):
    import shutil

    damaged = tmp_path / "checkpoints" / step_dir.name
    shutil.copytree(step_dir, damaged)
    _point_past_the_data(damaged)
    assert main([str(damaged), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: UnreadableCheckpoint: checkpoint {damaged} cannot be read: "
                                               "CheckpointException on rank 0: "), err
    assert not (tmp_path / "out").exists()
