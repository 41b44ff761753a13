"""cache_bytes="auto": the logits-cache budget min(4 GiB, device memory / 8), at least 1 GiB; 1 GiB on CPU.

The cache is used exactly when this rank's fp32 logits (4·N·V_shard bytes) fit the budget; results
are those of the recompute path. The engine option `engine.lce.cache_bytes` takes "auto" too.
"""
import pytest
import torch

import areal_lce
from areal_lce import device as device_mod
from areal_lce.backends.torch_chunked import TorchChunkedBackend

GiB = 1 << 30


@pytest.mark.parametrize("total_gib, expected_gib", [(80, 4), (141, 4), (24, 3), (16, 2), (8, 1), (4, 1)])
def test_auto_budget_of_a_device(monkeypatch, total_gib, expected_gib):
    monkeypatch.setattr(device_mod, "_total_memory", lambda kind, index: total_gib * GiB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device_mod.auto_cache_bytes(torch.device("cuda")) == expected_gib * GiB
    assert device_mod.auto_cache_bytes(torch.device("cuda", 3)) == expected_gib * GiB


def test_auto_budget_on_cpu_is_the_fixed_floor():
    assert device_mod.auto_cache_bytes(torch.device("cpu")) == GiB


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


def test_auto_keeps_the_logits_when_they_fit(seen_caches):
    cached = _step("auto")
    assert seen_caches[-1] is not None and tuple(seen_caches[-1].shape) == (40, 500)
    recomputed = _step(0)
    assert seen_caches[-1] is None
    for a, b in zip(cached, recomputed):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_auto_recomputes_when_they_do_not_fit(seen_caches, monkeypatch):
    monkeypatch.setattr(device_mod, "AUTO_CACHE_MIN_BYTES", 4 * 40 * 500 - 1)  # one byte short of the logits
    _step("auto")
    assert seen_caches[-1] is None
    monkeypatch.setattr(device_mod, "AUTO_CACHE_MIN_BYTES", 4 * 40 * 500)
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
    assert EngineConfig().lce.cache_bytes == 0
    for bad in ("lots", -1):
        with pytest.raises(ValueError, match="lce.cache_bytes"):
            LCEConfig(cache_bytes=bad)
    cfg = load_config(None, ["engine.lce.cache_bytes=auto"], cls=JobConfig)
    assert cfg.engine.lce.cache_bytes == "auto"
    cfg = load_config(None, ["engine.lce.cache_bytes=1073741824"], cls=JobConfig)
    assert cfg.engine.lce.cache_bytes == GiB
    with pytest.raises((ConfigError, ValueError), match="lce.cache_bytes"):
        load_config(None, ["engine.lce.cache_bytes=1.5"], cls=JobConfig)
