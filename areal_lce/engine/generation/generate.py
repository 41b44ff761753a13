"""Token generation for MegatronEngine: the sampling loop over either next-token route (decode.py).

`generate_tokens` runs on a `GenerationModel` (the narrow view of the engine that `MegatronEngine.generate`
builds; nothing here calls back into the engine). One sampling loop drives either route: each step a
route returns the fp32 next-token logits of the live sequences (in order, full vocabulary, on every
rank; the LM head builds them for the last position only) with the hidden states they come from,
`sample_tokens` picks the tokens on the device from the logits in the training head's logits precision
and only their ids reach the host. With `return_logprobs` the training head (the op) gives the sampled
tokens' logprobs from those hidden states, copied to the host once at the end (sampling.py). Both
routes see the same uniforms from the same host generator, so they give the same tokens wherever their
logits agree (fp32: to rounding).

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
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from ...op.checks import check_sampling_temperature
from .decode import CachedSteps, GenerationModel, recompute_next_logits, sampled_logprobs
from .sampling import sample_tokens, sampling_logits

__all__ = ["Generation", "GenerationModel", "check_prompts", "check_request", "generate_tokens",
           "kv_cache_supported", "sample_loop"]

# core attentions that honour the KV-cache contract (decode shapes + a per-sequence boolean mask)
CACHE_ATTENTIONS = ("SDPAttention", "DotProductAttention")


def check_request(prompts: List[List[int]], max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The request's types and ranges, each error naming the argument (the model's limits: `check_prompts`)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_sampling_temperature(temperature, "generate: temperature")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not math.isfinite(top_p):
        raise ValueError(f"generate: top_p must be a finite number, got {top_p!r}")
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


class Generation(NamedTuple):
    """`generate(..., return_logprobs=True)`: the new tokens per prompt and each token's logprob as the
    sampler drew it: log softmax(h·Wᵀ / temperature)[token] by the training head (`linear_logprobs_entropy`
    on the hidden state the sampled logits came from, the same logits precision and invariance option;
    sampling.py), of the full softmax (not renormalised over top_p); 0 at temperature 0 (greedy)."""

    tokens: List[List[int]]
    logprobs: List[List[float]]


@torch.no_grad()
def generate_tokens(gm: GenerationModel, prompts: List[List[int]], max_new_tokens: int, *, kv_cache: bool,
                    temperature: float, top_p: float, eos_id: Optional[int], generator: torch.Generator,
                    cuda_graphs: bool = True, return_logprobs: bool = False, invariant: Optional[bool] = None,
                    logits_precision: Optional[str] = None):
    """New tokens per prompt (stopping after `eos_id`, at max_new_tokens, or when the longest live
    sequence reaches gm.max_seq_len), through the KV cache when `kv_cache` and the model allow, its
    decode steps replayed from CUDA graphs when `cuda_graphs` and the model allow (decode.py); with
    `return_logprobs` a `Generation` (tokens and the sampler's logprobs). The tokens are drawn from the
    head's fp32 logits in `logits_precision`; `invariant` and `logits_precision` are the training head's
    options (None: those of gm.route's LCEOptions, i.e. engine.lce's).
    The request is checked by the caller (`check_request`); the prompts against the model here."""
    prompts = [[int(t) for t in p] for p in prompts]
    check_prompts(prompts, gm.max_seq_len, gm.vocab_size)
    invariant = gm.route.options.invariant if invariant is None else invariant
    logits_precision = gm.route.options.logits_precision if logits_precision is None else logits_precision
    cached = kv_cache and kv_cache_supported(gm)
    was_training = gm.model.training
    gm.model.eval()
    max_seq_len = gm.max_seq_len
    logprobs_of = None
    if return_logprobs:
        def logprobs_of(hidden, tokens):
            return sampled_logprobs(gm, hidden, tokens, temperature=temperature, invariant=invariant,
                                    logits_precision=logits_precision)

    def recompute(live, new):
        return recompute_next_logits(gm, [prompts[i] + new[i] for i in live])

    def loop(next_token):
        out = sample_loop(next_token, prompts, max_new_tokens, max_seq_len, temperature, top_p, eos_id, generator,
                          logits_precision=logits_precision, logprobs_of=logprobs_of)
        return out if return_logprobs else out.tokens

    try:
        with sequence_parallel_off(gm.gpt) if cached else contextlib.nullcontext():
            # at most max_seq_len - shortest prompt steps: the loop stops when a live sequence reaches it
            steps = min(max_new_tokens, max_seq_len - min(len(p) for p in prompts))
            if not cached:
                return loop(recompute)
            with CachedSteps(gm, prompts, steps, cuda_graphs=cuda_graphs) as step:
                return loop(step)
    finally:
        if was_training:
            gm.model.train()


def sample_loop(next_token: Callable, prompts, max_new_tokens: int, max_seq_len: int, temperature: float,
                top_p: float, eos_id: Optional[int], generator: torch.Generator, *,
                logits_precision: Optional[str] = None, logprobs_of: Optional[Callable] = None) -> Generation:
    """`next_token(live, new)` -> the `NextToken` (logits, hidden states) of the live sequences (prompt +
    new tokens); the tokens are drawn from its logits in `logits_precision`. `logprobs_of(hidden, tokens)`
    -> [n] logprobs of the sampled tokens, kept on the device until one copy at the end (None: the
    Generation's logprobs are None)."""
    new: List[List[int]] = [[] for _ in prompts]
    taken = []  # (live, [len(live)] device logprobs) of each step
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not live or max(len(prompts[i]) + len(new[i]) for i in live) >= max_seq_len:
            break
        head = next_token(live, new)
        tokens = sample_tokens(sampling_logits(head.logits, logits_precision), temperature, top_p, generator)
        if logprobs_of is not None:
            taken.append((live, logprobs_of(head.hidden, tokens)))
        still = []
        for i, t in zip(live, tokens.tolist()):
            new[i].append(t)
            if eos_id is None or t != eos_id:
                still.append(i)
        live = still
    if logprobs_of is None:
        return Generation(new, None)
    logprobs: List[List[float]] = [[] for _ in prompts]
    values = iter(torch.cat([lp.float() for _, lp in taken]).tolist() if taken else [])
    for step_live, _ in taken:
        for i in step_live:
            logprobs[i].append(next(values))
    return Generation(new, logprobs)


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
