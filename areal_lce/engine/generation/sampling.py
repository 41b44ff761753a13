"""Next-token sampling on the logits' device, reproducible from a host generator.

One token per row of [n, V] logits: greedy (argmax) at temperature 0, else inverse-CDF sampling of
softmax(logits / T), optionally restricted to the nucleus of mass `top_p` (the most likely token is
always kept). The only randomness is n uniforms drawn on the host from a CPU `torch.Generator` and
copied to the device, so ranks holding identical logits and identically seeded generators (every
tensor-parallel rank) pick the same tokens whatever their device RNG state, and only the n chosen ids
return to the host. The [n, V] logits never leave the device: copying fp32 [64, 151936] logits to the
host and sampling there took ~0.4 s per new token on an H100.

The sampler and the trainer share one LM head. `sampling_logits` puts the head's fp32 logits in the
training head's `logits_precision` ("bf16": each raw logit rounded to bf16, before temperature), and
`token_logprobs` gives the sampled tokens' logprobs by the op itself (`linear_logprobs_entropy` on the
hidden states the logits came from, with the same weight, vocabulary, temperature, precision and
`invariant` option as training), so that with invariant=True the trainer, given the same hidden states,
reproduces them bit for bit. They are the logprobs of the full tempered softmax, as training computes
them: not renormalised over a top-p nucleus.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...op.api import linear_logprobs_entropy
from ...op.types import VocabParallel


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative `weights` [n, V] (need not sum to 1) by the uniforms
    `u` [n] in [0, 1): the first column whose running sum exceeds u * row total. A zero-weight column
    is never returned."""
    cdf = weights.float().cumsum(-1)  # fp32: rounding moves each column's mass by < 1 ulp of the sum
    x = u.to(device=cdf.device, dtype=cdf.dtype).reshape(-1, 1) * cdf[:, -1:]
    choice = torch.searchsorted(cdf, x, right=True)
    # u * total can round up to the total itself: fall back to the last column with non-zero weight
    last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(-1, keepdim=True)
    return torch.minimum(choice, last).squeeze(-1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator) -> torch.Tensor:
    """[n] token ids on logits' device: greedy at temperature 0, else nucleus sampling with n host
    uniforms from the CPU `generator` (none drawn when greedy)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    u = torch.rand(probs.shape[0], generator=generator).to(probs.device)
    if top_p >= 1.0:
        return inverse_cdf(probs, u)
    sp, idx = probs.sort(dim=-1, descending=True, stable=True)
    keep = sp.cumsum(-1) - sp < top_p  # always keeps the most likely token
    choice = inverse_cdf(torch.where(keep, sp, torch.zeros_like(sp)), u)
    return idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


def sampling_logits(logits: torch.Tensor, logits_precision: Optional[str]) -> torch.Tensor:
    """The fp32 logits [n, V] the sampler draws from, in the training head's `logits_precision`
    (None: the op's default, "fp32")."""
    return logits.to(torch.bfloat16).float() if logits_precision == "bf16" else logits


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, temperature: float,
                   vocab_size: int, backend: str = "auto", invariant: Optional[bool] = None,
                   logits_precision: Optional[str] = None, tp_group=None) -> torch.Tensor:
    """[n] fp32 logprobs of `tokens` [n] under softmax(h·Wᵀ / temperature) by `linear_logprobs_entropy`:
    `hidden` [n, H] (cast to the weight's dtype, as the training head casts it), this rank's `weight` shard
    [V / tp, H] over `tp_group`. Greedy sampling (temperature 0) picks its token with probability 1: 0.
    `invariant` and `logits_precision` None: the op's defaults."""
    if temperature == 0:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    options = {k: v for k, v in (("invariant", invariant), ("logits_precision", logits_precision)) if v is not None}
    out = linear_logprobs_entropy(hidden.to(weight.dtype), weight, tokens, temperature=temperature,
                                  vocab_size=vocab_size, backend=backend, check_labels=False,
                                  vocab_parallel=VocabParallel(tp_group) if tp_group is not None else None,
                                  **options)
    return out.logprobs
