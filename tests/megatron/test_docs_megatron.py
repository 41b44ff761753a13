"""docs/megatron.md's CPU walk-through (`first_hour.py`) runs as written: the block is cut from the doc and
run at TP=1 (one process) and TP=2 with sequence parallelism (two gloo ranks)."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from helpers.launch import torchrun
from helpers.paths import REPO

DOC = REPO / "docs" / "megatron.md"


def _script(tmp_path):
    blocks = re.findall(r"```python\n(# first_hour\.py.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/megatron.md must hold one ```python block starting with '# first_hour.py'"
    path = tmp_path / "first_hour.py"
    path.write_text(blocks[0])
    return path


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout[-3000:]
    r = json.loads(lines[-1])
    assert r["loss"] > 0 and r["logprobs_max"] < 0 and r["final_norm_grad"] > 0, r
    return r


def _shown() -> dict:
    """What the doc says first_hour.py prints at TP=1 (and, it says, the same numbers at TP=2)."""
    found = re.findall(r'`(\{"tp": 1, [^`]*\})`', DOC.read_text())
    assert len(found) == 1, "docs/megatron.md must show first_hour.py's TP=1 output once"
    return json.loads(found[0])


def _matches_the_doc(got: dict, tp: int) -> None:
    # the doc prints 4 decimals: another CPU's BLAS (another fp32 summation order) may move the last digit
    want = {**_shown(), "tp": tp}
    assert got.keys() == want.keys() and got["tp"] == tp, (got, want)
    assert all(abs(got[k] - want[k]) <= 1e-4 for k in want if k != "tp"), (got, want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_first_hour_at_tp1_prints_what_the_doc_shows_run_after_run(tmp_path):
    """Two runs of the script (at once, one thread each: the time of one) print the same numbers, the doc's."""
    script, procs = _script(tmp_path), []
    for _ in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    first, second = (_result(out) for out, _err in outs)
    assert first == second  # the same process run twice: the same initialisation, the same numbers
    _matches_the_doc(first, tp=1)


@pytest.mark.distributed
def test_first_hour_at_tp2_sequence_parallel(tmp_path):
    proc = torchrun(_script(tmp_path), cwd=tmp_path, timeout=300)
    _matches_the_doc(_result(proc.stdout), tp=2)
