"""The LM-head route, chosen once: the fused op at the capture seam, or the output layer's logits.

    route = Route.choose(fused=True, seam="auto", options=LCEOptions(backend="auto", cache_bytes=0))
    packed = route.stats(model, input_ids, labels, vocab_size=V)   # [b, s, 4] on the LM-head stage
    logits = route.last_token_logits(model, gpt, positions, input_ids, position_ids, attention_mask)

`token_stats` builds a Route from its arguments; `MegatronEngine` builds one at construction from
`engine.use_fused_linear_ce`, `capture_seam` and `engine.lce` (`LCEConfig.options()`) and runs training,
logprob passes and generation through it (`engine.route`), so the flag is read in one place. Both routes
make one model call through the same seam (capture.py) and give the same outputs and gradients;
`name` ("fused" | "materialised") and `description` ("fused linear op" | "materialised logits") name
the route for logs. The model is a GPTModel or a HybridModel (megatron-core >= 0.19), whose forward has no
output_processor: "auto" takes the output_layer seam there, and `check_hybrid` refuses what that seam
cannot serve on it (MTP depths, the KV-cache decode path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..op.checks import check_temperature
from ..op.options import LCEOptions
from . import capture, compat
from .context_parallel import CPGroup
from .packing import PackedLayout


def find_gpt_model(model):
    """The megatron language model inside `model` (itself, or reached through `.module` of DDP /
    Float16Module / ...): a GPTModel, or a HybridModel (megatron-core >= 0.19; see `check_hybrid`)."""
    classes = compat.language_model_classes()
    seen = model
    for _ in range(16):
        if isinstance(seen, classes):
            return seen
        seen = getattr(seen, "module", None)
        if seen is None:
            break
    names = " or ".join(c.__name__ for c in classes)
    raise TypeError(f"token_stats: found no megatron {names} in {type(model).__name__} (looked through "
                    "`.module` of wrappers such as DistributedDataParallel and Float16Module)")


def is_hybrid(lm) -> bool:
    """Whether `lm` (find_gpt_model's result) is a HybridModel."""
    hybrid = compat.hybrid_model_class()
    return hybrid is not None and isinstance(lm, hybrid)


def check_hybrid(lm, seam: str, **model_kwargs) -> None:
    """Refuse, with the reason, the parts of a HybridModel the output_layer seam cannot serve. Its
    forward has no output_processor argument, so the seam is the instance-level output_layer one
    (capture.output_layer_seam), on which:
      * MTP depths (a hybrid_layer_pattern with "/"): the MTP block calls the replaced output layer for
        its own losses, with labels the seam does not see -- refused on both routes, which must agree;
      * the KV-cache decode path (inference_context=): HybridModel's inference path keeps Mamba states in
        the context and, under megatron's InferenceMode, slices the hidden states itself before the
        output layer, which the last-token processor already does -- refused.
    Sequence and tensor parallelism, THD packing, tied embeddings, pipeline stages without the head:
    the seam serves them as for GPTModel (MuP scaling after the output layer: check_seam_config)."""
    name = type(lm).__name__
    if seam == "output_processor":
        raise ValueError(f"capture_seam='output_processor' with a {name}: its forward has no output_processor "
                         "argument; use capture_seam='output_layer' or 'auto' (which picks it for this model)")
    depths = getattr(lm, "mtp_num_depths", 0) or 0
    if depths > 0:
        raise ValueError(f"{name} with {depths} MTP depth(s) (hybrid_layer_pattern {lm.hybrid_layer_pattern!r}): "
                         "its MTP block calls the output layer that the output_layer seam replaces, with labels "
                         "that seam does not receive; build the model without MTP depths for token_stats")
    if model_kwargs.get("inference_context") is not None or model_kwargs.get("inference_params") is not None:
        raise ValueError(f"inference_context with a {name}: its inference path (Mamba states in the context; under "
                         "megatron's InferenceMode the last token's hidden states picked before the output layer, "
                         "as the last-token processor picks them) is not served by the output_layer seam; decode "
                         "with a KV cache is supported for GPTModel only (a full forward without one works)")


def _check_inputs(gpt, input_ids, labels, position_ids, packed_seq_params, vocab_size) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= gpt.vocab_size:
        raise ValueError(f"token_stats(vocab_size={vocab_size!r}): the true vocabulary, an int in "
                         f"[1, {gpt.vocab_size}] (the model's padded vocabulary); padded rows are excluded")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be an integer tensor [b, s] (or [1, T] packed), got "
                         f"{capture._describe(input_ids)}")
    if not torch.is_tensor(labels) or labels.is_floating_point() or tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"labels must be an integer tensor laid out like input_ids {tuple(input_ids.shape)} "
                         f"(already shifted: labels[..., i] is the target after input_ids[..., i]), got "
                         f"{capture._describe(labels)}")
    if position_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must be shaped like input_ids "
                         f"{tuple(input_ids.shape)}")
    if packed_seq_params is not None:
        fmt = getattr(packed_seq_params, "qkv_format", None)
        if fmt != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: only packed 'thd' sequences are supported")
        if input_ids.shape[0] != 1:
            raise ValueError(f"packed (THD) input_ids must be [1, T] (all sequences in one row), got "
                             f"{tuple(input_ids.shape)}")
    cfg = gpt.config
    tp = getattr(cfg, "tensor_model_parallel_size", 1)
    if cfg.sequence_parallel and tp > 1 and input_ids.shape[1] % tp:
        raise ValueError(f"sequence_parallel with tensor_model_parallel_size={tp}: the sequence length "
                         f"{input_ids.shape[1]} must be a multiple of {tp} (pad it; padded labels = ignore_index)")


