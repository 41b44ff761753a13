"""The fused op as torch.library custom ops, for every call without tensor parallelism.

    areal_lce::lce_forward   (hidden, weight, labels, inv_t?, options, keep_cache) -> (diff [2, N], stats [3, N]
                              ([5, N] with logit_sums), h_c, lse_ent [2, N], cache)
    areal_lce::lce_backward  (g_diff [2, N]?, h_c, weight, labels, inv_t?, lse_ent, cache, options, need_dh,
                              need_dw) -> (d_hidden, d_weight)

`options` is the call's LCEParams (every field but the process group, which a TP call never brings
here) as one JSON string: an option added to LCEParams travels through both ops without touching
their signatures. api.py builds it once per call in a function torch.compile evaluates at trace time
(`encode`), so under torch.compile it is a constant of the graph.

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
import functools
import json
from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends import get_backend
from .function import lce_backward, lce_forward, once_differentiable
from .types import LCEParams

@torch.compiler.assume_constant_result
def encode(**options) -> str:
    """The options string of one call: LCEParams' fields (but the TP ones) as sorted JSON."""
    return json.dumps(options, sort_keys=True)


@functools.lru_cache(maxsize=1024)
def decode(options: str) -> LCEParams:
    return LCEParams(**json.loads(options))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("areal_lce::lce_forward", mutates_args=())
def lce_forward_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor], options: str,
                   keep_cache: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    params = decode(options)
    f = lce_forward(hidden, weight, labels, inv_t, params, keep_cache)
    h_c = f.h_c if params.compact_ignored else hidden.new_empty(0)
    cache = f.cache if f.cache is not None else hidden.new_empty(0, dtype=torch.float32)
    return f.diff, f.stats, h_c, f.lse_ent, cache


@lce_forward_op.register_fake
def _(hidden, weight, labels, inv_t, options, keep_cache):
    n, h = hidden.shape
    acc = _acc(hidden.dtype)
    params = decode(options)
    spec = get_backend(params.backend).cache_spec(n, h, weight.shape[0], hidden.dtype, params, keep_cache)
    cache = hidden.new_empty(spec[0], dtype=spec[1]) if spec is not None else hidden.new_empty(0, dtype=torch.float32)
    h_c = hidden.new_empty(hidden.shape) if params.compact_ignored else hidden.new_empty(0)
    return (hidden.new_empty((2, n), dtype=acc), hidden.new_empty((5 if params.logit_sums else 3, n), dtype=acc),
            h_c, hidden.new_empty((2, n), dtype=acc), cache)


@torch.library.custom_op("areal_lce::lce_backward", mutates_args=())
def lce_backward_op(g_diff: Tensor, h_c: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                    lse_ent: Tensor, cache: Tensor, options: str, need_dh: bool, need_dw: bool) -> Tuple[Tensor, Tensor]:
    dh, dw = lce_backward(h_c, weight, labels, inv_t, lse_ent, cache if cache.numel() else None, g_diff,
                          decode(options), need_dh, need_dw, h_c.dtype)
    return (dh if dh is not None else h_c.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@lce_backward_op.register_fake
def _(g_diff, h_c, weight, labels, inv_t, lse_ent, cache, options, need_dh, need_dw):
    return (h_c.new_empty(h_c.shape) if need_dh else h_c.new_empty(0),
            weight.new_empty(weight.shape, dtype=decode(options).d_weight_dtype(weight.dtype)) if need_dw
            else weight.new_empty(0))


_N_INPUTS = 6  # hidden, weight, labels, inv_t, options, keep_cache


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, inv_t, options, _ = inputs
    diff, stats, h_c, lse_ent, cache = output
    ctx.mark_non_differentiable(stats, h_c, lse_ent, cache)
    ctx.set_materialize_grads(False)
    # hidden is saved a second time for once_differentiable only: with weight it ties a create_graph=True
    # gradient to the graph. No output is saved, so outputs may be edited in place before backward.
    ctx.save_for_backward(h_c if decode(options).compact_ignored else hidden, weight, labels, inv_t, lse_ent,
                          cache, hidden)
    ctx.options = options


@once_differentiable
def _backward(ctx, g_diff, *_non_differentiable):
    h_c, weight, labels, inv_t, lse_ent, cache, _ = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if g_diff is None or not (need_dh or need_dw):
        return (None,) * _N_INPUTS
    dh, dw = lce_backward_op(g_diff, h_c, weight, labels, inv_t, lse_ent, cache, ctx.options, need_dh, need_dw)
    return (dh if need_dh else None, dw if need_dw else None) + (None,) * (_N_INPUTS - 2)


lce_forward_op.register_autograd(_backward, setup_context=_setup_context)


def lce(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor], options: str) -> Tuple[Tensor, Tensor]:
    """(diff [2, N], stats [3, N] or [5, N] with logit_sums) of the op without TP through the custom ops
    (api.py validated and encoded the options)."""
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    diff, stats, _, _, _ = lce_forward_op(hidden, weight, labels, inv_t, options, keep)
    return diff, stats

