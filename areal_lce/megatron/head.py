"""The LM head on this rank, as the capture seam's processors see it (capture.py): its weight, its tensor-
parallel group, the hidden states its shard multiplies, and the materialised route's fp32 logits.
`head_of` is the one reading of an output layer's tensor parallelism (as a `VocabParallel`) and logit scale,
shared by the capture seam and the AReaL adapter.

Logits precision on the materialised route: Megatron's output layer returns its GEMM in the weight's dtype,
so a bf16 model's logits arrive rounded to bf16 -- the op's logits_precision="bf16", not its default
"fp32". `output_layer_gives` says when the output layer's own GEMM gives what was asked; otherwise
`fp32_logits` computes the fp32 accumulation itself, behind the same input mappings (`head_input`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..op.library import placeholder_grad
from ..op.main_grad import check_main_grad, fuses_wgrad
from ..op.types import VocabParallel


def tp_of(output_layer):
    """(tp group or None, tp size) of the output layer: its own `tp_group` (megatron-core's parallel layers
    carry one), else parallel_state's; no group without tensor parallelism."""
    group = getattr(output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            return None, 1
        group = mpu.get_tensor_model_parallel_group()
    tp = group.size()
    return (group if tp > 1 else None), tp


class HeadOf(NamedTuple):
    """What the op needs to know of an output layer (`head_of`)."""

    vocab_parallel: VocabParallel  # the layer's TP group and who reduces d_hidden
    logit_scale: float  # m of the layer's logits m·h·Wᵀ (folded into the op's temperature as T / m)
    sequence_parallel: bool  # hidden arrives as this rank's sequence shard (TP > 1 with the layer's flag)


def mup_multiplier(config, scale_logits) -> float:
    """MuP's logit multiplier m (GPTModel's logits are m·h·Wᵀ; 1 without MuP), checked to be a plain
    positive scale so that the fused route can fold it into the op's temperature."""
    if not getattr(config, "use_mup", False) or scale_logits is None:
        return 1.0
    probe = torch.tensor([1.0, 2.0])
    out = scale_logits(probe)
    mult = float(out[0])
    if not torch.allclose(out, probe * mult) or not mult > 0:
        raise ValueError("scale_logits is not a positive constant multiplier; it cannot be folded into "
                         "the temperature. Set use_fused_linear_ce=false.")
    return mult


def head_of(output_layer, config=None, *, scale_logits=None, logit_scale=None, mappings: bool = True,
            caller: str = "head_of") -> HeadOf:
    """The output layer as the op sees it: its tensor parallelism as a `VocabParallel`, the scale of its
    logits, and whether hidden arrives sequence-sharded. Every caller that runs the op in an output
    layer's place (the capture seam, the AReaL adapter) asks here.

    TP group: the layer's own `tp_group`, else parallel_state's (`tp_of`); sequence parallel: the layer's
    `sequence_parallel` flag under TP > 1. d_hidden: with `mappings`, megatron's own input mappings
    (`head_input`) gather the sequence and reduce d_hidden, so the op leaves it to the caller; without,
    the op does: "reduce_scatter" of a sequence shard, else "all_reduce" where the layer all-reduces its
    input gradient (`allreduce_dgrad`, on by default under TP), else "caller".
    Logit scale: `logit_scale` where the framework passes it (a finite float > 0), else MuP's multiplier
    of `config` (the layer's when None) read through `scale_logits` (`mup_multiplier`), else 1."""
    group, tp = tp_of(output_layer)
    sp = tp > 1 and bool(getattr(output_layer, "sequence_parallel", False))
    if mappings:
        d_hidden = "caller"
    elif sp:
        d_hidden = "reduce_scatter"
    else:
        d_hidden = "all_reduce" if getattr(output_layer, "allreduce_dgrad", tp > 1) else "caller"
    if logit_scale is not None:
        if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)):
            raise TypeError(f"{caller}: logit_scale must be a float, got {type(logit_scale).__name__}")
        if not (math.isfinite(logit_scale) and logit_scale > 0):
            raise ValueError(f"{caller}: logit_scale must be finite and > 0, got {logit_scale}")
        scale = float(logit_scale)
    else:
        config = config if config is not None else getattr(output_layer, "config", None)
        scale = mup_multiplier(config, scale_logits)
    return HeadOf(VocabParallel(group, d_hidden), scale, sp)


