"""AReaL adapter: `chunked_lm_head_logprobs_entropy` with the signature and contract of AReaL's
`areal.models.mcore.vocab_parallel_head.chunked_lm_head_logprobs_entropy` (main branch, after 1.0.4),
computed by areal_lce's fused op in one pass (no sequence chunks, no [chunk, V] logits).

    from areal_lce.integrations import areal as lce_areal
    lce_areal.apply()           # AReaL's Megatron engine now calls areal_lce
    # or by hand, the one-line patch:
    # areal.engine.megatron_engine.chunked_lm_head_logprobs_entropy = lce_areal.chunked_lm_head_logprobs_entropy

AReaL's contract (read from its source):
  output_layer: the Megatron ColumnParallelLinear LM head. Its `tp_group`, `sequence_parallel`,
      `allreduce_dgrad` and `fp32_operands` say how hidden arrives and how d_hidden is reduced;
      `gather_output` and `config.defer_embedding_wgrad_compute` are refused (as AReaL does), and so is
      every layer whose logits are not (h·Wᵀ)·logit_scale, found by inspecting it: anything but
      megatron-core's ColumnParallelLinear (AReaL's LM-head mixin on it allowed), a class or instance that
      replaces its forward (AReaL marks those chunked_loss_supported=False) or its _forward_impl, an added
      bias (skip_bias_add=False with a bias). One forward override is read instead: Megatron-Bridge's (and
      NeMo's) Gemma2OutputLayer, c·tanh(h·Wᵀ / c) with c = layer.config.final_logit_softcapping (unset or
      0: no cap), computed by the op's softcap=c (then logit_scale must be 1). With its
      `gradient_accumulation_fusion=True` the weight gradient is added in fp32 into `weight.main_grad` and
      `grad_added_to_main_grad` set, as megatron's own linear does (areal_lce/op/main_grad.py); with
      `fp32_operands` the fp32 copy's gradient returns through autograd instead.
  hidden_states [s, b, H] (AReaL: [T, 1, H] packed): this rank's sequence shard [s/tp, b, H] under
      sequence parallel (gathered here, d_hidden reduce-scattered back), else the full sequence
      (d_hidden all-reduced over TP when `allreduce_dgrad`); under context parallelism, CP-local tokens.
  weight [V/tp, H]: this rank's vocab shard (the shared embedding when tied); every row is part of the
      softmax, Megatron's vocabulary padding included, as in AReaL.
  labels: global ids in hidden's leading shape [s, b] (under sequence parallel the full sequence's,
      [s·tp, b]), size-1 dimensions aside ([T] or [T, 1] for [T, 1, H]); another layout of the same
      count is refused. No ignore_index: a negative label (-100 included) is refused like an id >= vocab.
  check_labels (this adapter's option, passed to the op): True (default) checks label values at the call
      on CPU tensors ("sync": ValueError) and, on accelerators, without a host sync ("deferred": the bad
      token's logprob is NaN and only `areal_lce.check_deferred()` raises, which AReaL does not call);
      "sync" raises at the call on every device (one host sync per call); False checks nothing.
  invariant, logits_precision (this adapter's options, passed to the op, which validates them; docs/op.md
      "Consistency"): None (the backend's default) / True / False: each token's outputs bitwise independent
      of the rest of the call and of the TP degree; "fp32" (default: fp32 logits, as AReaL's own chunked
      head and fp32-head rollout engines compute them) or "bf16" (each raw logit rounded to bf16 before
      logit_scale and temperature, as a bf16-head engine does).
  temperature, logit_scale: floats > 0; logits z = (h·Wᵀ)·logit_scale / temperature.
  chunk_size: AReaL's sequence chunk; must be > 0, otherwise unused (the fused op bounds its own memory).
Returns AReaL's `ChunkedLMHeadOutput` (this module's look-alike when AReaL is not installed): six fp32
tensors [s·b]:
  logprobs           log softmax(z)[label]; the only differentiable output (to hidden and weight)
  entropy            of softmax(z), detached (AReaL marks it non-differentiable)
  vocab_min_logits, vocab_max_logits   min / max of the logits (h·Wᵀ)·logit_scale (soft-capped ones for a
      Gemma2OutputLayer), before temperature
  vocab_mean_logits, vocab_norm_logits mean and L2 norm of the same row, from the op's epilogue sums
      Σr, Σr² (mean = Σr·logit_scale / V, norm = sqrt(Σr²)·logit_scale), not from another pass.
The four vocab statistics are over the whole vocabulary on every TP rank. AReaL's own chunked head
computes them over each rank's local vocab shard (they differ per TP rank); at TP = 1 the two agree.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple, Optional

import torch

from ..op.api import linear_logprobs_entropy
from ..op.main_grad import fuses_wgrad, linear_logprobs_entropy_into_main_grad
from ..megatron.head import head_of
from ._common import (NO_IGNORE_INDEX, check_no_negative_labels, check_op_options, consistency_options, op_value,
                      patch, restore, token_rows)

_NAME = "areal_lce.integrations.areal.chunked_lm_head_logprobs_entropy"
PATCH_TARGET = ("areal.engine.megatron_engine", "chunked_lm_head_logprobs_entropy")


class ChunkedLMHeadOutput(NamedTuple):
    """Field-for-field AReaL's `ChunkedLMHeadOutput`, used only when AReaL is not importable."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    vocab_min_logits: torch.Tensor
    vocab_max_logits: torch.Tensor
    vocab_mean_logits: torch.Tensor
    vocab_norm_logits: torch.Tensor


