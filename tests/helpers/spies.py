"""Spies on the capture seam's heads (the fused op and the materialised function), for the tests of what
options reach them (tests/megatron/test_token_stats.py, tests/engine/test_engine.py), and on the
temperature rule (how often one entry checks a temperature: tests/op/test_options.py, test_token_stats.py)."""
from __future__ import annotations

import sys

from areal_lce.op import checks
from areal_lce.megatron import capture


def spy_heads(monkeypatch) -> list:
    """Record the head options each route hands its head (the fused op or the materialised function)."""
    seen = []
    for name in ("linear_logprobs_entropy", "logprobs_entropy_from_logits"):
        def spy(*args, _real=getattr(capture, name), _name=name, **kw):
            given = args[3].asdict() if len(args) > 3 else kw  # the fused op takes the LCEOptions value
            seen.append((_name, {k: given[k] for k in ("invariant", "logits_precision")}))
            return _real(*args, **kw)
        monkeypatch.setattr(capture, name, spy)
    return seen


def count_temperature_checks(monkeypatch) -> list:
    """Record every call of checks.check_temperature (its `what`), through whatever name a module of the
    package imported it by: how many times one entry checks a temperature."""
    real, calls = checks.check_temperature, []

    def counted(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("what", "temperature"))
        return real(*args, **kwargs)

    for name, mod in list(sys.modules.items()):
        if name.startswith("areal_lce") and getattr(mod, "check_temperature", None) is real:
            monkeypatch.setattr(mod, "check_temperature", counted)
    return calls
