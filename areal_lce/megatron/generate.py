"""Token generation for MegatronEngine: the sampling loop over either next-token route (decode.py).

`generate_tokens` runs on a `GenerationModel` (the narrow view of the engine that `MegatronEngine.generate`
builds; nothing here calls back into the engine). One sampling loop drives either route: each step a
route returns the fp32 next-token logits of the live sequences (in order, full vocabulary, on every
rank; the LM head builds them for the last position only), `sample_tokens` picks the tokens on the
device and only their ids reach the host. Both routes see the same uniforms from the same host
generator, so they give the same tokens wherever their logits agree (fp32: to rounding).

  * `kv_cache=True` (`engine.kv_cache`, the default): `decode.CachedSteps`, prefill once on megatron-core's
    static inference context, then one fixed-shape step per token, replayed from CUDA graphs where
    `cuda_graphs` and the model allow (`engine.decode_cuda_graphs`).
  * `kv_cache=False`: `decode.recompute_next_logits` re-runs every whole sequence (the reference).
  * Sequence parallelism is off while generating on the cache (a one-token step cannot be split over TP
    ranks), by megatron's `set_model_to_sequence_parallel`, and restored afterwards.
Falls back to the recompute route, with a warning: context parallelism, a core attention other than the
engine's SDPA or megatron's DotProductAttention (Transformer Engine's static-batch path ignores the
padding mask), a rotary embedding other than plain RoPE, or a megatron-core without StaticInferenceContext.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from typing import Callable, List, Optional, Sequence

import torch

from .decode import CachedSteps, GenerationModel, recompute_next_logits
from .sampling import sample_tokens

__all__ = ["GenerationModel", "check_prompts", "check_request", "generate_tokens", "kv_cache_supported",
           "sample_loop"]

# core attentions that honour the KV-cache contract (decode shapes + a per-sequence boolean mask)
CACHE_ATTENTIONS = ("SDPAttention", "DotProductAttention")


def check_request(prompts: List[List[int]], max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The request's types and ranges, each error naming the argument (the model's limits: `check_prompts`)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"generate: {name} must be a finite number, got {value!r}")
    if temperature < 0:
        raise ValueError(f"generate: temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"generate: prompts must be a non-empty list of lists of int token ids, got "
                         f"{type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes, torch.Tensor)) or not isinstance(p, Sequence) or len(p) == 0:
            raise ValueError(f"generate: prompts[{i}] must be a non-empty list of int token ids, got "
                             f"{type(p).__name__}{' of length 0' if isinstance(p, Sequence) else ''}")
        bad = next((t for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise ValueError(f"generate: prompts[{i}] holds {bad!r} ({type(bad).__name__}); token ids are ints")


def check_prompts(prompts: List[List[int]], max_seq_len: int, vocab_size: int) -> None:
    """Every prompt leaves room for a new token below `max_seq_len` (engine.model.max_seq_len) and holds
    ids in [0, vocab_size). A prompt at the limit would stop the whole batch's generation at once."""
    for i, p in enumerate(prompts):
        if len(p) >= max_seq_len:
            raise ValueError(f"generate: prompts[{i}] has {len(p)} tokens, no room below "
                             f"engine.model.max_seq_len={max_seq_len} for a new one (the longest prompt "
                             f"generate takes has {max_seq_len - 1})")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"generate: prompts[{i}] holds token id {lo if lo < 0 else hi}, outside the "
                             f"model's vocabulary [0, {vocab_size})")


