"""The one builder of the tests' engines: a tiny MegatronEngine in this process (CPU, a gloo group of one),
or on each rank a worker launched.

    tiny_config(model=..., optim=..., lce=..., parallel=..., **engine_options)   -> EngineConfig
    tiny_engine(vocab_size=500, trainable=True, **the same)                      -> MegatronEngine

`model`, `optim`, `lce` and `parallel` are each a dict of overrides or a finished config (used as it is);
every other keyword is an EngineConfig option (use_fused_linear_ce, pack_sequences, seed, ...). Defaults:
the `tiny` preset at max_seq_len 64 and the op's torch backend (what a CPU test compares against);
everything else is EngineConfig's own default, so a test states only what it is about.
"""
from __future__ import annotations

from typing import Optional, Union

from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig

MODEL = dict(preset="tiny", max_seq_len=64)
LCE = dict(backend="torch")

Part = Union[dict, None, object]


def _part(cls, value: Part, defaults: Optional[dict] = None):
    if isinstance(value, cls):
        return value
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"tiny_config: {cls.__name__} overrides must be a dict or a {cls.__name__}, got {value!r}")
    return cls(**{**(defaults or {}), **(value or {})})


def tiny_config(*, model: Part = None, optim: Part = None, lce: Part = None, parallel: Part = None,
                **engine) -> EngineConfig:
    return EngineConfig(model=_part(ModelConfig, model, MODEL), optim=_part(OptimConfig, optim),
                        lce=_part(LCEConfig, lce, LCE), parallel=_part(ParallelConfig, parallel), **engine)


def tiny_engine(vocab_size: Optional[int] = 500, *, trainable: bool = True, **config):
    from areal_lce.engine.engine import MegatronEngine

    return MegatronEngine(tiny_config(**config), vocab_size=vocab_size, trainable=trainable)