@functools.lru_cache(maxsize=None)
def output_type():
    """AReaL's own ChunkedLMHeadOutput when AReaL is installed (its engine tests isinstance on it)."""
    if importlib.util.find_spec("areal") is None:
        return ChunkedLMHeadOutput
    from areal.models.mcore.vocab_parallel_head import ChunkedLMHeadOutput as areal_type

    return areal_type


# The output layers whose logits the op computes exactly, r = (h·Wᵀ)·logit_scale: megatron-core's
# ColumnParallelLinear with its own forward, whose _forward_impl is megatron's linear or AReaL's LM-head
# mixin (the same GEMM, its output in the input dtype or fp32). Classes are matched by module and name,
# so neither framework is imported here.
_MEGATRON_LINEAR = ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear")
_AREAL_MIXIN = ("areal.models.mcore.vocab_parallel_head", "_AReaLVocabParallelLMHeadMixin")


# Output layers whose forward is megatron-core's followed by c·tanh(logits / c), c read from
# layer.config.final_logit_softcapping (Megatron-Bridge's gemma2_provider; NeMo 2's gemma2 model, which
# mixes it into the instance's class with extend_instance): the op applies that cap itself (softcap=c).
_SOFTCAP_LAYERS = (("megatron.bridge.models.gemma.gemma2_provider", "Gemma2OutputLayer"),
                   ("nemo.collections.llm.gpt.model.gemma2", "Gemma2OutputLayer"))
_SOFTCAP_OPTION = "final_logit_softcapping"


def _class_named(cls: type, module: str, qualname: str):
    return next((c for c in cls.__mro__ if c.__module__ == module and c.__qualname__ == qualname), None)


def _softcap_class(cls: type):
    return next((c for c in map(lambda k: _class_named(cls, *k), _SOFTCAP_LAYERS) if c is not None), None)


def _inexact_logits(output_layer) -> str:
    """Why the op would not compute this output layer's logits exactly; "" when it does."""
    cls = type(output_layer)
    linear = _class_named(cls, *_MEGATRON_LINEAR)
    if linear is None:
        return (f"output_layer is a {cls.__module__}.{cls.__qualname__}, not megatron-core's ColumnParallelLinear "
                "(or AReaL's LM head built on it)")
    capper = _softcap_class(cls)  # AReaL marks it chunked_loss_supported=False too: the adapter reads it
    if capper is None and getattr(output_layer, "chunked_loss_supported", True) is False:
        return "AReaL marks it chunked_loss_supported=False: its class overrides forward"
    replaced = [name for name in ("forward", "_forward_impl") if name in vars(output_layer)]
    if replaced:
        return f"its {replaced[0]} is replaced on the instance"
    mro = cls.__mro__
    between = mro[mro.index(capper) + 1:mro.index(linear)] if capper is not None else ()
    if cls.forward is not (capper or linear).forward or any("forward" in vars(c) for c in between):
        owner = next(c for c in mro if "forward" in vars(c) and c is not capper)
        return (f"{owner.__qualname__} overrides ColumnParallelLinear.forward (soft-capping is read only from "
                "Megatron-Bridge's / NeMo's Gemma2OutputLayer), so its logits are not h·Wᵀ")
    mixin = _class_named(cls, *_AREAL_MIXIN)
    exact_impls = [vars(c).get("_forward_impl") for c in (linear, mixin) if c is not None]
    if getattr(cls, "_forward_impl", None) not in exact_impls:
        owner = next(c for c in cls.__mro__ if "_forward_impl" in vars(c))
        return f"{owner.__qualname__} overrides _forward_impl, the layer's matrix multiply"
    if not getattr(output_layer, "skip_bias_add", True) and getattr(output_layer, "bias", None) is not None:
        return "it adds a bias to the logits"
    return ""


