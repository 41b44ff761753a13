"""The op's one options value, `LCEOptions` (areal_lce/op/options.py): declared once (fields, defaults, checks,
help), taken by the op, the engine's YAML group, the route, the capture seam, the adapters and the HF
patch; and a temperature checked once per entry.
"""
from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

import areal_lce
from helpers.spies import count_temperature_checks

from areal_lce import LCEOptions, linear_logprobs_entropy
from areal_lce.op.options import MAX_TOP_K

BAD = [  # (field, value, exception): each refused at construction, the error naming the field
    ("temperature", 0.0, ValueError), ("temperature", True, TypeError), ("temperature", torch.tensor(1.0), TypeError),
    ("ignore_index", 1.5, TypeError), ("ignore_index", True, TypeError),
    ("vocab_size", 0, ValueError), ("vocab_size", "big", TypeError),
    ("return_stats", 1, TypeError), ("return_logit_sums", None, TypeError),
    ("backend", "tritno", ValueError), ("cache_bytes", -1, ValueError), ("cache_bytes", True, ValueError),
    ("cache_bytes", "lots", ValueError), ("check_labels", "maybe", ValueError), ("check_labels", 1, ValueError),
    ("compact_ignored", "auto", TypeError), ("invariant", 1, TypeError), ("logits_precision", "fp16", ValueError),
    ("d_weight_fp32", None, TypeError), ("top_k", MAX_TOP_K + 1, ValueError), ("top_k", 2.0, ValueError),
    ("softcap", -1.0, ValueError), ("softcap", float("inf"), ValueError),
]


