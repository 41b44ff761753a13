"""The materialised route: per-token logprobs/entropy/stats from logits that already exist.

This is what a model that runs its LM-head GEMM (Megatron's output layer, an HF lm_head) feeds into:
vocab-parallel logits [..., V_shard] in, the same `LCEOutput` as the fused op out. The logits stay in the
dtype their GEMM produced; `materialised_lean.LeanLogprobsEntropy` reduces them block by block in fp32
(no fp32 copy of the [N, V] logits or their softmax) and writes d_logits once in backward. The fused op
must match it; the Megatron engine uses it when `use_fused_linear_ce` is off (the RL jobs).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from . import checks, comms, exact
from .checks import inv_temperature
from .materialised_lean import LeanLogprobsEntropy, LeanParams, block_rows
from .types import LCEOutput, LCEParams, VocabParallel


def _exact_values(raw, y, it, start: int, valid_cols: int, ignore_index: int, tp_group):
    """(logprob, entropy, max, min, lse) of the invariant mode (exact.py) from this shard's raw fp32 logits
    [N, valid_cols] (the shard starts at global id `start`), merged over tp_group. No gradient."""
    n = raw.shape[0]
    width = exact.segments(valid_cols) * exact.SEG
    r = torch.nn.functional.pad(raw, (0, width - valid_cols)) if width > valid_cols else raw
    inv = it.reshape(-1) if torch.is_tensor(it) else it
    seg = exact.segment_stats_torch(r, inv, valid_cols, False) if valid_cols else raw.new_zeros(3, 0, n)
    if valid_cols:
        mx, mn = raw.amax(-1), raw.amin(-1)
        local = y - start
        own = (local >= 0) & (local < valid_cols)
        zy = torch.where(own, raw.gather(1, local.clamp(0, valid_cols - 1)[:, None]).squeeze(1), 0.0) * inv
    else:
        mx = raw.new_full((n,), float("-inf"))
        mn = raw.new_full((n,), float("inf"))
        zy = raw.new_zeros(n)
    from .backends.base import ShardStats
    from .backends.torch_chunked import TorchChunkedBackend
    tp = comms.group_size(tp_group)
    params = LCEParams(group_name=comms.group_name(tp_group) if tp > 1 else None, tp_size=tp,
                       backend=TorchChunkedBackend(), ignore_index=ignore_index, invariant=True)
    fin = exact.merge(ShardStats(m=None, s=None, a=None, zy=zy, mn=mn, mx=mx, seg=seg), params, inv)
    return fin.lp, fin.ent, fin.mx, fin.mn, fin.lse


def vocab_parallel_group(vocab_parallel, what: str):
    """The process group of the materialised route's `vocab_parallel=VocabParallel(group)` (the value the
    fused op takes; only its group matters here: the logits' gradient is per shard, and d_hidden is the
    output layer's own business), or None."""
    if vocab_parallel is None:
        return None
    if not isinstance(vocab_parallel, VocabParallel):
        raise TypeError(f"{what}: vocab_parallel must be an areal_lce.VocabParallel or None, got {vocab_parallel!r}")
    return vocab_parallel.group


class _Call(NamedTuple):
    """One call's checked options (`checked_call`)."""
    tp: int
    vocab_size: int
    invariant: bool
    start: int  # global id of this shard's first column
    valid_cols: int  # columns of this shard below vocab_size
    inv_t_scalar: Optional[float]
    inv_t: Optional[torch.Tensor]  # [N] fp32 on labels' device, or None
    bad: Optional[torch.Tensor]  # check_labels="deferred": the bad labels' mask, shaped like labels


