"""The one CUDA-only notice hidden on a CPU run."""
from __future__ import annotations

import contextlib
import warnings

import torch

@contextlib.contextmanager
def cuda_advice_hidden_on_cpu(device: torch.device):
    """Inside the block, on a CPU device only, hide megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1
    (its tensor- and sequence-parallel linears give it on their first forward, whatever the device; a CPU
    run has nothing to set). Elsewhere the advice stands: on a GPU it is worth acting on."""
    with warnings.catch_warnings():
        if device.type == "cpu":
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)
        yield
