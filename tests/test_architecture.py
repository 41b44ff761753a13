"""The code's shape, checked: import layers (import-linter contracts in pyproject.toml), file sizes,
and where collectives may be called (docs/architecture.md)."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers.paths import REPO as ROOT

# one file, one tier, 100-400 lines (docs/architecture.md): a warning past WARN_LINES names the files to
# split by concern, a failure past MAX_LINES (never squeeze a file under the count)
WARN_LINES, MAX_LINES = 400, 500
# torch.distributed calls that move data between ranks; they belong in areal_lce/op/comms.py (the op) and the
# job-level module next to megatron/parallel.py, each with a comment saying what it reduces and why
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "broadcast_object_list", "all_gather_object", "barrier", "all_to_all", "send", "recv",
               "isend", "irecv"}


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    if exe.exists():
        return str(exe)
    found = shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e .[test], or .ci/setup.sh)")
    return found


def test_import_contracts_hold():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "kept" in r.stdout, r.stdout[-2000:]


def _sources(tops=("areal_lce", "benchmark", "torchrun", "tests")):
    for top in tops:
        yield from sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _over(paths, limit: int, root: Path = ROOT) -> dict:
    return {str(p.relative_to(root)): n for p in paths if (n := len(p.read_text().splitlines())) > limit}


def test_no_file_over_500_lines_and_a_warning_over_400():
    files = list(_sources())
    long = _over(files, MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"
    near = _over(files, WARN_LINES)
    if near:
        warnings.warn(f"files over {WARN_LINES} lines (split by concern before {MAX_LINES}): {near}", UserWarning)


def test_the_line_count_sees_a_long_file(tmp_path):
    f = tmp_path / "long.py"
    f.write_text("x = 1\n" * (MAX_LINES + 1))
    g = tmp_path / "short.py"
    g.write_text("x = 1\n" * WARN_LINES)
    assert _over([f, g], MAX_LINES, tmp_path) == {"long.py": MAX_LINES + 1}
    assert _over([f, g], WARN_LINES - 1, tmp_path) == {"long.py": MAX_LINES + 1, "short.py": WARN_LINES}


def _collective_calls(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            base = node.func.value
            if isinstance(base, ast.Name) and base.id in {"dist", "torch_dist"}:
                yield node.lineno, node.func.attr
            elif isinstance(base, ast.Attribute) and base.attr == "distributed":
                yield node.lineno, node.func.attr


def test_collectives_only_in_the_comms_modules():
    allowed = {"areal_lce/op/comms.py", "areal_lce/megatron/dist_utils.py", "areal_lce/engine/parallel.py"}
    found = {}
    for p in (ROOT / "areal_lce").rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        calls = list(_collective_calls(p))
        if calls and rel not in allowed:
            found[rel] = calls
    assert not found, f"torch.distributed collectives outside the comms modules: {found}"


def test_the_collective_scan_sees_a_collective(tmp_path):
    # the scan above must be able to fail: a direct collective is found
    f = tmp_path / "x.py"
    f.write_text("import torch.distributed as dist\n\ndef f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n")
    assert [c for _, c in _collective_calls(f)] == ["all_reduce", "barrier"]
