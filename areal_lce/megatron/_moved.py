"""The engine's former places under areal_lce.megatron, kept for one release: the names the package exported
(`moved_name`) and the modules (`install`: `import areal_lce.megatron.engine` and the like give a module that
forwards every attribute to the new one), each with a DeprecationWarning naming the new place."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MODULES = {
    "engine": "areal_lce.engine.engine", "config": "areal_lce.engine.config",
    "microbatch": "areal_lce.engine.microbatch", "schedule": "areal_lce.engine.schedule",
    "graphs": "areal_lce.engine.graphs", "optim": "areal_lce.engine.optim", "state": "areal_lce.engine.state",
    "parallel": "areal_lce.engine.parallel", "batch": "areal_lce.engine.batch", "own_loss": "areal_lce.engine.own_loss",
    "model": "areal_lce.engine.model.builder", "attention": "areal_lce.engine.model.attention",
    "kv_attention": "areal_lce.engine.model.kv_attention", "rope": "areal_lce.engine.model.rope",
    "generate": "areal_lce.engine.generation.generate", "decode": "areal_lce.engine.generation.decode",
    "sampling": "areal_lce.engine.generation.sampling",
}
NAMES = {"EngineConfig": "areal_lce.engine", "LCEConfig": "areal_lce.engine", "ModelConfig": "areal_lce.engine",
         "OptimConfig": "areal_lce.engine", "ParallelConfig": "areal_lce.engine", "MicroBatch": "areal_lce.engine",
         "MegatronEngine": "areal_lce.engine"}
_PREFIX = "areal_lce.megatron."


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} (the engine left areal_lce.megatron, which keeps the plugin seam); the "
                  "old name works until the next release", DeprecationWarning, stacklevel=3)


def moved_name(name: str):
    """areal_lce.megatron.<name> for a name that moved to areal_lce.engine."""
    if name not in NAMES:
        raise AttributeError(f"module 'areal_lce.megatron' has no attribute {name!r}")
    _warn(f"areal_lce.megatron.{name}", f"{NAMES[name]}.{name}")
    return getattr(importlib.import_module(NAMES[name]), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX):] in MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MODULES[spec.name[len(_PREFIX):]]
        _warn(spec.name, new)
        target = importlib.import_module(new)
        proxy = types.ModuleType(spec.name, f"Moved to {new}.")

        def forward(attr):
            return getattr(target, attr)

        proxy.__getattr__ = forward
        return proxy

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
