"""The contract every backend implements (reference, torch, triton, triton_ascend).

A backend sees one vocabulary shard and only 2-D, contiguous, already-validated tensors; it does no
communication and picks no other backend. All per-token outputs are fp32 [N].

Notation: z = (h · Wᵀ) · inv_t with inv_t = 1/T per token; columns j >= shard_valid are padding and
behave as z_j = -inf (excluded from every statistic, never read as 0).

forward -> ShardStats, per token over this shard's valid columns:
  m   = max_j z_j                             (the tempered max: the reference point of s and a)
  s   = Σ_j exp(z_j - m)
  a   = Σ_j (z_j - m) · exp(z_j - m)          (relative to m: no cancellation in the entropy)
  zy  = z_label if vocab_start <= label < vocab_start + shard_valid else 0
  mx, mn = max_j r_j and min_j r_j of the RAW logits r = h · Wᵀ (no temperature): the op's max_logit /
        min_logit, emitted as computed, never rescaled by T afterwards.
  lsum, lsq = Σ_j r_j and Σ_j r_j² of the raw logits, only when params.logit_sums (else None);
        accumulated in the same pass over the vocabulary as m and s.
  cache: opaque object handed back to backward (e.g. fp32 logits kept under params.cache_bytes), or None.
  With an empty shard (shard_valid == 0): m = mx = -inf, s = a = 0, mn = +inf, lsum = lsq = 0.
  Then lse = m + log s and entropy = log s - a / s (after the cross-shard merge in the Function).
  m is exactly mx · inv_t in fp32 (the Function relies on it): z_j is the rounded product r_j · inv_t,
  and rounding a product by inv_t > 0 is monotone, so the largest z_j is the rounded product of the
  largest r_j. A backend may so track the raw max alone and derive m from it, or the reverse.

backward(lse, ent, g_lp, g_ent) -> (d_hidden fp32 [N, H] or None, d_weight [V_shard, H] or None), d_weight in
  params.d_weight_dtype(weight.dtype) (weight.dtype; fp32 with params.d_weight_fp32):
  p_j  = exp(z_j - lse)
  dz_j = g_lp · (1[j = label] - p_j) - g_ent · p_j · (z_j - lse + ent)
  d_logits_j = dz_j · inv_t ;  d_hidden = d_logits · W (fp32, unreduced over shards);
  d_weight = d_logitsᵀ · h (accumulated in fp32 over all tokens, cast once); padding rows get 0.
  Rows with g_lp = g_ent = 0 contribute nothing. Accumulation order is fixed: bitwise deterministic.

Ignored rows (label == params.ignore_index) reach backward with g_lp = g_ent = 0. skips_ignored_rows:
  False: the backend computes every row as given; the Function compacts (params.compact_ignored, the
         API's default for such a backend): the ignored rows come last with hidden = 0, inv_t = 1, so
         they contribute exactly 0.
  True:  (triton) the backend may skip ignored rows (their forward stats are then unspecified) and must
         give them d_logits exactly 0 whatever their hidden, inv_t, lse or ent values (NaN included), so
         they need no compaction. It must not count them on the host: that would be a sync.

Invariant mode (params.invariant, exact.py): forward returns the per-segment partials `seg` [3, G, N]
  (raw max, s, a of each 128-column segment of the shard's valid columns; [5, G, N] with logit sums)
  with mx, mn, zy per row, and m = s = a = None. Each segment is reduced in an order that depends on
  nothing but the backend (not on N, the row's position, the split or the shard start).
  fold_segments(seg, mx, inv_t, scales) -> int64 [3 or 5, N], the arithmetic of exact.fold_segments
  (the torch version is the default for backends without their own).
params.bf16_logits: every raw logit is rounded to bf16 right after the fp32 accumulation, before the
  temperature, in forward and in backward's recompute (the rounding's gradient is taken as identity).
params.softcap > 0: then r -> softcap · tanh(r / softcap) (`head_transform`); "raw logits" (mx, mn, sums,
  zy before inv_t) are the capped ones and backward multiplies d_logits by cap_slope.
takes_sparse = True: backward also takes sparse=(cols [N, J] int64 local columns, -1 for none; coef [N, J] fp32)
  and adds coef[n, j] to d_logits[n, cols[n, j]] (after inv_t and softcap's slope: the coefficients carry
  both) before its GEMMs, a row's slots in order; else the Function adds those columns itself (select.py).
Optional, for selected ids / top-k (select.py has torch defaults):
  extracts_selected = True: forward(..., selected=ids [N, K] global ids, the forward's row order) may take
      the ids' raw logits from its own tiles, one per row and 128-id segment (ShardStats.sel), and
      pair_logits(hidden, weight, ids, need [N, K] bool, vocab_start) -> fp32 [N, K] computes the rest (values
      where need, before head_transform, each one's bits depending on its row and id only);
  gather_logits(hidden, weight, cols [N, J]) -> fp32 [N, J] h_n · W[cols] before head_transform, each
      value's bits independent of N, J and the row's position;
  segment_logits(hidden, weight, rows [P], segs [P], params) -> fp32 [P, 128] head-transformed raw logits
      of segment segs[p] for row rows[p], bitwise what the invariant forward reduced (-inf past the shard);
  or, doing the top-k's ranking, recompute and selection in its own kernels (triton): rank_segments(seg_rows
      [N, G], inv_t, kk, top=None, vocab_start=0, lists=False) -> ([N, kk] segment indices, [N] fp32 the
      kk-th largest tempered segment maximum, and with lists an opaque plan for candidate_topk (the chosen
      segments to recompute, listed per segment: with top = ShardStats.seg_top's (max columns, second values)
      only those that can hold a candidate besides their max, whose key the plan keeps; else all), else None) and
      candidate_topk(hidden, weight, row0, segs [c, kk], thr [N], inv_t, params, vocab_start, k, plan=None)
      -> [c, k] select.sort_key keys of the k best logits >= thr in those segments, descending.
  and one launch each for a per-row step that select.py otherwise takes in ten to twenty small torch
  operations (the same values: bitwise in the forward; in the backward up to the order of a row's sum of its
  upstream gradients), none of them under softcap:
      selected_raw(hidden, weight, ids [N, K] global, params) -> fp32 [N, K] head-transformed raw logits, 0
      where the id is not this shard's (the gather route of select.selected_logits);
      selected_logprobs(r [N, K], ids, labels, lse [N], inv_t, params) -> fp32 [N, K] (select.forward_outputs,
      with the "deferred" check's NaN); topk_logprobs(keys [N, k], labels, lse, params) -> (fp32 [N, k], int64
      [N, k]); and with takes_sparse, for fp32 gradients, sparse_columns(labels, inv_t, params, g [2, N], g_lse
      [N] or None, ((selected ids, their gradient) or None, (top-k ids, their gradient) or None)) -> (g [2, N]
      with the dense part, local columns [N, J], coefficients [N, J]) (select_grad.SparseGrad.of and .columns).

cache_spec(n, h, v_shard, dtype, params, keep_cache) -> (shape, dtype) of the cache forward() keeps for
  these sizes, or None: forward decides with it, and the op's fake (meta) implementation allocates with
  it, so the two agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import torch

from ..types import LCEParams


POISON_ENV = "AREAL_LCE_POISON_OUTPUTS"
POISON = os.environ.get(POISON_ENV, "") == "1"  # read once; tests/conftest.py sets it before areal_lce loads


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty for every buffer a backend's kernels (or loops) write. With AREAL_LCE_POISON_OUTPUTS=1,
    which tests/conftest.py sets, floating-point buffers start as NaN instead, so an element a kernel fails
    to write shows up as NaN in the tests. Off otherwise (one flag test per allocation)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if POISON and t.is_floating_point() else t


def head_transform(r: torch.Tensor, params: LCEParams) -> torch.Tensor:
    """The op's raw logit from the GEMM's accumulation: rounded to bf16 with logits_precision="bf16",
    then soft-capped (softcap · tanh(r / softcap)) when params.softcap > 0. Every backend applies it to
    each logit before the temperature, in forward and in backward's recompute."""
    if params.bf16_logits:
        r = r.to(torch.bfloat16).to(r.dtype)
    if params.softcap:
        r = torch.tanh(r / params.softcap) * params.softcap
    return r


