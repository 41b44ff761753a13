"""Host side of the Ascend (Triton-Ascend) backend: checks, allocation, tile choice, grids.

Implements the backend contract of `areal_lce.op.backends.base` with three kernels (kernels.py):
forward stats, backward d_hidden and backward d_weight. Memory beyond the inputs: the [N] stats, the
fp32 [N, H] d_hidden the contract returns, and one fp32 [V_shard, H] d_weight accumulator (cast once
to weight.dtype at the end; no extra copy for fp32 weights). Nothing of size N x V is allocated; the
backward recomputes logits instead of caching them (params.cache_bytes is not used by this backend).

Tiles come from a unified-buffer budget (configs.pick_tiles) and grids are capped (configs: 65535 per
axis by default, further at the AI-core count on an NPU) with persistent programs striding over the
remaining tiles.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import torch

from ...types import LCEParams
from ..base import Backend, ShardStats, alloc, check_shard
from . import configs

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _npu_core_count(device: torch.device) -> Optional[int]:
    """AI-core (cube) count of the NPU holding `device`, None off-NPU or when it can't be read."""
    if device.type != "npu":
        return None
    index = device.index
    if index is None:
        index = torch.npu.current_device()  # torch.npu exists whenever an npu device does (torch_npu)
    return _core_count_of(int(index))


@functools.lru_cache(maxsize=None)
def _core_count_of(index: int) -> Optional[int]:
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        cores = int(props.get("num_aicore", -1))
    except Exception:  # a driver without this query (non-Ascend Triton, older CANN): no extra cap
        return None
    return cores if cores > 0 else None


def _aligned_labels(labels: torch.Tensor) -> torch.Tensor:
    # int64 loads from an address that is not 16-byte aligned miscompile in Triton on GPU; copy then.
    labels = labels.contiguous()
    if labels.data_ptr() % 16 != 0:
        labels = labels.clone()
    return labels