def _layer_softcap(output_layer, logit_scale: float) -> Optional[float]:
    """The soft-cap c of a Gemma2OutputLayer (None when it has none, or the layer is another kind)."""
    if _softcap_class(type(output_layer)) is None:
        return None
    cap = getattr(getattr(output_layer, "config", None), _SOFTCAP_OPTION, None)
    if not cap:  # Gemma2OutputLayer leaves the logits alone for an unset or 0 cap
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf"):
        raise ValueError(f"{_NAME}: output_layer.config.{_SOFTCAP_OPTION} must be a finite number > 0, "
                         f"got {cap!r}")
    if logit_scale != 1.0:
        raise NotImplementedError(f"{_NAME}: logit_scale={logit_scale} with a soft-capped output layer "
                                  f"({_SOFTCAP_OPTION}={cap}): the order of the two is not the layer's to say")
    return float(cap)


def _check_layer(output_layer) -> None:
    if getattr(output_layer, "gather_output", False):
        raise NotImplementedError(f"{_NAME}: needs a vocab-parallel output layer (gather_output=False)")
    if getattr(getattr(output_layer, "config", None), "defer_embedding_wgrad_compute", False):
        raise NotImplementedError(f"{_NAME}: incompatible with config.defer_embedding_wgrad_compute")
    why = _inexact_logits(output_layer)
    if why:
        raise NotImplementedError(f"{_NAME}: the fused op computes logits (h·Wᵀ)·logit_scale only, and this "
                                  f"output layer's differ: {why}. Turn AReaL's chunked LM head off for this "
                                  "model (enable_chunked_logits: false) or do not apply the adapter")


def chunked_lm_head_logprobs_entropy(output_layer, hidden_states: torch.Tensor, weight: torch.Tensor,
                                     labels: torch.Tensor, *, temperature: float, chunk_size: int,
                                     logit_scale: float = 1.0, check_labels=True, invariant: Optional[bool] = None,
                                     logits_precision: str = "fp32", **op_options):
    """AReaL's `chunked_lm_head_logprobs_entropy`; contract and the keyword options in the module docstring.
    `op_options` go to `areal_lce.linear_logprobs_entropy` (backend, cache_bytes, compact_ignored)."""
    check_op_options(op_options, _NAME)
    consistency = consistency_options(invariant, logits_precision, _NAME)
    opts = op_value(op_options, _NAME, temperature)
    # the layer's TP group, sequence parallelism and d_hidden reduction (the op's: no megatron mapping here)
    vp, scale, sp = head_of(output_layer, logit_scale=logit_scale, mappings=False, caller=_NAME)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{_NAME}: chunk_size must be a positive int, got {chunk_size!r}")
    _check_layer(output_layer)
    softcap = _layer_softcap(output_layer, scale)
    tp = vp.size
    h2, y = token_rows(hidden_states, labels, _NAME, seq_factor=tp if sp else 1)
    check_no_negative_labels(y, check_labels, tp, _NAME)
    # the layer's gradient_accumulation_fusion: d_weight added in fp32 into weight.main_grad (main_grad.py);
    # with fp32 operands the op's weight is an fp32 copy, whose fp32 gradient autograd returns to the weight
    fp32_operands = bool(getattr(output_layer, "fp32_operands", False))
    into_main_grad = fuses_wgrad(output_layer, weight) and not fp32_operands
    op = linear_logprobs_entropy_into_main_grad if into_main_grad else linear_logprobs_entropy
    if fp32_operands:  # AReaL's enable_fp32_lm_head: fp32 GEMM operands
        h2, weight = h2.float(), weight.float()
    elif h2.dtype != weight.dtype:
        raise ValueError(f"{_NAME}: hidden ({h2.dtype}) and weight ({weight.dtype}) dtypes must match")
    if scale != 1.0:  # the model's logits m·h·Wᵀ at T: the op's h·Wᵀ at T/m
        opts = opts.replace(_NAME, temperature=opts.temperature / scale)
    out = op(h2, weight, y, opts, vocab_parallel=vp, return_stats=True, return_logit_sums=True,
             ignore_index=NO_IGNORE_INDEX, check_labels=check_labels, softcap=softcap, **consistency)
    vocab = weight.shape[0] * tp
    return output_type()(
        out.logprobs, out.entropy.detach(), out.min_logit * scale, out.max_logit * scale,
        out.sum_logit * (scale / vocab), torch.sqrt(out.sumsq_logit) * scale)


def apply(**op_options) -> list:
    """Make AReaL's Megatron engine call `chunked_lm_head_logprobs_entropy` above (with `op_options`).
    It only runs where AReaL's chunked head would: `enable_chunked_logits: true`,
    `lm_head_loss_chunk_size > 0`. Returns the patched name; `remove()` undoes it."""
    check_op_options(op_options, _NAME)
    fn = functools.partial(chunked_lm_head_logprobs_entropy, **op_options) if op_options \
        else chunked_lm_head_logprobs_entropy
    return [patch(*PATCH_TARGET, fn)]


def remove() -> list:
    """Restore AReaL's own chunked head where `apply()` replaced it; returns the restored names."""
    return [".".join(PATCH_TARGET)] if restore(*PATCH_TARGET) else []
