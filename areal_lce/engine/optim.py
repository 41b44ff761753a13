"""The engine's optimizer, its step, gradient clipping and learning-rate schedule.

On GPU: megatron-core's `get_megatron_optimizer` (Adam; fp32 master weights under bf16) with its own
grad clipping (its L2 norm computed on the device when megatron fell back to its local one:
`compat.use_device_grad_norm`). On CPU megatron's optimizer wrappers allocate on CUDA, so the engine uses
`torch.optim.AdamW` on the parameters (fed `param.grad = param.main_grad`) and `grad_norm_and_clip`.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from ..op import comms


def lr_at(step: int, optim) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then constant or cosine."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.lr_schedule == "constant":
        return optim.lr
    span = max(1, optim.total_steps - optim.warmup_steps)
    frac = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * frac))


def build_optimizer(model, o, dtype: torch.dtype) -> Tuple[object, bool]:
    """(optimizer, is megatron's) for the DDP-wrapped `model` and the OptimConfig `o`."""
    if torch.cuda.is_available():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from ..megatron.compat import use_device_grad_norm

        use_device_grad_norm()  # no per-parameter host read in the grad norm without Apex / TE

        ocfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                               adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
                               clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16,
                               params_dtype=dtype, use_distributed_optimizer=False)
        # Non-distributed optimizer: no Gloo groups needed (init_distributed creates none on GPU).
        return get_megatron_optimizer(ocfg, [model], use_gloo_process_groups=False), True
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)  # no decay on norms and biases
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return opt, False


def grad_norm_and_clip(model, mp_group, device, clip: float) -> float:
    """Global L2 norm of main_grad (TP duplicates and the last stage's copy of tied embeddings counted
    once, summed over model-parallel ranks; context-parallel ranks hold the same reduced grads); clip."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in model.parameters() if p.requires_grad]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p):
            sq += p.main_grad.float().pow(2).sum()
    comms.all_reduce_sum_(sq, mp_group)  # SUM of squared norms over TP x PP shards
    norm = float(sq.sqrt())
    if clip > 0 and norm > clip:
        for p in params:
            p.main_grad.mul_(clip / (norm + 1e-6))
    return norm


def optimizer_step(model, optimizer, megatron_optimizer: bool, lr: float, mp_group, device, clip: float) -> float:
    """One optimizer step at learning rate `lr` on the finalised grad buffers; returns the grad norm
    (before clipping: the run loop stops on a non-finite one). Megatron's optimizer clips and steps
    itself; the torch one is fed main_grad."""
    for g in optimizer.param_groups:
        g["lr"] = lr
    if megatron_optimizer:
        _ok, grad_norm, _zeros = optimizer.step()
        if grad_norm is None:  # clip_grad=0: megatron computes no norm; its own helper, on the same grads
            grad_norm = optimizer.get_grad_norm()
        return float(grad_norm)
    grad_norm = grad_norm_and_clip(model, mp_group, device, clip)
    for p in model.parameters():
        if p.requires_grad:
            # fp32 on CPU: a view of the grad buffer. (bf16 on CPU has no fp32 master weights; it exists to
            # exercise the Float16Module path, not to train.)
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
    optimizer.step()
    return grad_norm
