"""GPU correctness run of the Triton backend and the public op on CUDA: the `gpu` tests, with a summary.

    python -m benchmark.op.gpu_check [--out DIR]

Runs `pytest -m gpu` on the files in TESTS (the op's and the engine's GPU cases, and the checkpoint
integrity tests: megatron's mixed-precision optimizer state saved and reloaded with weights_only=True) in this process (the cases, the oracles and the pass rules are written there), then prints one PASS/FAIL line per test with the errors it
measured (kernel next to torch's own), writes gpu_check.json (run stamp, one row per test) and ends with
`gpu_check: P/T passed on DEVICE`; exit status 1 on any failure or when nothing ran. Without a CUDA device
it says so and exits 0. `run_gpu_tests` is shared with benchmark/engine/gpu_attention_check.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmark.harness import ROOT, run_meta, write_json

TESTS = ("tests/op/backends/test_backends.py", "tests/op/test_compile.py", "tests/engine/test_generate.py",
         "tests/engine/test_rope.py", "tests/engine/test_graphs.py", "tests/train/test_checkpoint_integrity.py")


class _Rows:
    """pytest plugin: one row per test -- its id, outcome, seconds, what it recorded with
    `record_property("result", ...)`, and the failure's tail."""

    def __init__(self):
        self.rows = {}

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.passed:
            return  # setup and teardown only matter when they fail (or skip)
        row = self.rows.setdefault(report.nodeid, {"case": report.nodeid.split("::", 1)[-1], "outcome": "passed",
                                                   "seconds": 0.0})
        row.update((k, v) for k, v in dict(report.user_properties).get("result", {}).items() if k not in row)
        row["seconds"] = round(row["seconds"] + report.duration, 2)
        if report.failed:
            row["error"] = (row.get("error", "") + report.longreprtext)[-3000:]
        if row["outcome"] != "failed":
            row["outcome"] = report.outcome
        row["ok"] = row["outcome"] == "passed"


def run_gpu_tests(paths, *pytest_args: str) -> tuple[list, int]:
    """pytest -m gpu on `paths` (relative to the repository root) in this process: (rows, exit status)."""
    import pytest

    os.environ["AREAL_LCE_TEST_GPU_SESSION"] = "1"  # a GPU session: tests/helpers/gpu_host.py keeps CUDA visible
    plugin = _Rows()
    rc = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", *pytest_args,
                      *(os.path.join(ROOT, p) for p in paths)], plugins=[plugin])
    rows = list(plugin.rows.values())
    for r in rows:
        shown = {k: v for k, v in r.items() if k not in ("case", "ok", "outcome", "seconds", "why", "checks", "error")}
        print({"passed": "PASS", "failed": "FAIL"}.get(r["outcome"], "SKIP"), r["case"], f"({r['seconds']} s)",
              *(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={json.dumps(v, default=str)}"
                for k, v in shown.items()), flush=True)
    return rows, int(rc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    rows, rc = run_gpu_tests(TESTS)
    meta = run_meta()
    write_json(args.out, "gpu_check.json", {"meta": meta, "tests": list(TESTS), "pytest_exit": rc, "results": rows})
    print(f"gpu_check: {sum(r['ok'] for r in rows)}/{len(rows)} passed on {meta['device']}")
    return 0 if rc == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
