"""Launchers of output_kernels.py: the Triton backend's optional `selected_raw`, `selected_logprobs`,
`topk_logprobs` and `sparse_columns` (base.py). select.py keeps the torch version of each (the reference,
and what every other backend runs); the two agree bitwise in the forward, and in the backward up to the order
of one row's sum of its selected gradients."""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ...types import LCEParams
from ..base import alloc
from .runtime import INTERPRET, device_ctx
from .output_kernels import selected_gather_kernel, selected_lp_kernel, sparse_coef_kernel, topk_lp_kernel
from .select_launch import GATHER_H, GATHER_J, GATHER_R, _inv_t_args

ROWS = 16  # rows per program of the per-row kernels
SLOTS = 64  # K slots per block (a program's [ROWS, SLOTS] block; any K: more blocks)


def _block_k(k: int) -> int:
    return min(SLOTS, triton.next_power_of_2(max(k, 1)))


def _grid(n: int, k: int):
    return (triton.cdiv(n, ROWS), triton.cdiv(k, _block_k(k)))


def selected_raw(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, params: LCEParams) -> torch.Tensor:
    """fp32 [N, K] head-transformed raw logits at global ids (0 where not this shard's): select.py's gather
    route in one launch (no softcap: the caller keeps torch's tanh for that)."""
    n, k = ids.shape
    out = alloc((n, k), torch.float32, hidden.device)
    if n and k:
        with device_ctx(hidden.device):
            selected_gather_kernel[(triton.cdiv(n, GATHER_R), triton.cdiv(k, GATHER_J))](
                hidden, weight, ids.contiguous(), out, n, k, hidden.shape[1], params.vocab_start, params.shard_valid,
                params.ignore_index, BLOCK_R=GATHER_R, BLOCK_J=GATHER_J, BLOCK_H=GATHER_H,
                BF16_LOGITS=params.bf16_logits, UPCAST=INTERPRET, num_warps=4)
    return out


def selected_logprobs(r: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, inv_t,
                      params: LCEParams) -> torch.Tensor:
    """fp32 [N, K] selected logprobs from the TP-summed raw logits r [N, K] (select.forward_outputs)."""
    n, k = ids.shape
    out = alloc((n, k), torch.float32, r.device)
    it, scalar, has = _inv_t_args(inv_t, lse)
    if n and k:
        with device_ctx(r.device):
            selected_lp_kernel[_grid(n, k)](
                r.contiguous(), ids.contiguous(), labels, lse.contiguous(), it, out, n, k, scalar, params.ignore_index,
                params.vocab_size, HAS_INV_T=has, CHECK=params.check_labels == "deferred", BLOCK_R=ROWS,
                BLOCK_K=_block_k(k), num_warps=4, enable_fp_fusion=False)  # z = r·inv_t rounded, no FMA
    return out


def topk_logprobs(keys: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, params: LCEParams):
    """(fp32 [N, k] logprobs, int64 [N, k] ids) of select.sort_key keys [N, k] (select.forward_outputs)."""
    n, k = keys.shape
    lp = alloc((n, k), torch.float32, keys.device)
    ids = alloc((n, k), torch.int64, keys.device)
    if n and k:
        with device_ctx(keys.device):
            topk_lp_kernel[_grid(n, k)](keys.contiguous(), labels, lse.contiguous(), lp, ids, n, k, params.ignore_index,
                                        BLOCK_R=ROWS, BLOCK_K=_block_k(k), num_warps=4)
    return lp, ids


def sparse_columns(labels: torch.Tensor, inv_t, params: LCEParams, g: torch.Tensor, g_lse: Optional[torch.Tensor],
                   parts):
    """(g [2, N] with the dense part in g_lp, local columns int64 [N, J], coefficients fp32 [N, J]) of
    select_grad.SparseGrad for fp32 gradients: parts = ((selected ids, their gradient) or None, (top-k ids, their
    gradient) or None), J = 1 + K1 + K2 (the label's column first)."""
    n = labels.shape[0]
    (sel, g_sel), (top, g_top) = (p if p is not None else (None, None) for p in parts)
    k1 = sel.shape[1] if sel is not None else 0
    k2 = top.shape[1] if top is not None else 0
    dev = labels.device
    g = g.contiguous()
    g_out = alloc((2, n), torch.float32, dev)
    cols = alloc((n, 1 + k1 + k2), torch.int64, dev)
    coef = alloc((n, 1 + k1 + k2), torch.float32, dev)
    it, scalar, has = _inv_t_args(inv_t, g)
    if n:
        with device_ctx(dev):
            sparse_coef_kernel[(triton.cdiv(n, ROWS),)](
                labels, it, g, g_lse.contiguous() if g_lse is not None else g,
                sel.contiguous() if sel is not None else labels, g_sel.contiguous() if g_sel is not None else g,
                top.contiguous() if top is not None else labels, g_top.contiguous() if g_top is not None else g,
                g_out, cols, coef, n, k1, k2, scalar, params.ignore_index, params.vocab_start, params.shard_valid,
                HAS_INV_T=has, HAS_LSE=g_lse is not None, HAS_SEL=sel is not None, HAS_TOP=top is not None,
                BLOCK_R=ROWS, BLOCK_K=_block_k(max(k1, k2)), num_warps=4, enable_fp_fusion=False)
    return g_out, cols, coef
