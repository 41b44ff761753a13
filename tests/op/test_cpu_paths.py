"""The numerics tests a second time, under another CPU path than the machine's own: ATen's AVX2 kernels
(`ATEN_CPU_CAPABILITY=avx2`), oneDNN capped at AVX2 (its bf16 GEMMs then take another kernel) and OpenBLAS's
Haswell kernel for numpy (the Triton interpreter's tl.dot). A bitwise claim that held only on one ISA level
fails here; a bound that was fitted to one machine's rounding fails here too. On an AVX-512 machine (most CI
hosts) this is a different path from the first run; on an AVX2-only one it repeats it, and the position
sweeps still vary the positions themselves."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from helpers.cpu import cpu_flags
from helpers.paths import REPO

NUMERICS = ["tests/op/test_positions.py", "tests/op/test_invariance.py", "tests/engine/test_main_grad.py",
            "tests/op/test_bounds.py"]
AVX2 = dict(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", OPENBLAS_CORETYPE="Haswell")


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags(),
                    reason="the second CPU path is AVX2: an x86-64 CPU with AVX2")
def test_numerics_under_the_avx2_path():
    env = dict(os.environ, **AVX2)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not distributed",
           *NUMERICS]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-4000:]
    print(tail)
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
