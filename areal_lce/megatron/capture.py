"""Capture seam: per-token logprobs/entropy/stats at Megatron's LM head, without building logits.

Two seams, same result (a packed fp32 tensor [b, s, 4] = logprobs, entropy, max_logit, min_logit):
  * `output_processor` (megatron-core >= 0.18): `GPTModel.forward(output_processor=fused_output_processor,
    output_processor_context=CaptureContext)`; GPTModel hands the processor the decoder's final hidden
    states and the output layer instead of running the logits GEMM.
  * `output_layer` (megatron-core 0.16/0.17): `legacy_capture(output_layer, ctx)` sets a replacement
    `forward` on the output-layer *instance* for the duration of one model call (module hooks still
    fire) and restores the class method with `del output_layer.forward`. GPTModel then transposes our
    [s, b, 4] result to [b, s, 4] exactly as it would transpose logits.

Who reduces d_hidden (exactly once): Megatron's own mappings, the same ones ColumnParallelLinear uses
on the materialised route. Without sequence parallelism the hidden states pass through
`copy_to_tensor_model_parallel_region` (identity forward, all-reduce of d_hidden backward); with it,
through `gather_from_sequence_parallel_region` (all-gather forward, reduce-scatter backward). The op
is then called with `reduce_d_hidden=False, sequence_parallel=False`: its `tp_group` only merges the
per-shard softmax statistics in the forward. Going through Megatron's mappings keeps the fused route's
communication identical to the materialised route's (same collectives on the same groups), and keeps
Megatron's sequence-parallel conventions in Megatron's hands.

The LM-head weight's gradient comes out of the op's autograd Function into `weight.grad`, so Megatron
DDP's per-parameter hook adds it to `main_grad` (grad buffer) exactly as for the materialised route
without gradient-accumulation fusion. Tied embeddings: GPTModel passes the shared embedding matrix as
`weight=`; we use it as is, so both uses accumulate into one parameter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .compat import has_output_processor

SEAMS = ("output_processor", "output_layer")


@dataclass
class CaptureContext:
    """What the seam needs besides the hidden states (one model call)."""

    labels: torch.Tensor  # [b, s] global token ids, -100 = ignore (next-token targets)
    temperature: float
    vocab_size: int  # true vocabulary; Megatron's padded rows are excluded
    backend: str = "auto"
    cache_bytes: int = 0
    ignore_index: int = -100


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


def check_capture_supported(gpt_model, seam: str) -> None:
    """Refuse, naming the option, configurations the fused route cannot reproduce exactly."""
    cfg = gpt_model.config
    if getattr(cfg, "mtp_num_layers", None):
        raise ValueError(f"mtp_num_layers={cfg.mtp_num_layers}: multi-token-prediction heads call the output "
                         "layer again on their own hidden states; the fused route does not cover them. "
                         "Set use_fused_linear_ce=false or mtp_num_layers=None.")
    if getattr(cfg, "context_parallel_size", 1) != 1:
        raise ValueError(f"context_parallel_size={cfg.context_parallel_size}: context parallelism is not "
                         "supported by the fused route (parallel.context_parallel must be 1)")
    if getattr(cfg, "defer_embedding_wgrad_compute", False):
        raise ValueError("defer_embedding_wgrad_compute=True defers the LM-head weight gradient to "
                         "Megatron's GEMM; not supported with use_fused_linear_ce=true")
    if not gpt_model.post_process:
        return  # no LM head on this pipeline stage: nothing to capture
    if not gpt_model.parallel_output or getattr(gpt_model.output_layer, "gather_output", False):
        raise ValueError("parallel_output=False gathers full-vocabulary logits on every rank; the fused "
                         "route needs vocab-parallel output (build GPTModel with parallel_output=True)")
    if seam == "output_layer" and getattr(cfg, "use_mup", False) and getattr(cfg, "mup_output_mult", 1.0) != 1.0:
        raise ValueError("MuP output scaling (use_mup with mup_output_mult != 1) is applied by GPTModel after "
                         "the output layer; with capture_seam='output_layer' it would scale the statistics. "
                         "Use capture_seam='output_processor' (megatron-core >= 0.18), which folds it into "
                         "the temperature.")


def _logit_multiplier(config, scale_logits) -> float:
    """MuP's logit multiplier, checked to be a plain positive scale so it folds into the temperature."""
    if not getattr(config, "use_mup", False) or scale_logits is None:
        return 1.0
    probe = torch.tensor([1.0, 2.0])
    out = scale_logits(probe)
    mult = float(out[0])
    if not torch.allclose(out, probe * mult) or not mult > 0:
        raise ValueError("scale_logits is not a positive constant multiplier; it cannot be folded into "
                         "the temperature. Set use_fused_linear_ce=false.")
    return mult


