"""Capture seam: per-token logprobs/entropy/stats at Megatron's LM head, without building logits.

Two output processors run at the LM head: `stats_output_processor` (packed fp32 [b, s, 4] = logprobs,
entropy, max_logit, min_logit; fused op or materialised logits) and `last_token_output_processor` (the
[b, V_pad] logits of one position per sequence, for sampling). `call_with_processor` installs either for
one model call, on one of two seams:
  * `output_processor` (megatron-core >= 0.18): `GPTModel.forward(output_processor=...,
    output_processor_context=...)`; GPTModel hands the processor the decoder's final hidden states and
    the output layer instead of running the logits GEMM.
  * `output_layer` (megatron-core 0.16/0.17): `output_layer_seam` sets a replacement `forward` on the
    output-layer *instance* for the duration of one model call (module hooks still fire) that runs the
    processor, and restores the class method afterwards (areal_lce.patching). GPTModel transposes the
    output layer's sequence-first result to batch-first, so the processor's batch-first result is
    handed back transposed.

Who reduces d_hidden (exactly once): Megatron's own mappings, as ColumnParallelLinear does on the
materialised route (`_fused_packed`); the op's `VocabParallel(group, d_hidden="caller")` only merges the
per-shard softmax statistics (docs/megatron.md, "Who reduces d_hidden").

Logits precision (`logits_precision`, "fp32" by default): the fused op accumulates in fp32 and rounds
each logit to bf16 under "bf16". The materialised route builds the same logits: Megatron's output layer
where its own GEMM gives them (an fp32 weight; a bf16 weight under "bf16"), else an fp32-output GEMM
(`head.fp32_logits`) behind the output layer's input mappings, so a bf16 model's materialised logits are
not rounded to bf16 under "fp32".

The LM-head weight's gradient: without gradient-accumulation fusion it comes out of the op's autograd
Function into `weight.grad`, and Megatron DDP's per-parameter hook adds it to `main_grad` (grad buffer),
as for the materialised route. With the output layer's `gradient_accumulation_fusion=True` the fused
route adds it in fp32 into `weight.main_grad` itself and sets `grad_added_to_main_grad`, as Megatron's
own linear does (areal_lce/op/main_grad.py), so it is not rounded to the weight's dtype first. Tied
embeddings: GPTModel passes the shared embedding matrix as `weight=`; we use it as is, so both uses
accumulate into one parameter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import patching
from ..op.api import linear_logprobs_entropy
from ..op.main_grad import fuses_wgrad, linear_logprobs_entropy_into_main_grad
from ..op.materialised import logprobs_entropy_from_logits
from ..op.options import LCEOptions
from ..op.types import VocabParallel
from .compat import has_output_processor
from .context_parallel import CPGroup, gather_from_context_parallel
from .head import HeadOf, fp32_logits, head_input, head_of, output_layer_gives
from .head import head_weight as _head_weight
from .head import tp_of as _tp

SEAMS = ("output_processor", "output_layer")


@dataclass
class CaptureContext:
    """What the seam needs besides the hidden states (one model call).

    labels: global next-token ids laid out like the model's input_ids ([b, s], or [1, T] for packed THD),
        options.ignore_index where there is no target.
    options: the op's `LCEOptions` for this call (its checked value: nothing here checks a field again).
        options.vocab_size is required, the true vocabulary (Megatron's padded rows must not enter the
        softmax): the HF config's `vocab_size` to match vLLM / SGLang, not the tokenizer's size. Both routes
        take it: the fused one hands it to `linear_logprobs_entropy` as it is (return_stats set), the
        materialised one its temperature, ignore_index, vocab_size, invariant, logits_precision and
        check_labels (`logprobs_entropy_from_logits`), building its logits in the precision asked for
        (`head.fp32_logits`). options.top_k: fused route only.
    temperature: a per-token temperature tensor shaped like labels (a call input), or None: the scalar
        options.temperature.
    fused: True computes the stats with the fused op; False builds the logits through the output layer
        (the materialised route, same outputs).
    """

    labels: torch.Tensor
    options: LCEOptions
    temperature: Optional[torch.Tensor] = None
    fused: bool = True
    selected_ids: Optional[torch.Tensor] = None  # [b, s, K] global ids laid out like labels (+ K)
    extras: Optional[dict] = None  # output of the fused processor with selected_ids / top_k: selected_logprobs
    #                                [b, s, K], topk_ids [b, s, k] int64, topk_logprobs [b, s, k] (None if not asked)

    def __post_init__(self):
        if not isinstance(self.options, LCEOptions):
            raise TypeError(f"CaptureContext(options=...): an areal_lce.LCEOptions, got {self.options!r}")
        if self.options.vocab_size is None:
            raise ValueError("CaptureContext(options.vocab_size=None): pass the true vocabulary size (an int > 0); "
                             "without it Megatron's padded vocabulary rows enter the softmax")
        if not self.options.return_stats:  # the packed stats carry the logit extremes
            self.options = self.options.replace("CaptureContext", return_stats=True)
        if not torch.is_tensor(self.labels) or self.labels.dim() != 2 or self.labels.is_floating_point():
            raise ValueError("CaptureContext(labels=...): an integer tensor [b, s] (or [1, T] for packed "
                             f"sequences) laid out like input_ids, got {_describe(self.labels)}")
        sel = self.selected_ids
        if sel is not None and (not torch.is_tensor(sel) or sel.dim() != 3
                                or tuple(sel.shape[:2]) != tuple(self.labels.shape)):
            raise ValueError(f"selected_ids must be an integer tensor [b, s, K] laid out like labels "
                             f"{tuple(self.labels.shape)} plus K ids per token, got {_describe(sel)}")
        if (sel is not None or self.options.top_k) and not self.fused:
            raise ValueError("selected_ids / top_k are computed by the fused route only (the materialised route "
                             "returns logprobs, entropy and logit extremes): set fused=True "
                             "(engine.use_fused_linear_ce: true)")
        t = self.temperature
        if t is not None and (not torch.is_tensor(t) or not t.is_floating_point()
                              or tuple(t.shape) != tuple(self.labels.shape)):
            raise ValueError(f"CaptureContext(temperature=...): a per-token floating-point tensor shaped like labels "
                             f"{tuple(self.labels.shape)} (token_stats broadcasts it), or None for "
                             f"options.temperature; got {_describe(t)}")


def _describe(x) -> str:
    return f"tensor {tuple(x.shape)} {x.dtype}" if torch.is_tensor(x) else type(x).__name__


def resolve_seam(name: str) -> str:
    """'auto' -> output_processor when GPTModel has it, else output_layer; explicit names are checked."""
    if name == "auto":
        return "output_processor" if has_output_processor() else "output_layer"
    if name not in SEAMS:
        raise ValueError(f"capture_seam={name!r}: expected 'auto' or one of {SEAMS}")
    if name == "output_processor" and not has_output_processor():
        raise ValueError("capture_seam='output_processor' needs megatron-core >= 0.18 "
                         "(GPTModel.forward(output_processor=...)); use capture_seam='output_layer' or 'auto'")
    return name


def check_seam_config(config, seam: str, fused: bool = True) -> None:
    """Refuse, naming the option, what a route cannot reproduce exactly. Run by `token_stats` and again by
    the seam itself (the processor / the replaced output layer), so a direct caller gets the same checks.
    Context parallelism needs no check: the statistics are per token, so CP-local hidden states and labels
    give CP-local statistics (the LM-head weight gradient is partial per CP rank; megatron's DDP sums it)."""
    if not fused:
        return
    if getattr(config, "mtp_num_layers", None) and seam == "output_layer":
        raise ValueError(f"mtp_num_layers={config.mtp_num_layers} with capture_seam='output_layer': the MTP "
                         "heads call the replaced output layer too. Use megatron-core >= 0.18 (the "
                         "output_processor seam runs MTP as Megatron does) or use_fused_linear_ce=false.")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("defer_embedding_wgrad_compute=True defers the LM-head weight gradient to "
                         "Megatron's GEMM; not supported with use_fused_linear_ce=true")
    if seam == "output_layer" and getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        raise ValueError("MuP output scaling (use_mup with mup_output_mult != 1) is applied by GPTModel after "
                         "the output layer; with capture_seam='output_layer' it would scale the statistics. "
                         "Use capture_seam='output_processor' (megatron-core >= 0.18), which folds it into "
                         "the temperature.")


def _seq_first(ctx: CaptureContext, s: int, b: int):
    """Labels and the per-token temperature (or None) of ctx in Megatron's sequence-first [s, b] layout
    (views, no copy)."""
    if tuple(ctx.labels.shape) != (b, s):
        raise ValueError(f"labels {tuple(ctx.labels.shape)} do not match the model's tokens [b={b}, s={s}] "
                         "(labels are laid out like input_ids: [batch, seq], or [1, T] for packed sequences)")
    t = ctx.temperature
    return ctx.labels.t(), (None if t is None else t.t())


def _fused_packed(hidden: torch.Tensor, weight: torch.Tensor, output_layer, ctx: CaptureContext,
                  head: HeadOf) -> torch.Tensor:
    """[s_local, b, H] hidden + this rank's [V/tp, H] weight -> packed [s, b, 4] fp32 stats of the model's
    logits m·h·Wᵀ (m = head.logit_scale, MuP's multiplier). m is folded in here and nowhere else: the op runs at
    temperature T/m (its softmax is that of m·h·Wᵀ / T) and returns the extremes of the raw h·Wᵀ, which
    one multiply by m puts on the model's logit scale. With ctx.selected_ids / options.top_k the selected and
    top-k outputs go to ctx.extras, batch-first like labels, as their own tensors (the ids stay int64)."""
    hidden, _ = head_input(hidden, weight, output_layer)
    mult = head.logit_scale
    s, b, h = hidden.shape
    labels, temperature = _seq_first(ctx, s, b)
    options, per_token = ctx.options, {}
    if temperature is not None:  # a call input
        per_token = {"temperature": temperature.reshape(-1) / mult}
    elif mult != 1.0:  # the scalar option at T/m
        options = options.replace("CaptureContext", temperature=options.temperature / mult)
    # gradient_accumulation_fusion: the weight gradient goes into weight.main_grad in fp32 (main_grad.py)
    op = linear_logprobs_entropy_into_main_grad if fuses_wgrad(output_layer, weight) else linear_logprobs_entropy
    out = op(
        hidden.reshape(s * b, h), weight, labels.reshape(-1).to(hidden.device), options, **per_token,
        vocab_parallel=head.vocab_parallel,  # d_hidden="caller": Megatron's own mapping (head_input) reduces it
        selected_ids=None if ctx.selected_ids is None else ctx.selected_ids.transpose(0, 1).reshape(s * b, -1),
    )
    stats = (out.logprobs, out.entropy, out.max_logit * mult, out.min_logit * mult)
    if ctx.selected_ids is not None or options.top_k:
        ctx.extras = {name: (None if t is None else t.view(s, b, -1).transpose(0, 1))
                      for name, t in (("selected_logprobs", out.selected_logprobs), ("topk_ids", out.topk_ids),
                                      ("topk_logprobs", out.topk_logprobs))}
    return torch.stack([t.view(s, b) for t in stats], dim=-1)


def _materialised_packed(logits: torch.Tensor, labels: torch.Tensor, temperature, weight_rows: int, output_layer,
                         ctx: CaptureContext) -> torch.Tensor:
    """logits [x, y, V_pad/tp] (or gathered [x, y, V_pad]) and labels / temperature [x, y] -> packed
    [x, y, 4] fp32 stats, in whichever layout they come (no copy of the logits)."""
    tp_group, tp = _tp(output_layer)
    vocab_parallel = tp > 1 and logits.shape[-1] == weight_rows  # else parallel_output=False gathered them
    o = ctx.options
    r = logprobs_entropy_from_logits(logits, labels.to(logits.device),
                                     temperature=o.temperature if temperature is None else temperature,
                                     ignore_index=o.ignore_index, vocab_size=o.vocab_size,
                                     vocab_parallel=VocabParallel(tp_group) if vocab_parallel else None,
                                     invariant=o.invariant, logits_precision=o.logits_precision,
                                     check_labels=o.check_labels)
    return torch.stack([r.logprobs, r.entropy, r.max_logit, r.min_logit], dim=-1)


def stats_output_processor(*, hidden_states, output_layer, output_weight, context, runtime_gather_output=None,
                           scale_logits=None, config=None, input_ids=None, packed_seq_params=None,
                           seam: str = "output_processor", **_unused) -> torch.Tensor:
    """GPTModel output_processor: packed [b, s, 4] token stats (logprobs, entropy, max_logit, min_logit),
    fused or materialised as `context.fused` says. `seam` is "output_layer" where `output_layer_seam`
    runs it in place of the output layer (fused route only)."""
    if not isinstance(context, CaptureContext):
        raise TypeError("stats_output_processor needs output_processor_context=CaptureContext(...), got "
                        f"{type(context).__name__}")
    config = config if config is not None else output_layer.config
    check_seam_config(config, seam, context.fused)
    if input_ids is not None and tuple(input_ids.shape) != tuple(context.labels.shape):
        raise ValueError(f"labels {tuple(context.labels.shape)} must be laid out like input_ids "
                         f"{tuple(input_ids.shape)}")
    if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' packing "
                         "is supported")
    weight = _head_weight(output_layer, output_weight)
    if not context.fused:
        if seam != "output_processor":
            raise ValueError("the output_layer seam runs the fused route only (the materialised route calls "
                             "the model as is)")
        if output_layer_gives(weight, context.options.logits_precision):
            logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        else:
            logits = fp32_logits(hidden_states, weight, output_layer)
        if scale_logits is not None:
            logits = scale_logits(logits)
        labels, temperature = _seq_first(context, logits.shape[0], logits.shape[1])
        packed = _materialised_packed(logits, labels, temperature, weight.shape[0], output_layer, context)
        return packed.transpose(0, 1).contiguous()
    if runtime_gather_output:
        raise ValueError("runtime_gather_output=True asks for gathered logits; the fused route returns "
                         "token statistics only")
    packed = _fused_packed(hidden_states, weight, output_layer, context,
                           head_of(output_layer, config, scale_logits=scale_logits))
    return packed.transpose(0, 1).contiguous()


