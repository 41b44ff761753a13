"""Spies on the capture seam's heads (the fused op and the materialised function), for the tests of what
options reach them (tests/megatron/test_token_stats.py, tests/engine/test_engine.py)."""
from __future__ import annotations

from areal_lce.megatron import capture


def spy_heads(monkeypatch) -> list:
    """Record the head options each route hands its head (the fused op or the materialised function)."""
    seen = []
    for name in ("linear_logprobs_entropy", "logprobs_entropy_from_logits"):
        def spy(*args, _real=getattr(capture, name), _name=name, **kw):
            seen.append((_name, {k: kw[k] for k in ("invariant", "logits_precision") if k in kw}))
            return _real(*args, **kw)
        monkeypatch.setattr(capture, name, spy)
    return seen
