"""The contract every backend implements (reference, torch, triton, triton_ascend): the `Backend` base class.

A backend sees one vocabulary shard and only 2-D, contiguous, already-validated tensors; it does no
communication and picks no other backend. All per-token outputs are fp32 [N].

Notation: z = (h · Wᵀ) · inv_t with inv_t = 1/T per token; columns j >= shard_valid are padding and
behave as z_j = -inf (excluded from every statistic, never read as 0).

A backend subclasses `Backend` and implements forward, backward and cache_spec; every other method has
the torch default here, and every capability is a class attribute with its default, so the core calls
the call's backend (LCEParams.backend, resolved once by api.py) without asking what it has.
params.bf16_logits and params.softcap apply to every logit, in forward and in backward's recompute
(`head_transform`): each raw logit is rounded to bf16 right after the fp32 accumulation (the rounding's
gradient taken as identity), then soft-capped; "raw logits" (mx, mn, sums, zy before inv_t) are the
rounded, capped ones, and backward multiplies d_logits by `cap_slope`.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from .. import exact
from ..types import LCEParams


POISON_ENV = "AREAL_LCE_POISON_OUTPUTS"
POISON = os.environ.get(POISON_ENV, "") == "1"  # read once; tests/conftest.py sets it before areal_lce loads


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty for every buffer a backend's kernels (or loops) write. With AREAL_LCE_POISON_OUTPUTS=1,
    which tests/conftest.py sets, floating-point buffers start as NaN instead, so an element a kernel fails
    to write shows up as NaN in the tests. Off otherwise (one flag test per allocation)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if POISON and t.is_floating_point() else t


def check_shard(backend: str, dtypes: Tuple[torch.dtype, ...], hidden: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor, inv_t: Optional[torch.Tensor], params: LCEParams) -> None:
    """What a kernel backend's launcher relies on, checked where a backend is called directly (api.py checks a
    call of the op): 2-D hidden [N, H] and weight [V_shard, H] of one dtype in `dtypes`, labels and inv_t [N],
    params.shard_valid within [0, V_shard], one device. Raises ValueError (TypeError for a dtype) naming the
    tensor or option, prefixed with the backend's name."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{backend} backend: hidden and weight must be 2-D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype not in dtypes or weight.dtype != hidden.dtype:
        raise TypeError(f"{backend} backend: hidden and weight must have one dtype of {[str(d) for d in dtypes]}, "
                        f"got {hidden.dtype} and {weight.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{backend} backend: hidden [N, H] and weight [V, H] disagree on H: {tuple(hidden.shape)} "
                         f"vs {tuple(weight.shape)}")
    n = hidden.shape[0]
    for name, t in (("labels", labels), ("inv_t", inv_t)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"{backend} backend: {name} must be [N={n}], got {tuple(t.shape)}")
    if not 0 <= params.shard_valid <= weight.shape[0]:
        raise ValueError(f"{backend} backend: params.shard_valid={params.shard_valid} outside [0, "
                         f"V_shard={weight.shape[0]}]")
    if any(t is not None and t.device != hidden.device for t in (weight, labels, inv_t)):
        raise ValueError(f"{backend} backend: hidden, weight, labels and inv_t must be on one device")


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


GATHER_ROWS = 32  # fixed block shape of the torch gather_logits (on CUDA: GATHER_ROWS_CUDA rows)
GATHER_ROWS_CUDA = 512
GATHER_IDS = 8
SEG_ROWS_CUDA = 1024  # fixed GEMM height of the torch segment recompute for a CUDA backend with its own forward