class AscendBackend(Backend):
    """Triton-Ascend backend (the same kernels run on CPU tensors under TRITON_INTERPRET=1).

    ub_bytes      unified-buffer budget per program for the tile calculator (None: env / 192 KiB).
    max_programs  cap on programs per launch (None: env / 65535); work past it is looped over.
    """

    name = "triton_ascend"
    supports_softcap = False  # api.py refuses softcap here

    def __init__(self, ub_bytes: Optional[int] = None, max_programs: Optional[int] = None):
        self.ub_bytes = configs.resolve_ub_bytes(ub_bytes)
        self.max_programs = configs.resolve_max_programs(max_programs)
        from . import kernels  # lazy: triton (or triton-ascend) is needed only once a backend exists

        self._k = kernels

    # ---- helpers -------------------------------------------------------------------------------
    def _prep(self, hidden, weight, labels, inv_t, params):
        check_shard("triton_ascend", _DTYPES, hidden, weight, labels, inv_t, params)
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        labels = _aligned_labels(labels.to(torch.int64))
        if inv_t is not None:
            inv_t = inv_t.to(torch.float32).contiguous()
        return hidden, weight, labels, inv_t, params.inv_t if inv_t is None else 1.0

    def tiles(self, kind: str, hidden: torch.Tensor, n_tokens: int, vocab: int) -> configs.Tiles:
        return configs.pick_tiles(kind, hidden=hidden.shape[1], elt_bytes=hidden.element_size(),
                                  ub_budget=self.ub_bytes, n_tokens=n_tokens, vocab=vocab)

    def programs(self, n_tiles: int, device: torch.device) -> int:
        """Programs to launch for `n_tiles` units of work (each program loops over the rest)."""
        n = min(n_tiles, self.max_programs)
        cores = _npu_core_count(device)
        if cores is not None:
            n = min(n, cores)
        return max(1, n)

    def _backward_rows(self, kind: str, out, hidden, weight, labels, inv_t, rows, params: LCEParams,
                       inv_t_scalar: float) -> None:
        """One backward kernel into the fp32 rows `out`: kind "bwd_dh" (d_hidden [N, H], a program per token
        tile) or "bwd_dw" (d_weight [V_shard, H], a program per vocab tile of the shard's valid rows)."""
        n, h = hidden.shape
        valid = params.shard_valid
        t = self.tiles(kind, hidden, n, valid)
        if kind == "bwd_dh":
            kernel, n_tiles = self._k.lce_bwd_dh_kernel, _cdiv(n, t.block_n)
        else:
            kernel, n_tiles = self._k.lce_bwd_dw_kernel, _cdiv(valid, t.block_v)
        kernel[(self.programs(n_tiles, hidden.device),)](
            hidden, weight, labels, inv_t if inv_t is not None else hidden, *rows, out,  # inv_t unread: HAS_INV_T
            n, h, valid, params.vocab_start, inv_t_scalar,
            hidden.stride(0), weight.stride(0), out.stride(0),
            HAS_INV_T=inv_t is not None,
            BLOCK_N=t.block_n, BLOCK_V=t.block_v, BLOCK_H=t.block_h,
        )

    # ---- contract ------------------------------------------------------------------------------
    def cache_spec(self, n, h, v_shard, dtype, params: LCEParams, keep_cache: bool):
        return None  # always recomputes

    def forward(self, hidden, weight, labels, inv_t, params: LCEParams, keep_cache: bool) -> ShardStats:
        hidden, weight, labels, inv_t, inv_t_scalar = self._prep(hidden, weight, labels, inv_t, params)
        n, h = hidden.shape
        dev = hidden.device
        sums = params.logit_sums
        outs = [alloc(n, torch.float32, dev) for _ in range(8 if sums else 6)]  # m..mx[, Σr, Σr²]
        if n > 0:
            t = self.tiles("fwd", hidden, n, params.shard_valid)
            grid = (self.programs(_cdiv(n, t.block_n), dev),)
            self._k.lce_fwd_kernel[grid](
                hidden, weight, labels, inv_t if inv_t is not None else hidden,
                *(outs if sums else outs + [outs[0], outs[0]]),  # the sums' pointers are unused without HAS_SUMS
                n, h, params.shard_valid, params.vocab_start, inv_t_scalar,
                hidden.stride(0), weight.stride(0),
                HAS_INV_T=inv_t is not None, HAS_SUMS=sums,
                BLOCK_N=t.block_n, BLOCK_V=t.block_v, BLOCK_H=t.block_h,
            )
        m, s, a, zy, mn, mx = outs[:6]
        return ShardStats(m=m, s=s, a=a, zy=zy, mn=mn, mx=mx, cache=None,
                          lsum=outs[6] if sums else None, lsq=outs[7] if sums else None)

    def backward(self, hidden, weight, labels, inv_t, params: LCEParams, cache: Any, lse, ent, g_lp, g_ent,
                 need_d_hidden: bool, need_d_weight: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        hidden, weight, labels, inv_t, inv_t_scalar = self._prep(hidden, weight, labels, inv_t, params)
        n, h = hidden.shape
        v_shard, valid = weight.shape[0], params.shard_valid
        dev = hidden.device
        rows = [x.to(torch.float32).contiguous() for x in (lse, ent, g_lp, g_ent)]
        for name, x in zip(("lse", "ent", "g_lp", "g_ent"), rows):
            if x.shape != (n,):
                raise ValueError(f"{name} must be [N={n}], got {tuple(x.shape)}")
        empty = n == 0 or valid == 0  # the kernels need both (kernels.py); the gradients are then 0
        d_hidden = d_weight = None
        if need_d_hidden:
            if empty:
                d_hidden = torch.zeros(n, h, dtype=torch.float32, device=dev)
            else:
                d_hidden = alloc((n, h), torch.float32, dev)
                self._backward_rows("bwd_dh", d_hidden, hidden, weight, labels, inv_t, rows, params, inv_t_scalar)
        if need_d_weight:
            if empty:
                d_weight = torch.zeros(v_shard, h, dtype=params.d_weight_dtype(weight.dtype), device=dev)
            else:
                acc = alloc((v_shard, h), torch.float32, dev)
                self._backward_rows("bwd_dw", acc, hidden, weight, labels, inv_t, rows, params, inv_t_scalar)
                acc[valid:].zero_()  # vocabulary padding rows: exactly 0 (the kernel skips them)
                d_weight = acc.to(params.d_weight_dtype(weight.dtype))  # the single cast of the fp32 accumulation
        return d_hidden, d_weight
