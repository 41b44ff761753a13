"""The op's option values and its named result.

`VocabParallel` is the op's tensor-parallel option (the process group, who reduces d_hidden, and the
vocabulary bookkeeping derived from the group). `LCEParams` travels as one frozen value from the
functional API through the custom op (library.py: as one options string) to the backend; the process
group travels in it by name, as torch's functional collectives take it, and is resolved where a
collective runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from . import comms

D_HIDDEN_MODES = ("all_reduce", "reduce_scatter", "caller")


@dataclass(frozen=True)
class VocabParallel:
    """Vocabulary (tensor) parallelism of `linear_logprobs_entropy`: `weight` is this rank's vocab shard.

    group     the torch.distributed process group over which the LM-head weight is split along the
              vocabulary (Megatron's tensor-parallel group). None or a 1-rank group: no collective.
    d_hidden  how the hidden states arrive and who reduces their gradient (below).

    Vocabulary bookkeeping, derived from the group and `weight` (nothing to pass): every rank holds an
    equal shard of V_shard = weight.shape[0] rows, rank r owning global ids [r·V_shard, (r+1)·V_shard)
    (Megatron's layout). Labels are global ids on every rank. The true vocabulary size stays the op's
    own `vocab_size` argument, because an unsharded weight can carry padding rows too: rows at global
    ids >= vocab_size are padding on whichever rank they fall. Outputs are the full-vocabulary values,
    identical on every rank.

    Who reduces d_hidden. Each rank's backward computes only its vocab shard's part of d_hidden (a
    partial sum over the vocabulary), and exactly one reduction over `group` must make it whole:
      "all_reduce"      hidden [N, H] is the same on every rank; the op all-reduces (SUM) d_hidden in its
                        backward, so every rank's hidden.grad is the full gradient. For callers without
                        an autograd mapping of their own.
      "reduce_scatter"  sequence parallel: hidden is this rank's [N/tp, H] sequence shard (rank order),
                        labels (and a per-token temperature) cover the full sequence [N]. The forward
                        all-gathers hidden; the backward reduce-scatters d_hidden, so this rank gets its
                        shard of the full gradient. Pass the hidden from *before* Megatron's
                        gather_from_sequence_parallel_region (whose backward would reduce a second time).
      "caller"          hidden is the same on every rank and the op leaves d_hidden vocab-partial: the
                        caller's own mapping reduces it, e.g. Megatron's copy_to_tensor_model_parallel_region
                        (identity forward, all-reduce backward) or gather_from_sequence_parallel_region
                        (all-gather forward, reduce-scatter backward) applied before the op.
    Reducing in the op *and* in the caller's mapping would multiply the gradient by the group size; a
    sequence shard whose gradient is left to the caller has no spelling here. d_weight is never reduced
    (each rank's gradient is of its own shard).
    """

    group: Any = None
    d_hidden: str = "all_reduce"

    def __post_init__(self):
        if self.d_hidden not in D_HIDDEN_MODES:
            raise ValueError(f"VocabParallel(d_hidden={self.d_hidden!r}): expected one of {D_HIDDEN_MODES}")
        comms.checked_group_size(self.group, "VocabParallel.group")

    @property
    def size(self) -> int:
        return comms.group_size(self.group)

    @property
    def rank(self) -> int:
        return comms.group_rank(self.group)

    @property
    def group_name(self) -> Optional[str]:
        """The group's torch.distributed group_name (how the op's options carry it), None for a 1-rank one."""
        return comms.group_name(self.group) if self.size > 1 else None

    @property
    def sequence_parallel(self) -> bool:
        """hidden is this rank's sequence shard (d_hidden="reduce_scatter")."""
        return self.d_hidden == "reduce_scatter"

    def vocab_range(self, v_shard: int) -> tuple:
        """(first, end) global ids of this rank's V_shard weight rows."""
        return self.rank * v_shard, (self.rank + 1) * v_shard


@dataclass(frozen=True)
class LCEParams:
    """Resolved options of one call (validated by `api.linear_logprobs_entropy`).

    Vocabulary bookkeeping is per shard: this rank's `weight` rows hold global ids
    ``[vocab_start, vocab_start + V_shard)``, of which the first `shard_valid` rows are real tokens
    (rows past it are vocabulary padding and are excluded from the softmax, i.e. masked to -inf).
    Temperature: the API validates `temperature` and hands on its inverse, `inv_t` (logits z = r · inv_t
    with r = h·Wᵀ): this float when the temperature is one number, else a per-token [N] fp32 tensor
    passed beside the params (and `inv_t` here is None).
    `backend` is the instance every step of the call runs on (backends/base.py: its methods and
    capabilities); the core never looks a backend up by name.
    """

    inv_t: Optional[float] = 1.0  # 1/T of a scalar temperature; None when a per-token inv_t tensor is given
    ignore_index: int = -100
    vocab_size: int = 0  # true global vocabulary (<= V_shard * tp)
    vocab_start: int = 0  # global id of this shard's row 0
    shard_valid: int = 0  # real (unpadded) rows in this shard, 0 <= shard_valid <= V_shard
    cache_bytes: int = 0  # logits-cache budget in bytes ("auto" resolved): forward keeps fp32 logits when they fit
    backend: Any = None  # the call's backends.base.Backend instance (a layer above: typed Any here); api.py
    #                      resolves it once, library.py's options carry its name; None only for a value handed
    #                      to one backend method directly, which reads no other backend
    group_name: Optional[str] = None  # the vocab-parallel process group by its torch.distributed group_name
    #                                   (resolved by `tp_group`); None = unsharded
    tp_size: int = 1  # the group's size, resolved once by the API
    d_hidden: str = "all_reduce"  # VocabParallel.d_hidden; "all_reduce" without vocab parallelism (no collective)
    compact_ignored: bool = True  # partition ignore_index rows to the tail on the device (function.py); the API
    #                               resolves its default per backend (False for triton: it skips them itself)
    check_labels: str = "off"  # label/temperature value checks: "sync" | "deferred" | "off" (checks.py)
    logit_sums: bool = False  # backends also accumulate Σ_j r_j and Σ_j r_j² of the raw logits
    invariant: bool = False  # per-segment partials + exact fixed-point merge (exact.py): bitwise batch/TP-invariant
    logits_precision: str = "fp32"  # "bf16": each raw logit rounded to bf16 after the fp32 accumulation
    d_weight_fp32: bool = False  # the backward's d_weight stays in the accumulation dtype (fp32; fp64 for fp64
    #                              inputs), not cast to weight.dtype: for main_grad accumulation (main_grad.py)
    softcap: float = 0.0  # > 0: raw logits r -> softcap · tanh(r / softcap) before the temperature (0: off)
    top_k: int = 0  # > 0: also the k largest logits' ids and logprobs per row (select.py)

    def d_weight_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype a backend returns d_weight in: weight's, or fp32 / fp64 with d_weight_fp32."""
        if not self.d_weight_fp32:
            return weight_dtype
        return torch.float64 if weight_dtype == torch.float64 else torch.float32

    @property
    def dstat_rows(self) -> tuple:
        """Names of the rows of the op's differentiable statistics [R, N] (beside logprobs and entropy)."""
        return ("lse",) + (("sum_logit",) if self.logit_sums and not self.softcap else ())

    @property
    def stat_rows(self) -> tuple:
        """Names of the rows of the op's non-differentiable [R, N] output, in order."""
        sums = ("sum_logit", "sumsq_logit") if self.softcap else ("sumsq_logit",)
        return ("max_logit", "min_logit") + (sums if self.logit_sums else ())

    @property
    def bf16_logits(self) -> bool:
        return self.logits_precision == "bf16"

    @property
    def tp_group(self):
        """The vocab-parallel process group (torch.distributed's resolver of `group_name`), None without."""
        return None if self.group_name is None else comms.resolve_group(self.group_name)


class LCEOutput(NamedTuple):
    """Per-token results, fp32, shaped like `labels`.

    logprobs  log softmax(z)[label], z = h·Wᵀ / T over the true vocabulary; 0 at ignore_index rows.
    entropy   -Σ p log p of softmax(z); 0 at ignore_index rows.
    max_logit max_j h·W_jᵀ, the raw logit *before* temperature (None unless return_stats).
    min_logit min_j h·W_jᵀ, raw logit before temperature (None unless return_stats).
    lse       log Σ_j exp(z_j), of the tempered logits z (None unless return_stats); differentiable
              (z-loss: lse²).
    sum_logit   Σ_j h·W_jᵀ, raw logits before temperature (None unless return_logit_sums); differentiable
                without softcap (label smoothing: sum_logit · inv_T / vocab_size − lse).
    sumsq_logit Σ_j (h·W_jᵀ)², raw logits before temperature (None unless return_logit_sums); not
                differentiable. Row mean = sum_logit / vocab_size, row L2 norm = sqrt(sumsq_logit).
    selected_logprobs [..., K] log softmax(z) at the ids of `selected_ids` (None unless given);
                differentiable; 0 at ignore_index entries and rows.
    topk_ids    [..., k] int64 ids of the k largest logits, descending, ties to the lower id
                (None unless top_k); ignore_index at ignore_index rows.
    topk_logprobs [..., k] their logprobs (differentiable, as if those ids had been selected).
    With softcap, "raw logits" are the soft-capped ones (before temperature).
    Stats are over the true vocabulary (padding rows excluded) and are 0 at ignore_index rows.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    max_logit: Optional[torch.Tensor] = None
    min_logit: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    sum_logit: Optional[torch.Tensor] = None
    sumsq_logit: Optional[torch.Tensor] = None
    selected_logprobs: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None