def _fused_packed(hidden: torch.Tensor, weight: torch.Tensor, output_layer, ctx: CaptureContext,
                  logit_mult: float = 1.0) -> torch.Tensor:
    """[s_local, b, H] hidden + this rank's [V/tp, H] weight -> packed [s, b, 4] fp32 stats."""
    from megatron.core import tensor_parallel

    from .. import linear_logprobs_entropy

    from megatron.core import parallel_state as mpu

    tp_group = getattr(output_layer, "tp_group", None)
    if tp_group is None:  # older megatron-core keeps the group in parallel_state only
        tp_group = mpu.get_tensor_model_parallel_group()
    tp = mpu.get_tensor_model_parallel_world_size()
    if output_layer.sequence_parallel and tp > 1:
        # All-gather the sequence shards forward; reduce-scatter d_hidden backward (its one reduction).
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    elif tp > 1:
        # Identity forward; all-reduce of d_hidden over TP backward (its one reduction).
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    if hidden.dtype != weight.dtype:  # Float16Module / fp32 residual: compute in the weight's dtype
        hidden = hidden.to(weight.dtype)
    s, b, h = hidden.shape
    labels = ctx.labels.t()  # [b, s] -> [s, b], matching Megatron's sequence-first layout
    if tuple(labels.shape) != (s, b):
        raise ValueError(f"labels {tuple(ctx.labels.shape)} do not match the model's hidden states "
                         f"[s={s}, b={b}] (labels must be [batch, seq])")
    out = linear_logprobs_entropy(
        hidden.reshape(s * b, h), weight, labels.reshape(-1).to(hidden.device),
        temperature=ctx.temperature / logit_mult, ignore_index=ctx.ignore_index, vocab_size=ctx.vocab_size,
        return_stats=True, backend=ctx.backend, cache_bytes=ctx.cache_bytes,
        tp_group=tp_group if tp > 1 else None, sequence_parallel=False, reduce_d_hidden=False,
    )
    stats = (out.logprobs, out.entropy, out.max_logit * logit_mult, out.min_logit * logit_mult)
    return torch.stack([t.view(s, b) for t in stats], dim=-1)


def fused_output_processor(*, hidden_states, output_layer, output_weight, context, runtime_gather_output=None,
                           scale_logits=None, config=None, **_unused) -> torch.Tensor:
    """GPTModel output_processor (megatron-core >= 0.18): returns packed [b, s, 4] token stats."""
    if not isinstance(context, CaptureContext):
        raise TypeError("fused_output_processor needs output_processor_context=CaptureContext(...)")
    if runtime_gather_output:
        raise ValueError("runtime_gather_output=True asks for gathered logits; the fused route returns "
                         "token statistics only")
    weight = output_weight if output_weight is not None else output_layer.weight
    mult = _logit_multiplier(config if config is not None else output_layer.config, scale_logits)
    return _fused_packed(hidden_states, weight, output_layer, context, mult).transpose(0, 1).contiguous()


@contextlib.contextmanager
def legacy_capture(output_layer, ctx: CaptureContext):
    """Seam for megatron-core 0.16/0.17: replace output_layer.forward on the instance for one call."""
    if "forward" in vars(output_layer):
        raise RuntimeError("output_layer.forward is already replaced on this instance (nested capture?)")

    def forward(input_, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None):
        if runtime_gather_output:
            raise ValueError("runtime_gather_output=True asks for gathered logits; the fused route returns "
                             "token statistics only")
        w = weight if weight is not None else output_layer.weight
        if w is None:
            raise RuntimeError("output layer has no weight and none was passed (tied embeddings need weight=)")
        return _fused_packed(input_, w, output_layer, ctx), None

    output_layer.forward = forward
    try:
        yield
    finally:
        del output_layer.forward  # back to ColumnParallelLinear.forward


