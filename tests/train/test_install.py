"""The installed package, not the checkout: build the wheel, install it into a fresh venv and run the main
job from a directory that holds no areal_lce, so every config and data file it reads must be package data.

Nothing is downloaded: the wheel is built without build isolation and installed with --no-deps --no-index
into a venv made with --system-site-packages whose `stack.pth` adds this interpreter's site-packages (the
venv the tests run in, itself a venv: --system-site-packages alone shows the base interpreter's) and the
folders PYTHONPATH brings packages from, the checkout excepted -- a plain
path line, so the checkout's editable-install hook there is not run and `import areal_lce` finds the
installed copy only.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers.paths import REPO
from areal_lce.train.__main__ import CONFIG_DIR, config_path
from areal_lce.train.config import ConfigError

# what a build reads: the project metadata, the package and configs/ (areal_lce/configs links to it)
SOURCES = ("pyproject.toml", "README.md", "areal_lce", "configs")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _path_stack() -> list:
    """The PYTHONPATH entries that bring packages (a GPU image's megatron-core in a --target folder, say),
    the checkout itself left out: the test drops PYTHONPATH so that areal_lce comes from the wheel alone."""
    repo = REPO.resolve()
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).is_dir() and Path(p).resolve() != repo]


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"  # a copy, so the build writes no build/ or egg-info into the checkout
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("areal_lce-*.whl")
    return wheel


def test_shipped_configs_are_the_repository_configs():
    """One copy of each config: areal_lce/configs is a link to configs/, so a new configs/*.yaml ships."""
    link = REPO / "areal_lce" / "configs"
    assert link.is_symlink() and os.readlink(link) == "../configs"
    assert sorted(p.name for p in link.glob("*.yaml")) == sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def test_builtin_names_a_shipped_config_and_nothing_else():
    assert config_path(None) == CONFIG_DIR / "sft_tiny.yaml"
    assert config_path("builtin:grpo_tiny.yaml") == CONFIG_DIR / "grpo_tiny.yaml"
    assert config_path("configs/grpo_tiny.yaml") == Path("configs/grpo_tiny.yaml")  # a path stays a path
    for bad in ("builtin:nope.yaml", "builtin:../pyproject.toml", "builtin:"):
        with pytest.raises(ConfigError, match=r"no shipped config .*\(shipped: .*sft_tiny\.yaml"):
            config_path(bad)


@pytest.mark.slow  # about 20 s on 2 idle cores (wheel build, pip, the job's start-up)
def test_the_installed_wheel_runs_the_main_job_from_another_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    shipped = {f"areal_lce/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    shipped |= {f"areal_lce/train/data/{p.name}" for p in (REPO / "areal_lce" / "train" / "data").iterdir()}
    assert shipped <= names, sorted(shipped - names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    stack = dict.fromkeys([*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")), *_path_stack()])
    (site / "stack.pth").write_text("".join(f"{p}\n" for p in stack))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([python, "-c", "import importlib.util; print(importlib.util.find_spec('areal_lce').origin)"],
                 cwd=elsewhere, env=env).stdout.strip()
    assert Path(where).is_relative_to(site), f"areal_lce imported from {where}, not the installed wheel"
    # the embedded default (configs/sft_tiny.yaml, data builtin:sft_tiny.jsonl), its first two steps
    proc = _run([python, "-m", "areal_lce.train", "trainer.stop_at=2", "trainer.progress=false"], cwd=elsewhere,
                env=env)
    assert "[sft]" in proc.stdout
    records = [json.loads(line) for line in (elsewhere / "runs" / "sft_tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
