"""A checkpoint saved at one parallel layout resumes at others (tests/engine/checkpoint_worker.py, four gloo ranks):
saved at TP=2 (DP=2), loaded at TP=1 (DP=4) and at TP=2 + PP=2 (DP=1), and at TP=2 again; a 2-layer model
with tied embeddings (under PP=2 the last stage's LM head is a copy of the first stage's embedding).

Oracles:
* after each load the parameters and AdamW moments, gathered from their shards, are bitwise the saved ones
  (the padded vocabulary changes from 512 to 384 rows at TP=1: the 259 true rows are compared);
* the same-layout load reproduces the reference steps bit for bit (RNG states restored);
* the two steps after a load at another layout run on bitwise-equal state, so their losses differ from the
  reference's by rounding alone: the reductions are split and ordered otherwise (the vocab-parallel
  logsumexp, the row-parallel all-reduce, the data-parallel mean of the losses and of the gradients). For a
  sum of n fp32 terms the probabilistic rounding bound is ~sqrt(n)·u (u = 2^-24); the longest reduction is the
  logsumexp over 512 padded rows (sqrt(512) ≈ 23), and the loss chains a few such reductions per layer
  (2 layers) and a mean over 64 tokens: 64·u·|loss| per step bounds their sum, with the second step's
  parameters moved by one AdamW update of gradients that differ by the same relative rounding.
"""
from __future__ import annotations

import pytest

from pathlib import Path
from helpers.launch import torchrun

U = 2.0 ** -24  # fp32 unit roundoff


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_resumes_at_other_parallel_layouts(tmp_path):
    r = torchrun(Path(__file__).with_name("checkpoint_worker.py"), tmp_path, nproc=4, timeout=400,
                 env={"PYTHONWARNINGS": "ignore"}, result=tmp_path / "result.json")
    assert r["same_layout"] == r["reference"], r  # an unchanged layout resumes exactly
    for layout in ("tp1", "tp2_pp2"):
        got = r[layout]
        # 9 parameters (the LM head is the embedding), their exp_avg and exp_avg_sq
        assert got["keys"] == 27 and got["step_count"] == 2, got
        assert got["max_diff"] == 0.0, (layout, got)  # gathered parameters and moments: bitwise the saved ones
        for ref, loss in zip(r["reference"], got["losses"]):
            assert abs(loss - ref) <= 64 * U * abs(ref), (layout, got["losses"], r["reference"])