@pytest.mark.parametrize("name,value,exc", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_option(name, value, exc):
    with pytest.raises(exc, match=name):
        LCEOptions(**{name: value})
    with pytest.raises(exc, match=f"linear_logprobs_entropy: {name}"):  # replace: the same check, the caller named
        LCEOptions().replace("linear_logprobs_entropy", **{name: value})


def test_every_field_has_its_default_check_and_help_in_one_place():
    for f in dataclasses.fields(LCEOptions):
        assert f.metadata["help"] and callable(f.metadata["check"]), f.name
    o = LCEOptions()
    assert (o.temperature, o.ignore_index, o.vocab_size, o.backend, o.cache_bytes, o.check_labels) == (
        1.0, -100, None, "auto", 0, True)
    assert isinstance(LCEOptions(temperature=2).temperature, float)  # an int is a number, stored as a float
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.backend = "torch"


def test_replace_checks_only_what_changes_and_names_unknown_keywords():
    o = LCEOptions(backend="torch", top_k=4)
    p = o.replace(return_stats=True)
    assert (p.backend, p.top_k, p.return_stats, o.return_stats) == ("torch", 4, True, False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_group'"):
        o.replace("linear_logprobs_entropy", tp_group=None)
    with pytest.raises(TypeError, match="options must be an areal_lce.LCEOptions"):
        LCEOptions.of({"backend": "torch"}, {}, "caller")


def _inputs():
    torch.manual_seed(0)
    h, w = torch.randn(12, 16), torch.randn(40, 16)
    y = torch.randint(0, 40, (12,))
    y[3] = -100
    return h, w, y


def test_the_value_and_the_keywords_are_one_call():
    h, w, y = _inputs()
    opts = LCEOptions(backend="torch", temperature=0.7, return_stats=True, top_k=3, vocab_size=37)
    a = linear_logprobs_entropy(h, w, y, opts)
    b = linear_logprobs_entropy(h, w, y, backend="torch", temperature=0.7, return_stats=True, top_k=3, vocab_size=37)
    c = linear_logprobs_entropy(h, w, y, LCEOptions(backend="torch"), temperature=0.7, return_stats=True, top_k=3,
                                vocab_size=37)  # overrides on top of a value
    for x, z in ((a, b), (a, c)):
        for u, v in zip(x, z):
            assert (u is None and v is None) or torch.equal(u, v)  # the same kernel computes both sides
    with pytest.raises(TypeError, match="unexpected keyword argument 'tempreature'"):
        linear_logprobs_entropy(h, w, y, tempreature=0.7)
    t = torch.full((12,), 0.7)  # a tensor temperature is a call input: the option is left as it is
    d = linear_logprobs_entropy(h, w, y, opts, temperature=t)
    assert torch.equal(d.logprobs, a.logprobs)


def test_the_engine_group_is_built_from_the_value():
    """engine.lce's op fields are LCEOptions' own (type, check and help: not restated); compact_ignored
    "auto" is the engine's; `options()` is the value the engine's route carries."""
    from areal_lce.engine.config import EngineConfig, LCEConfig

    ours = {f.name: f for f in dataclasses.fields(LCEOptions)}
    hints, op_hints = typing.get_type_hints(LCEConfig), typing.get_type_hints(LCEOptions)
    for f in dataclasses.fields(LCEConfig):
        if f.name == "compact_ignored":
            assert f.default == "auto" and f.metadata["check"] is not ours[f.name].metadata["check"]
            continue
        assert dict(f.metadata) == dict(ours[f.name].metadata) and hints[f.name] == op_hints[f.name]
    cfg = LCEConfig(backend="torch", invariant=True, logits_precision="bf16")
    o = cfg.options()
    assert isinstance(o, LCEOptions) and (o.backend, o.invariant, o.logits_precision, o.cache_bytes,
                                          o.compact_ignored) == ("torch", True, "bf16", "auto", None)
    assert EngineConfig().lce.cache_bytes == "auto"  # the engine's default budget
    with pytest.raises(TypeError, match=r"engine\.lce\.invariant"):
        LCEConfig(invariant="yes")


def test_the_adapters_share_one_list_of_block_options():
    from areal_lce.integrations import _common, miles, slime

    assert slime.BLOCK_OPTIONS is miles.BLOCK_OPTIONS is _common.BLOCK_OPTIONS
    assert not hasattr(slime, "_BLOCK_OPTIONS") and not hasattr(miles, "_BLOCK_OPTIONS")
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_byte'"):
        slime.log_probs_step(None, lambda: None, cache_byte=0)  # a misspelt op option: refused when built


def test_the_op_checks_a_temperature_once(monkeypatch):
    h, w, y = _inputs()
    calls = count_temperature_checks(monkeypatch)
    linear_logprobs_entropy(h, w, y, backend="torch", temperature=0.7)
    assert len(calls) == 1
    calls.clear()
    opts = LCEOptions(backend="torch", temperature=0.7)
    assert len(calls) == 1  # where the value is built
    linear_logprobs_entropy(h, w, y, opts)
    linear_logprobs_entropy(h, w, y, opts, return_stats=True)  # other fields changed: the temperature stays
    assert len(calls) == 1


def test_the_hf_head_checks_a_temperature_once(monkeypatch):
    from torch import nn

    from areal_lce.integrations.transformers.head import fused_head

    head = nn.Linear(16, 40, bias=False)
    h, _, y = _inputs()
    calls = count_temperature_checks(monkeypatch)
    fused_head(head, h, y, temperature=0.5, backend="torch")
    assert len(calls) == 1


def test_public_names():
    assert areal_lce.LCEOptions is LCEOptions and "LCEOptions" in areal_lce.__all__


def options_table() -> str:
    """docs/op.md's options table: LCEOptions' fields, their types, defaults and help strings."""
    from areal_lce.train.config_io import format_markdown

    return format_markdown(LCEOptions).split("\n\n", 1)[1]  # the table, without format_markdown's section title


def test_docs_options_table_is_generated_from_the_fields():
    from helpers.paths import REPO

    text = (REPO / "docs" / "op.md").read_text()
    table = text.split("<!-- options table: begin -->\n", 1)[1].split("<!-- options table: end -->", 1)[0]
    assert table == options_table(), "regenerate: python -c 'import sys; sys.path.insert(0, \"tests\"); " \
        "from op.test_options import options_table; print(options_table(), end=\"\")'"
