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
from typing import Any, Dict, Protocol, Sequence, Tuple

# the one metric reduction (the engine's step share and the jobs' own metrics), re-exported for the jobs
from ..engine.metrics import REDUCE_OPS, last_stage_share, reduce_metrics  # noqa: F401
from ..engine.model.builder import resolve_arch, true_vocab_size
from .data import check_special_ids

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
    """The model's true vocabulary (`builder.true_vocab_size`): engine.model.vocab_size when set, else the
    checkpoint config's / preset's vocab_size, whatever the tokenizer's size. A tokenizer with fewer ids is
    fine (the model's extra rows stay in the softmax, as in vLLM / SGLang); raises when the tokenizer has
    more ids, or a special id the model cannot embed, since the jobs feed its ids to the model."""
    model = cfg.engine.model
    vocab_size = true_vocab_size(model, resolve_arch(model))
    if vocab_size < tok.vocab_size:
        source = (f"engine.model.vocab_size={model.vocab_size}" if model.vocab_size else
                  f"the vocab_size of {model.hf_checkpoint_dir or model.hf_config_dir or 'preset ' + model.preset}")
        raise ValueError(f"the model's vocabulary of {vocab_size} ids ({source}) is smaller than the tokenizer's "
                         f"{tok.vocab_size} ids (data.tokenizer={cfg.data.tokenizer!r}): use the model's own "
                         "tokenizer" + ("" if model.hf_checkpoint_dir else
                                        f", or set engine.model.vocab_size >= {tok.vocab_size}"))
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