def _temperature(temperature, labels: torch.Tensor) -> Optional[torch.Tensor]:
    """A per-token temperature tensor as the seam takes it: fp32, broadcast to labels' shape (checks'
    rule, checked here once); None for a float (the `temperature` option, checked by LCEOptions)."""
    if not torch.is_tensor(temperature):
        return None
    checked = check_temperature(temperature, "temperature", shape=labels.shape)
    return checked.to(labels.device, torch.float32).contiguous()


@dataclass(frozen=True)
class Route:
    """fused: the fused op at the LM head (no [tokens, vocab] logits) or the output layer's logits;
    seam: "output_processor" | "output_layer" (resolved, see capture.py); options: the op's `LCEOptions`
    of every call on this route (backend, cache_bytes, ... : what the engine's `engine.lce` sets), to which
    each call adds its own (vocab_size, temperature, ignore_index, compact_ignored, top_k); the materialised
    route takes those it has (invariant, logits_precision, ...: capture.CaptureContext); auto_seam: the
    seam was asked as "auto" (a HybridModel then takes the output_layer seam, `seam_for`)."""

    fused: bool
    seam: str
    options: LCEOptions = LCEOptions()
    auto_seam: bool = False

    @classmethod
    def choose(cls, fused: bool = True, seam: str = "auto", options: Optional[LCEOptions] = None) -> "Route":
        """The route of these options (None: the op's defaults); seam "auto" resolves to the installed
        megatron-core's seam."""
        if options is not None and not isinstance(options, LCEOptions):
            raise TypeError(f"Route.choose(options=...): an areal_lce.LCEOptions or None, got {options!r}")
        return cls(bool(fused), capture.resolve_seam(seam), LCEOptions.of(options, {}, "Route.choose"),
                   seam == "auto")

    @property
    def name(self) -> str:
        return "fused" if self.fused else "materialised"

    @property
    def description(self) -> str:
        return "fused linear op" if self.fused else "materialised logits"

    def check(self, config, seam: Optional[str] = None) -> None:
        """Refuse, naming the option, what this route cannot reproduce on a model of `config` through `seam`
        (the one `seam_for` gives for that model; None: the route's own)."""
        seam = self.seam if seam is None else seam
        capture.check_seam_config(config, seam, self.fused)
        compat.check_linear_cross_entropy(config, seam)  # megatron's fused linear CE: another output layer

    def seam_for(self, lm, **model_kwargs) -> str:
        """The seam this route uses on the language model `lm`: its own, except on a HybridModel (no
        output_processor argument) where "auto" means the output_layer seam; what a HybridModel cannot
        do on it is refused (`check_hybrid`)."""
        if not is_hybrid(lm):
            return self.seam
        seam = "output_layer" if self.auto_seam else self.seam
        check_hybrid(lm, seam, **model_kwargs)
        return seam

    def stats(self, model, input_ids: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, position_ids=None,
              attention_mask=None, packed_seq_params=None, temperature=1.0, ignore_index: int = -100,
              compact_ignored: Optional[bool] = None, selected_ids: Optional[torch.Tensor] = None,
              top_k: Optional[int] = None):
        """One model call: packed [b, s, 4] stats (logprobs, entropy, max_logit, min_logit) on the stage
        with the LM head, the decoder's output (what a pipeline schedule sends on) on the other stages.
        Arguments as `token_stats`'; `compact_ignored` is this call's (the engine picks it per micro-batch).
        With selected_ids [b, s, K] / top_k the stage with the LM head returns (packed, extras): extras is a
        dict of selected_logprobs [b, s, K] fp32, topk_ids [b, s, k] int64 and topk_logprobs [b, s, k] fp32
        laid out like labels (None where not asked): their own tensors, so the ids stay exact."""
        gpt = find_gpt_model(model)
        seam = self.seam_for(gpt)
        if isinstance(packed_seq_params, PackedLayout):  # the layout value: megatron's form, built once here
            packed_seq_params = packed_seq_params.packed_seq_params()
        _check_inputs(gpt, input_ids, labels, position_ids, packed_seq_params, vocab_size)
        self.check(gpt.config, seam)
        labels = labels.to(input_ids.device)
        t = _temperature(temperature, labels)
        scalar = {} if t is not None else {"temperature": temperature}  # the option: checked there, once
        options = self.options.replace("token_stats", vocab_size=vocab_size, ignore_index=ignore_index,
                                       compact_ignored=compact_ignored, top_k=top_k, return_stats=True, **scalar)
        ctx = capture.CaptureContext(labels=labels, options=options, temperature=t, fused=self.fused,
                                     selected_ids=None if selected_ids is None else selected_ids.to(input_ids.device))
        run = capture.run_fused if self.fused else capture.run_materialised
        out = run(model, gpt, seam, ctx, input_ids, position_ids, attention_mask, packed_seq_params)
        if gpt.post_process and ctx.extras is not None:
            return out, ctx.extras
        return out

    def last_token_logits(self, model, gpt_model, positions: torch.Tensor, input_ids, position_ids, attention_mask,
                          *, cp_group=None, **model_kwargs):
        """One model call: [b, V_pad] fp32 logits of position `positions[i]` of each row i on the last
        stage (only those rows are built, on either route), hidden states on the others. `cp_group`: the
        context-parallel group when the batch is this CP rank's share (anything `CPGroup.of` takes);
        `model_kwargs` go to GPTModel (e.g. inference_context= for the KV cache)."""
        seam = self.seam_for(gpt_model, **model_kwargs)
        ctx = capture.LastTokenContext(positions=positions, cp=CPGroup.of(cp_group))
        return capture.run_last_token(model, gpt_model, seam, ctx, input_ids, position_ids, attention_mask,
                                      **model_kwargs)
