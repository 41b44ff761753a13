"""The public entry point: per-token logprobs, entropy and logit extremes from any megatron GPTModel.

    from areal_lce.megatron import token_stats, TokenStats
    st = token_stats(model, input_ids, labels, vocab_size=V)           # BSHD: [b, s] in, [b, s] out
    st = token_stats(model, ids, labels, vocab_size=V, packed_seq_params=psp)   # THD: [1, T] in and out

`model` is a GPTModel or any wrapper of one (megatron DDP, Float16Module, ...). One model call: the
decoder runs as usual and the LM head is replaced by the capture seam (capture.py), so the fused route
never builds the [tokens, vocab] logits; `fused=False` runs the materialised route through the same
seam (Megatron's output layer builds the logits), with the same outputs and gradients. MTP heads (on
megatron-core >= 0.18) run as Megatron runs them and add their losses to the backward through
Megatron's MTPLossAutoScaler. The engine (engine.py) calls this function; so can any training loop.
"""
from __future__ import annotations

from typing import NamedTuple, Union

import torch

from . import capture


class TokenStats(NamedTuple):
    """Per-token fp32 tensors shaped like the labels; 0 where labels == ignore_index.

    logprobs  log softmax(z)[label], z = logits / temperature over the true vocabulary (differentiable)
    entropy   -Σ p log p of softmax(z) (differentiable)
    max_logit, min_logit  extremes of the raw logits (before temperature) over the true vocabulary
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    max_logit: torch.Tensor
    min_logit: torch.Tensor

    def pack(self) -> torch.Tensor:
        """[..., 4] tensor, e.g. the output a pipeline schedule's forward_step hands its loss function."""
        return torch.stack(tuple(self), dim=-1)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "TokenStats":
        """Inverse of `pack` (also of the seam's packed [b, s, 4] output)."""
        return cls(*capture.unpack(packed))


def find_gpt_model(model):
    """The GPTModel inside `model` (itself, or reached through `.module` of DDP / Float16Module / ...)."""
    from megatron.core.models.gpt import GPTModel

    seen = model
    for _ in range(16):
        if isinstance(seen, GPTModel):
            return seen
        seen = getattr(seen, "module", None)
        if seen is None:
            break
    raise TypeError(f"token_stats: found no megatron GPTModel in {type(model).__name__} (looked through "
                    "`.module` of wrappers such as DistributedDataParallel and Float16Module)")


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


def _temperature(temperature, labels: torch.Tensor) -> Union[float, torch.Tensor]:
    """A float, or a per-token fp32 tensor broadcast to labels' shape."""
    if torch.is_tensor(temperature):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature tensor must be floating point, got {temperature.dtype}")
        try:
            return torch.broadcast_to(temperature.to(labels.device, torch.float32), labels.shape).contiguous()
        except RuntimeError as e:
            raise ValueError(f"temperature of shape {tuple(temperature.shape)} does not broadcast to labels "
                             f"{tuple(labels.shape)} (use [b, s], [b, 1] or [1, T])") from e
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    t = float(temperature)
    if not 0 < t < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be finite and > 0")
    return t


def model_output(model, input_ids, labels, *, vocab_size: int, position_ids=None, attention_mask=None,
                 packed_seq_params=None, temperature=1.0, fused: bool = True, backend: str = "auto",
                 cache_bytes: int = 0, seam: str = "auto", ignore_index: int = -100) -> torch.Tensor:
    """`token_stats` as a pipeline stage sees it: packed [b, s, 4] stats on the stage with the LM head,
    the decoder's output (what the schedule sends on) on the other stages."""
    gpt = find_gpt_model(model)
    seam = capture.resolve_seam(seam)
    _check_inputs(gpt, input_ids, labels, position_ids, packed_seq_params, vocab_size)
    capture.check_seam_config(gpt.config, seam, fused)
    labels = labels.to(input_ids.device)
    ctx = capture.CaptureContext(labels=labels, temperature=_temperature(temperature, labels), vocab_size=vocab_size,
                                 backend=backend, cache_bytes=cache_bytes, ignore_index=ignore_index, fused=fused)
    run = capture.run_fused if fused else capture.run_materialised
    return run(model, gpt, seam, ctx, input_ids, position_ids, attention_mask, packed_seq_params)


def token_stats(model, input_ids: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, position_ids=None,
                attention_mask=None, packed_seq_params=None, temperature: Union[float, torch.Tensor] = 1.0,
                fused: bool = True, backend: str = "auto", cache_bytes: int = 0, seam: str = "auto",
                ignore_index: int = -100) -> Union[TokenStats, torch.Tensor]:
    """Per-token logprobs, entropy and logit extremes of `labels` under `model`, in one model call.

    model        GPTModel or a wrapper of one (DDP, Float16Module); called as `model(input_ids, position_ids,
                 attention_mask, packed_seq_params=..., output_processor=...)`.
    input_ids    [b, s] (BSHD), or [1, T] with `packed_seq_params` (PackedSeqParams(qkv_format="thd", ...)).
    labels       laid out like input_ids, already shifted (the target after each position; see
                 `packed_next_token_labels` for THD), ignore_index where there is no target.
    vocab_size   the true vocabulary (required): Megatron's padded rows never enter the softmax.
    temperature  float, or a tensor broadcastable to labels ([b, s], [b, 1], [1, T]); not differentiated.
    fused        True: the fused op at the LM head (no logits); False: the output layer's logits
                 (materialised route), same outputs and gradients.
    backend, cache_bytes  passed to `linear_logprobs_entropy` (fused route).
    seam         "auto" | "output_processor" (megatron-core >= 0.18) | "output_layer" (instance patch).

    Returns TokenStats of fp32 tensors shaped like labels on the pipeline stage that holds the LM head;
    on other stages the model's output (hidden states for the next stage), unchanged. Gradients flow
    into every parameter (the LM-head weight's into its .grad / Megatron's main_grad) when the caller
    backpropagates through logprobs / entropy. Refused with the option named: defer_embedding_wgrad_compute
    (fused), MTP on the output_layer seam (fused), packing other than THD, labels not laid out like input_ids.

    Context parallelism: pass this CP rank's tokens (`split_for_context_parallel` of ids, labels, per-token
    temperature; THD: the PackedSeqParams of the CP-padded sequences); the stats are CP-local, d_hidden
    stays local and the LM-head weight gradient is this rank's partial sum, which megatron's DDP reduces
    over data x context parallel ranks with every other parameter's. `gather_from_context_parallel`
    gives every CP rank the full per-token stats (its backward returns each rank its own slice).
    """
    out = model_output(model, input_ids, labels, vocab_size=vocab_size, position_ids=position_ids,
                       attention_mask=attention_mask, packed_seq_params=packed_seq_params, temperature=temperature,
                       fused=fused, backend=backend, cache_bytes=cache_bytes, seam=seam, ignore_index=ignore_index)
    if not find_gpt_model(model).post_process:
        return out
    return TokenStats.unpack(out)