def head_weight(output_layer, output_weight) -> torch.Tensor:
    """The weight GPTModel passed (tied embeddings) or the output layer's own."""
    w = output_weight if output_weight is not None else output_layer.weight
    if w is None:
        raise RuntimeError("output layer has no weight and none was passed (tied embeddings need weight=)")
    return w


def head_input(hidden: torch.Tensor, weight: torch.Tensor, output_layer):
    """(the [s, b, H] hidden states this rank's LM-head shard multiplies, in the weight's dtype; tp group or
    None): Megatron's own mappings, as ColumnParallelLinear applies them, reduce d_hidden in the backward."""
    from megatron.core import tensor_parallel

    tp_group, tp = tp_of(output_layer)
    if output_layer.sequence_parallel and tp > 1:
        # All-gather the sequence shards forward; reduce-scatter d_hidden backward (its one reduction).
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    elif tp > 1:
        # Identity forward; all-reduce of d_hidden over TP backward (its one reduction).
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    if hidden.dtype != weight.dtype:  # Float16Module / fp32 residual: compute in the weight's dtype
        hidden = hidden.to(weight.dtype)
    return hidden, tp_group


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b of bf16 / fp16 operands, the fp32 accumulation not rounded to their dtype. CUDA: one cuBLAS GEMM
    with an fp32 output (`out_dtype`; on an H100 its error against fp64 is that of fp32 accumulation, 1e-5
    at H = 896, where the bf16-rounded result is 1.6e-2 off); elsewhere the operands are upcast (their
    products are exact in fp32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class Fp32Logits(torch.autograd.Function):
    """[n, H] · [V, H]ᵀ of bf16 / fp16 operands with the fp32 result of the fp32 accumulation (what the
    fused op and an fp32 LM head compute), not rounded to the operands' dtype as `F.linear` rounds it.
    Backward in the operands' dtype, as the output layer's own GEMM runs it; with `into_main_grad`
    (the output layer's gradient_accumulation_fusion) d_weight is accumulated in fp32 into the
    weight's main_grad instead, as Megatron's linear does (main_grad.py)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, into_main_grad: bool = False) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.main_grad = weight.main_grad if into_main_grad else None  # the buffer of this call (main_grad.py)
        return _mm_fp32(hidden, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        d_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        d_weight = None
        if ctx.needs_input_grad[1] and ctx.main_grad is not None:
            ctx.main_grad.add_(_mm_fp32(grad.t(), hidden))
            weight.main_grad = ctx.main_grad
            d_weight = placeholder_grad(weight)
        elif ctx.needs_input_grad[1]:
            d_weight = grad.t() @ hidden
        return d_hidden, d_weight, None


def output_layer_gives(weight: torch.Tensor, logits_precision: Optional[str]) -> bool:
    """Whether the output layer's own GEMM gives the logits `logits_precision` asks for (None: the op's
    default, "fp32"): an fp32 (or fp64) weight gives fp32 logits (the head rounds them under "bf16"); a
    bf16 weight gives the bf16-rounded fp32 accumulation, which is "bf16". Otherwise (a bf16 / fp16 model
    under "fp32"; fp16 under "bf16") the materialised route takes `fp32_logits`."""
    if weight.dtype in (torch.float32, torch.float64):
        return True
    return weight.dtype == torch.bfloat16 and logits_precision == "bf16"


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, output_layer) -> torch.Tensor:
    """[s_local, b, H] hidden -> this rank's [s, b, V/tp] fp32 logits h·Wᵀ (vocab-parallel, as with
    parallel_output=True), through the output layer's input mappings (`head_input`)."""
    hidden, _ = head_input(hidden, weight, output_layer)
    s, b, h = hidden.shape
    into_main_grad = fuses_wgrad(output_layer, weight)
    if into_main_grad:
        check_main_grad(weight, "the materialised route's fp32 logits")
    return Fp32Logits.apply(hidden.reshape(s * b, h), weight, into_main_grad).view(s, b, -1)
