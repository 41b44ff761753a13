"""Functional API: validate once, resolve the backend once, call the op.

Every call, at every TP degree, goes through the torch.library ops of library.py (the process group by
its name in the options), which torch.compile(fullgraph=True) traces without a graph break.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import checks, comms, library
from .checks import check_invariant_layout, inv_temperature, resolve_invariant
from .backends import Backend, get_backend, resolve_backend
from .options import LCEOptions
from .types import LCEOutput, LCEParams, VocabParallel

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_tensors(hidden, weight, labels, sequence_parallel: bool, tp: int):
    if not torch.is_tensor(hidden) or hidden.dim() < 1:
        got = "a 0-d tensor" if torch.is_tensor(hidden) else type(hidden).__name__
        raise TypeError(f"hidden must be a tensor [..., H] with at least one dimension, got {got}")
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [V, H], got shape {tuple(getattr(weight, 'shape', ()))}")
    if hidden.shape[-1] == 0 or weight.shape[0] == 0:
        raise ValueError(f"hidden's H and weight's V must be > 0, got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dim ({hidden.shape[-1]}) must equal weight's H ({weight.shape[1]}); "
                         f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if hidden.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype; "
                        "cast one of them (e.g. hidden.to(weight.dtype))")
    if not torch.is_tensor(labels) or labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) "
                         "must be on the same device")
    if hidden.is_meta:
        raise ValueError("hidden, weight and labels are on the meta device (shapes without data): materialise "
                         "them (e.g. module.to_empty(device=...) and initialise) before calling the op")
    rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
    if sequence_parallel:
        if labels.numel() != rows * tp:
            raise ValueError(f"with sequence parallelism (VocabParallel(d_hidden='reduce_scatter')), labels "
                             f"must hold the full sequence: expected "
                             f"{rows} hidden rows × tp {tp} = {rows * tp} labels, got {labels.numel()}")
    elif tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")


def _check_selected_ids(selected_ids, labels, hidden) -> Optional[torch.Tensor]:
    """selected_ids as [N, K] int64, or None (a call input: checked against labels and hidden)."""
    if selected_ids is None:
        return None
    if not torch.is_tensor(selected_ids) or selected_ids.dtype.is_floating_point or selected_ids.is_complex() \
            or selected_ids.dtype == torch.bool:
        raise TypeError(f"selected_ids must be an integer tensor [..., K] (global vocab ids), got "
                        f"{getattr(selected_ids, 'dtype', type(selected_ids).__name__)}")
    if selected_ids.dim() != labels.dim() + 1 or selected_ids.shape[:-1] != labels.shape:
        raise ValueError(f"selected_ids must be shaped like labels plus one trailing dim [..., K]: labels "
                         f"{tuple(labels.shape)}, selected_ids {tuple(selected_ids.shape)}")
    if selected_ids.device != hidden.device:
        raise ValueError(f"selected_ids is on {selected_ids.device}, hidden on {hidden.device}")
    return selected_ids.reshape(-1, selected_ids.shape[-1]).to(torch.int64).contiguous()


def check_vocab_parallel(vocab_parallel):
    """The one tensor-parallel option, `vocab_parallel=VocabParallel(...)` or None."""
    if vocab_parallel is not None and not isinstance(vocab_parallel, VocabParallel):
        raise TypeError(f"vocab_parallel must be an areal_lce.VocabParallel or None, got {vocab_parallel!r}")
    return vocab_parallel


# cache_bytes="auto": keep the fp32 logits (4·N·V_shard bytes) for the backward when the hidden size is at least
# AUTO_CACHE_MIN_HIDDEN and they take at most AUTO_CACHE_BYTES. Measured on one H200
# (benchmark/results/h200_head_7b_rank_cache, h200_defaults_cache_ce_fusion): at H = 3584 (a 7B model's TP=2
# rank, V_shard = 76032) the cache takes the head's forward + backward from 0.93x to 0.75x of megatron-core's
# output GEMM + vocab_parallel_cross_entropy at 8k and 16k tokens (the recompute is a 2NHV GEMM, the cache one
# write and one read of 4NV bytes); at H = 896 (the 0.5B presets) the recompute costs less than that traffic
# and the SFT step was 1.03x slower with the cache. 6 GiB holds a 16k-token micro-batch of a 152k vocabulary
# at TP=2 (4.64 GiB) or 8192 x 151936 at TP=1.
AUTO_CACHE_MIN_HIDDEN = 2048
AUTO_CACHE_BYTES = 6 << 30


def auto_cache_bytes(hidden_size: int) -> int:
    """The budget of cache_bytes="auto" for this hidden size: a function of the shape alone, never of the
    device's free memory, so a resumed run and a CUDA-graph capture take the path the first call took."""
    return AUTO_CACHE_BYTES if hidden_size >= AUTO_CACHE_MIN_HIDDEN else 0


