"""Export a train job's checkpoint as a Hugging Face model directory.

    python -m areal_lce.export RUN_DIR/checkpoints/step_N OUT_DIR [--dtype fp32|bf16] [--max-shard-gib G]

Builds the run's engine from the job config saved with the checkpoint (trainer_state.json, read once the
checkpoint matches its manifest) at tensor_parallel = pipeline_parallel = context_parallel = 1 (frozen: no
optimizer), loads the step's model weights (saved at any layout), and writes config.json, the safetensors
shards and the tokenizer files of the run's data.tokenizer into OUT_DIR (areal_lce.export.hf).
Exit status: 0 written; 2 a usage or config error; 1 any other error, printed as one line `error: ...`
(--debug: the traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def job_config(step_dir: Path):
    """The job config saved with checkpoint `step_dir`, its layout set to one rank of each parallel kind."""
    from ..train import checkpoint as ckpt
    from ..train.config import ConfigError, JobConfig, from_dict
    from ..train.yaml_strict import yaml_load

    if not step_dir.is_dir():
        what = "is not a directory" if step_dir.exists() else "does not exist"
        raise ConfigError(f"{step_dir} {what}: give a checkpoint directory, RUN_DIR/checkpoints/step_N")
    if not (step_dir / ckpt.MARKER).is_file():
        found = ckpt.list_checkpoints(step_dir)
        hint = f" (its newest complete checkpoint: {found[-1][1]})" if found else ""
        raise ConfigError(f"{step_dir} is not a complete checkpoint directory (no {ckpt.MARKER} marker): give "
                          f"RUN_DIR/checkpoints/step_N{hint}")
    text = ckpt.read_state(step_dir).get("config")
    if not isinstance(text, str):
        raise ConfigError(f"{step_dir / ckpt.STATE_FILE} holds no job config")
    data = yaml_load(text)
    parallel = data.setdefault("engine", {}).setdefault("parallel", {})
    parallel.update(tensor_parallel=1, pipeline_parallel=1, context_parallel=1, sequence_parallel=False)
    return from_dict(JobConfig, data)


def load_weights(engine, step_dir: Path) -> None:
    """The model weights of checkpoint `step_dir` into `engine`, whatever layout saved them (its optimizer
    state, counters and RNG states are not read)."""
    from ..train.checkpoint import load_model_weights

    load_model_weights(engine, step_dir)


def export_checkpoint(step_dir, out_dir, *, dtype: Optional[str] = None, max_shard_bytes: Optional[int] = None) -> Path:
    """Build the engine of checkpoint `step_dir` (job_config), load its weights and export it into `out_dir`
    with the run's tokenizer; returns `out_dir`."""
    import torch

    from ..engine.engine import MegatronEngine
    from ..engine.state import saved_vocab_size
    from ..train.job import model_vocab_size
    from ..train.tokenizer import load_tokenizer
    from .hf import DEFAULT_SHARD_BYTES, export_hf

    step_dir = Path(step_dir)
    cfg = job_config(step_dir)
    tok = load_tokenizer(cfg.data.tokenizer)
    engine_cfg = dataclasses.replace(cfg.engine, model_cuda_graphs=False)
    # the vocabulary the checkpoint was trained with (state.pt), else the job's; engine.model.vocab_size wins
    vocab = saved_vocab_size(str(step_dir / "engine")) or model_vocab_size(cfg, tok)
    engine = MegatronEngine(engine_cfg, vocab_size=vocab, trainable=False)
    load_weights(engine, step_dir)
    torch_dtype = getattr(torch, DTYPES[dtype]) if dtype else None
    return export_hf(engine, out_dir, tokenizer=tok, dtype=torch_dtype,
                     max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m areal_lce.export", description=__doc__.split("\n\n")[0])
    p.add_argument("step_dir", help="a complete checkpoint: RUN_DIR/checkpoints/step_N")
    p.add_argument("out_dir", help="the Hugging Face model directory to write (must not exist, or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="the tensors' dtype (default: the engine's parameters')")
    p.add_argument("--max-shard-gib", type=float, default=2.0, help="largest safetensors file (GiB)")
    p.add_argument("--debug", action="store_true", help="raise errors with their traceback")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..train.__main__ import error_line, limit_cpu_threads, quiet_known_warnings
    from ..train.config import ConfigError

    args = _parser().parse_args(argv)
    if not args.max_shard_gib > 0:
        print("config error: --max-shard-gib must be > 0", file=sys.stderr)
        return 2
    quiet_known_warnings()
    limit_cpu_threads()
    try:
        out = export_checkpoint(args.step_dir, args.out_dir, dtype=args.dtype,
                                max_shard_bytes=int(args.max_shard_gib * 2**30))
    except Exception as e:
        if args.debug or os.environ.get("AREAL_LCE_DEBUG", "") not in ("", "0"):
            raise
        print(error_line(e), file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        from ..engine.parallel import destroy_distributed

        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
