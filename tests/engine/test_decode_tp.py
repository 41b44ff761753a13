"""KV-cache decode under tensor parallelism: CUDA graphs are used at TP > 1 on NCCL (their collectives are
captured) and not on gloo or CPU; the TP=2 decode path samples the tokens of eager and full-recompute
decoding (torchrun/run_decode_tp.py, gloo; on a GPU the same script compares graphed with eager decode)."""
from __future__ import annotations

import types

import pytest
import torch

from areal_lce.op import comms
from areal_lce.engine.generation import decode

from helpers.launch import torchrun


def _gm(device, tp, pp=1):
    return types.SimpleNamespace(device=torch.device(device),
                                 dist=types.SimpleNamespace(tp_size=tp, pp_size=pp, tp_group=object()))


@pytest.mark.parametrize("device, tp, pp, backend, usable", [
    ("cuda", 1, 1, None, True), ("cuda", 2, 1, "nccl", True), ("cuda", 2, 1, "gloo", False),
    ("cuda", 2, 2, "nccl", False), ("cpu", 1, 1, None, False), ("cpu", 2, 1, "gloo", False)])
def test_graphs_are_used_where_the_step_can_be_captured(monkeypatch, device, tp, pp, backend, usable):
    monkeypatch.setattr(comms, "group_backend", lambda group: backend)
    assert decode.graphs_usable(_gm(device, tp, pp)) is usable


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_decode_samples_the_eager_and_recompute_tokens(tmp_path):
    out = tmp_path / "decode_tp.json"
    res = torchrun("torchrun/run_decode_tp.py", "--tp", "2", "--out", out, nproc=2, result=out, timeout=300)
    assert res["graphs_usable"] is False  # gloo: the same fixed-shape step runs eagerly
    for temp in ("0.0", "1.0"):
        assert all(res[f"equal_t{temp}"].values()), res