@torch.compiler.assume_constant_result
def _resolve(backend: str, device: torch.device, dtype: torch.dtype, cache_bytes, check_labels, invariant=None,
             hidden_size: int = 0):
    """(backend name, cache budget in bytes, check mode, invariant): host-side choices that depend on the
    device and the shapes only (torch.compile evaluates this once while tracing and keeps the result as a
    constant)."""
    if cache_bytes == "auto":  # the values were checked by LCEOptions
        cache_bytes = auto_cache_bytes(hidden_size)
    name = resolve_backend(backend, device, dtype)
    return name, cache_bytes, checks.resolve_mode(check_labels, device), resolve_invariant(invariant, name, dtype)


class PreparedCall(NamedTuple):
    """One call of the op, validated and resolved (`prepare_call`): its inputs as the op takes them and its
    options, for `linear_logprobs_entropy` and for main_grad.py's `linear_logprobs_entropy_into_main_grad`
    (the same custom ops with the weight's main_grad)."""

    hidden: torch.Tensor  # [N, H], contiguous (this rank's [N/tp, H] sequence shard under SP)
    weight: torch.Tensor  # [V_shard, H], contiguous
    labels: torch.Tensor  # [N] int64
    inv_t: Optional[torch.Tensor]  # [N] fp32 per-token 1/T, or None (options["inv_t"] holds the scalar)
    options: dict  # LCEParams' fields, the backend and the process group by name (library.encode's argument)
    backend: Backend  # the call's backend, resolved once (LCEParams.backend)
    tp: int
    shape: torch.Size  # labels' shape: the outputs'
    return_stats: bool
    selected_ids: Optional[torch.Tensor] = None  # [N, K] int64

    @property
    def params(self) -> LCEParams:
        return LCEParams(**{**self.options, "backend": self.backend})

    def output(self, outs) -> LCEOutput:
        """The named result of the op's (diff [2, N], dstats, stats, selected, top-k logprobs, top-k ids)."""
        diff, dstats, stats, sel, topk_lp, topk_ids = outs
        p = self.params
        rows = dict(zip(p.dstat_rows, dstats.unbind(0)))
        rows.update(zip(p.stat_rows, stats.unbind(0)))
        rows = {k: v.view(self.shape) for k, v in rows.items()}
        sums = self.options["logit_sums"]
        st = self.return_stats

        def extra(t, asked):
            return t.view(*self.shape, t.shape[-1]) if asked else None

        return LCEOutput(diff[0].view(self.shape), diff[1].view(self.shape),
                         rows["max_logit"] if st else None, rows["min_logit"] if st else None,
                         rows["lse"] if st else None,
                         rows["sum_logit"] if sums else None, rows["sumsq_logit"] if sums else None,
                         extra(sel, self.selected_ids is not None), extra(topk_ids, p.top_k > 0),
                         extra(topk_lp, p.top_k > 0))


