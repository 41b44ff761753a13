"""What every train job shares: the `Job` protocol that the run loop drives, and the job-side helpers
both jobs call (model vocabulary, sequence padding multiple, the run banner, metric reduction).

A job is built on the host first (tokenizer, data or task, every check of its options against the
parallel layout), so that a bad option fails before the run directory is touched or a model is built;
`build_engines()` then builds its Megatron engine(s). The loop (loop.py) owns everything else: the
run directory, resume, seeding, metrics.jsonl, the progress bar, end-of-step checkpoints and the plot.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Mapping, Protocol, Sequence, Tuple

import torch

from .. import comms
from .data import check_special_ids

REDUCE_OPS = ("sum", "mean", "max", "min")


class Job(Protocol):
    """One kind of training run (SFT, GRPO/PPO), as the run loop sees it."""

    name: str  # "sft" | "grpo" | "ppo": log prefix, progress-bar label
    log_keys: Sequence[str]  # metrics of the line printed every trainer.log_interval steps
    plot_keys: Sequence[str]  # panels of metrics.png
    postfix: Sequence[Tuple[str, str]]  # (metric, format spec) shown on the progress bar
    plot_title: str
    # The trained engine (None until build_engines): what a checkpoint saves (model, optimizer, lr schedule,
    # RNG states) and resume loads. The data state is the step number alone (batches are functions of it).
    engine: Any

    def build_engines(self) -> None:
        """Build the engine(s); called once, after the host-side checks and the run directory set-up."""

    def banner(self) -> str:
        """One line describing the run (data or task, tokenizer, parallel layout, LM-head route)."""

    def step(self, step: int) -> Dict[str, Any]:
        """Build optimizer step `step`'s batch (1-based), run it and return its metrics record, the same
        on every rank (reduced over the data-parallel ranks)."""

    def finish(self, output_dir: Path) -> None:
        """After the last step of the run (every rank): e.g. print sample completions."""


def model_vocab_size(cfg, tok) -> int:
    """The model's vocabulary for tokenizer `tok`: engine.model.vocab_size when set (a model vocabulary
    larger than the tokenizer's), else the tokenizer's. Raises when it is smaller than the tokenizer's
    or lacks one of the tokenizer's special ids, which the jobs feed to the model."""
    model_vocab = cfg.engine.model.vocab_size
    if model_vocab and model_vocab < tok.vocab_size:
        raise ValueError(f"engine.model.vocab_size={model_vocab} is smaller than the tokenizer's "
                         f"{tok.vocab_size} ids (data.tokenizer={cfg.data.tokenizer!r})")
    vocab_size = model_vocab or tok.vocab_size
    check_special_ids(tok, vocab_size)
    return vocab_size


def sequence_multiple(cfg, dist) -> int:
    """Right-pad every batch to a multiple of data.pad_to_multiple_of, and of the tensor-parallel size
    under sequence parallelism (the sequence is split over the TP ranks)."""
    if cfg.engine.parallel.sequence_parallel:
        return math.lcm(cfg.data.pad_to_multiple_of, dist.tp_size)
    return cfg.data.pad_to_multiple_of


def run_banner(engine, tok) -> str:
    """The part of the start-up line that every job prints: tokenizer, parallel layout, and the LM-head
    route the engine chose (engine.route)."""
    dist, route = engine.dist, engine.route.description
    return (f"tokenizer {tok.name} ({tok.vocab_size} ids), world {dist.world_size} = TP {dist.tp_size} x "
            f"PP {dist.pp_size} x CP {dist.cp_size} x DP {dist.dp_size}, LM-head route: {route}")


def reduce_metrics(values: Mapping[str, float], ops: Mapping[str, str], dist, *,
                   over_pipeline: bool = False) -> Dict[str, float]:
    """Step metrics of the whole job from every rank's share: `values[k]` reduced by `ops[k]` (default
    mean) over the data-parallel group of `dist` (a DistInfo: each DP rank holds a slice of the batch).

    sum   partial sums (tokens, NLL sums) -> their total
    mean  per-rank means -> their average over the data-parallel ranks
    max / min  per-rank extremes -> the global extreme
    With `over_pipeline`, the values are first reduced over the pipeline group: only the last stage ran
    the loss, so the other stages must hold each op's identity (0 for sum/mean, -inf / +inf for max /
    min). Tensor- and context-parallel ranks hold identical values and are not reduced over. Every rank
    passes the same keys; one SUM and one MAX collective per group carry all of them.
    """
    kind = {k: ops.get(k, "mean") for k in values}
    unknown = sorted(set(kind.values()) - set(REDUCE_OPS))
    if unknown:
        raise ValueError(f"reduce_metrics: unknown op(s) {unknown}; expected one of {REDUCE_OPS}")
    added = sorted(k for k in values if kind[k] in ("sum", "mean"))
    extreme = sorted(k for k in values if kind[k] in ("max", "min"))
    sums = torch.tensor([float(values[k]) for k in added], dtype=torch.float64)
    # MIN as MAX of the negated value (exact): one MAX collective carries both kinds of extremes
    maxes = torch.tensor([float(values[k]) if kind[k] == "max" else -float(values[k]) for k in extreme],
                         dtype=torch.float64)
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
