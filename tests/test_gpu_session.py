"""On a host with a CUDA device, the `gpu` tests in their own session (tests/helpers/gpu_host.py): the main
session hides CUDA so that every other test runs as on a CPU-only host, and this test runs
`pytest -m gpu tests` in a child process that sees the GPU. It is the one place those tests run under the
README's command there; without a GPU (CI) it skips, as the `gpu` tests do."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import gpu_host
from helpers.paths import REPO


@pytest.mark.skipif(not gpu_host.MAIN_SESSION_ON_GPU_HOST,
                    reason="not the main session of a GPU host: the gpu tests run (or skip) in this session itself")
def test_the_gpu_tests_in_a_session_that_sees_the_gpu():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    proc = subprocess.run(cmd, cwd=REPO, env=gpu_host.gpu_session_env(), capture_output=True, text=True,
                          timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    print(tail)
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout, tail


@pytest.mark.parametrize("host", [
    dict(devices=2, env={"CUDA_VISIBLE_DEVICES": "0,1"}, hidden=True),  # a GPU host, devices named
    dict(devices=1, env={}, hidden=True),  # a GPU host, nothing set
    dict(devices=1, env={"CUDA_VISIBLE_DEVICES": ""}, hidden=False),  # CUDA hidden by hand: a CPU session
    dict(devices=0, env={}, hidden=False),  # a CPU-only host (CI): nothing changes
    dict(devices=1, env={gpu_host.GPU_SESSION: "1"}, hidden=False),  # the GPU session itself
], ids=["gpu-host-named", "gpu-host", "hidden-by-hand", "cpu-host", "gpu-session"])
def test_the_split_on_each_kind_of_host(monkeypatch, host):
    """split() as each host would run it (the device count simulated): CUDA hidden exactly in the main session
    of a GPU host, and the GPU session's environment gives the host's own values back."""
    for k in (*gpu_host.HIDDEN, gpu_host.GPU_SESSION, gpu_host.SAVED):
        monkeypatch.delenv(k, raising=False)
    for k, v in host["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the host's own value, which the GPU session must get back
    monkeypatch.setattr(gpu_host, "_cuda_devices", lambda: host["devices"])
    before = {k: host["env"].get(k) for k in ("CUDA_VISIBLE_DEVICES",)}
    assert gpu_host.split() is host["hidden"]
    if not host["hidden"]:
        return
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert gpu_host.split() is True  # a worker or launch of the main session: decided once, inherited
    child = gpu_host.gpu_session_env()
    assert child[gpu_host.GPU_SESSION] == "1" and gpu_host.SAVED not in child
    assert child.get("CUDA_VISIBLE_DEVICES") == before["CUDA_VISIBLE_DEVICES"]
    assert child.get("TRITON_INTERPRET") == "0"
