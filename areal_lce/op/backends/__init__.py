"""The one dispatch point: backend name -> Backend instance, and the auto/env/explicit resolution.

api.py resolves the name once per call (`resolve_backend`) and takes the instance (`get_backend`), which
the call's LCEParams carries from there on; library.py turns the name in an op's options string back into
the instance. Resolution order: explicit argument, then the
AREAL_LCE_BACKEND environment variable, then auto by device (cuda -> triton, npu -> triton_ascend,
else torch). An explicitly named backend that cannot load raises; auto warns once when an accelerator
falls back to the chunked torch backend.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Dict

import torch

from .base import Backend, ShardStats

# name -> (module, class); imported lazily so triton / torch_npu are only touched when used.
_REGISTRY = {
    "reference": ("areal_lce.op.backends.reference", "ReferenceBackend"),
    "torch": ("areal_lce.op.backends.torch_chunked", "TorchChunkedBackend"),
    "triton": ("areal_lce.op.backends.triton.launch", "TritonBackend"),
    "triton_ascend": ("areal_lce.op.backends.ascend.launch", "AscendBackend"),
}
BACKENDS = tuple(_REGISTRY)
_AUTO_KERNELS = {"cuda": "triton", "npu": "triton_ascend"}  # device type -> its kernel backend
ENV_VAR = "AREAL_LCE_BACKEND"


_LOADED: Dict[str, Backend] = {}  # one instance per backend, made on first use


def get_backend(name: str) -> Backend:
    """The instance of backend `name` (loaded on the first call). A loaded one is a dictionary read, which
    torch.compile traces without a graph break (api.py calls this after `resolve_backend` loaded it)."""
    backend = _LOADED.get(name)
    if backend is None:
        if name not in _REGISTRY:
            raise ValueError(f"backend={name!r} is not one of {BACKENDS + ('auto',)}")
        module, cls = _REGISTRY[name]
        try:
            backend = _LOADED[name] = getattr(importlib.import_module(module), cls)()
        except (ImportError, OSError, RuntimeError) as e:
            raise RuntimeError(f"backend={name!r} could not be loaded: {type(e).__name__}: {e}") from e
    return backend


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Resolve 'auto' / the env var to a concrete name and check it can run on `device`."""
    if name == "auto":
        name = os.environ.get(ENV_VAR, "auto") or "auto"
        if name not in _REGISTRY and name != "auto":
            raise ValueError(f"environment variable {ENV_VAR}={name!r} is not one of {BACKENDS + ('auto',)}")
    if name == "auto" and dtype == torch.float64:
        return "torch"  # the Triton kernels take bf16/fp16/fp32; fp64 (checks) runs chunked torch
    if name == "auto":
        kernel = _AUTO_KERNELS.get(device.type)
        if kernel is None:
            return "torch"
        try:
            get_backend(kernel)
            return kernel
        except RuntimeError as e:
            _warn_once(f"areal_lce: {kernel} backend unavailable on {device.type.upper()} ({e}); "
                       "using the chunked torch backend")
            return "torch"
    if name not in _REGISTRY:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS + ('auto',)}")
    if name == "triton" and device.type != "cuda" and not (device.type == "cpu" and interpreter_on()):
        raise ValueError(f"backend='triton' needs CUDA tensors (got device {device}); "
                         "CPU tensors run it only under TRITON_INTERPRET=1")
    if name == "triton_ascend" and device.type != "npu" and not (device.type == "cpu" and interpreter_on()):
        raise ValueError(f"backend='triton_ascend' needs NPU tensors (got device {device}); "
                         "CPU tensors run it only under TRITON_INTERPRET=1")
    get_backend(name)  # raises if it cannot load
    return name


__all__ = ["Backend", "ShardStats", "BACKENDS", "ENV_VAR", "get_backend", "resolve_backend", "interpreter_on"]
