"""One temperature rule (`checks.check_temperature`) at every entry point, each error naming its option.

The rule: a Python number (not a bool), finite and > 0, whose inverse fits fp32; or, where per-token
temperatures are taken, a floating-point tensor broadcastable to the labels (its values are checked on the
device with the labels: tests/op/test_sync_free.py). The sampler's one extension: exactly 0 is greedy.
Before, the entry points disagreed: `rl.temperature` took True and 1e-40 (refused by the op only at the
first training step), `MicroBatch` and `CaptureContext` took 0, -1, NaN and strings (refused deep in the op,
or never on megatron's own loss), the sampler let 1e-40 through and called a string a ValueError, and
megatron's own-loss path read True as 1.0.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from areal_lce import LCEOptions
from areal_lce.op.checks import check_sampling_temperature, check_temperature
from areal_lce.engine.generation.generate import check_request
from areal_lce.engine.microbatch import MicroBatch
from areal_lce.engine.own_loss import check_temperature_one
from areal_lce.megatron.capture import CaptureContext
from areal_lce.train.rl_config import RLConfig

IDS = torch.zeros(1, 4, dtype=torch.long)

# entry point -> (the name its errors carry, a call with the temperature)
ENTRIES = {
    "rl": ("rl.temperature", lambda t: RLConfig(temperature=t)),
    "microbatch": ("MicroBatch.temperature", lambda t: MicroBatch(IDS, IDS, t)),
    # the op's options value: what token_stats, the capture seam, the adapters and the HF patch take
    "options": ("temperature", lambda t: LCEOptions(temperature=t, vocab_size=8)),
    "sampler": ("generate: temperature", lambda t: check_request([[1, 2]], 1, t, 1.0)),
    "own_loss": ("temperature", check_temperature_one),
    "op": ("temperature", lambda t: check_temperature(t)),
}

BAD = [
    pytest.param(True, TypeError, id="bool"),  # not a number, though Python's True == 1
    pytest.param("1", TypeError, id="str"),
    pytest.param(None, TypeError, id="None"),
    pytest.param(-0.5, ValueError, id="negative"),
    pytest.param(math.nan, ValueError, id="nan"),
    pytest.param(math.inf, ValueError, id="inf"),
    pytest.param(1e-40, ValueError, id="tiny"),  # 1/T overflows fp32: the logits are scaled by it in fp32
]


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("value,exc", BAD)
def test_every_entry_point_refuses_what_the_rule_refuses(entry, value, exc):
    name, call = ENTRIES[entry]
    with pytest.raises(exc, match=re.escape(name)):
        call(value)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_zero_is_greedy_for_the_sampler_only(entry):
    name, call = ENTRIES[entry]
    if entry == "sampler":
        call(0)
        call(0.0)
        assert check_sampling_temperature(0) == 0.0
        with pytest.raises(TypeError, match="temperature"):
            check_sampling_temperature(False)  # a bool is not 0
    else:
        with pytest.raises(ValueError, match=re.escape(name)):
            call(0.0)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "own_loss"])
def test_valid_values_pass_as_floats(entry):
    _, call = ENTRIES[entry]
    for t in (0.7, 2):  # an int is a number
        call(t)
    assert RLConfig(temperature=2).temperature == 2.0 and isinstance(RLConfig(temperature=2).temperature, float)
    assert isinstance(MicroBatch(IDS, IDS, 1).temperature, float)


def test_own_loss_takes_only_one():
    check_temperature_one(1)
    check_temperature_one(1.0)
    with pytest.raises(ValueError, match="megatron-core's own loss"):
        check_temperature_one(0.7)


def test_tensor_temperatures_where_per_token_values_are_taken():
    labels_shape = (2, 3)
    per_row = torch.tensor([[0.5], [2.0]])
    out = check_temperature(per_row, "temperature=", shape=labels_shape)
    assert out.shape == labels_shape and torch.equal(out[:, 2], per_row[:, 0])
    with pytest.raises(ValueError, match=r"temperature= of shape \(3,\) does not broadcast to labels \(2, 4\)"):
        check_temperature(torch.ones(3), "temperature=", shape=(2, 4))
    with pytest.raises(TypeError, match="temperature= tensor must be floating point"):
        check_temperature(torch.ones(2, 3, dtype=torch.long), "temperature=", shape=labels_shape)
    # a per-token tensor where one number is taken: named
    for name, call in (ENTRIES["rl"], ENTRIES["microbatch"], ENTRIES["sampler"]):
        with pytest.raises(TypeError, match=re.escape(name) + ".*tensor"):
            call(torch.tensor(1.0))
    with pytest.raises(ValueError, match=re.escape("CaptureContext(temperature=...)")):
        CaptureContext(labels=IDS, options=LCEOptions(vocab_size=8), temperature=torch.ones(2, 4))  # labels' shape
    with pytest.raises(ValueError, match=re.escape("CaptureContext(temperature=...)")):  # a float is the option
        CaptureContext(labels=IDS, options=LCEOptions(vocab_size=8), temperature=0.5)
    CaptureContext(labels=IDS, options=LCEOptions(vocab_size=8), temperature=torch.ones(1, 4))


def test_hf_head_broadcasts_with_the_same_rule():
    from torch import nn

    from areal_lce.integrations.transformers.head import fused_head

    head = nn.Linear(8, 16, bias=False)
    hidden, labels = torch.randn(2, 3, 8), torch.randint(0, 16, (2, 3))
    out = fused_head(head, hidden, labels, temperature=torch.tensor([[0.5], [2.0]]), backend="torch")
    assert out.logprobs.shape == (2, 3)
    with pytest.raises(ValueError, match=re.escape("areal_lce.integrations.transformers: temperature of shape (4,)")):
        fused_head(head, hidden, labels, temperature=torch.ones(4), backend="torch")


@pytest.mark.parametrize("value,exc", BAD)
def test_engine_token_stats_checks_first(value, exc):
    """MegatronEngine.token_stats checks its temperature before anything else runs (before: True and 1e-40
    reached the route as 1.0 / a float whose inverse overflows; no engine is needed to see it)."""
    from areal_lce.engine.engine import MegatronEngine

    with pytest.raises(exc, match="token_stats: temperature"):
        MegatronEngine.token_stats(None, IDS, IDS, temperature=value)
