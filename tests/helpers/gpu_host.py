"""Two sessions on a machine with a GPU, so that the README's one test command means the same there as on CI.

The tests other than the `gpu` ones are written for a CPU-only host: the engine and the megatron seams take
CUDA whenever torch sees it, while their inputs, oracles and torchrun (gloo) launches are CPU ones. So on a
host with a CUDA device, `python -m pytest tests` runs as two sessions:

    the main session   CUDA hidden (CUDA_VISIBLE_DEVICES="", set here before anything initialises CUDA, and
                       inherited by every launch): every test runs as on a CPU-only host, the Triton kernels
                       through the interpreter; the `gpu` tests skip
    the GPU session    one test of the main session (tests/test_gpu_session.py) runs `pytest -m gpu tests` in
                       a child process with the host's CUDA_VISIBLE_DEVICES and TRITON_INTERPRET as they were,
                       and GPU_SESSION=1: every `gpu` test on the GPU, the kernels compiled

A process started with GPU_SESSION=1 (the child, benchmark/op/gpu_check.py, run_suite.sh's gpu phase) keeps
CUDA visible. Without a CUDA device nothing changes. Imported first by tests/conftest.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

GPU_SESSION = "AREAL_LCE_TEST_GPU_SESSION"  # "1": this process runs the gpu tests on the GPU
SAVED = "AREAL_LCE_TEST_HOST_ENV"  # JSON: the variables the main session changed, as the host had them
HIDDEN = ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def _cuda_devices() -> int:
    """CUDA devices torch sees, counted in a child process (this one must not initialise CUDA before it may
    hide it); 0 at once where there is no NVIDIA driver."""
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def split() -> bool:
    """Hide CUDA from this process and its children when it is the main session on a GPU host; True then."""
    if os.environ.get(GPU_SESSION) == "1" or SAVED in os.environ:
        return SAVED in os.environ and os.environ.get(GPU_SESSION) != "1"
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or _cuda_devices() == 0:
        return False
    os.environ[SAVED] = json.dumps({k: os.environ.get(k) for k in HIDDEN})
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True


def gpu_session_env() -> dict:
    """The environment of the GPU session: the host's own CUDA_VISIBLE_DEVICES and TRITON_INTERPRET back."""
    env = dict(os.environ)
    for k, v in json.loads(env.pop(SAVED, "{}")).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env[GPU_SESSION] = "1"
    return env


MAIN_SESSION_ON_GPU_HOST = split()  # on import: tests/conftest.py imports this module first
