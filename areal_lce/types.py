"""The op's option bundle and its named result.

`LCEParams` travels as one frozen value from the functional API into the autograd Function and on to
the backend, so the Function's backward returns one gradient slot per tensor input, not one per option.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch


@dataclass(frozen=True)
class LCEParams:
    """Resolved options of one call (validated by `api.linear_logprobs_entropy`).

    Vocabulary bookkeeping is per shard: this rank's `weight` rows hold global ids
    ``[vocab_start, vocab_start + V_shard)``, of which the first `shard_valid` rows are real tokens
    (rows past it are vocabulary padding and are excluded from the softmax, i.e. masked to -inf).
    Temperature: the API validates `temperature` and hands on its inverse, `inv_t` (logits z = r · inv_t
    with r = h·Wᵀ): this float when the temperature is one number, else a per-token [N] fp32 tensor
    passed beside the params (and `inv_t` here is None).
    """

    inv_t: Optional[float] = 1.0  # 1/T of a scalar temperature; None when a per-token inv_t tensor is given
    ignore_index: int = -100
    vocab_size: int = 0  # true global vocabulary (<= V_shard * tp)
    vocab_start: int = 0  # global id of this shard's row 0
    shard_valid: int = 0  # real (unpadded) rows in this shard, 0 <= shard_valid <= V_shard
    cache_bytes: int = 0  # logits-cache budget in bytes ("auto" resolved): forward keeps fp32 logits when they fit
    backend: str = "torch"  # resolved backend name
    tp_group: Any = None  # torch.distributed ProcessGroup of the vocab shards, None = unsharded
    tp_size: int = 1
    sequence_parallel: bool = False  # hidden is this rank's [N/tp, H] sequence shard
    reduce_d_hidden: bool = True  # the Function reduces d_hidden over tp_group (off: caller's mappings do)
    compact_ignored: bool = True  # partition ignore_index rows to the tail on the device (function.py)
    check_labels: str = "off"  # label/temperature value checks: "sync" | "deferred" | "off" (checks.py)
    logit_sums: bool = False  # backends also accumulate Σ_j r_j and Σ_j r_j² of the raw logits


class LCEOutput(NamedTuple):
    """Per-token results, fp32, shaped like `labels`.

    logprobs  log softmax(z)[label], z = h·Wᵀ / T over the true vocabulary; 0 at ignore_index rows.
    entropy   -Σ p log p of softmax(z); 0 at ignore_index rows.
    max_logit max_j h·W_jᵀ, the raw logit *before* temperature (None unless return_stats).
    min_logit min_j h·W_jᵀ, raw logit before temperature (None unless return_stats).
    lse       log Σ_j exp(z_j), of the tempered logits z (None unless return_stats).
    sum_logit   Σ_j h·W_jᵀ, raw logits before temperature (None unless return_logit_sums).
    sumsq_logit Σ_j (h·W_jᵀ)², raw logits before temperature (None unless return_logit_sums).
                Row mean = sum_logit / vocab_size, row L2 norm = sqrt(sumsq_logit).
    Stats are over the true vocabulary (padding rows excluded) and are 0 at ignore_index rows.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    max_logit: Optional[torch.Tensor] = None
    min_logit: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    sum_logit: Optional[torch.Tensor] = None
    sumsq_logit: Optional[torch.Tensor] = None
