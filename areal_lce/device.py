"""The device's memory budget for the op's logits cache (`cache_bytes="auto"`): CUDA, Ascend NPU, CPU;
and the one CUDA-only notice hidden on a CPU run."""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch

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


@contextlib.contextmanager
def cuda_advice_hidden_on_cpu(device: torch.device):
    """Inside the block, on a CPU device only, hide megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1
    (its tensor- and sequence-parallel linears give it on their first forward, whatever the device; a CPU
    run has nothing to set). Elsewhere the advice stands: on a GPU it is worth acting on."""
    with warnings.catch_warnings():
        if device.type == "cpu":
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)
        yield
