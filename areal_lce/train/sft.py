"""Supervised fine-tuning job: token-mean NLL on the response (or all) tokens, on the Megatron engine.

    torchrun --nproc_per_node=N -m areal_lce.train configs/sft_tiny.yaml [key=value ...]

Each optimizer step takes global batch `step` of the dataset (a pure function of the data seed and
the step), gives every data-parallel rank its contiguous slice (DP = world / (TP x PP x CP)), splits the
slice into micro-batches and calls `engine.train_step`. The per-token statistics come from the fused
linear op at the LM head when `engine.use_fused_linear_ce` is true, else from materialised logits.
Rank 0 writes metrics.jsonl, config.yaml, metrics.png and shows the progress bar.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from . import checkpoint as ckpt
from .config import JobConfig, dump_yaml, split_global_batch
from .data import SFTDataset
from .logging_utils import MetricsLog, ProgressBar, format_record, plot_metrics, read_metrics
from .losses import SFTLoss
from .tokenizer import load_tokenizer


def _reduce_metrics(sums: dict, groups) -> dict:
    """Global batch sums (nll, entropy, tokens) and extremes (max/min logit) from every rank's share.

    `groups`: the pipeline group (only the last stage ran the loss; the others hold zeros and
    -inf/+inf) and the data-parallel group (each rank holds a slice of the batch). TP ranks hold
    identical values and are not reduced over.
    """
    from areal_lce import comms

    t = torch.tensor([sums["nll"], sums["entropy"], float(sums["tokens"])], dtype=torch.float64)
    ext = torch.tensor([sums["max_logit"], -sums["min_logit"]], dtype=torch.float64)
    for g in groups:
        comms.all_reduce_sum_(t, g)  # partial sums of stages / DP slices -> global batch sums (metrics only)
        comms.all_reduce_max_(ext, g)  # per-rank extremes -> global extremes (metrics only)
    return {"nll": float(t[0]), "entropy": float(t[1]), "tokens": int(round(float(t[2]))),
            "max_logit": float(ext[0]), "min_logit": -float(ext[1])}


def _metric_groups(dist_info) -> list:
    from megatron.core import parallel_state as mpu

    groups = []
    if dist_info.pp_size > 1:
        groups.append(mpu.get_pipeline_model_parallel_group())
    if dist_info.dp_size > 1:
        groups.append(mpu.get_data_parallel_group())
    return groups


def _default_engine(engine_cfg, vocab_size: int):
    from areal_lce.megatron.engine import MegatronEngine

    return MegatronEngine(engine_cfg, vocab_size=vocab_size)


def run(cfg: JobConfig, engine_factory: Optional[Callable] = None) -> dict:
    """Run the SFT job; returns {'output_dir', 'step' (last step run), 'records' (this invocation's)}."""
    from areal_lce.megatron.parallel import destroy_distributed, init_distributed

    if cfg.job != "sft":
        raise ValueError(f"sft.run got job={cfg.job!r}")
    dist_info = init_distributed(cfg.engine.parallel, seed=cfg.engine.seed)
    try:
        return _train(cfg, dist_info, engine_factory or _default_engine)
    finally:
        destroy_distributed()


def _train(cfg: JobConfig, dist_info, engine_factory) -> dict:
    tr, is_main = cfg.trainer, dist_info.is_main
    dp_size, dp_rank = dist_info.dp_size, dist_info.dp_rank
    split_global_batch(tr.global_batch_size, tr.micro_batch_size, dp_size)
    tok = load_tokenizer(cfg.data.tokenizer)
    model_vocab = cfg.engine.model.vocab_size
    if model_vocab and model_vocab < tok.vocab_size:
        raise ValueError(f"engine.model.vocab_size={model_vocab} is smaller than the tokenizer's "
                         f"{tok.vocab_size} ids (data.tokenizer={cfg.data.tokenizer!r})")
    dataset = SFTDataset(cfg.data, tok, vocab_size=model_vocab or tok.vocab_size)  # ids checked against it
    pad_mult = cfg.data.pad_to_multiple_of
    if cfg.engine.parallel.sequence_parallel:  # the sequence is split over TP ranks
        pad_mult = math.lcm(pad_mult, dist_info.tp_size)

    out = Path(tr.output_dir)
    resume_from = ckpt.resolve_resume(tr.resume, out)
    if resume_from is None:
        ckpt.clear_run_dir(out, is_main)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_yaml(cfg))

    # engine.model.vocab_size, when set, keeps a larger model vocabulary than the tokenizer's.
    engine = engine_factory(cfg.engine, model_vocab or tok.vocab_size)
    random.seed(tr.seed)  # after the engine, whose set-up seeds torch with engine.seed
    torch.manual_seed(tr.seed)
    start = 0
    if resume_from is not None:
        resume_from, state = ckpt.load_resumable(engine, out, resume_from)  # falls back past a damaged one
        start = int(state["step"])
    metrics = MetricsLog(out / "metrics.jsonl", enabled=is_main, resume_step=start)
    if is_main:
        route = "fused linear op" if cfg.engine.use_fused_linear_ce else "materialised logits"
        resumed = f", resumed from {resume_from} (step {start})" if resume_from else ""
        print(f"[sft] {len(dataset)} examples, tokenizer {tok.name} ({tok.vocab_size} ids), world "
              f"{dist_info.world_size} = TP {dist_info.tp_size} x PP {dist_info.pp_size} x CP {dist_info.cp_size} x "
              f"DP {dp_size}, "
              f"LM-head route: {route}{resumed}", flush=True)
    bar = ProgressBar(tr.steps, initial=start, enabled=tr.progress, is_main=is_main, desc="sft")

    groups = _metric_groups(dist_info)
    records, step = [], start
    for step in range(start + 1, tr.steps + 1):
        data_step = step - 1  # global batches are numbered from 0
        mbs = dataset.microbatches(data_step, tr.global_batch_size, tr.micro_batch_size, dp_rank, dp_size, pad_mult)
        global_tokens = dataset.global_batch_targets(data_step, tr.global_batch_size)
        input_tokens = dataset.global_batch_input_tokens(data_step, tr.global_batch_size)
        loss_fn = SFTLoss(global_tokens / dp_size)
        t0 = time.perf_counter()
        result = engine.train_step(mbs, loss_fn)
        dt = time.perf_counter() - t0
        s = _reduce_metrics(loss_fn.sums(), groups)
        n = max(s["tokens"], 1)
        rec = {
            "step": step,
            "loss": s["nll"] / n,
            "entropy": s["entropy"] / n,
            "max_logit": s["max_logit"],
            "min_logit": s["min_logit"],
            "grad_norm": float(result.get("grad_norm", float("nan"))),
            "lr": float(result.get("lr", float("nan"))),
            "tokens": s["tokens"],  # loss (target) tokens of the global batch
            "input_tokens": input_tokens,  # non-padding input tokens of the global batch
            "tokens_per_s": input_tokens / dt if dt > 0 else 0.0,
            "step_time_s": dt,
            "peak_mem_gib": float(result.get("peak_mem_gib", float("nan"))),
        }
        records.append(rec)
        metrics.write(rec)
        bar.update({"loss": f"{rec['loss']:.4f}"})
        if is_main and (step % tr.log_interval == 0 or step == tr.steps):
            bar.write(format_record(rec))
        if ckpt.end_of_step(engine, tr, out, step, {"config": dump_yaml(cfg)}, is_main, bar.write, "sft"):
            break
    bar.close()
    if tr.sample_prompts and step == tr.steps:
        _print_samples(engine, dataset, tok, tr.sample_prompts, cfg.engine.model.max_seq_len, out, is_main)
    if is_main and tr.plot and step == tr.steps:
        png = plot_metrics(read_metrics(out / "metrics.jsonl"), out / "metrics.png", title=f"SFT {out.name}")
        if png:
            print(f"[sft] wrote {out / 'metrics.jsonl'} and {png}", flush=True)
    return {"output_dir": str(out), "step": step, "records": records}


def _print_samples(engine, dataset: SFTDataset, tok, n: int, max_seq_len: int, out: Path, is_main: bool) -> None:
    """Greedy completions of the first `n` prompts (every rank generates: TP ranks share the work)."""
    examples = dataset.examples[:n]
    prompts = [list(e.ids[:e.loss_start]) for e in examples]
    longest = max(e.n_targets for e in examples)
    new = engine.generate(prompts, max_new_tokens=min(longest + 2, max_seq_len), temperature=0.0, eos_id=tok.eos_id)
    if not is_main:
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
