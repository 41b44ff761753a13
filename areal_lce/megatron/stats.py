"""The public entry point: per-token logprobs, entropy and logit extremes from any megatron GPTModel.

    from areal_lce.megatron import token_stats, TokenStats
    st = token_stats(model, input_ids, labels, vocab_size=V)           # BSHD: [b, s] in, [b, s] out
    st = token_stats(model, ids, labels, vocab_size=V, packed_seq_params=psp)   # THD: [1, T] in and out

`model` is a GPTModel or any wrapper of one (megatron DDP, Float16Module, ...). One model call: the
decoder runs as usual and the LM head is replaced by the capture seam (capture.py), so the fused route
never builds the [tokens, vocab] logits; `fused=False` runs the materialised route through the same
seam (Megatron's output layer builds the logits), with the same outputs and gradients. MTP heads (on
megatron-core >= 0.18) run as Megatron runs them and add their losses to the backward through
Megatron's MTPLossAutoScaler. The route is a `Route` (route.py) built from `fused`, `seam` and the
`LCEOptions` of `backend`, `cache_bytes`, `invariant` and `logits_precision`; the engine holds one; any
training loop can call this function. On a host without CUDA the call runs inside `compat.cpu_shims()`
(megatron-core's RoPE, TP mappings and buffers ask for a CUDA device), entered here.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from ..op.options import LCEOptions
from . import capture, compat
from .route import Route, find_gpt_model


class TokenStats(NamedTuple):
    """Per-token fp32 tensors shaped like the labels; 0 where labels == ignore_index.

    logprobs  log softmax(z)[label], z = logits / temperature over the true vocabulary (differentiable)
    entropy   -Σ p log p of softmax(z) (differentiable)
    max_logit, min_logit  extremes of the model's logits (before temperature; after MuP's output
              multiplier where the model has one) over the true vocabulary
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    max_logit: torch.Tensor
    min_logit: torch.Tensor

    def pack(self) -> torch.Tensor:
        """[..., 4] tensor, e.g. the output a pipeline schedule's forward_step hands its loss function."""
        return torch.stack(tuple(self), dim=-1)

    @classmethod
    def unpack(cls, packed: torch.Tensor, extras: Optional[dict] = None) -> Union["TokenStats", "SelectedTokenStats"]:
        """Inverse of `pack` (also of the seam's packed [b, s, 4] output); with Route.stats' `extras` (a call
        with selected_ids / top_k) the SelectedTokenStats holding them."""
        st = cls(*capture.unpack(packed))
        return st.with_extras(**extras) if extras is not None else st

    def with_extras(self, selected_logprobs=None, topk_ids=None, topk_logprobs=None) -> "SelectedTokenStats":
        return SelectedTokenStats(*self, selected_logprobs, topk_ids, topk_logprobs)