class Backend(abc.ABC):
    """One vocabulary shard's forward and backward (module docstring). Subclasses set `name` and implement
    forward, backward and cache_spec (abstract); the other methods are the torch defaults, which a backend
    overrides with its own kernels (the same values: bitwise where a docstring says so), or raise where a
    capability flag says the backend has no such kernels and the core does not call them."""

    name: str = ""

    skips_ignored_rows: bool = False
    """How ignored rows (label == params.ignore_index, which reach backward with g_lp = g_ent = 0) are kept
    out of the work. False: the backend computes every row as given; the Function compacts
    (params.compact_ignored, the API's default for such a backend): the ignored rows come last with
    hidden = 0, inv_t = 1, so they contribute exactly 0. True (triton): the backend may skip ignored rows
    (their forward stats are then unspecified) and must give them d_logits exactly 0 whatever their
    hidden, inv_t, lse or ent values (NaN included), so they need no compaction. It must not count them
    on the host: that would be a sync."""

    supports_softcap: bool = True
    """params.softcap > 0 is implemented (api.py refuses softcap on a backend without it)."""

    takes_sparse: bool = False
    """backward takes sparse=(cols [N, J] int64 local columns, -1 for none; coef [N, J] fp32) and adds
    coef[n, j] to d_logits[n, cols[n, j]] (after inv_t and softcap's slope: the coefficients carry both)
    before its GEMMs, a row's slots in order; else the Function adds those columns itself (select_grad.py)."""

    extracts_selected: bool = False
    """In invariant mode forward(..., selected=ids [N, K] global ids, the forward's row order) may take the
    ids' raw logits from its own tiles, one per row and 128-id segment (ShardStats.sel), and `pair_logits`
    computes the rest."""

    ranks_topk: bool = False
    """The top-k's ranking, recompute and selection run in the backend's own kernels (`rank_segments`,
    `candidate_topk`) instead of select.py's torch steps over `segment_logits`."""

    fused_rows: bool = False
    """One launch each for the per-row steps that select.py otherwise takes in ten to twenty small torch
    operations (the same values: bitwise in the forward; in the backward up to the order of a row's sum of
    its upstream gradients): `selected_raw`, `selected_logprobs`, `topk_logprobs` and, with takes_sparse,
    `sparse_columns`. The core uses them only without softcap (torch's tanh)."""

    record_labels: Optional[Callable] = None
    """A one-launch version of checks.record's fold (the "deferred" label / temperature check):
    (y, inv_t, vocab_size, ignore_index, rec) -> [N] bool mask of bad labels, folding the call into the
    int64 record `rec`. None: checks.record folds with a dozen [N] torch operations."""

    @abc.abstractmethod
    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                inv_t: Optional[torch.Tensor], params: LCEParams, keep_cache: bool) -> ShardStats:
        """ShardStats of hidden [N, H] against weight [V_shard, H] (same dtype); labels [N] int64 global ids
        (any value; out-of-shard ids give zy = 0); inv_t [N] fp32, or None -> the scalar params.inv_t;
        keep_cache: the caller will run backward and may keep logits. Per token over the valid columns:
          m   = max_j z_j                         (the tempered max: the reference point of s and a)
          s   = Σ_j exp(z_j - m)
          a   = Σ_j (z_j - m) · exp(z_j - m)      (relative to m: no cancellation in the entropy)
          zy  = z_label if vocab_start <= label < vocab_start + shard_valid else 0
          mx, mn = max_j r_j and min_j r_j of the RAW logits r = h · Wᵀ (no temperature): the op's
                max_logit / min_logit, emitted as computed, never rescaled by T afterwards.
          lsum, lsq = Σ_j r_j and Σ_j r_j² of the raw logits, only when params.logit_sums (else None),
                accumulated in the same pass over the vocabulary as m and s.
          cache: opaque object handed back to backward (e.g. fp32 logits kept under params.cache_bytes), or None.
        With an empty shard (shard_valid == 0): m = mx = -inf, s = a = 0, mn = +inf, lsum = lsq = 0. Then
        lse = m + log s and entropy = log s - a / s (after the cross-shard merge in the Function).
        m is exactly mx · inv_t in fp32 (the Function relies on it): z_j is the rounded product r_j · inv_t,
        and rounding a product by inv_t > 0 is monotone, so the largest z_j is the rounded product of the
        largest r_j. A backend may so track the raw max alone and derive m from it, or the reverse.
        Invariant mode (params.invariant, exact.py): the per-segment partials `seg` [3, G, N] (raw max, s, a
        of each 128-column segment of the shard's valid columns; [5, G, N] with logit sums) with mx, mn, zy
        per row, and m = s = a = None. Each segment is reduced in an order that depends on nothing but the
        backend (not on N, the row's position, the split or the shard start)."""


    @abc.abstractmethod
    def backward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 inv_t: Optional[torch.Tensor], params: LCEParams, cache: Any, lse: torch.Tensor,
                 ent: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor, need_d_hidden: bool,
                 need_d_weight: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(d_hidden fp32 [N, H] or None, d_weight [V_shard, H] or None) for the global lse, ent [N] fp32 and
        the contiguous upstream g_lp, g_ent [N] fp32; cache: what forward kept. d_weight in
        params.d_weight_dtype(weight.dtype) (weight.dtype; fp32 with params.d_weight_fp32):
          p_j  = exp(z_j - lse)
          dz_j = g_lp · (1[j = label] - p_j) - g_ent · p_j · (z_j - lse + ent)
          d_logits_j = dz_j · inv_t ;  d_hidden = d_logits · W (fp32, unreduced over shards);
          d_weight = d_logitsᵀ · h (accumulated in fp32 over all tokens, cast once); padding rows get 0.
        Rows with g_lp = g_ent = 0 contribute nothing. Accumulation order is fixed: bitwise deterministic.
        With takes_sparse it also takes sparse=(cols, coef)."""


    @abc.abstractmethod
    def cache_spec(self, n: int, h: int, v_shard: int, dtype: torch.dtype, params: LCEParams,
                   keep_cache: bool) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of the cache forward() keeps for these sizes, or None: forward decides with it, and
        the op's fake (meta) implementation allocates with it, so the two agree."""


    def fold_segments(self, seg: torch.Tensor, mx: torch.Tensor, inv_t, scales) -> torch.Tensor:
        """Invariant mode: the segment partials folded into int64 [3 or 5, N] (exact.fold_segments, whose
        arithmetic a backend's own version keeps bitwise)."""
        return exact.fold_segments(seg, mx, inv_t, scales)

    def finish_folded(self, q, zy, mx, mn, inv_t, scales) -> exact.Finished:
        """Invariant mode: the merged integer sums to the per-token outputs (exact.finish, bitwise)."""
        return exact.finish(q, zy, mx, mn, inv_t, scales)

    def gather_logits(self, hidden: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """fp32 [N, J] h_n · W[cols[n, j]] for local columns cols [N, J], before head_transform, each value's
        bits independent of N, J and the row's position. The torch version: fixed [GATHER_ROWS, GATHER_IDS,
        H] blocks (GATHER_ROWS_CUDA rows on CUDA)."""
        n, j = cols.shape
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        out = torch.empty((n, j), dtype=torch.float32, device=hidden.device)
        block = GATHER_ROWS_CUDA if hidden.is_cuda else GATHER_ROWS
        for t0 in range(0, n, block):
            rows = min(block, n - t0)
            hb = hidden.new_zeros((block, hidden.shape[1]))
            hb[:rows] = hidden[t0:t0 + rows]
            hb = hb.to(acc)[:, None, :]
            for c0 in range(0, j, GATHER_IDS):
                ids = cols.new_zeros((block, GATHER_IDS))
                width = min(GATHER_IDS, j - c0)
                ids[:rows, :width] = cols[t0:t0 + rows, c0:c0 + width]
                r = (hb * weight[ids].to(acc)).sum(-1)  # [GATHER_ROWS, GATHER_IDS]
                out[t0:t0 + rows, c0:c0 + width] = r[:rows, :width].float()
        return out

    def segment_logits(self, hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor,
                       params: LCEParams) -> torch.Tensor:
        """fp32 [P, 128] head-transformed raw logits of segment segs[p] for row rows[p] (-inf past the
        shard), bitwise what the backend's invariant forward reduced. The torch version recomputes with the
        torch backend's blocks, SEG_ROWS_CUDA rows high on CUDA (invariant, not another forward's bits)."""
        from .torch_chunked import INV_ROWS, segment_logits
        return segment_logits(hidden, weight, rows, segs, params, SEG_ROWS_CUDA if hidden.is_cuda else INV_ROWS)

    def pair_logits(self, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, need: torch.Tensor,
                    vocab_start: int) -> torch.Tensor:
        """With extracts_selected: fp32 [N, K] raw logits at global ids [N, K] where need [N, K] (bool), before
        head_transform, each one's bits depending on its row and id only (the ids forward did not take)."""
        raise NotImplementedError(f"backend {self.name!r} does not extract selected ids (extracts_selected)")

    def rank_segments(self, seg_rows: torch.Tensor, inv_t, kk: int, top=None, vocab_start: int = 0,
                      lists: bool = False):
        """With ranks_topk: from the segment maxima [N, G] (rows contiguous), ([N, kk] segment indices, [N] fp32
        the kk-th largest tempered segment maximum, and with lists an opaque plan for candidate_topk (the
        chosen segments to recompute, listed per segment: with top = ShardStats.seg_top's (max columns,
        second values) only those that can hold a candidate besides their max, whose key the plan keeps;
        else all), else None)."""
        raise NotImplementedError(f"backend {self.name!r} has no top-k kernels (ranks_topk)")

    def candidate_topk(self, hidden: torch.Tensor, weight: torch.Tensor, row0: int, segs: torch.Tensor,
                       thr: torch.Tensor, inv_t, params: LCEParams, vocab_start: int, k: int,
                       plan=None) -> torch.Tensor:
        """With ranks_topk: [c, k] select.sort_key keys of the k best logits >= thr [N] in the segments segs
        [c, kk] of rows row0.., descending."""
        raise NotImplementedError(f"backend {self.name!r} has no top-k kernels (ranks_topk)")

    def selected_raw(self, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                     params: LCEParams) -> torch.Tensor:
        """With fused_rows: fp32 [N, K] head-transformed raw logits at global ids [N, K], 0 where the id is not
        this shard's (the gather route of select.selected_logits)."""
        raise NotImplementedError(f"backend {self.name!r} has no fused per-row steps (fused_rows)")

    def selected_logprobs(self, r: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                          inv_t, params: LCEParams) -> torch.Tensor:
        """With fused_rows: fp32 [N, K] logprobs of the raw logits r [N, K] at ids (select.forward_outputs,
        with the "deferred" check's NaN)."""
        raise NotImplementedError(f"backend {self.name!r} has no fused per-row steps (fused_rows)")

    def topk_logprobs(self, keys: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, params: LCEParams):
        """With fused_rows: (fp32 [N, k] logprobs, int64 [N, k] ids) of the top-k keys [N, k]."""
        raise NotImplementedError(f"backend {self.name!r} has no fused per-row steps (fused_rows)")

    def sparse_columns(self, labels: torch.Tensor, inv_t, params: LCEParams, g: torch.Tensor,
                       g_lse: Optional[torch.Tensor], parts):
        """With fused_rows and takes_sparse, for fp32 gradients: (g [2, N] with the dense part, local columns
        [N, J], coefficients [N, J]) from g_lse [N] or None and parts = ((selected ids, their gradient) or None,
        (top-k ids, their gradient) or None) (select_grad.SparseGrad.of and .columns)."""
        raise NotImplementedError(f"backend {self.name!r} has no fused per-row steps (fused_rows)")
