"""Instance-level patch of a transformers causal LM: fused LM head instead of logits.

`apply(model, **options)` replaces `model.forward` on this one instance (the class is never touched)
with a `PatchedForward`: a callable object that holds its model, so that `copy.deepcopy` and pickling
(`torch.save`) carry the patch to the copy, whose forward then runs the copy (a closure over the
model would keep running the original's weights). The patched forward runs the fused path when it is given `labels=` (or `shift_labels=`) or
`return_token_stats=True`; otherwise it calls the original forward unchanged (generation, plain
logits). The fused path:

  1. runs the base model (``getattr(model, model.base_model_prefix)``, else ``model.model``, else
     ``model.get_decoder()``) with the same arguments, minus the head and loss ones;
  2. builds next-token labels: position t predicts labels[t + 1]; the last position, and with
     ``position_ids`` every position whose next token starts a new packed sequence (position id 0),
     get ignore_index;
  3. calls `linear_logprobs_entropy` on the flattened hidden states and `lm_head.weight` *through*
     ``lm_head.__call__`` (its forward temporarily swapped), so module hooks on the head still fire:
     FSDP2's unshard/reshard and gradient reduce-scatter work exactly as for the unpatched head;
  4. returns `LCECausalLMOutput`: logits None, per-token logprobs / entropy / max_logit / min_logit /
     lse shaped [B, S] at the predicting position (0 where ignored), the `shift_labels` used, and
     the loss = mean of -logprob over non-ignored positions (or sum / ``num_items_in_batch``), the
     value transformers' `ForCausalLMLoss` gives at temperature 1.

The head call itself (step 3, DTensor weights included) is head.py.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
import types
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...op.options import LCEOptions
from .head import fused_head

# Families whose causal-LM forward is exactly `lm_head(base_model(...).last_hidden_state)` (gemma2: then
# soft-capped by config.final_logit_softcapping, which the op applies) and that tests/integrations/transformers/test_hf.py
# (tests/integrations/transformers/test_softcap_hf.py for gemma2) checks against the unpatched model. Others need `allow_unverified=True`.
VERIFIED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2"})

# Soft-capping (Gemma2/3, ...): logits -> c · tanh(logits / c), the op's softcap=c. Verified families whose
# forward ignores it refuse a set value; an unverified one (allow_unverified) must cap as Gemma2 does.
_SOFTCAP_OPTION, _SOFTCAP_MODEL_TYPES = "final_logit_softcapping", frozenset({"gemma2"})

# Config options that change the logits after lm_head in ways the op can't express: (name, neutral
# values). A value outside the neutral set refuses the patch.
_LOGIT_TRANSFORM_OPTIONS = (
    ("logit_scale", (None, 1, 1.0)),  # Cohere: logits * logit_scale
    ("logits_scaling", (None, 1, 1.0)),  # Granite: logits / logits_scaling
    ("lm_head_multiplier", (None, 1, 1.0)),  # Falcon-H1: logits * lm_head_multiplier
    ("output_multiplier", (None, 1, 1.0)),  # logits * output_multiplier
)

# LCEOptions fields the patch sets itself: ignore_index (apply's own argument, also the labels' shift),
# return_stats (the output's max / min logit and lse), softcap (the model config's final_logit_softcapping).
_SET_BY_PATCH = ("ignore_index", "return_stats", "softcap")
# Forward keywords that belong to the loss or the head, never passed to the base model.
_HEAD_KWARGS = ("labels", "shift_labels", "logits_to_keep", "num_items_in_batch", "return_dict")

_STATE_ATTR = "_areal_lce_patch"
# transformers >= 5 names the output's cache field `cache`; the old name `past_key_values` still works
# there but logs a deprecation warning on each use.
_CACHE_FIELD = ("cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
                else "past_key_values")


@dataclass
class LCECausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` with `logits=None` and per-token fused-op results, all [B, S] fp32.

    Entry t belongs to the prediction made at position t, i.e. of token ``shift_labels[:, t]``
    (= labels[:, t + 1]); ignored positions hold 0.
    logprobs   log softmax(z)[shift_label], z = r / temperature, r = h·Wᵀ the raw logits, soft-capped
               (c · tanh(r / c)) when config.final_logit_softcapping = c is set (differentiable).
    entropy    entropy of softmax(z) (differentiable).
    max_logit  max raw (soft-capped) logit r_j (before temperature); min_logit likewise; lse: log-sum-exp of z.
    shift_labels  int64 [B, S], the next-token labels used (ignore_index where ignored).
    """

    logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    max_logit: Optional[torch.Tensor] = None
    min_logit: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    shift_labels: Optional[torch.Tensor] = None


