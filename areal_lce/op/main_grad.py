"""The LM-head weight gradient added in fp32 into `weight.main_grad`, as Megatron's own linear layer adds it
under `gradient_accumulation_fusion`.

    out = linear_logprobs_entropy_into_main_grad(hidden, weight, labels, options, **overrides)  # as the op's

Megatron's `LinearWithGradAccumulationAndAsyncCommunication` with gradient_accumulation_fusion=True adds its
weight gradient to `weight.main_grad` (the fp32 gradient buffer of Megatron's DDP) inside its backward,
accumulating in fp32, sets `weight.grad_added_to_main_grad = True` and hands autograd a placeholder
gradient, so that DDP's per-parameter hook still fires (it marks the parameter ready for the bucket's
reduction) but adds nothing. Through autograd the op's d_weight would reach DDP rounded to the weight's
dtype (torch casts a gradient to its tensor's dtype) and be added from there: one bf16 rounding of each
micro-batch's gradient. Here the op (the same custom ops, forward, backward and collectives) takes
weight.main_grad as an argument of its own: the backend's d_weight is left in fp32 (LCEParams.d_weight_fp32)
and the backward op adds it into the main_grad the weight had at the forward (its mutated argument, kept
from the forward as Megatron's linear keeps it: a layer called twice, e.g. by MTP, accumulates into the
buffer of each call), and autograd gets `placeholder_grad(weight)` for the weight (library.py).

Used by the capture seam (megatron/capture.py) and the AReaL adapter where the output layer has
gradient_accumulation_fusion=True. It compiles with torch.compile(fullgraph=True) as the op does (library.py
says where the flag is set then).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import library
from .api import call_options, prepare_call
from .options import LCEOptions
from .types import LCEOutput


def fuses_wgrad(output_layer, weight: torch.Tensor) -> bool:
    """Whether the weight gradient goes into main_grad here: the output layer was built with
    gradient_accumulation_fusion=True (Megatron's linear would add it there itself) and a gradient of the
    weight is being recorded."""
    return (bool(getattr(output_layer, "gradient_accumulation_fusion", False)) and weight.requires_grad
            and torch.is_grad_enabled())


def check_main_grad(weight: torch.Tensor, where: str) -> None:
    """Refuse, naming `where`, a weight without the gradient buffer gradient_accumulation_fusion adds to."""
    main_grad = getattr(weight, "main_grad", None)
    if not torch.is_tensor(main_grad) or tuple(main_grad.shape) != tuple(weight.shape):
        got = f"main_grad {tuple(main_grad.shape)}" if torch.is_tensor(main_grad) else "no main_grad"
        raise ValueError(f"{where}: gradient_accumulation_fusion=True adds the LM-head weight gradient into "
                         f"weight.main_grad (Megatron DDP's gradient buffer), but the weight {tuple(weight.shape)} "
                         f"has {got}: wrap the model in megatron's DistributedDataParallel, or build it with "
                         "gradient_accumulation_fusion=False")


def linear_logprobs_entropy_into_main_grad(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                           options: Optional[LCEOptions] = None, *, vocab_parallel=None,
                                           selected_ids=None, **overrides) -> LCEOutput:
    """`linear_logprobs_entropy(hidden, weight, labels, options, ..., **overrides)` (same arguments, same
    outputs and d_hidden) whose weight gradient is added in fp32 into `weight.main_grad` (the module
    docstring)."""
    name = "linear_logprobs_entropy_into_main_grad"
    if "d_weight_fp32" in overrides or (options is not None and getattr(options, "d_weight_fp32", False)):
        raise TypeError(f"{name}: d_weight_fp32 is set here")
    check_main_grad(weight, name)
    options, temperature = call_options(options, overrides, name)
    options = options.replace(name, d_weight_fp32=True)
    call = prepare_call(hidden, weight, labels, options, temperature=temperature, vocab_parallel=vocab_parallel,
                        selected_ids=selected_ids)
    if call.weight is not weight:
        raise ValueError("linear_logprobs_entropy_into_main_grad: weight must be contiguous (its main_grad is "
                         "laid out like it)")
    return call.output(library.lce(call.hidden, weight, call.labels, call.inv_t, library.encode(**call.options),
                                   call.selected_ids, main_grad=weight.main_grad))
