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


AUTO_CACHE_MIN_BYTES = 1 << 30  # cache_bytes="auto": at least 1 GiB (the fixed budget on CPU) ...
AUTO_CACHE_MAX_BYTES = 4 << 30  # ... at most 4 GiB, and otherwise an eighth of the device's memory


@functools.lru_cache(maxsize=None)
def _total_memory(device_type: str, index: int) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).total_memory
    return torch.npu.get_device_properties(index).total_memory  # torch_npu's mirror of the CUDA API


def auto_cache_bytes(device: torch.device) -> int:
    """Logits-cache budget of cache_bytes="auto": min(4 GiB, device memory / 8), at least 1 GiB; 1 GiB on
    CPU (host memory is shared with everything else, so no fraction of it is taken)."""
    if device.type not in ("cuda", "npu"):
        return AUTO_CACHE_MIN_BYTES
    module = torch.cuda if device.type == "cuda" else torch.npu
    index = device.index if device.index is not None else module.current_device()
    return max(AUTO_CACHE_MIN_BYTES, min(AUTO_CACHE_MAX_BYTES, _total_memory(device.type, index) // 8))
