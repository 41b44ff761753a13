"""Write a live MegatronEngine as a Hugging Face checkpoint directory.

    export_hf(engine, "out/hf", tokenizer=tok)     # collective: every rank of the engine calls it
    engine.export_hf("out/hf", tokenizer=tok)      # the same

What is written (by global rank 0; the other ranks take part in the gathers, weights.py):
  config.json                    the transformers config of the architecture (Qwen2, Llama, Qwen3), with
                                 the engine's true vocabulary (megatron's padding rows cut), the
                                 parameters' dtype and the tokenizer's bos/eos/pad ids
  generation_config.json         those ids again, for `generate`
  model.safetensors              the weights, or model-0000k-of-0000N.safetensors shards of at most
  (+ model.safetensors.index.json)  `max_shard_bytes` each and their index when they do not fit one file
  tokenizer files                `tokenizer.save_pretrained(dir)` of the tokenizer passed (the train jobs'
                                 tokenizers: the built-in byte tokenizer writes a tokenizer.json that
                                 reproduces its ids, a Hugging Face one its own files); none without one
Everything is written into a temporary directory beside OUT_DIR, fsynced, and renamed to OUT_DIR last: an
export that fails leaves no OUT_DIR behind. OUT_DIR must not exist, or be an empty directory.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from .. import durable
from ..engine.parallel import all_ranks_true
from .weights import check_mappable, hf_tensors

ARCHITECTURES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_SHARD_BYTES = 2 * 2**30


def token_ids(tokenizer) -> dict:
    """bos/eos/pad_token_id of a train job's tokenizer (None each without one)."""
    return {key: getattr(tokenizer, attr, None) for key, attr in
            (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"), ("pad_token_id", "pad_id"))}


def hf_config(arch, vocab_size: int, dtype: torch.dtype, tokenizer=None):
    """The transformers config (Qwen2Config, LlamaConfig or Qwen3Config) of `arch` with `vocab_size` ids."""
    import transformers

    if arch.family not in ARCHITECTURES:
        raise ValueError(f"HF export: architecture family {arch.family!r} has no Hugging Face mapping here "
                         f"({', '.join(ARCHITECTURES)})")
    config_cls, model_cls = ARCHITECTURES[arch.family]
    kw = dict(vocab_size=vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
              num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
              num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim, hidden_act="silu",
              rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
              max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=arch.tie_word_embeddings,
              architectures=[model_cls], dtype=DTYPE_NAMES[dtype], **token_ids(tokenizer))
    if arch.family != "qwen2":
        kw.update(attention_bias=False, **({"mlp_bias": False} if arch.family == "llama" else {}))
    return getattr(transformers, config_cls)(**kw)


def _check_tokenizer(tokenizer, vocab_size: int) -> None:
    if tokenizer is None:
        return
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"HF export: tokenizer {type(tokenizer).__name__} has no save_pretrained(directory) "
                        "(pass an areal_lce.train.tokenizer tokenizer, or None to write no tokenizer files)")
    n = getattr(tokenizer, "vocab_size", None)
    if n is not None and n > vocab_size:
        raise ValueError(f"HF export: the tokenizer has {n} ids but the model's vocabulary is {vocab_size}")


def _check_out_dir(out: Path) -> str:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return (f"HF export: {out} already exists and is not an empty directory; give a new directory (an "
                "export never overwrites files)")
    return ""


class _ShardWriter:
    """Rank 0's side: tensors in arrival order, cut into shard files of at most `limit` bytes (a tensor
    larger than that gets a file of its own)."""

    def __init__(self, directory: Path, limit: int):
        self.dir, self.limit = directory, limit
        self.pending: dict = {}
        self.pending_bytes = 0
        self.files: list = []  # [(temporary file name, [tensor names])]
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        part = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.dir / part), metadata={"format": "pt"})
        durable.chmod_default(self.dir / part)  # save_file writes 0o600; the other files get open()'s mode
        self.files.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list:
        """Give the parts their Hugging Face names and write the index; returns the file names."""
        self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for (part, _), name in zip(self.files, names):
            os.replace(self.dir / part, self.dir / name)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {t: name for (_, tensors), name in zip(self.files, names) for t in tensors}}
            (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
            names.append("model.safetensors.index.json")
        return names


def _seal(tmp: Path, out: Path) -> None:
    """fsync every file of `tmp`, then rename it to `out` (an empty `out` is replaced)."""
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    durable.fsync_dir(tmp)
    if out.is_dir():
        out.rmdir()  # empty: checked before the export began
    os.replace(tmp, out)
    durable.fsync_dir(out.parent)


def export_hf(engine, out_dir, tokenizer=None, *, dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Collective over the engine's ranks: write the engine's model as a Hugging Face checkpoint in `out_dir`
    (module docstring), from any tensor/pipeline/context/data-parallel layout. `dtype`: the tensors' dtype
    (default: the parameters'). Returns the directory. What cannot be exported raises ValueError on every
    rank before anything is written; a failed write raises RuntimeError on every rank and leaves no OUT_DIR."""
    out = Path(out_dir).absolute()
    main = engine.dist.rank == 0
    dtype = dtype or next(engine.gpt.parameters()).dtype
    error = ""
    try:
        check_mappable(engine)  # every rank: its own stage's parameters
        if main:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"HF export: dtype {dtype} is not one of {list(DTYPE_NAMES.values())}")
            if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
                raise ValueError(f"HF export: max_shard_bytes={max_shard_bytes!r} must be an int > 0")
            _check_tokenizer(tokenizer, engine.vocab_size)
            error = _check_out_dir(out)
    except (TypeError, ValueError) as e:
        error = str(e)
    if not all_ranks_true(not error):
        raise ValueError(error or "HF export: another rank refused the export (its error names the reason)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if main:
            error = _write(engine, tmp, out, tokenizer, dtype, max_shard_bytes)
        else:
            for _ in hf_tensors(engine, dtype):  # the other ranks' side of the gathers
                pass
    finally:
        if main and tmp.exists():  # left only by a failure
            shutil.rmtree(tmp, ignore_errors=True)
    if not all_ranks_true(not error):
        raise RuntimeError(error or f"HF export into {out} failed on rank 0 (its error names the reason)")
    return out


def _write(engine, tmp: Path, out: Path, tokenizer, dtype: torch.dtype, max_shard_bytes: int) -> str:
    """Rank 0: gather and write everything into `tmp`, then rename it to `out`; returns an error message
    ('' when done). Rank 0 takes part in every gather even after a failed write (the others wait in them)."""
    error = ""
    try:
        tmp.mkdir(parents=True)
        writer = _ShardWriter(tmp, max_shard_bytes)
    except OSError as e:
        error, writer = f"HF export: cannot create {tmp}: {e}", None
    for name, t in hf_tensors(engine, dtype):
        if not error:
            try:
                writer.add(name, t)
            except Exception as e:  # noqa: BLE001 -- reported on every rank by the caller
                error = f"HF export: writing {name} into {tmp}: {type(e).__name__}: {e}"
    if error:
        return error
    try:
        writer.finish()
        hf_config(engine.arch, engine.vocab_size, dtype, tokenizer).to_json_file(str(tmp / "config.json"))
        (tmp / "generation_config.json").write_text(json.dumps(token_ids(tokenizer), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _seal(tmp, out)
    except Exception as e:  # noqa: BLE001 -- reported on every rank by the caller
        return f"HF export into {out}: {type(e).__name__}: {e}"
    return ""
