"""SFT data: JSONL examples -> token ids with a loss start, a stateless sampler, right-padded batches.

Label convention (the engine's): labels are next-token targets aligned with input positions,
``labels[t] = ids[t + 1]``, and -100 where position t must not be trained on: when ids[t + 1] is a
prompt token (format prompt_response), on padding, and on the last position of every row.

Order: the examples of global batch `step` are a pure function of (shuffle_seed, step): sample g of
the run is position g mod n of epoch g div n's permutation. A resumed run therefore needs nothing
but the step number to see the same batches, on any data-parallel layout.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..engine.microbatch import MicroBatch
from .config import DataConfig, split_global_batch

IGNORE_INDEX = -100
BUILTIN_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Example:
    ids: tuple  # token ids, BOS/EOS included
    loss_start: int  # first index of `ids` that is a training target (>= 1)

    @property
    def n_targets(self) -> int:
        return max(len(self.ids) - self.loss_start, 0)


def resolve_data_path(path: str) -> Path:
    if path.startswith("builtin:"):
        name = path[len("builtin:"):]
        p = BUILTIN_DIR / name
        if not p.is_file():
            shipped = sorted(x.name for x in BUILTIN_DIR.glob("*.jsonl"))
            raise FileNotFoundError(f"data.path={path!r}: no shipped file {name!r} (shipped: {shipped})")
        return p
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r}: file not found")
    return p


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
            rows.append(row)
    return rows


def _field(row: dict, key: str, option: str, where: str) -> str:
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r} (set {option} to the right key)")
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: key {key!r} must hold a string, got {type(value).__name__}")
    return value


def tokenize_example(row: dict, cfg: DataConfig, tok, where: str = "example") -> Example:
    """One JSON row -> Example, truncated to cfg.max_seq_len tokens."""
    bos = [tok.bos_id] if cfg.add_bos and tok.bos_id is not None else []
    eos = [tok.eos_id] if cfg.add_eos and tok.eos_id is not None else []
    if cfg.format == "prompt_response":
        prompt = bos + tok.encode(_field(row, cfg.prompt_key, "data.prompt_key", where))
        response = tok.encode(_field(row, cfg.response_key, "data.response_key", where)) + eos
        ids, loss_start = prompt + response, max(len(prompt), 1)
    else:
        ids, loss_start = bos + tok.encode(_field(row, cfg.text_key, "data.text_key", where)) + eos, 1
    return Example(ids=tuple(ids[: cfg.max_seq_len]), loss_start=loss_start)


def check_token_ids(ids, vocab_size: int, where: str, option: str = "data.tokenizer") -> None:
    """Raise naming `where`, the token id and the vocabulary when an id is outside [0, vocab_size): the
    model's embedding would otherwise fail later with an opaque index error."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise ValueError(f"{where}: token id {bad} is outside the model's vocabulary of {vocab_size} ids "
                         f"({option} produces ids the model cannot embed; set engine.model.vocab_size to "
                         "cover them or use the model's own tokenizer)")


def check_special_ids(tok, vocab_size: int) -> None:
    """The tokenizer's pad/bos/eos ids, which the jobs feed to the model, must be in the vocabulary."""
    for name in ("pad_id", "bos_id", "eos_id"):
        i = getattr(tok, name, None)
        if i is not None:
            check_token_ids([i], vocab_size, f"tokenizer {tok.name!r} {name}")


def make_labels(ids, loss_start: int) -> list[int]:
    """labels[t] = ids[t+1] when t+1 >= loss_start, else -100; the last position is -100."""
    n = len(ids)
    return [ids[t + 1] if t + 1 >= loss_start else IGNORE_INDEX for t in range(n - 1)] + [IGNORE_INDEX] * min(n, 1)


def collate(examples, pad_id: int, pad_to_multiple_of: int = 1) -> MicroBatch:
    """Right-pad a list of Examples to one length -> MicroBatch of LongTensors [B, S]."""
    if not examples:
        raise ValueError("collate: empty list of examples")
    longest = max(len(e.ids) for e in examples)
    m = max(int(pad_to_multiple_of), 1)
    seq = -(-longest // m) * m
    input_ids = torch.full((len(examples), seq), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), seq), IGNORE_INDEX, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.ids)
        input_ids[b, :n] = torch.tensor(e.ids, dtype=torch.long)
        labels[b, :n] = torch.tensor(make_labels(e.ids, e.loss_start), dtype=torch.long)
    return MicroBatch(input_ids, labels)


class SFTDataset:
    """Tokenized examples of one JSONL file plus the run's deterministic global-batch order."""

    def __init__(self, cfg: DataConfig, tok, examples: Optional[list] = None, vocab_size: Optional[int] = None):
        """`vocab_size`: the model's vocabulary; every token id (and the pad id) must be below it."""
        self.cfg, self.tok = cfg, tok
        if examples is None:
            path = resolve_data_path(cfg.path)
            rows = read_jsonl(path)
            examples = [tokenize_example(r, cfg, tok, f"{path}:{i + 1}") for i, r in enumerate(rows)]
            if vocab_size is not None:
                for i, e in enumerate(examples):
                    check_token_ids(e.ids, vocab_size, f"data.path={cfg.path!r} ({path}:{i + 1})")
        if vocab_size is not None:
            check_special_ids(tok, vocab_size)
        kept = [e for e in examples if e.n_targets > 0]
        if len(kept) < len(examples):
            warnings.warn(f"{len(examples) - len(kept)} examples have no training target after truncation "
                          f"to data.max_seq_len={cfg.max_seq_len}; they are skipped")
        if not kept:
            raise ValueError(f"data.path={cfg.path!r}: no example with a training target")
        self.examples = kept
        self._perms: dict = {}

    def __len__(self) -> int:
        return len(self.examples)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            n = len(self.examples)
            if self.cfg.shuffle:
                g = torch.Generator().manual_seed(self.cfg.shuffle_seed * 1_000_003 + epoch)
                self._perms[epoch] = torch.randperm(n, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(n))
        return self._perms[epoch]

    def global_batch_indices(self, step: int, global_batch_size: int) -> list[int]:
        """Example indices of global batch `step` (0-based)."""
        n = len(self.examples)
        out = []
        for g in range(step * global_batch_size, (step + 1) * global_batch_size):
            out.append(self._perm(g // n)[g % n])
        return out

    def global_batch_targets(self, step: int, global_batch_size: int) -> int:
        """Training-target tokens in global batch `step` (the SFT loss's normaliser)."""
        return sum(self.examples[i].n_targets for i in self.global_batch_indices(step, global_batch_size))

    def global_batch_input_tokens(self, step: int, global_batch_size: int) -> int:
        """Non-padding input tokens in global batch `step` (the throughput count)."""
        return sum(len(self.examples[i].ids) for i in self.global_batch_indices(step, global_batch_size))

    def microbatches(self, step: int, global_batch_size: int, micro_batch_size: int,
                     dp_rank: int = 0, dp_size: int = 1, pad_to_multiple_of: Optional[int] = None) -> list[MicroBatch]:
        """This data-parallel rank's slice of global batch `step`, split into right-padded micro-batches."""
        per_rank = split_global_batch(global_batch_size, micro_batch_size, dp_size)
        idx = self.global_batch_indices(step, global_batch_size)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        mult = self.cfg.pad_to_multiple_of if pad_to_multiple_of is None else pad_to_multiple_of
        return [
            collate([self.examples[i] for i in idx[k:k + micro_batch_size]], self.tok.pad_id, mult)
            for k in range(0, per_rank, micro_batch_size)
        ]
