"""The fused op as torch.library custom ops, for every call without tensor parallelism.

    areal_lce::lce_forward   (hidden, weight, labels, inv_t?, selected_ids?, options, keep_cache) -> (diff [2, N],
                              dstats [R, N], stats [S, N], selected [N, K], topk_lp [N, k], topk_ids [N, k],
                              h_c, lse_ent [2, N], cache)  (rows: LCEParams.dstat_rows / stat_rows)
    areal_lce::lce_backward  (g_diff?, g_dstats?, g_sel?, g_topk?, h_c, weight, labels, inv_t?, selected_ids?,
                              topk_ids, lse_ent, cache, options, need_dh, need_dw) -> (d_hidden, d_weight)

`options` is the call's LCEParams (every field but the process group, which a TP call never brings
here) as one JSON string, the backend by its name: an option added to LCEParams travels through both
ops without touching their signatures. api.py builds it once per call in a function torch.compile
evaluates at trace time (`encode`), so under torch.compile it is a constant of the graph. `decode` turns
the name back into the backend instance, the one place past api.py where a backend is taken by name (an
operator argument cannot be the instance).

Both are opaque to torch.compile: a fake (meta) implementation gives the output shapes from the input
shapes alone (the logits cache's through the backend's `cache_spec`), and `register_autograd` ties the
backward op to the forward, so `torch.compile(fullgraph=True)` traces a model calling
`linear_logprobs_entropy` without a graph break, forward and backward. The real implementations are
function.lce_forward / lce_backward, the same code the tensor-parallel autograd.Function runs (a
process group cannot be an operator argument, so TP calls take that path; see api.py).

The first six forward outputs are the op's results ([N, 0] where selected_ids / top_k are not asked);
the other three are what the backward needs:
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
from .function import empty_extras, lce_backward, lce_forward, once_differentiable
from .types import LCEParams

@torch.compiler.assume_constant_result
def encode(**options) -> str:
    """The options string of one call: LCEParams' fields (but the TP ones) as sorted JSON."""
    return json.dumps(options, sort_keys=True)


@functools.lru_cache(maxsize=1024)
def decode(options: str) -> LCEParams:
    """The call's LCEParams from its options string, the backend's name resolved to its instance."""
    fields = json.loads(options)
    return LCEParams(**{**fields, "backend": get_backend(fields["backend"])})


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("areal_lce::lce_forward", mutates_args=())
def lce_forward_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                   selected_ids: Optional[Tensor], options: str, keep_cache: bool
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    params = decode(options)
    f = lce_forward(hidden, weight, labels, inv_t, params, keep_cache, selected_ids=selected_ids)
    h_c = f.h_c if params.compact_ignored else hidden.new_empty(0)
    cache = f.cache if f.cache is not None else hidden.new_empty(0, dtype=torch.float32)
    sel, topk_lp, topk_ids = empty_extras(f, labels.shape[0], hidden.device)
    return f.diff, f.dstats, f.stats, sel, topk_lp, topk_ids, h_c, f.lse_ent, cache


@lce_forward_op.register_fake
def _(hidden, weight, labels, inv_t, selected_ids, options, keep_cache):
    n, h = hidden.shape
    acc = _acc(hidden.dtype)
    params = decode(options)
    spec = params.backend.cache_spec(n, h, weight.shape[0], hidden.dtype, params, keep_cache)
    cache = hidden.new_empty(spec[0], dtype=spec[1]) if spec is not None else hidden.new_empty(0, dtype=torch.float32)
    h_c = hidden.new_empty(hidden.shape) if params.compact_ignored else hidden.new_empty(0)
    k_sel = 0 if selected_ids is None else selected_ids.shape[1]
    return (hidden.new_empty((2, n), dtype=acc), hidden.new_empty((len(params.dstat_rows), n), dtype=acc),
            hidden.new_empty((len(params.stat_rows), n), dtype=acc),
            hidden.new_empty((n, k_sel), dtype=torch.float32), hidden.new_empty((n, params.top_k), dtype=torch.float32),
            hidden.new_empty((n, params.top_k), dtype=torch.int64),
            h_c, hidden.new_empty((2, n), dtype=acc), cache)


@torch.library.custom_op("areal_lce::lce_backward", mutates_args=())
def lce_backward_op(g_diff: Optional[Tensor], g_dstats: Optional[Tensor], g_sel: Optional[Tensor],
                    g_topk: Optional[Tensor], h_c: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                    selected_ids: Optional[Tensor], topk_ids: Tensor, lse_ent: Tensor, cache: Tensor, options: str,
                    need_dh: bool, need_dw: bool) -> Tuple[Tensor, Tensor]:
    dh, dw = lce_backward(h_c, weight, labels, inv_t, lse_ent, cache if cache.numel() else None, g_diff,
                          decode(options), need_dh, need_dw, h_c.dtype, g_dstats=g_dstats,
                          selected_ids=selected_ids, g_sel=g_sel, topk_ids=topk_ids if topk_ids.numel() else None,
                          g_topk=g_topk)
    return (dh if dh is not None else h_c.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@lce_backward_op.register_fake
def _(g_diff, g_dstats, g_sel, g_topk, h_c, weight, labels, inv_t, selected_ids, topk_ids, lse_ent, cache, options,
      need_dh, need_dw):
    return (h_c.new_empty(h_c.shape) if need_dh else h_c.new_empty(0),
            weight.new_empty(weight.shape, dtype=decode(options).d_weight_dtype(weight.dtype)) if need_dw
            else weight.new_empty(0))


_N_INPUTS = 7  # hidden, weight, labels, inv_t, selected_ids, options, keep_cache


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, inv_t, selected_ids, options, _ = inputs
    diff, dstats, stats, sel, topk_lp, topk_ids, h_c, lse_ent, cache = output
    ctx.mark_non_differentiable(stats, topk_ids, h_c, lse_ent, cache)
    ctx.set_materialize_grads(False)
    # hidden is saved a second time for once_differentiable only: with weight it ties a create_graph=True
    # gradient to the graph. No output is saved, so outputs may be edited in place before backward.
    ctx.save_for_backward(h_c if decode(options).compact_ignored else hidden, weight, labels, inv_t, selected_ids,
                          topk_ids.clone(), lse_ent, cache, hidden)
    ctx.options = options


@once_differentiable
def _backward(ctx, g_diff, g_dstats, _g_stats, g_sel, g_topk, *_non_differentiable):
    h_c, weight, labels, inv_t, selected_ids, topk_ids, lse_ent, cache, _ = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if all(g is None for g in (g_diff, g_dstats, g_sel, g_topk)) or not (need_dh or need_dw):
        return (None,) * _N_INPUTS
    if g_sel is not None and g_sel.shape[1] == 0:
        g_sel = None
    if g_topk is not None and g_topk.shape[1] == 0:
        g_topk = None
    dh, dw = lce_backward_op(g_diff, g_dstats, g_sel, g_topk, h_c, weight, labels, inv_t, selected_ids, topk_ids,
                             lse_ent, cache, ctx.options, need_dh, need_dw)
    return (dh if need_dh else None, dw if need_dw else None) + (None,) * (_N_INPUTS - 2)


lce_forward_op.register_autograd(_backward, setup_context=_setup_context)


def lce(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor], options: str,
        selected_ids: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
    """(diff [2, N], dstats, stats, selected [N, K], top-k logprobs [N, k], top-k ids [N, k]) of the op
    without TP through the custom ops (api.py validated and encoded the options)."""
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return lce_forward_op(hidden, weight, labels, inv_t, selected_ids, options, keep)[:6]