class SelectedTokenStats(NamedTuple):
    """TokenStats of a call with selected_ids and / or top_k (token_stats returns TokenStats otherwise, so
    code unpacking four values keeps working), laid out like labels plus a last dim:

    selected_logprobs  [..., K] logprobs at `selected_ids` (differentiable; 0 at ignore_index entries), or None
    topk_ids, topk_logprobs  [..., k] ids of the k largest logits (int64, descending, ties to the lower id)
              and their logprobs (differentiable), or None; ignore_index / 0 where labels are ignore_index
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    max_logit: torch.Tensor
    min_logit: torch.Tensor
    selected_logprobs: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None

    def pack(self) -> torch.Tensor:
        """The four stats as TokenStats.pack does (the selected / top-k outputs travel as their own tensors)."""
        return torch.stack(tuple(self[:4]), dim=-1)


def model_output(model, input_ids, labels, *, vocab_size: int, position_ids=None, attention_mask=None,
                 packed_seq_params=None, temperature=1.0, fused: bool = True, backend: str = "auto",
                 cache_bytes: int = 0, seam: str = "auto", ignore_index: int = -100,
                 compact_ignored: Optional[bool] = None, invariant: Optional[bool] = None,
                 logits_precision: Optional[str] = None, selected_ids: Optional[torch.Tensor] = None,
                 top_k: Optional[int] = None):
    """`token_stats` as a pipeline stage sees it: packed [b, s, 4] stats on the stage with the LM head
    ((packed, extras) with selected_ids / top_k: Route.stats), the decoder's output (what the schedule
    sends on) on the other stages."""
    precision = {} if logits_precision is None else {"logits_precision": logits_precision}  # None: the default
    options = LCEOptions.of(None, dict(backend=backend, cache_bytes=cache_bytes, invariant=invariant, **precision),
                            "token_stats")  # only these fields are checked: the defaults were, once
    route = Route.choose(fused, seam, options)
    _check_cpu_backward(find_gpt_model(model))
    _check_input_ids(find_gpt_model(model), input_ids)
    with compat.cpu_shims():  # a no-op with CUDA
        return route.stats(model, input_ids, labels, vocab_size=vocab_size, position_ids=position_ids,
                           attention_mask=attention_mask, packed_seq_params=packed_seq_params,
                           temperature=temperature, ignore_index=ignore_index, compact_ignored=compact_ignored,
                           selected_ids=selected_ids, top_k=top_k)


def _check_input_ids(gpt, input_ids: torch.Tensor) -> None:
    """On the stage that embeds, ids on the host must index the embedding: an id past it is named (torch's
    lookup says only `index out of range`, and a tensor-parallel embedding masks it to a zero row). On an
    accelerator this costs a host sync, so the check runs on CPU tensors only."""
    embedding = getattr(getattr(gpt, "embedding", None), "word_embeddings", None)
    rows = getattr(embedding, "num_embeddings", None)
    on_host = input_ids.device.type == "cpu" and input_ids.numel() > 0
    if not (getattr(gpt, "pre_process", False) and rows is not None and on_host):
        return
    bad = (input_ids < 0) | (input_ids >= rows)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"input_ids{list(where)} = {int(input_ids[where])} is outside the model's embedding of {rows} "
                         f"rows (ids 0..{rows - 1}): check the tokenizer against the model's vocabulary")


def _check_cpu_backward(gpt) -> None:
    """The shims entered for the forward are gone when the caller runs the backward. Under sequence
    parallelism that backward reduce-scatters d_hidden into a buffer megatron-core allocates on
    `torch.cuda.current_device()`: refuse up front, saying what to call, rather than fail there."""
    if torch.cuda.is_available() or compat.shims_active() or not torch.is_grad_enabled():
        return
    cfg = gpt.config
    if cfg.sequence_parallel and getattr(cfg, "tensor_model_parallel_size", 1) > 1:
        raise RuntimeError("token_stats on a host without CUDA, with sequence_parallel and gradients: the backward "
                           "runs megatron-core's reduce-scatter, which allocates on torch.cuda.current_device(). "
                           "Run the forward and the backward inside `with areal_lce.megatron.compat.cpu_shims():` "
                           "(token_stats enters it for the forward only), or call it under torch.no_grad()")


def token_stats(model, input_ids: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, position_ids=None,
                attention_mask=None, packed_seq_params=None, temperature: Union[float, torch.Tensor] = 1.0,
                fused: bool = True, backend: str = "auto", cache_bytes: int = 0, seam: str = "auto",
                ignore_index: int = -100, compact_ignored: Optional[bool] = None, invariant: Optional[bool] = None,
                logits_precision: Optional[str] = None, selected_ids: Optional[torch.Tensor] = None,
                top_k: Optional[int] = None) -> Union[TokenStats, SelectedTokenStats, torch.Tensor]:
    """Per-token logprobs, entropy and logit extremes of `labels` under `model`, in one model call.

    model        GPTModel or a wrapper of one (DDP, Float16Module); called as `model(input_ids, position_ids,
                 attention_mask, packed_seq_params=..., output_processor=...)`.
    input_ids    [b, s] (BSHD), or [1, T] with `packed_seq_params` (PackedSeqParams(qkv_format="thd", ...),
                 or a `PackedLayout`, whose `packed_seq_params()` the model then gets).
    labels       laid out like input_ids, already shifted (the target after each position; see
                 `packed_next_token_labels` for THD), ignore_index where there is no target.
    vocab_size   the true vocabulary (required): Megatron's padded rows never enter the softmax. Pass the HF
                 config's `vocab_size` (the checkpoint's rows, what vLLM / SGLang normalise over), not the
                 tokenizer's size: docs/rl.md, "The vocabulary".
    temperature  float, or a tensor broadcastable to labels ([b, s], [b, 1], [1, T]); not differentiated.
    fused        True: the fused op at the LM head (no logits); False: the output layer's logits
                 (materialised route), same outputs and gradients.
    backend, cache_bytes, compact_ignored  passed to `linear_logprobs_entropy` (fused route).
                 compact_ignored=True suits batches where most positions have no target (RL: prompts
                 masked): the op then computes only the rows with one; None (default): the backend's
                 choice (Triton skips 128-row blocks without a target in place).
    invariant    True: each token's values are bitwise the same whatever else is in the call (row count,
                 order, packing, tensor-parallel degree; the LM head, not the model body); False: no such
                 promise; None (default): the backend's default. Both routes.
    logits_precision  "fp32" (the op's default, None): logits from fp32 accumulation, as an fp32 LM head;
                 "bf16": each logit rounded to bf16 before temperature, as a bf16-head inference engine.
                 Both routes: the materialised route of a bf16 model builds fp32 logits under "fp32".
    seam         "auto" | "output_processor" (megatron-core >= 0.18) | "output_layer" (instance patch).
    selected_ids [b, s, K] (or [1, T, K]) global ids laid out like labels: `selected_logprobs` at them.
    top_k        int: `topk_ids` / `topk_logprobs` [b, s, k]. Both: fused route only, TP/SP/CP/THD as the
                 logprobs (linear_logprobs_entropy says how they are computed, exactly).

    Returns TokenStats of fp32 tensors shaped like labels on the pipeline stage that holds the LM head;
    on other stages the model's output (hidden states for the next stage), unchanged. Gradients flow
    into every parameter (the LM-head weight's into its .grad / Megatron's main_grad) when the caller
    backpropagates through logprobs / entropy. Refused with the option named: defer_embedding_wgrad_compute
    (fused), MTP on the output_layer seam (fused), packing other than THD, labels not laid out like input_ids.

    On a host without CUDA the model call runs inside `areal_lce.megatron.compat.cpu_shims()`, entered here.
    A backward under sequence parallelism and megatron's `finalize_model_grads` need it too: wrap them (and
    this call) in `with cpu_shims():`; token_stats refuses, saying so, a CPU call with gradients under
    sequence parallelism outside it.

    Context parallelism: pass this CP rank's tokens (`split_for_context_parallel` of ids, labels, per-token
    temperature; THD: the PackedSeqParams of the CP-padded sequences); the stats are CP-local, d_hidden
    stays local and the LM-head weight gradient is this rank's partial sum, which megatron's DDP reduces
    over data x context parallel ranks with every other parameter's. `gather_from_context_parallel`
    gives every CP rank the full per-token stats (its backward returns each rank its own slice).
    """
    out = model_output(model, input_ids, labels, vocab_size=vocab_size, position_ids=position_ids,
                       attention_mask=attention_mask, packed_seq_params=packed_seq_params, temperature=temperature,
                       fused=fused, backend=backend, cache_bytes=cache_bytes, seam=seam, ignore_index=ignore_index,
                       compact_ignored=compact_ignored, invariant=invariant, logits_precision=logits_precision,
                       selected_ids=selected_ids, top_k=top_k)
    if not find_gpt_model(model).post_process:
        return out
    return TokenStats.unpack(*out) if isinstance(out, tuple) else TokenStats.unpack(out)
