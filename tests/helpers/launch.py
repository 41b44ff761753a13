"""The one torchrun launch of the tests' multi-rank workers and jobs.

    torchrun(TESTS / "helpers" / "megatron_worker.py", out, result=out) -> the worker's JSON result (a dict)
    torchrun("areal_lce.train", cfg, "x=1", module=True, cwd=REPO)   -> the finished CompletedProcess

`python -m torch.distributed.run --standalone --nproc_per_node=N` on this interpreter, gloo ranks on CPU
(OMP_NUM_THREADS=1: 2 cores shared by the ranks), PYTHONPATH = the extra paths, this checkout, tests/, then
the caller's PYTHONPATH, so every rank imports this checkout and `helpers` (and, with `pythonpath=`, e.g. another
megatron-core installed aside). A failed launch -- a non-zero exit, no result file, a timeout -- raises
AssertionError with the tail of stdout and stderr. On timeout torchrun gets SIGTERM, which it passes on
to its ranks, and SIGKILL if it has not stopped 30 s later.

Under pytest, a launch of several ranks from a test without the `distributed` marker is refused (the
inner loop `-m "not distributed and not slow"` must not start any): tests/conftest.py records the
running test's markers in TEST_MARKERS.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Mapping, Optional, Sequence, Union

from helpers.paths import REPO, TESTS

TAIL = 6000  # characters of stdout and of stderr shown when a launch fails
TEST_MARKERS: Optional[frozenset] = None  # the running pytest item's marker names (None outside pytest)


def torchrun(target: Union[str, os.PathLike], *args, nproc: int = 2, module: bool = False, timeout: float = 400,
             env: Optional[Mapping[str, str]] = None, pythonpath: Union[str, Sequence[str]] = (),
             cwd: Union[str, os.PathLike, None] = None, result: Union[str, os.PathLike, None] = None,
             check_returncode: bool = True):
    """Launch `target` (a script path, or a module name with module=True) with `args` on `nproc` ranks.

    env:        variables set on top of this process's environment (after OMP_NUM_THREADS=1)
    pythonpath: path(s) put first on PYTHONPATH; empty strings are dropped
    result:     a JSON file the launch writes: returned parsed; its absence is a failure
    check_returncode: False when the result file alone decides (a worker that exits with a stalled
                process group behind it)
    Returns the parsed result when `result` is given, else the subprocess.CompletedProcess (stdout, stderr).
    """
    if nproc > 1 and TEST_MARKERS is not None and "distributed" not in TEST_MARKERS:
        raise AssertionError(f"a test launches {nproc} ranks of {target} without @pytest.mark.distributed")
    extra = [pythonpath] if isinstance(pythonpath, (str, os.PathLike)) else list(pythonpath)
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (*extra, REPO, TESTS, full_env.get("PYTHONPATH", "")) if str(p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *(["-m", str(target)] if module else [str(target)]), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its ranks (each in a session of its own) on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise AssertionError(_failure(f"timed out after {timeout:g} s", cmd, stdout, stderr)) from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check_returncode and proc.returncode != 0:
        raise AssertionError(_failure(f"exit status {proc.returncode}", cmd, stdout, stderr))
    if result is None:
        return done
    if not os.path.exists(result):
        raise AssertionError(_failure(f"no result file {result} (exit status {proc.returncode})", cmd, stdout, stderr))
    with open(result) as f:
        return json.load(f)


def _failure(why: str, cmd: Sequence[str], stdout: str, stderr: str) -> str:
    return (f"torchrun launch failed: {why}\n  {' '.join(cmd)}\n"
            f"--- stdout (tail)\n{(stdout or '')[-TAIL:]}\n--- stderr (tail)\n{(stderr or '')[-TAIL:]}")