class PatchedForward:
    """`model.forward` while patched (module docstring). It holds the model, the options and the instance
    attribute `forward` that `apply` replaced (None: the class method was in use), and nothing that
    cannot be copied or pickled: the original forward and its signature are looked up on the model it
    holds at call time. `copy.deepcopy(model)` copies this object along with the model (the copy holds
    the copy); `torch.save` / `torch.load` likewise."""

    def __init__(self, model: nn.Module, previous, options: LCEOptions, ignore_index: int,
                 packed_boundaries: bool):
        self.model = model
        self.previous = previous
        self.options = options
        self.ignore_index = ignore_index
        self.packed_boundaries = packed_boundaries
        self._signatures = None  # (original's, with the patch's parameters): a cache, never copied

    def __call__(self, *args, **kwargs):
        return _patched_forward(self, args, kwargs)

    def original(self):
        """What `model.forward` was before apply: the replaced instance attribute, else the class method
        bound to the model this object holds."""
        return self.previous if self.previous is not None else types.MethodType(type(self.model).forward, self.model)

    @property
    def signature(self) -> inspect.Signature:
        """The original forward's signature, to name the arguments of each call."""
        return self._signature_pair()[0]

    @property
    def __signature__(self) -> inspect.Signature:
        # What `inspect.signature(model.forward)` reports (e.g. the Trainer's unused-column filter): the
        # original parameters plus the two this patch adds.
        return self._signature_pair()[1]

    def _signature_pair(self):
        if self._signatures is None:
            sig = inspect.signature(self.original())
            self._signatures = (sig, _with_patch_parameters(sig))
        return self._signatures

    def __getstate__(self):
        return dict(self.__dict__, _signatures=None)


# --------------------------------------------------------------------------------------------------
# apply / remove


def apply(
    model: nn.Module,
    *,
    ignore_index: int = -100,
    packed_boundaries: bool = True,
    allow_unverified: bool = False,
    options: Optional[LCEOptions] = None,
    **op_options: Any,
) -> nn.Module:
    """Patch `model` (in place, this instance only) to use the fused LM head; returns `model`.

    ignore_index       label value that is skipped (transformers' default -100).
    packed_boundaries  with `position_ids`, ignore positions whose next token has position id 0 (the
                       first token of the next packed sequence).
    allow_unverified   patch a model type outside VERIFIED_MODEL_TYPES (its forward must be
                       lm_head(base_model(...)) with no extra logits transform, or soft-capped by
                       config.final_logit_softcapping as Gemma2's).
    options, op_options  the op's `LCEOptions` (None: the defaults) and fields of it by keyword
                       (temperature, backend, cache_bytes, vocab_size to exclude padded vocabulary rows,
                       check_labels, invariant, logits_precision, ...), checked here once; ignore_index,
                       return_stats and softcap are the patch's own.
    Applying twice raises; call `remove(model)` first.
    """
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("areal_lce.integrations.transformers.apply: this model is already patched; call areal_lce.integrations.transformers.remove(model) "
                           "first to change options")
    value = LCEOptions.of(options, op_options, "areal_lce.integrations.transformers.apply")
    own = [k for k in _SET_BY_PATCH if getattr(value, k) != getattr(LCEOptions, k)]
    if own:
        raise TypeError(f"areal_lce.integrations.transformers.apply: {own} are set by the patch (ignore_index: its own argument; "
                        "return_stats; softcap: the config's final_logit_softcapping)")
    if not isinstance(ignore_index, int):
        raise TypeError(f"areal_lce.integrations.transformers.apply: ignore_index must be an int, got {ignore_index!r}")
    check_supported(model, allow_unverified=allow_unverified)
    softcap = model_softcap(model.config)
    if softcap is not None:
        value = value.replace("areal_lce.integrations.transformers.apply", softcap=softcap)

    forward = PatchedForward(model, model.__dict__.get("forward"), value, ignore_index, packed_boundaries)
    model.__dict__[_STATE_ATTR] = forward
    model.forward = forward
    return model