def logits_output_processor(*, hidden_states, output_layer, output_weight, context, **_unused) -> torch.Tensor:
    """The materialised route's output layer on the output_layer seam where the layer's own GEMM would not
    give the logits precision asked for (`head.output_layer_gives`): batch-first [b, s, V/tp] fp32 logits,
    which `output_layer_seam` hands GPTModel sequence-first, as the output layer returns them."""
    return fp32_logits(hidden_states, _head_weight(output_layer, output_weight), output_layer).transpose(0, 1)


@dataclass
class LastTokenContext:
    """Positions whose next-token logits are wanted (one per sequence of the batch)."""

    positions: torch.Tensor  # [b] long, index into the sequence dimension
    cp: CPGroup = CPGroup.none()  # the context-parallel group when the hidden states are this CP rank's chunks


def _last_token_logits(hidden: torch.Tensor, weight: torch.Tensor, output_layer, ctx: LastTokenContext):
    """[s_local, b, H] hidden -> [b, V_pad + H] fp32 at ctx.positions (no grad), on every TP rank:
      [:, :V_pad]  the full-vocabulary logits, the fp32 accumulation of h·Wᵀ (not rounded to the weight's
                   dtype: a bf16 sampler rounds them itself, as the op's logits_precision="bf16" does);
      [:, V_pad:]  the hidden states they come from, in the weight's dtype (held exactly in fp32), from
                   which generation takes the sampled tokens' logprobs through the training head.
    Only b rows of logits are ever built. Under context parallelism the hidden states of this CP rank's
    zigzag chunks are gathered back into sequence order first (BSHD)."""
    from megatron.core import tensor_parallel

    tp_group, tp = _tp(output_layer)
    if output_layer.sequence_parallel and tp > 1:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    if ctx.cp.active:
        hidden = gather_from_context_parallel(hidden.transpose(0, 1), ctx.cp).transpose(0, 1)
    rows = torch.arange(hidden.shape[1], device=hidden.device)
    picked = hidden[ctx.positions.to(hidden.device), rows].to(weight.dtype)  # [b, H]
    if picked.is_cuda and picked.dtype in (torch.bfloat16, torch.float16):
        logits = torch.mm(picked, weight.t(), out_dtype=torch.float32)  # [b, V_pad / tp], fp32 accumulation
    else:
        logits = picked.float() @ weight.float().t()  # products of bf16 / fp32 values are exact in fp32
    if tp > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous(), group=tp_group)
    return torch.cat([logits, picked.float()], dim=-1)


