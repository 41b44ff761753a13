"""The fused op as torch.library custom ops: the one entry of linear_logprobs_entropy at every TP degree.

    areal_lce::lce_forward   (hidden, weight, labels, inv_t?, selected_ids?, main_grad?, placeholder, options,
                              keep_cache)
                              -> (diff [2, N], dstats [R, N], stats [S, N], selected [N, K], topk_lp [N, k],
                              topk_ids [N, k], h_c, lse_ent [2, N], cache)  (rows: LCEParams.dstat_rows / stat_rows)
    areal_lce::lce_backward  (g_diff?, g_dstats?, g_sel?, g_topk?, h_c, weight, labels, inv_t?, selected_ids?,
                              topk_ids, lse_ent, cache, main_grad!, options, need_dh, need_dw) -> (d_hidden, d_weight)

`options` is the call's LCEParams as one JSON string, the backend by its name and the vocab-parallel
process group by its torch.distributed `group_name` (as torch's functional collectives take a group),
with the group's size and the d_hidden mode (VocabParallel): an option added to LCEParams travels
through both ops without touching their signatures. api.py builds it once per call in a function
torch.compile evaluates at trace time (`encode`), so under torch.compile it is a constant of the graph.
`decode` turns the backend's name back into its instance, the one place past api.py where a backend is
taken by name (an operator argument cannot be the instance); the group is resolved by name where a
collective runs (LCEParams.tp_group). The collectives (types.VocabParallel, function.py) run inside the
ops' real implementations.

Both are opaque to torch.compile: a fake (meta) implementation gives the output shapes from the input
shapes and the options alone (under sequence parallelism hidden is this rank's [N/tp, H] shard and the
outputs cover the full sequence [N], as labels do; the logits cache's shape through the backend's
`cache_spec`), and `register_autograd` ties the backward op to the forward, so
`torch.compile(fullgraph=True)` traces a model calling `linear_logprobs_entropy` without a graph break,
forward and backward, at every TP degree. The real implementations are function.lce_forward / lce_backward.

The first six forward outputs are the op's results ([N, 0] where selected_ids / top_k are not asked);
the other three are what the backward needs:
the hidden rows the backend saw (partitioned, or all-gathered under sequence parallelism; an empty
placeholder when they are hidden itself, which is then saved: an op output may not alias an input),
(lse, entropy) in the backend's row order, and the logits cache (empty when none is kept). They are
marked non-differentiable and never materialise a gradient.

main_grad (Megatron's gradient_accumulation_fusion, main_grad.py): the forward takes the weight's
`main_grad` buffer of this call and the backward op adds the fp32 d_weight into it (its one mutated
argument, `mutates_args=("main_grad",)`) and returns an empty d_weight; autograd then gets
`placeholder_grad(weight)` for the weight (`placeholder`, read from the weight at the call, says which).
Under torch.compile the backward cannot reach the parameter itself, so `lce` sets its
`grad_added_to_main_grad` at the forward instead (the value DDP's hook reads is the same: the hook runs
after the backward, and megatron resets the flag only when it zeroes the buffers).

Second-order gradients are refused: the backward runs under function.once_differentiable, with
hidden saved so that a gradient taken with create_graph=True is tied to a node
that raises when differentiated again.
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
    """The options string of one call: LCEParams' fields (the backend and the group by name) as sorted JSON."""
    return json.dumps(options, sort_keys=True)


@functools.lru_cache(maxsize=1024)
def decode(options: str) -> LCEParams:
    """The call's LCEParams from its options string, the backend's name resolved to its instance."""
    fields = json.loads(options)
    return LCEParams(**{**fields, "backend": get_backend(fields["backend"])})


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _own_rows(params: LCEParams) -> bool:
    """Whether the backend's hidden rows are a tensor of their own (partitioned, or all-gathered under
    sequence parallelism), not hidden itself."""
    return params.compact_ignored or params.d_hidden == "reduce_scatter"