def _with_patch_parameters(sig: inspect.Signature) -> inspect.Signature:
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
             for name, default in (("return_token_stats", False), ("temperature", None))
             if name not in sig.parameters]
    return sig.replace(parameters=params[:at] + extra + params[at:])


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: `model.forward` becomes exactly what it was before (the class method, or the
    instance attribute that was there). Raises if the model is not patched, or if something else
    replaced the patched forward since (restoring would drop that wrapper)."""
    state: Optional[PatchedForward] = model.__dict__.get(_STATE_ATTR)
    if state is None:
        raise RuntimeError("areal_lce.integrations.transformers.remove: this model is not patched by areal_lce.integrations.transformers.apply")
    if model.__dict__.get("forward") is not state:
        raise RuntimeError("areal_lce.integrations.transformers.remove: model.forward was replaced after areal_lce.integrations.transformers.apply; "
                           "remove that wrapper first")
    if state.previous is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = state.previous
    del model.__dict__[_STATE_ATTR]
    return model


def is_patched(model: nn.Module) -> bool:
    return model.__dict__.get(_STATE_ATTR) is not None


# --------------------------------------------------------------------------------------------------
# what the patch supports


def get_base_model(model: nn.Module) -> nn.Module:
    """The module the causal-LM forward runs before its head."""
    prefix = getattr(model, "base_model_prefix", None)
    if prefix:
        base = getattr(model, prefix, None)
        if isinstance(base, nn.Module) and base is not model:
            return base
    base = getattr(model, "model", None)
    if isinstance(base, nn.Module) and base is not model:
        return base
    if hasattr(model, "get_decoder"):
        base = model.get_decoder()
        if isinstance(base, nn.Module) and base is not model:
            return base
    raise ValueError(f"areal_lce.integrations.transformers: can't find the base model of {type(model).__name__} (tried "
                     f"base_model_prefix={prefix!r}, .model, .get_decoder())")


def get_lm_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(f"areal_lce.integrations.transformers: {type(model).__name__} has no output embeddings / lm_head")
    return head


def _config_values(config, name):
    """Values of `name` on the config and on its text sub-config (multimodal wrappers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return [getattr(cfg, name) for cfg in {id(config): config, id(text): text}.values()
            if cfg is not None and getattr(cfg, name, None) is not None]


def model_softcap(config) -> Optional[float]:
    """config.final_logit_softcapping (on the config or its text sub-config) as the op's softcap; None when
    unset or 0. Anything but one finite number > 0 is a ValueError naming the option."""
    values = [v for v in _config_values(config, _SOFTCAP_OPTION) if v != 0]
    ok = all(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < float("inf") for v in values)
    if not ok or len({float(v) for v in values}) > 1:
        raise ValueError(f"areal_lce.integrations.transformers: config.{_SOFTCAP_OPTION} must be one finite number > 0 (or unset / 0), "
                         f"got {values!r} on the config and its text config")
    return float(values[0]) if values else None


def check_supported(model: nn.Module, *, allow_unverified: bool = False) -> None:
    """Raise ValueError naming the option/module when the fused head can't reproduce the model's logits."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"areal_lce.integrations.transformers: {type(model).__name__} has no .config; expected a transformers model")
    for name, neutral in _LOGIT_TRANSFORM_OPTIONS:
        for value in _config_values(config, name):
            if value not in neutral:
                raise ValueError(f"areal_lce.integrations.transformers: config.{name}={value!r} transforms the logits after lm_head, "
                                 "which the fused op can't express; refusing to patch")
    model_type = getattr(config, "model_type", None)
    softcap = model_softcap(config)  # applied by the op (softcap=)
    if softcap is not None and model_type in VERIFIED_MODEL_TYPES - _SOFTCAP_MODEL_TYPES:
        raise ValueError(f"areal_lce.integrations.transformers: config.{_SOFTCAP_OPTION}={softcap!r} is set, but model_type "
                         f"{model_type!r}'s forward does not soft-cap its logits; refusing to patch")
    head = get_lm_head(model)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise ValueError(f"areal_lce.integrations.transformers: lm_head is {type(head).__name__}, not a plain nn.Linear (adapters, "
                         "quantised or custom heads are not supported)")
    if head.bias is not None:
        raise ValueError("areal_lce.integrations.transformers: lm_head has a bias (lm_head.bias is set), which the fused op can't "
                         "express; refusing to patch")
    if not head.weight.is_floating_point() or head.weight.device.type == "meta":
        raise ValueError(f"areal_lce.integrations.transformers: lm_head.weight must be a materialised floating-point tensor, got "
                         f"dtype {head.weight.dtype} on {head.weight.device}")
    if model_type not in VERIFIED_MODEL_TYPES and not allow_unverified:
        raise ValueError(f"areal_lce.integrations.transformers: model_type {model_type!r} is not among the verified families "
                         f"{sorted(VERIFIED_MODEL_TYPES)}; pass allow_unverified=True if its forward is "
                         "lm_head(base_model(...).last_hidden_state) with no further logits transform")
    get_base_model(model)


# --------------------------------------------------------------------------------------------------
# the patched forward


def _patched_forward(state: PatchedForward, args, kwargs):
    return_token_stats = bool(kwargs.pop("return_token_stats", False))
    temperature = kwargs.pop("temperature", None)
    call = _bind(state.signature, args, kwargs)
    if not (return_token_stats or call.get("labels") is not None or call.get("shift_labels") is not None):
        if temperature is not None:
            raise TypeError("areal_lce.integrations.transformers: temperature= applies to the fused path only (pass labels= or "
                            "return_token_stats=True)")
        return state.original()(*args, **kwargs)
    return _fused_forward(state.model, state, call, temperature)


def _bind(sig: inspect.Signature, args, kwargs) -> Dict[str, Any]:
    """Name every argument of a call; **kwargs entries are flattened in."""
    bound = sig.bind(*args, **kwargs)
    out: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError("areal_lce.integrations.transformers: unexpected extra positional arguments")
        else:
            out[name] = value
    return out


def next_token_labels(labels: torch.Tensor, ignore_index: int, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """shift[..., t] = labels[..., t + 1]; the last position, and positions whose next token has
    position id 0 (the first token of the next packed sequence), get ignore_index."""
    shift = torch.full_like(labels, ignore_index)
    shift[..., :-1] = labels[..., 1:]
    if position_ids is not None:
        if position_ids.dim() != labels.dim():
            raise ValueError(f"areal_lce.integrations.transformers: position_ids of shape {tuple(position_ids.shape)} can't mark packed "
                             f"boundaries for labels of shape {tuple(labels.shape)}; pass shift_labels= or "
                             "apply(..., packed_boundaries=False)")
        pos = torch.broadcast_to(position_ids.to(labels.device), labels.shape)
        shift[..., :-1].masked_fill_(pos[..., 1:] == 0, ignore_index)
    return shift


def _fused_forward(model, state: PatchedForward, call: Dict[str, Any], temperature):
    labels = call.pop("labels", None)
    shift_labels = call.pop("shift_labels", None)
    logits_to_keep = call.pop("logits_to_keep", 0)
    num_items_in_batch = call.pop("num_items_in_batch", None)
    return_dict = call.pop("return_dict", None)
    ignore_index = call.pop("ignore_index", state.ignore_index)
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("areal_lce.integrations.transformers: logits_to_keep must be 0 on the fused path (it computes every position)")

    outputs = get_base_model(model)(**call)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]

    want_loss = labels is not None or shift_labels is not None
    if shift_labels is None:
        if labels is None:
            labels = call.get("input_ids")
            if labels is None:
                raise ValueError("areal_lce.integrations.transformers: return_token_stats=True without labels needs input_ids "
                                 "(the next tokens are scored)")
        position_ids = call.get("position_ids") if state.packed_boundaries else None
        shift_labels = next_token_labels(labels, ignore_index, position_ids)
    if tuple(shift_labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"areal_lce.integrations.transformers: labels of shape {tuple(shift_labels.shape)} don't match the hidden "
                         f"states' {tuple(hidden.shape[:-1])}")

    head = get_lm_head(model)
    out = fused_head(head, hidden, shift_labels, state.options, ignore_index=ignore_index, temperature=temperature)

    loss = None
    if want_loss:
        nll_sum = -out.logprobs.sum()  # ignored positions hold exactly 0
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(nll_sum.device)
            loss = nll_sum / num_items_in_batch
        else:
            loss = nll_sum / (shift_labels != ignore_index).sum()

    result = LCECausalLMOutput(
        loss=loss,
        logits=None,
        **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD, None)},
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        logprobs=out.logprobs,
        entropy=out.entropy,
        max_logit=out.max_logit,
        min_logit=out.min_logit,
        lse=out.lse,
        shift_labels=shift_labels,
    )
    if return_dict is False or (return_dict is None and getattr(model.config, "return_dict", True) is False):
        return result.to_tuple()
    return result
