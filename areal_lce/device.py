"""Device detection: CUDA, Ascend NPU (torch_npu, imported only here and in the Ascend backend), CPU."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def npu_available() -> bool:
    """True when torch_npu imports and sees a device. torch_npu without CANN can raise on import."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except RuntimeError:
        return False


def device_kind(device: torch.device) -> str:
    """'cuda', 'npu' or 'cpu' (any other device type is returned as is)."""
    return device.type