def placeholder_kind(weight: Tensor) -> str:
    """What Megatron's linear returns as the weight's gradient once main_grad holds it: with DDP's
    `grad_added_to_main_grad` attribute a placeholder, "zeros" under `zero_out_wgrad`, else "empty"
    (uninitialised); without the attribute "none" (no gradient)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return "none"
    return "zeros" if getattr(weight, "zero_out_wgrad", False) else "empty"


def placeholder_grad(weight: Tensor, kind: Optional[str] = None):
    """Call after adding the weight's gradient into its main_grad: the placeholder of `placeholder_kind`
    (read from the weight unless given), with the flag set, so that DDP's hook fires and adds nothing."""
    kind = placeholder_kind(weight) if kind is None else kind
    if kind == "none":
        return None
    weight.grad_added_to_main_grad = True
    if kind == "zeros":
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


@torch.library.custom_op("areal_lce::lce_forward", mutates_args=())
def lce_forward_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                   selected_ids: Optional[Tensor], main_grad: Optional[Tensor], placeholder: str, options: str,
                   keep_cache: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    params = decode(options)
    f = lce_forward(hidden, weight, labels, inv_t, params, keep_cache, selected_ids=selected_ids)
    h_c = f.h_c if _own_rows(params) else hidden.new_empty(0)
    cache = f.cache if f.cache is not None else hidden.new_empty(0, dtype=torch.float32)
    sel, topk_lp, topk_ids = empty_extras(f, labels.shape[0], hidden.device)
    return f.diff, f.dstats, f.stats, sel, topk_lp, topk_ids, h_c, f.lse_ent, cache


@lce_forward_op.register_fake
def _(hidden, weight, labels, inv_t, selected_ids, main_grad, placeholder, options, keep_cache):
    n, h = labels.shape[0], hidden.shape[1]  # under sequence parallelism hidden holds N / tp rows
    acc = _acc(hidden.dtype)
    params = decode(options)
    spec = params.backend.cache_spec(n, h, weight.shape[0], hidden.dtype, params, keep_cache)
    cache = hidden.new_empty(spec[0], dtype=spec[1]) if spec is not None else hidden.new_empty(0, dtype=torch.float32)
    h_c = hidden.new_empty((n, h)) if _own_rows(params) else hidden.new_empty(0)
    k_sel = 0 if selected_ids is None else selected_ids.shape[1]
    return (hidden.new_empty((2, n), dtype=acc), hidden.new_empty((len(params.dstat_rows), n), dtype=acc),
            hidden.new_empty((len(params.stat_rows), n), dtype=acc),
            hidden.new_empty((n, k_sel), dtype=torch.float32), hidden.new_empty((n, params.top_k), dtype=torch.float32),
            hidden.new_empty((n, params.top_k), dtype=torch.int64),
            h_c, hidden.new_empty((2, n), dtype=acc), cache)