def last_token_output_processor(*, hidden_states, output_layer, output_weight, context, scale_logits=None,
                                **_unused) -> torch.Tensor:
    """GPTModel output_processor for sampling: [b, V_pad] fp32 logits of the positions in context."""
    logits = _last_token_logits(hidden_states, _head_weight(output_layer, output_weight), output_layer, context)
    return scale_logits(logits) if scale_logits is not None else logits


# ------------------------------------------------------------------------------------ one seam, two processors


@contextlib.contextmanager
def output_layer_seam(output_layer, processor, context):
    """The seam of megatron-core 0.16/0.17: for one model call `output_layer.forward`, set on the instance,
    runs `processor` (as GPTModel >= 0.18 would call it, with seam="output_layer"); `del` restores the
    class method. GPTModel transposes the output layer's sequence-first result to batch-first (applying
    its MuP scaling first, which is why the fused route refuses MuP here), so the processor's batch-first
    result is handed back transposed."""
    if "forward" in vars(output_layer):
        raise RuntimeError("output_layer.forward is already replaced on this instance (nested capture?)")

    def forward(input_, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None):
        out = processor(hidden_states=input_, output_layer=output_layer, output_weight=weight, context=context,
                        runtime_gather_output=runtime_gather_output, config=output_layer.config, seam="output_layer")
        return out.transpose(0, 1), None

    with patching.patched(patching.Patch(output_layer, "forward", forward)):  # then ColumnParallelLinear.forward
        yield


