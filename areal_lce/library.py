"""The fused op as torch.library custom ops, for every call without tensor parallelism.

    areal_lce::lce_forward   (hidden, weight, labels, inv_t?, options...) -> (diff [2, N], stats [3, N]
                              ([5, N] with logit_sums), h_c, lse_ent [2, N], cache)
    areal_lce::lce_backward  (g_diff [2, N]?, h_c, weight, labels, inv_t?, lse_ent, cache, options...)
                              -> (d_hidden, d_weight)

Both are opaque to torch.compile: a fake (meta) implementation gives the output shapes from the input
shapes alone (the logits cache's through the backend's `cache_spec`), and `register_autograd` ties the
backward op to the forward, so `torch.compile(fullgraph=True)` traces a model calling
`linear_logprobs_entropy` without a graph break, forward and backward. The real implementations are
function.lce_forward / lce_backward, the same code the tensor-parallel autograd.Function runs (a
process group cannot be an operator argument, so TP calls take that path; see api.py).

The first two forward outputs are the op's results; the other three are what the backward needs:
the partitioned hidden (an empty placeholder when compact_ignored=False, then hidden itself is saved:
an op output may not alias an input), (lse, entropy) in partition order, and the logits cache (empty
when none is kept). They are marked non-differentiable and never materialise a gradient.

Second-order gradients are refused, as on the autograd.Function path: the backward runs under
function.once_differentiable, with the differentiable output `diff` saved so that a gradient taken with
create_graph=True is tied to a node that raises when differentiated again.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends import get_backend
from .function import lce_backward, lce_forward, once_differentiable
from .types import LCEParams


def _params(inv_t_scalar, ignore_index, vocab_size, shard_valid, cache_bytes, backend, compact_ignored,
            check_labels, logit_sums=False) -> LCEParams:
    return LCEParams(inv_t=inv_t_scalar, ignore_index=ignore_index, vocab_size=vocab_size,
                     vocab_start=0, shard_valid=shard_valid, cache_bytes=cache_bytes, backend=backend,
                     compact_ignored=compact_ignored, check_labels=check_labels, logit_sums=logit_sums)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("areal_lce::lce_forward", mutates_args=())
def lce_forward_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                   inv_t_scalar: Optional[float], ignore_index: int, vocab_size: int, shard_valid: int,
                   cache_bytes: int, backend: str, compact_ignored: bool, check_labels: str,
                   keep_cache: bool, logit_sums: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    params = _params(inv_t_scalar, ignore_index, vocab_size, shard_valid, cache_bytes, backend, compact_ignored,
                     check_labels, logit_sums)
    f = lce_forward(hidden, weight, labels, inv_t, params, keep_cache)
    h_c = f.h_c if compact_ignored else hidden.new_empty(0)
    cache = f.cache if f.cache is not None else hidden.new_empty(0, dtype=torch.float32)
    return f.diff, f.stats, h_c, f.lse_ent, cache


@lce_forward_op.register_fake
def _(hidden, weight, labels, inv_t, inv_t_scalar, ignore_index, vocab_size, shard_valid, cache_bytes, backend,
      compact_ignored, check_labels, keep_cache, logit_sums=False):
    n, h = hidden.shape
    acc = _acc(hidden.dtype)
    params = _params(inv_t_scalar, ignore_index, vocab_size, shard_valid, cache_bytes, backend, compact_ignored,
                     check_labels, logit_sums)
    spec = get_backend(backend).cache_spec(n, h, weight.shape[0], hidden.dtype, params, keep_cache)
    cache = hidden.new_empty(spec[0], dtype=spec[1]) if spec is not None else hidden.new_empty(0, dtype=torch.float32)
    h_c = hidden.new_empty(hidden.shape) if compact_ignored else hidden.new_empty(0)
    return (hidden.new_empty((2, n), dtype=acc), hidden.new_empty((5 if logit_sums else 3, n), dtype=acc), h_c,
            hidden.new_empty((2, n), dtype=acc), cache)


@torch.library.custom_op("areal_lce::lce_backward", mutates_args=())
def lce_backward_op(g_diff: Tensor, h_c: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                    lse_ent: Tensor, cache: Tensor, inv_t_scalar: Optional[float], ignore_index: int,
                    vocab_size: int, shard_valid: int, cache_bytes: int, backend: str, compact_ignored: bool,
                    need_dh: bool, need_dw: bool) -> Tuple[Tensor, Tensor]:
    params = _params(inv_t_scalar, ignore_index, vocab_size, shard_valid, cache_bytes, backend, compact_ignored,
                     "off")
    dh, dw = lce_backward(h_c, weight, labels, inv_t, lse_ent, cache if cache.numel() else None, g_diff, params,
                          need_dh, need_dw, h_c.dtype)
    return (dh if dh is not None else h_c.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@lce_backward_op.register_fake
def _(g_diff, h_c, weight, labels, inv_t, lse_ent, cache, inv_t_scalar, ignore_index, vocab_size, shard_valid,
      cache_bytes, backend, compact_ignored, need_dh, need_dw):
    return (h_c.new_empty(h_c.shape) if need_dh else h_c.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else weight.new_empty(0))


_OPTIONS = slice(4, 11)  # inv_t_scalar .. compact_ignored among the forward op's inputs
_N_INPUTS = 14  # hidden, weight, labels, inv_t, 8 options, keep_cache, logit_sums


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, inv_t = inputs[:4]
    diff, stats, h_c, lse_ent, cache = output
    ctx.mark_non_differentiable(stats, h_c, lse_ent, cache)
    ctx.set_materialize_grads(False)
    compact = inputs[10]
    # diff is saved for once_differentiable only (it ties a create_graph=True gradient to the graph)
    ctx.save_for_backward(h_c if compact else hidden, weight, labels, inv_t, lse_ent, cache, diff)
    ctx.options = inputs[_OPTIONS]


@once_differentiable
def _backward(ctx, g_diff, *_non_differentiable):
    h_c, weight, labels, inv_t, lse_ent, cache, _ = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if g_diff is None or not (need_dh or need_dw):
        return (None,) * _N_INPUTS
    dh, dw = lce_backward_op(g_diff, h_c, weight, labels, inv_t, lse_ent, cache, *ctx.options, need_dh, need_dw)
    return (dh if need_dh else None, dw if need_dw else None) + (None,) * (_N_INPUTS - 2)


lce_forward_op.register_autograd(_backward, setup_context=_setup_context)


def lce(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor], *, inv_t_scalar: Optional[float],
        ignore_index: int, vocab_size: int, shard_valid: int, cache_bytes: int, backend: str,
        compact_ignored: bool, check_labels: str, logit_sums: bool = False) -> Tuple[Tensor, Tensor]:
    """(diff [2, N], stats [3, N] or [5, N] with logit_sums) of the op without TP through the custom ops
    (api.py validated)."""
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    diff, stats, _, _, _ = lce_forward_op(hidden, weight, labels, inv_t, inv_t_scalar, ignore_index, vocab_size,
                                          shard_valid, cache_bytes, backend, compact_ignored, check_labels, keep,
                                          logit_sums)
    return diff, stats