def unpack(packed: torch.Tensor):
    """[b, s, 4] -> (logprobs, entropy, max_logit, min_logit), each [b, s] fp32."""
    packed = packed.float()
    return packed[..., 0], packed[..., 1], packed[..., 2], packed[..., 3]


def run_fused(model, gpt_model, seam: str, ctx: CaptureContext, input_ids, position_ids, attention_mask) -> Any:
    """One model call through the chosen seam. `model` is what is called (DDP/Float16Module wrapped),
    `gpt_model` the bare GPTModel. Returns packed stats on the last pipeline stage, hidden otherwise."""
    if seam == "output_processor":
        return model(input_ids, position_ids, attention_mask,
                     output_processor=fused_output_processor, output_processor_context=ctx)
    if not gpt_model.post_process:
        return model(input_ids, position_ids, attention_mask)
    with legacy_capture(gpt_model.output_layer, ctx):
        return model(input_ids, position_ids, attention_mask)


# ------------------------------------------------------------------------------------ generation


@dataclass
class LastTokenContext:
    """Positions whose next-token logits are wanted (one per sequence of the batch)."""

    positions: torch.Tensor  # [b] long, index into the sequence dimension


def _last_token_logits(hidden: torch.Tensor, weight: torch.Tensor, output_layer, ctx: LastTokenContext):
    """[s_local, b, H] hidden -> full-vocabulary [b, V_pad] fp32 logits at ctx.positions (no grad),
    on every TP rank. Only b rows of logits are ever built."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    tp_group = getattr(output_layer, "tp_group", None)
    if tp_group is None:
        tp_group = mpu.get_tensor_model_parallel_group()
    tp = mpu.get_tensor_model_parallel_world_size()
    if output_layer.sequence_parallel and tp > 1:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    rows = torch.arange(hidden.shape[1], device=hidden.device)
    picked = hidden[ctx.positions.to(hidden.device), rows]  # [b, H]
    logits = (picked.to(weight.dtype) @ weight.t()).float()  # [b, V_pad / tp]
    if tp > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous(), group=tp_group)
    return logits


def last_token_output_processor(*, hidden_states, output_layer, output_weight, context, scale_logits=None,
                                **_unused) -> torch.Tensor:
    """GPTModel output_processor for sampling: [b, V_pad] fp32 logits of the positions in context."""
    weight = output_weight if output_weight is not None else output_layer.weight
    logits = _last_token_logits(hidden_states, weight, output_layer, context)
    return scale_logits(logits) if scale_logits is not None else logits


@contextlib.contextmanager
def legacy_last_token(output_layer, ctx: LastTokenContext):
    """output_layer seam for sampling; GPTModel applies its own logit scaling and [s,b]->[b,s] transpose
    to our [1, b, V_pad] result, giving [b, 1, V_pad]."""
    if "forward" in vars(output_layer):
        raise RuntimeError("output_layer.forward is already replaced on this instance (nested capture?)")

    def forward(input_, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None):
        w = weight if weight is not None else output_layer.weight
        return _last_token_logits(input_, w, output_layer, ctx).unsqueeze(0), None

    output_layer.forward = forward
    try:
        yield
    finally:
        del output_layer.forward


def run_last_token(model, gpt_model, seam: str, ctx: LastTokenContext, input_ids, position_ids, attention_mask,
                   **model_kwargs):
    """[b, V_pad] fp32 logits at ctx.positions on the last stage (hidden states on other stages).
    `model_kwargs` go to GPTModel.forward (e.g. inference_context= for the KV cache)."""
    if seam == "output_processor":
        return model(input_ids, position_ids, attention_mask, **model_kwargs,
                     output_processor=last_token_output_processor, output_processor_context=ctx)
    if not gpt_model.post_process:
        return model(input_ids, position_ids, attention_mask, **model_kwargs)
    with legacy_last_token(gpt_model.output_layer, ctx):
        return model(input_ids, position_ids, attention_mask, **model_kwargs)[:, 0]
