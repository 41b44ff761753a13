"""The Triton backend's deferred value check: checks.record's fold of one call in one kernel launch."""
from __future__ import annotations

import contextlib

import torch
import triton

from . import configs
from .kernels import check_labels_kernel


def record_labels(y: torch.Tensor, inv_t, vocab_size: int, ignore_index: int, rec: torch.Tensor) -> torch.Tensor:
    """Fold one call's bad labels and temperatures into the int64 record `rec` (checks.py "deferred")
    with check_labels_kernel, in place of a dozen [N] torch ops. Returns the [N] bool mask of bad labels."""
    n = y.numel()
    bad = torch.empty(n, dtype=torch.int8, device=y.device)
    it = inv_t.to(torch.float32).contiguous() if inv_t is not None else None
    y = y.contiguous()
    with torch.cuda.device(y.device) if y.device.type == "cuda" else contextlib.nullcontext():
        check_labels_kernel[(triton.cdiv(n, configs.CHECK_BLOCK),)](
            y, it if it is not None else y, bad, rec, n, vocab_size, ignore_index,
            HAS_INV_T=it is not None, BLOCK=configs.CHECK_BLOCK, num_warps=4)
    return bad.view(torch.bool)