@torch.no_grad()
def generate_tokens(gm: GenerationModel, prompts: List[List[int]], max_new_tokens: int, *, kv_cache: bool,
                    temperature: float, top_p: float, eos_id: Optional[int], generator: torch.Generator,
                    cuda_graphs: bool = True) -> List[List[int]]:
    """New tokens per prompt (stopping after `eos_id`, at max_new_tokens, or when the longest live
    sequence reaches gm.max_seq_len), through the KV cache when `kv_cache` and the model allow, its
    decode steps replayed from CUDA graphs when `cuda_graphs` and the model allow (decode.py).
    The request is checked by the caller (`check_request`); the prompts against the model here."""
    prompts = [[int(t) for t in p] for p in prompts]
    check_prompts(prompts, gm.max_seq_len, gm.vocab_size)
    cached = kv_cache and kv_cache_supported(gm)
    was_training = gm.model.training
    gm.model.eval()
    max_seq_len = gm.max_seq_len

    def recompute(live, new):
        return recompute_next_logits(gm, [prompts[i] + new[i] for i in live])

    try:
        with sequence_parallel_off(gm.gpt) if cached else contextlib.nullcontext():
            # at most max_seq_len - shortest prompt steps: the loop stops when a live sequence reaches it
            steps = min(max_new_tokens, max_seq_len - min(len(p) for p in prompts))
            if not cached:
                return sample_loop(recompute, prompts, max_new_tokens, max_seq_len, temperature, top_p, eos_id,
                                   generator)
            with CachedSteps(gm, prompts, steps, cuda_graphs=cuda_graphs) as step:
                return sample_loop(step, prompts, max_new_tokens, max_seq_len, temperature, top_p, eos_id,
                                   generator)
    finally:
        if was_training:
            gm.model.train()


def sample_loop(next_logits: Callable, prompts, max_new_tokens: int, max_seq_len: int, temperature: float,
                top_p: float, eos_id: Optional[int], generator: torch.Generator) -> List[List[int]]:
    """`next_logits(live, new)` -> [len(live), vocab] logits of the live sequences (prompt + new tokens)."""
    new: List[List[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not live or max(len(prompts[i]) + len(new[i]) for i in live) >= max_seq_len:
            break
        toks = sample_tokens(next_logits(live, new), temperature, top_p, generator).tolist()
        still = []
        for i, t in zip(live, toks):
            new[i].append(t)
            if eos_id is None or t != eos_id:
                still.append(i)
        live = still
    return new


def kv_cache_supported(gm: GenerationModel) -> bool:
    if gm.dist.cp_size > 1:
        warnings.warn(f"engine.kv_cache: megatron's static inference context does not run under context "
                      f"parallelism (parallel.context_parallel={gm.dist.cp_size}); generating by full "
                      "recompute over the CP-split sequences", RuntimeWarning, stacklevel=3)
        return False
    try:
        from megatron.core.inference.contexts import StaticInferenceContext  # noqa: F401
    except ImportError:
        warnings.warn("engine.kv_cache: this megatron-core has no StaticInferenceContext; generating by full "
                      "recompute", RuntimeWarning, stacklevel=3)
        return False
    rope = getattr(gm.gpt, "position_embedding_type", "rope")
    if rope not in ("rope", "none"):
        warnings.warn(f"engine.kv_cache: position_embedding_type={rope!r}: the cached decode step places plain "
                      "RoPE (or none) only; generating by full recompute", RuntimeWarning, stacklevel=3)
        return False
    kinds = {type(layer.self_attention.core_attention).__name__ for layer in gm.gpt.decoder.layers}
    if not kinds <= set(CACHE_ATTENTIONS):
        warnings.warn(f"engine.kv_cache: core attention {sorted(kinds - set(CACHE_ATTENTIONS))} does not take "
                      f"the cache's padding mask (supported: {CACHE_ATTENTIONS}); generating by full recompute",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


@contextlib.contextmanager
def sequence_parallel_off(gpt_model):
    """Megatron's static inference runs without sequence parallelism; restore it afterwards."""
    if not gpt_model.config.sequence_parallel:
        yield
        return
    from megatron.core.transformer import utils

    def forget():  # megatron caches the model's modules by id(): a freed model's id can come back
        (getattr(utils, "_sequence_parallel_attr_cache", None) or {}).pop(id(gpt_model), None)

    forget()
    utils.set_model_to_sequence_parallel(gpt_model, False)
    try:
        yield
    finally:
        utils.set_model_to_sequence_parallel(gpt_model, True)
        forget()