@torch.library.custom_op("areal_lce::lce_backward", mutates_args=("main_grad",))
def lce_backward_op(g_diff: Optional[Tensor], g_dstats: Optional[Tensor], g_sel: Optional[Tensor],
                    g_topk: Optional[Tensor], h_c: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor],
                    selected_ids: Optional[Tensor], topk_ids: Tensor, lse_ent: Tensor, cache: Tensor,
                    main_grad: Optional[Tensor], options: str, need_dh: bool, need_dw: bool) -> Tuple[Tensor, Tensor]:
    dh, dw = lce_backward(h_c, weight, labels, inv_t, lse_ent, cache if cache.numel() else None, g_diff,
                          decode(options), need_dh, need_dw, h_c.dtype, g_dstats=g_dstats,
                          selected_ids=selected_ids, g_sel=g_sel, topk_ids=topk_ids if topk_ids.numel() else None,
                          g_topk=g_topk)
    if main_grad is not None and dw is not None:
        main_grad.add_(dw)  # the fp32 d_weight (d_weight_fp32), rounded once: by the add into main_grad's dtype
        dw = None
    return (dh if dh is not None else h_c.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@lce_backward_op.register_fake
def _(g_diff, g_dstats, g_sel, g_topk, h_c, weight, labels, inv_t, selected_ids, topk_ids, lse_ent, cache, main_grad,
      options, need_dh, need_dw):
    params = decode(options)
    rows = h_c.shape[0] // params.tp_size if params.d_hidden == "reduce_scatter" else h_c.shape[0]
    return (h_c.new_empty((rows, h_c.shape[1])) if need_dh else h_c.new_empty(0),
            weight.new_empty(weight.shape, dtype=params.d_weight_dtype(weight.dtype))
            if need_dw and main_grad is None else weight.new_empty(0))


_N_INPUTS = 9  # hidden, weight, labels, inv_t, selected_ids, main_grad, placeholder, options, keep_cache


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, inv_t, selected_ids, main_grad, placeholder, options, _ = inputs
    diff, dstats, stats, sel, topk_lp, topk_ids, h_c, lse_ent, cache = output
    ctx.mark_non_differentiable(stats, topk_ids, h_c, lse_ent, cache)
    ctx.set_materialize_grads(False)
    # hidden is saved a second time for once_differentiable only: with weight it ties a create_graph=True
    # gradient to the graph. No output is saved, so outputs may be edited in place before backward.
    ctx.save_for_backward(h_c if _own_rows(decode(options)) else hidden, weight, labels, inv_t, selected_ids,
                          topk_ids.clone(), lse_ent, cache, hidden)
    # main_grad: the buffer of this call (a layer called twice, e.g. by MTP, accumulates into the buffer of each
    # call), kept as it is, not saved: the backward of another call adds into it in place before this one's runs
    ctx.options, ctx.placeholder, ctx.main_grad = options, placeholder, main_grad


@once_differentiable
def _backward(ctx, g_diff, g_dstats, _g_stats, g_sel, g_topk, *_non_differentiable):
    h_c, weight, labels, inv_t, selected_ids, topk_ids, lse_ent, cache, _ = ctx.saved_tensors
    main_grad = ctx.main_grad
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if all(g is None for g in (g_diff, g_dstats, g_sel, g_topk)) or not (need_dh or need_dw):
        return (None,) * _N_INPUTS
    if g_sel is not None and g_sel.shape[1] == 0:
        g_sel = None
    if g_topk is not None and g_topk.shape[1] == 0:
        g_topk = None
    into = main_grad if need_dw else None
    dh, dw = lce_backward_op(g_diff, g_dstats, g_sel, g_topk, h_c, weight, labels, inv_t, selected_ids, topk_ids,
                             lse_ent, cache, into, ctx.options, need_dh, need_dw)
    if into is not None:  # d_weight is in main_grad: DDP gets Megatron's placeholder
        weight.main_grad = main_grad
        dw = placeholder_grad(weight, ctx.placeholder)
    return (dh if need_dh else None, dw if need_dw else None) + (None,) * (_N_INPUTS - 2)


lce_forward_op.register_autograd(_backward, setup_context=_setup_context)


def lce(hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Optional[Tensor], options: str,
        selected_ids: Optional[Tensor] = None, main_grad: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
    """(diff [2, N], dstats, stats, selected [N, K], top-k logprobs [N, k], top-k ids [N, k]) of the op through
    the custom ops (api.py validated and encoded the options); with main_grad, the weight's gradient is
    added into it and autograd gets `placeholder_grad(weight)` (main_grad.py)."""
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    placeholder = "none" if main_grad is None else placeholder_kind(weight)
    if placeholder != "none" and torch.compiler.is_compiling():
        # a compiled backward holds no reference to the parameter: its flag is set here, where torch.compile
        # replays the attribute write on the real one at every call (DDP's hook reads it after the backward)
        weight.grad_added_to_main_grad = True
    return lce_forward_op(hidden, weight, labels, inv_t, selected_ids, main_grad, placeholder, options, keep)[:6]