def cap_slope(capped: torch.Tensor, params: LCEParams) -> torch.Tensor:
    """d cap(r) / d r written with the capped value: 1 - (cap(r) / softcap)^2 (params.softcap > 0)."""
    t = capped / params.softcap
    return 1.0 - t * t


@dataclass
class ShardStats:
    m: torch.Tensor  # tempered max (softmax reference point)
    s: torch.Tensor
    a: torch.Tensor
    zy: torch.Tensor
    mn: torch.Tensor  # raw min
    mx: torch.Tensor  # raw max
    cache: Any = None
    lsum: Optional[torch.Tensor] = None  # Σ raw logits, only with params.logit_sums
    lsq: Optional[torch.Tensor] = None  # Σ raw logits², only with params.logit_sums
    seg: Optional[torch.Tensor] = None  # invariant mode: fp32 [3 or 5, G, N] segment partials (exact.py);
    #                                     then m, s, a are None and mx, mn, zy are this shard's exact values
    seg_top: Optional[tuple] = None  # invariant mode with params.top_k, where the backend keeps it: (int8 [G, N]
    #                                  each segment's max column (lowest on ties), fp32 [G, N] its second
    #                                  largest raw value, fp32 [N, G] the maxima, rows contiguous) (select.py);
    #                                  the first two may be None (then every chosen segment is recomputed)
    sel: Optional[tuple] = None  # invariant mode, forward(selected=ids) on a backend with `extracts_selected`,
    #                              where it took them: (fp32 [N, K] raw (rounded, capped) logits at the slots it
    #                              picked, int64 [N, K] the slot whose value slot j takes, -1 = pair_logits,
    #                              -2 = not this shard's id)


class Backend(Protocol):
    name: str
    skips_ignored_rows: bool  # see "Ignored rows" above

    def forward(
        self,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V_shard, H], same dtype as hidden
        labels: torch.Tensor,  # [N] int64, global ids (any value; out-of-shard ids give zy = 0)
        inv_t: Optional[torch.Tensor],  # [N] fp32, or None -> the scalar params.inv_t
        params: LCEParams,
        keep_cache: bool,  # True when the caller will run backward and may keep logits
    ) -> ShardStats: ...

    def backward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        inv_t: Optional[torch.Tensor],
        params: LCEParams,
        cache: Any,
        lse: torch.Tensor,  # [N] fp32, global
        ent: torch.Tensor,  # [N] fp32, global
        g_lp: torch.Tensor,  # [N] fp32, contiguous
        g_ent: torch.Tensor,  # [N] fp32, contiguous
        need_d_hidden: bool,
        need_d_weight: bool,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]: ...

    def cache_spec(self, n: int, h: int, v_shard: int, dtype: torch.dtype, params: LCEParams,
                   keep_cache: bool) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]: ...