def call_with_processor(model, gpt_model, seam: str, processor, context, input_ids, position_ids, attention_mask,
                        **model_kwargs) -> Any:
    """`model(input_ids, position_ids, attention_mask, **model_kwargs)` with `processor` at the LM head in
    place of the logits GEMM, on `seam`: the processor's result on the last pipeline stage, hidden
    states on the others. `model` is what is called (DDP / Float16Module wrapped), `gpt_model` the bare
    GPTModel."""
    if seam == "output_processor":
        if not has_output_processor(type(gpt_model)):  # HybridModel: the output_layer seam only
            raise ValueError(f"capture_seam='output_processor': {type(gpt_model).__name__}.forward has no "
                             "output_processor argument; use the output_layer seam")
        return model(input_ids, position_ids, attention_mask, **model_kwargs, output_processor=processor,
                     output_processor_context=context)
    if not gpt_model.post_process:
        return model(input_ids, position_ids, attention_mask, **model_kwargs)
    with output_layer_seam(gpt_model.output_layer, processor, context):
        return model(input_ids, position_ids, attention_mask, **model_kwargs)


def unpack(packed: torch.Tensor):
    """[b, s, 4] -> (logprobs, entropy, max_logit, min_logit), each [b, s] fp32."""
    packed = packed.float()
    return packed[..., 0], packed[..., 1], packed[..., 2], packed[..., 3]


