"""cache_bytes="auto": keep the fp32 logits when the hidden size is at least api.AUTO_CACHE_MIN_HIDDEN (2048)
and they take at most api.AUTO_CACHE_BYTES (6 GiB); a function of the shapes alone.

The cache is used exactly when this rank's fp32 logits (4·N·V_shard bytes) fit the budget; results
are those of the recompute path. The engine option `engine.lce.cache_bytes` defaults to "auto".
"""
import pytest
import torch

import areal_lce
from areal_lce.op import api
from areal_lce.op.backends.torch_chunked import TorchChunkedBackend

GiB = 1 << 30


@pytest.mark.parametrize("hidden, expected", [(896, 0), (2047, 0), (2048, 6 * GiB), (3584, 6 * GiB), (8192, 6 * GiB)])
def test_auto_budget_follows_the_hidden_size(hidden, expected):
    assert api.auto_cache_bytes(hidden) == expected


def test_auto_budget_does_not_look_at_the_device(monkeypatch):
    """Neither the device's memory nor what is free decides: a resumed run and a graph capture see one path."""
    def boom(*a, **k):
        raise AssertionError("cache_bytes='auto' queried the device")
    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)
    assert api.auto_cache_bytes(4096) == 6 * GiB


@pytest.fixture
def seen_caches(monkeypatch):
    """Record the cache object the torch backend's backward receives."""
    seen = []
    orig = TorchChunkedBackend.backward

    def spy(self, hidden, weight, labels, inv_t, params, cache, *rest, **kw):
        seen.append(cache)
        return orig(self, hidden, weight, labels, inv_t, params, cache, *rest, **kw)

    monkeypatch.setattr(TorchChunkedBackend, "backward", spy)
    return seen


def _step(cache_bytes, n=40, h=16, v=500):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.4).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    out = areal_lce.linear_logprobs_entropy(hidden, weight, labels, temperature=0.9, backend="torch",
                                            cache_bytes=cache_bytes)
    (out.logprobs.sum() + 0.2 * out.entropy.sum()).backward()
    return out.logprobs.detach(), out.entropy.detach(), hidden.grad, weight.grad


def test_auto_keeps_the_logits_at_a_large_hidden_size(seen_caches, monkeypatch):
    """At H >= AUTO_CACHE_MIN_HIDDEN (lowered here so the case stays small) the backward reads the cache, and
    every output and gradient is bitwise the recompute's (fp32: the cached logits are the forward's bits)."""
    monkeypatch.setattr(api, "AUTO_CACHE_MIN_HIDDEN", 16)
    cached = _step("auto")
    assert seen_caches[-1] is not None and tuple(seen_caches[-1].shape) == (40, 500)
    recomputed = _step(0)
    assert seen_caches[-1] is None
    for a, b in zip(cached[:2], recomputed[:2]):
        assert torch.equal(a, b)
    for a, b in zip(cached[2:], recomputed[2:]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_auto_recomputes_at_a_small_hidden_size_or_past_the_budget(seen_caches, monkeypatch):
    _step("auto")  # H = 16 < 2048
    assert seen_caches[-1] is None
    monkeypatch.setattr(api, "AUTO_CACHE_MIN_HIDDEN", 16)
    monkeypatch.setattr(api, "AUTO_CACHE_BYTES", 4 * 40 * 500 - 1)  # one byte short of the logits
    _step("auto")
    assert seen_caches[-1] is None
    monkeypatch.setattr(api, "AUTO_CACHE_BYTES", 4 * 40 * 500)
    _step("auto")
    assert seen_caches[-1] is not None


@pytest.mark.parametrize("bad", ["big", -1, 1.5, True])
def test_bad_cache_bytes_is_named(bad):
    with pytest.raises(ValueError, match="cache_bytes"):
        _step(bad)


def test_engine_option_accepts_auto():
    from areal_lce.engine.config import EngineConfig, LCEConfig
    from areal_lce.train.config import ConfigError, JobConfig, load_config

    assert EngineConfig(lce=LCEConfig(cache_bytes="auto")).lce.cache_bytes == "auto"
    assert EngineConfig().lce.cache_bytes == "auto"
    for bad in ("lots", -1):
        with pytest.raises(ValueError, match="lce.cache_bytes"):
            LCEConfig(cache_bytes=bad)
    cfg = load_config(None, ["engine.lce.cache_bytes=auto"], cls=JobConfig)
    assert cfg.engine.lce.cache_bytes == "auto"
    cfg = load_config(None, ["engine.lce.cache_bytes=1073741824"], cls=JobConfig)
    assert cfg.engine.lce.cache_bytes == GiB
    with pytest.raises((ConfigError, ValueError), match="lce.cache_bytes"):
        load_config(None, ["engine.lce.cache_bytes=1.5"], cls=JobConfig)
