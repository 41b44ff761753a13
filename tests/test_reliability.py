"""Failure behaviour: bad input, kills and stalled ranks end in a clear error or a correct result, never in a
silently wrong number, an opaque crash or a hang.

In process: second-order gradients are refused; bad op options, environment variables and YAML (duplicate
keys, syntax errors, YAML 1.2 floats) are named; bad engine/RL options fail at config load; token ids
beyond the model's vocabulary fail at data load; a torn metrics line and a corrupt checkpoint behind
COMPLETE do not stop a resume, which still reproduces the uninterrupted run bitwise; checkpoint files are
fsynced before COMPLETE.
Two gloo ranks, ONE launch of tests/reliability_worker.py: a TP rank whose vocab shard is all padding
(op, materialised route, SFT job), a full weight passed with tp_group, ranks with different labels, and a
stalled rank against the collective timeout.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

from areal_lce import linear_logprobs_entropy
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import sft
from areal_lce.train.config import ConfigError, load_config
from areal_lce.train.logging_utils import MetricsLog, read_metrics
from areal_lce.train.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[1]
SFT_TINY = REPO / "configs" / "sft_tiny.yaml"
GRPO_TINY = REPO / "configs" / "grpo_tiny.yaml"


# ------------------------------------------------------------------------ second-order gradients

def _op_inputs(n_ignored: int, weight_grad: bool):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(10, 8, dtype=torch.float64, generator=g).requires_grad_(weight_grad)
    y = torch.randint(0, 10, (6,), generator=g)
    y[:n_ignored] = -100
    return h, w, y


# no ignored row (hidden saved as is) and ignored rows (hidden compacted) with a frozen weight: the
# refusal must reach d/dh in both, also when the gradient is mixed with other terms
@pytest.mark.parametrize("n_ignored,weight_grad", [(0, True), (2, False)], ids=["dense", "compacted-frozen_w"])
def test_second_order_gradient_is_refused(n_ignored, weight_grad):
    h, w, y = _op_inputs(n_ignored, weight_grad)
    first, = torch.autograd.grad(linear_logprobs_entropy(h, w, y).logprobs.sum(), h)
    out = linear_logprobs_entropy(h, w, y)
    g, = torch.autograd.grad((out.logprobs + 0.5 * out.entropy).sum() - 0.5 * out.entropy.sum(), h,
                             create_graph=True)
    assert torch.equal(g, first)  # first order is unchanged by create_graph=True
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad((g ** 2).sum() + (h ** 2).sum(), h)


def test_gradgradcheck_raises_instead_of_failing_silently():
    h, w, y = _op_inputs(1, True)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.gradgradcheck(lambda a, b: linear_logprobs_entropy(a, b, y).logprobs, (h, w))


# ------------------------------------------------------------------------ op options

def _call(**kw):
    g = torch.Generator().manual_seed(1)
    args = dict(hidden=torch.randn(4, 8, generator=g), weight=torch.randn(10, 8, generator=g),
                labels=torch.randint(0, 10, (4,), generator=g))
    args.update(kw)
    return linear_logprobs_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


BAD_OPTIONS = [
    pytest.param(dict(ignore_index=None), TypeError, "ignore_index", id="ignore_index=None"),
    pytest.param(dict(vocab_size=True), TypeError, "vocab_size", id="vocab_size=True"),
    pytest.param(dict(temperature="2.0"), TypeError, "temperature", id="temperature='2.0'"),
    pytest.param(dict(temperature=None), TypeError, "temperature", id="temperature=None"),
    pytest.param(dict(temperature=1e-40), ValueError, "temperature.*overflows", id="temperature=1e-40"),
    pytest.param(dict(hidden=torch.tensor(1.0)), TypeError, "hidden.*0-d", id="0-d hidden"),
    pytest.param(dict(hidden=torch.randn(4, 0), weight=torch.randn(10, 0)), ValueError, "H and weight's V",
                 id="H=0"),
    pytest.param(dict(hidden=torch.randn(4, 8, device="meta"), weight=torch.randn(10, 8, device="meta"),
                      labels=torch.zeros(4, dtype=torch.long, device="meta")), ValueError, "meta device",
                 id="meta tensors"),
    pytest.param(dict(tp_group=1), TypeError, "tp_group", id="tp_group=1"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_OPTIONS)
def test_bad_op_input_names_the_option(kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(**kw)


@pytest.mark.parametrize("var,value", [("AREAL_LCE_BACKEND", "torhc"), ("AREAL_LCE_TORCH_CHUNK_BYTES", "32M"),
                                       ("AREAL_LCE_TORCH_CHUNK_BYTES", "-1")])
def test_bad_environment_variable_is_named(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"environment variable {var}={value!r}"):
        _call(backend="auto" if var == "AREAL_LCE_BACKEND" else "torch")


def test_valid_chunk_budget_still_works(monkeypatch):
    monkeypatch.setenv("AREAL_LCE_TORCH_CHUNK_BYTES", "4096")  # tiny chunks: same values as the default
    small = _call(backend="torch").logprobs
    monkeypatch.delenv("AREAL_LCE_TORCH_CHUNK_BYTES")
    torch.testing.assert_close(small, _call(backend="torch").logprobs)
