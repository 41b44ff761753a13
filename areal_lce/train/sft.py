"""Supervised fine-tuning job: token-mean NLL on the response (or all) tokens, on the Megatron engine.

    torchrun --nproc_per_node=N -m areal_lce.train configs/sft_tiny.yaml [key=value ...]

Each optimizer step takes global batch `step` of the dataset (a pure function of the data seed and
the step), gives every data-parallel rank its contiguous slice (DP = world / (TP x PP x CP)), splits the
slice into micro-batches and calls `engine.train_step`. With `engine.use_fused_linear_ce: true` the
per-token logprobs, entropy and logit extremes come from the fused linear op at the LM head; with false
the loss is megatron-core's own (GPTModel's `labels=` loss through `compute_language_model_loss`,
megatron/own_loss.py), which builds no per-token entropy or logit extremes: that run's metrics and plot
have no entropy, max_logit or min_logit (STATS_KEYS), and its loss takes the softmax over megatron's
padded vocabulary.
The run loop (loop.py) writes metrics.jsonl, config.yaml, metrics.png and checkpoints.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from . import loop
from .config import JobConfig, split_global_batch
from .data import SFTDataset
from .job import model_vocab_size, reduce_metrics, run_banner, sequence_multiple
from .logging_utils import LOG_KEYS, PLOT_KEYS
from .losses import SFTLoss
from .tokenizer import load_tokenizer

# how the loss's per-rank sums become the global batch's (job.reduce_metrics)
_REDUCE = {"nll": "sum", "entropy": "sum", "tokens": "sum", "max_logit": "max", "min_logit": "min"}
STATS_KEYS = ("entropy", "max_logit", "min_logit")  # what megatron-core's own loss path does not compute


def _number(value):
    """A metric the engine may not have computed: a float, or None."""
    return None if value is None else float(value)


class SFTJob:
    """The SFT job as the run loop drives it (job.Job)."""

    name = "sft"
    log_keys, plot_keys = LOG_KEYS, PLOT_KEYS
    postfix = (("loss", ".4f"),)
    plot_title = "SFT"

    def __init__(self, cfg: JobConfig, dist_info):
        self.cfg, self.dist = cfg, dist_info
        tr = cfg.trainer
        split_global_batch(tr.global_batch_size, tr.micro_batch_size, dist_info.dp_size)
        self.tok = load_tokenizer(cfg.data.tokenizer)
        self.vocab_size = model_vocab_size(cfg, self.tok)
        self.dataset = SFTDataset(cfg.data, self.tok, vocab_size=self.vocab_size)  # ids checked against it
        self.pad_mult = sequence_multiple(cfg, dist_info)
        self.engine = None

    def build_engines(self) -> None:
        from ..engine.engine import MegatronEngine

        self.engine = MegatronEngine(self.cfg.engine, vocab_size=self.vocab_size)
        self.megatron_loss = self.engine.uses_megatron_loss(SFTLoss)
        if self.megatron_loss:  # no logits kept: no entropy or logit-extreme metrics
            self.log_keys = tuple(k for k in LOG_KEYS if k not in STATS_KEYS)
            self.plot_keys = tuple(k for k in PLOT_KEYS if k not in STATS_KEYS)
            self.plot_title = "SFT (megatron-core's own loss: no entropy or logit extremes)"

    def banner(self) -> str:
        text = f"{len(self.dataset)} examples, {run_banner(self.engine, self.tok)}"
        if self.megatron_loss:
            fusion = self.cfg.engine.model.cross_entropy_loss_fusion
            text += (f"; SFT loss: megatron-core's own (compute_language_model_loss, cross_entropy_loss_fusion="
                     f"{str(fusion).lower()}; metrics without {', '.join(STATS_KEYS)})")
        return text

    def step(self, step: int) -> dict:
        tr, d, data = self.cfg.trainer, self.dist, self.dataset
        data_step = step - 1  # global batches are numbered from 0
        mbs = data.microbatches(data_step, tr.global_batch_size, tr.micro_batch_size, d.dp_rank, d.dp_size,
                                self.pad_mult)
        input_tokens = data.global_batch_input_tokens(data_step, tr.global_batch_size)
        loss_fn = SFTLoss(data.global_batch_targets(data_step, tr.global_batch_size) / d.dp_size)
        t0 = time.perf_counter()
        result = self.engine.train_step_local(mbs, loss_fn).extra  # the loss's own sums are reduced below
        dt = time.perf_counter() - t0
        # under PP only the last stage ran the loss (the others hold 0 and -inf/+inf): reduced over both
        keep = ("nll", "tokens") + (() if self.megatron_loss else STATS_KEYS)  # the same keys on every stage
        s = reduce_metrics({k: v for k, v in loss_fn.sums().items() if k in keep}, _REDUCE, d, over_pipeline=True)
        tokens = int(round(s["tokens"]))
        n = max(tokens, 1)
        stats = {} if self.megatron_loss else {"entropy": s["entropy"] / n, "max_logit": s["max_logit"],
                                               "min_logit": s["min_logit"]}
        return {
            "loss": s["nll"] / n,
            **stats,
            "grad_norm": _number(result.get("grad_norm")),  # None (null in metrics.jsonl): not computed
            "lr": _number(result.get("lr")),
            "tokens": tokens,  # loss (target) tokens of the global batch
            "input_tokens": input_tokens,  # non-padding input tokens of the global batch
            "tokens_per_s": input_tokens / dt if dt > 0 else 0.0,
            "step_time_s": dt,
            "peak_mem_gib": _number(result.get("peak_mem_gib")),
        }

    def finish(self, output_dir: Path) -> None:
        if self.cfg.trainer.sample_prompts:
            self.print_samples(self.cfg.trainer.sample_prompts, output_dir)

    def print_samples(self, n: int, out: Path) -> None:
        """Greedy completions of the first `n` prompts (every rank generates: TP ranks share the work);
        rank 0 prints them and writes samples.jsonl."""
        tok, examples = self.tok, self.dataset.examples[:n]
        prompts = [list(e.ids[:e.loss_start]) for e in examples]
        longest = max(e.n_targets for e in examples)
        new = self.engine.generate(prompts, max_new_tokens=min(longest + 2, self.cfg.engine.model.max_seq_len),
                                   temperature=0.0, eos_id=tok.eos_id)
        if not self.dist.is_main:
            return
        rows = []
        print("[sft] greedy completions of the first prompts (-> completion | reference):", flush=True)
        for e, p, c in zip(examples, prompts, new):
            row = {"prompt": tok.decode(p), "completion": tok.decode(c), "reference": tok.decode(e.ids[e.loss_start:])}
            rows.append(row)
            print(f"  {row['prompt']!r} -> {row['completion']!r} | {row['reference']!r}", flush=True)
        with open(out / "samples.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def run(cfg: JobConfig) -> dict:
    """Run the SFT job; returns {'output_dir', 'step' (last step run), 'records' (this invocation's)}."""
    if cfg.job != "sft":
        raise ValueError(f"sft.run got job={cfg.job!r}")
    return loop.run(cfg, SFTJob)