@torch.compiler.assume_constant_result
def _check_group_once(group_name: str, v_shard: int, vocab_size: int, shard_size: bool, weight) -> bool:
    """The host-side checks of a vocab-parallel group, each once per group and shape (comms.py): the shard
    size (unless "sync" label checks compare it per call, function.py) and, where one shard covers the
    vocabulary, that the weight is not the full one. Collective, with a host sync: torch.compile runs it
    while tracing, on every rank, and keeps its result (the checks are done once either way)."""
    group = comms.resolve_group(group_name)
    tp = comms.group_size(group)
    if shard_size:
        comms.check_same_across_group(v_shard, group, "weight's vocab shard size (weight.shape[0])")
    if vocab_size <= v_shard:  # ranks > 0 hold only padding (legal), unless this is the full weight
        comms.check_not_replicated(weight[:vocab_size], group, "weight (rows below vocab_size)",
                                   f"the vocab-parallel group has {tp} ranks and weight's {v_shard} rows "
                                   f"already cover vocab_size={vocab_size}, identically on every rank: pass "
                                   "this rank's vocab shard [vocab/tp, H], not the full weight")
    return True


def linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    options: Optional[LCEOptions] = None,
    *,
    vocab_parallel: Optional[VocabParallel] = None,
    selected_ids: Optional[torch.Tensor] = None,
    **overrides,
) -> LCEOutput:
    """Per-token logprobs and entropy of softmax(hidden · weightᵀ / temperature), never materialising logits.

    hidden [..., H] and weight [V, H] (bf16, fp16, fp32 or fp64; same dtype), labels [...] integer ids.
    Returns `LCEOutput` of fp32 tensors shaped like labels (see its docstring for the stats' definitions).

    options: an `LCEOptions` (options.py: every option, its default, check and meaning), None for the
        defaults; `overrides` are its fields by keyword (`backend="torch"`, `return_stats=True`, ...),
        applied on top of it. A keyword that is not a field is a TypeError. `temperature=` is the option
        for a float, and a call input for a tensor broadcastable to labels (per token / per sample; its
        values are checked as check_labels says); not differentiated.
    The other call inputs besides the tensors:
    vocab_parallel: `VocabParallel(group, d_hidden=...)` when `weight` is this rank's vocab shard
        [V/tp, H]: how hidden arrives, who reduces d_hidden and how global ids map to shards are stated
        in VocabParallel's docstring (types.py). Forward: two O(N) collectives (one MAX, one packed SUM).
    selected_ids: integer tensor [..., K] (labels' shape + K) of global ids: `selected_logprobs` [..., K] are
        the row's logprobs at those ids (any K, repeats allowed; ignore_index entries give 0 with zero
        gradient), differentiable into hidden and weight in the same backward. Checked like labels. Batch /
        TP invariant like the logprobs (a value's bits depend on its row, the row's selected ids and label,
        K, H and vocab_size: select.py says how the route is chosen).
    Differentiable statistics: `lse` (z-loss: lse²) and, without softcap, `sum_logit` (label smoothing:
        sum_logit / (T · vocab_size) - lse is the mean tempered logprob). max / min logit and sumsq are not.
    Determinism: bitwise-identical outputs and gradients run to run for the same inputs and backend.
    Host syncs: none with the defaults on accelerators (CUDA-graph capturable), apart from one-time checks
    per group (the shard size agrees; with vocab_size <= V_shard, weight is not the full weight).
    """
    options, temperature = call_options(options, overrides, "linear_logprobs_entropy")
    call = prepare_call(hidden, weight, labels, options, temperature=temperature, vocab_parallel=vocab_parallel,
                        selected_ids=selected_ids)
    return call.output(library.lce(call.hidden, call.weight, call.labels, call.inv_t, library.encode(**call.options),
                                   call.selected_ids))


