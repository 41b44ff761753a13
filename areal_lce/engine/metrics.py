"""Step metrics: each rank's share of a training step, and the one reduction that makes the job's numbers.

A training step leaves every rank with its own share (`StepShare`): the loss and the loss function's
metrics summed over the rank's micro-batches, how many there were, and the target tokens. Nothing is
reduced there. `reduce_metrics` turns per-rank values into the job's, over the pipeline group (only the
last stage ran the loss) and then the data-parallel group, with one SUM and one MAX collective per group
for every key; `MegatronEngine.train_step` calls it on its share, and the train jobs, which take the
share itself (`train_step_local`), call it once on the share's values together with their own metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

import torch

from ..op import comms

REDUCE_OPS = ("sum", "mean", "max", "min")
_IDENTITY = {"sum": 0.0, "mean": 0.0, "max": -math.inf, "min": math.inf}


@dataclass
class StepShare:
    """One rank's share of a training step, before any reduction.

    sums          "loss" and each metric of loss_fn summed over this rank's micro-batches (floats or 0-d
                  fp64 device tensors, read on the host only after a reduction); the keys are the last
                  pipeline stage's on every stage (0 where the stage ran no loss_fn)
    microbatches  this rank's micro-batches in the step
    tokens        this rank's target tokens
    extra         values that need no reduction: grad_norm and lr (the same on every rank), this rank's
                  peak_mem_gib and peak_reserved_gib
    """

    sums: Dict[str, Any]
    microbatches: int
    tokens: int
    extra: Dict[str, float] = field(default_factory=dict)

    def values(self, dist) -> Dict[str, Any]:
        """This rank's values for `reduce_metrics(..., STEP_OPS, over_pipeline=True)`: the loss summed over
        micro-batches (loss_fn normalises), each metric's mean over micro-batches, the tokens; on a
        pipeline stage other than the last, the identities (0: the last stage alone ran loss_fn)."""
        last = dist.pp_size == 1 or dist.is_last_stage
        n = max(self.microbatches, 1)
        out = {"loss": self.sums.get("loss", 0.0) if last else 0.0, "tokens": float(self.tokens) if last else 0.0}
        out.update({k: (v / n if last else 0.0) for k, v in self.sums.items() if k != "loss"})
        return out


STEP_OPS = {"tokens": "sum"}  # the step's values: the rest are data-parallel means


def reduce_step(share: StepShare, dist) -> Dict[str, float]:
    """The step's metrics of the whole job, the same on every rank: the data-parallel mean of the loss and
    of each metric, the tokens summed (a float), and the share's `extra` values as they are."""
    out = reduce_metrics(share.values(dist), STEP_OPS, dist, over_pipeline=True)
    out.update(share.extra)
    return out


def last_stage_share(values: Mapping[str, Any], ops: Mapping[str, str], dist) -> Dict[str, Any]:
    """`values` on the last pipeline stage, each op's identity elsewhere: for `reduce_metrics(...,
    over_pipeline=True)` of values every stage holds alike (they are then counted once)."""
    if dist.pp_size == 1 or dist.is_last_stage:
        return dict(values)
    return {k: _IDENTITY[ops.get(k, "mean")] for k in values}


def reduce_metrics(values: Mapping[str, Any], ops: Mapping[str, str], dist, *,
                   over_pipeline: bool = False) -> Dict[str, float]:
    """Step metrics of the whole job from every rank's share: `values[k]` reduced by `ops[k]` (default
    mean) over the data-parallel group of `dist` (a DistInfo: each DP rank holds a slice of the batch).

    sum   partial sums (tokens, NLL sums) -> their total
    mean  per-rank means -> their average over the data-parallel ranks
    max / min  per-rank extremes -> the global extreme
    With `over_pipeline`, the values are first reduced over the pipeline group: only the last stage ran
    the loss, so the other stages must hold each op's identity (0 for sum/mean, -inf / +inf for max /
    min; `last_stage_share`). Tensor- and context-parallel ranks hold identical values and are not
    reduced over. Every rank passes the same keys; one SUM and one MAX collective per group carry all of
    them. Values are floats or 0-d tensors (on the device of the first tensor: they reach the host once,
    after the reductions).
    """
    kind = {k: ops.get(k, "mean") for k in values}
    unknown = sorted(set(kind.values()) - set(REDUCE_OPS))
    if unknown:
        raise ValueError(f"reduce_metrics: unknown op(s) {unknown}; expected one of {REDUCE_OPS}")
    device = next((v.device for v in values.values() if torch.is_tensor(v)), torch.device("cpu"))

    def vector(items):
        return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in items]) \
            if items else torch.zeros(0, dtype=torch.float64, device=device)

    added = sorted(k for k in values if kind[k] in ("sum", "mean"))
    extreme = sorted(k for k in values if kind[k] in ("max", "min"))
    sums = vector([values[k] for k in added])
    # MIN as MAX of the negated value (exact): one MAX collective carries both kinds of extremes
    maxes = vector([values[k] if kind[k] == "max" else -values[k] for k in extreme])
    groups = ([(dist.pp_group, dist.pp_size)] if over_pipeline else []) + [(dist.dp_group, dist.dp_size)]
    for group, size in groups:
        if size > 1:
            if added:
                comms.all_reduce_sum_(sums, group)  # stage / DP-slice shares -> job totals (metrics only)
            if extreme:
                comms.all_reduce_max_(maxes, group)  # per-rank extremes -> job extremes (metrics only)
    out = {k: v / dist.dp_size if kind[k] == "mean" else v for k, v in zip(added, sums.tolist())}
    out.update({k: v if kind[k] == "max" else -v for k, v in zip(extreme, maxes.tolist())})
    return {k: out[k] for k in values}  # the caller's key order