def checked_call(logits, labels, temperature, ignore_index, vocab_size, tp_group, invariant, logits_precision,
                 check_labels) -> _Call:
    """Checks the materialised route's arguments once (both implementations take them this way)."""
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits leading shape {tuple(logits.shape[:-1])} must equal labels {tuple(labels.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    from .checks import check_invariant_layout, check_logits_precision, resolve_invariant

    check_logits_precision(logits_precision)
    tp = comms.group_size(tp_group)
    v_shard = logits.shape[-1]
    vocab_size = v_shard * tp if vocab_size is None else vocab_size
    asked = invariant is not None
    invariant = resolve_invariant(invariant, "reference", logits.dtype)  # None: off (docs/op.md, Consistency)
    if invariant:
        invariant = check_invariant_layout(v_shard, tp, vocab_size, asked)
    start = comms.group_rank(tp_group) * v_shard
    valid_cols = max(0, min(v_shard, vocab_size - start))
    inv_t_scalar, inv_t = inv_temperature(temperature, labels)
    bad = None
    mode = checks.resolve_mode(check_labels, logits.device)
    if mode == "sync":
        checks.check_now(labels.reshape(-1), inv_t, vocab_size, ignore_index)
    elif mode == "deferred":
        bad = checks.record(labels.reshape(-1), inv_t, vocab_size, ignore_index).view(labels.shape)
    return _Call(tp, vocab_size, bool(invariant), start, valid_cols, inv_t_scalar, inv_t, bad)


def logprobs_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
    vocab_parallel: Optional[VocabParallel] = None,
    invariant: Optional[bool] = None,
    logits_precision: str = "fp32",
    check_labels: Union[bool, str] = True,
    return_logit_sums: bool = False,
) -> LCEOutput:
    """logits [..., V_shard] (this rank's vocab shard under vocab_parallel, any float dtype: kept as given),
    labels [...] global ids.

    vocab_parallel: `VocabParallel(group)`, the value `linear_logprobs_entropy` takes, when the logits are
    this rank's vocab shard (rank r owns global ids [r·V_shard, (r+1)·V_shard)); only its group is used
    (the logits' gradient stays per shard).

    logits_precision: "fp32" takes the logits as given (reduced in fp32); "bf16" rounds each to bf16 first,
    as the fused op's option does (the rounding's gradient is identity; a no-op on bf16 logits).
    invariant=True: each row's values do not depend on the other rows or on the TP degree (exact.py's
    segment sums over a transient fp32 copy of the logits, three more passes; the gradient is the ordinary
    one); None (default): off. The contract covers these reductions given the logits: logits a model
    computes for a whole batch carry the batch dependence of that GEMM. check_labels as the op's (a label
    outside [0, vocab_size) that is not ignore_index raises, or with "deferred" gives NaN and
    check_deferred() raises). return_logit_sums: also sum_logit (differentiable) and sumsq_logit.

    Returns fp32 logprobs, entropy, lse (tempered; differentiable w.r.t. logits) and max_logit, min_logit
    (raw), all 0 at ignore_index rows, whose logits get an exact 0 gradient; columns >= vocab_size are
    padding (excluded, 0 gradient). Collectives over the group, forward only: MAX of the per-token
    [max, -min], then one SUM of the packed shard partials (`LeanLogprobsEntropy`).
    """
    tp_group = vocab_parallel_group(vocab_parallel, "logprobs_entropy_from_logits")
    c = checked_call(logits, labels, temperature, ignore_index, vocab_size, tp_group, invariant, logits_precision,
                     check_labels)
    tp, v_shard, start, valid_cols = c.tp, logits.shape[-1], c.start, c.valid_cols
    invariant, inv_t_scalar, inv_t, bad = c.invariant, c.inv_t_scalar, c.inv_t, c.bad
    shape = labels.shape
    x = logits.reshape(-1, v_shard)
    y = labels.reshape(-1).to(device=logits.device, dtype=torch.int64)
    inv_t = None if inv_t is None else inv_t.to(logits.device)
    params = LeanParams(inv_t=1.0 if inv_t_scalar is None else inv_t_scalar, start=start, valid_cols=valid_cols,
                        ignore_index=ignore_index, tp_group=tp_group if tp > 1 else None,
                        round_bf16=logits_precision == "bf16", logit_sums=bool(return_logit_sums),
                        rows_per_block=block_rows(valid_cols))
    outs = [t.view(shape) for t in LeanLogprobsEntropy.apply(x, y, inv_t, params)]
    lp, ent, mx, mn, lse = outs[:5]
    if invariant:
        with torch.no_grad():
            raw = x.detach()[:, :valid_cols].float()
            if logits_precision == "bf16":
                raw = raw.to(torch.bfloat16).float()
            ex = _exact_values(raw, y, inv_t_scalar if inv_t is None else inv_t, start, valid_cols, ignore_index,
                               params.tp_group)
            del raw
            valid = (y != ignore_index).view(shape)
            ex = [torch.where(valid, t.view(shape), 0.0) for t in ex]
        # the exact values, with the lean graph's gradient (x - x.detach() adds exactly 0)
        lp, ent, lse = (ex[0] + (lp - lp.detach()), ex[1] + (ent - ent.detach()), ex[4] + (lse - lse.detach()))
        mx, mn = ex[2], ex[3]
    if bad is not None:
        lp = lp.masked_fill(bad, float("nan"))
    sums = dict(sum_logit=outs[5], sumsq_logit=outs[6]) if return_logit_sums else {}
    return LCEOutput(lp, ent, mx, mn, lse, **sums)