def _stats_call(model, gpt_model, seam: str, ctx: CaptureContext, input_ids, position_ids, attention_mask,
                packed_seq_params):
    kwargs = {"packed_seq_params": packed_seq_params}
    if seam == "output_processor" and getattr(gpt_model.config, "mtp_num_layers", None):
        # Megatron's MTP heads need labels and a loss mask (GPTModel rolls both once per MTP layer)
        valid = ctx.labels != ctx.options.ignore_index
        kwargs.update(labels=torch.where(valid, ctx.labels, torch.zeros_like(ctx.labels)), loss_mask=valid.float())
    return call_with_processor(model, gpt_model, seam, stats_output_processor, ctx, input_ids, position_ids,
                               attention_mask, **kwargs)


def run_fused(model, gpt_model, seam: str, ctx: CaptureContext, input_ids, position_ids, attention_mask,
              packed_seq_params=None) -> Any:
    """One model call on the fused route: packed [b, s, 4] stats on the last pipeline stage, hidden
    states otherwise."""
    return _stats_call(model, gpt_model, seam, ctx, input_ids, position_ids, attention_mask, packed_seq_params)


def run_materialised(model, gpt_model, seam: str, ctx: CaptureContext, input_ids, position_ids, attention_mask,
                     packed_seq_params=None) -> Any:
    """run_fused's twin on the materialised route: the output layer builds the logits (same outputs)."""
    if seam == "output_processor":
        return _stats_call(model, gpt_model, seam, ctx, input_ids, position_ids, attention_mask, packed_seq_params)
    if not gpt_model.post_process:
        return model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
    weight = gpt_model.shared_embedding_or_output_weight()
    with contextlib.ExitStack() as stack:
        if not output_layer_gives(weight, ctx.options.logits_precision):
            stack.enter_context(output_layer_seam(gpt_model.output_layer, logits_output_processor, ctx))
        out = model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
    if tuple(out.shape[:2]) != tuple(ctx.labels.shape):
        raise ValueError(f"labels {tuple(ctx.labels.shape)} do not match the model's logits {tuple(out.shape)}")
    # GPTModel returned batch-first [b, s, V] logits
    return _materialised_packed(out, ctx.labels, ctx.temperature, weight.shape[0], gpt_model.output_layer, ctx)


def run_last_token(model, gpt_model, seam: str, ctx: LastTokenContext, input_ids, position_ids, attention_mask,
                   **model_kwargs):
    """[b, V_pad] fp32 logits at ctx.positions on the last stage (hidden states on other stages).
    `model_kwargs` go to GPTModel.forward (e.g. inference_context= for the KV cache)."""
    return call_with_processor(model, gpt_model, seam, last_token_output_processor, ctx, input_ids, position_ids,
                               attention_mask, **model_kwargs)