def call_options(options: Optional[LCEOptions], overrides: dict, caller: str) -> tuple:
    """(LCEOptions, per-token temperature tensor or None) of one call of a front end taking
    `(options=None, **overrides)`: `overrides["temperature"]` is the option (checked there, once) unless
    it is a tensor, a call input."""
    temperature = overrides.get("temperature")
    if torch.is_tensor(temperature):
        overrides = {k: v for k, v in overrides.items() if k != "temperature"}
    else:
        temperature = None
    return LCEOptions.of(options, overrides, caller), temperature


def prepare_call(hidden, weight, labels, options: LCEOptions, *, temperature=None, vocab_parallel=None,
                 selected_ids=None) -> PreparedCall:
    """Validate the call inputs of `linear_logprobs_entropy` (same meaning) against its checked `options`
    (`call_options`) and resolve the backend and the options once: the call as the op runs it."""
    o = options
    vp = check_vocab_parallel(vocab_parallel)
    tp = 1 if vp is None else vp.size
    _check_tensors(hidden, weight, labels, vp is not None and vp.sequence_parallel, tp)
    sel_ids = _check_selected_ids(selected_ids, labels, hidden)
    top_k, softcap, compact_ignored, vocab_size = o.top_k or 0, float(o.softcap or 0.0), o.compact_ignored, o.vocab_size
    asked = o.invariant is not None
    name, cache_bytes, check, invariant = _resolve(
        o.backend, hidden.device, hidden.dtype, o.cache_bytes, o.check_labels, o.invariant, hidden.shape[-1])
    resolved = get_backend(name)  # the one instance the call runs on (LCEParams.backend)
    if compact_ignored is None:  # partition unless the backend skips ignored rows itself
        compact_ignored = not resolved.skips_ignored_rows
    v_shard = weight.shape[0]
    v_total = v_shard * tp
    if vocab_size is None:
        vocab_size = v_total
    if vocab_size > v_total:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int in [1, {v_total}] "
                         f"(weight rows {v_shard} × tp {tp})")
    if tp > 1:
        _check_group_once(vp.group_name, v_shard, vocab_size, check != "sync", weight)
    vocab_start = vp.vocab_range(v_shard)[0] if tp > 1 else 0
    if torch.is_tensor(temperature):  # a call input: broadcast to labels (the full sequence under SP)
        inv_t_scalar, inv_t = inv_temperature(temperature, labels)
    else:  # the option, checked by LCEOptions
        inv_t_scalar, inv_t = 1.0 / o.temperature, None
    y = labels.reshape(-1).to(torch.int64)  # label values are checked inside the op (checks.py)
    shard_valid = max(0, min(v_shard, vocab_size - vocab_start))
    sums = o.return_logit_sums
    h2 = hidden.reshape(-1, hidden.shape[-1])
    h2 = h2 if h2.is_contiguous() else h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if invariant:
        invariant = check_invariant_layout(v_shard, tp, vocab_size, asked)
    if top_k > vocab_size:
        raise ValueError(f"top_k={top_k} exceeds vocab_size={vocab_size}")
    if softcap and not resolved.supports_softcap:
        raise ValueError(f"softcap is not implemented by backend={name!r}; use backend='torch'")
    # every option of the call in one place: LCEParams' fields (library.encode for the custom ops), the process
    # group by its name (resolved inside the op, as torch's functional collectives take it)
    options = dict(group_name=vp.group_name if tp > 1 else None, tp_size=tp,
                   d_hidden=vp.d_hidden if tp > 1 else "all_reduce", inv_t=inv_t_scalar, ignore_index=o.ignore_index,
                   vocab_size=vocab_size, vocab_start=vocab_start, shard_valid=shard_valid, cache_bytes=cache_bytes,
                   backend=name, compact_ignored=compact_ignored, check_labels=check, logit_sums=sums,
                   invariant=invariant, logits_precision=o.logits_precision, d_weight_fp32=o.d_weight_fp32,
                   softcap=softcap, top_k=top_k)
    return PreparedCall(h2, w, y, inv_t, options, resolved, tp, labels.shape, o.return_stats, sel_ids)
