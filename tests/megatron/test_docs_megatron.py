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


@pytest.mark.slow
def test_first_hour_at_tp1(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(_script(tmp_path))], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _result(proc.stdout)["tp"] == 1


@pytest.mark.distributed
def test_first_hour_at_tp2_sequence_parallel(tmp_path):
    proc = torchrun(_script(tmp_path), cwd=tmp_path, timeout=300)
    assert _result(proc.stdout)["tp"] == 2
