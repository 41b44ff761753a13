"""What the CPU running the tests offers, for the numerics tests that pick a second CPU path or an OpenBLAS
kernel it can run (tests/op/test_positions.py, tests/op/test_cpu_paths.py)."""
from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """The x86 feature flags of /proc/cpuinfo (empty where it cannot be read, e.g. off Linux)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()
