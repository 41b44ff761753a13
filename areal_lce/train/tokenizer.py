"""Tokenizers of the train jobs: a local Hugging Face tokenizer directory, or a built-in byte tokenizer.

Both expose the same small surface the jobs use: `encode(text) -> list[int]` (no special tokens),
`decode(ids)`, `vocab_size` (true vocabulary, before any Megatron padding), `pad_id`, `bos_id`,
`eos_id`, `name`. The built-in one needs no file and no download: ids 0..255 are the UTF-8 bytes,
256 = <pad>, 257 = <bos>, 258 = <eos>, so any text round-trips and the vocabulary is 259.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional


class ByteTokenizer:
    """Deterministic byte-level tokenizer: one id per UTF-8 byte plus three special ids."""

    PAD, BOS, EOS = 256, 257, 258
    name = "builtin"

    def __init__(self):
        self.vocab_size = 259
        self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS
        self.hf = None  # no Hugging Face object behind it

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out.extend({self.PAD: b"<pad>", self.BOS: b"<bos>", self.EOS: b"<eos>"}.get(i, b"<unk>"))
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """Thin adapter over `transformers.AutoTokenizer` loaded from a local directory (no download)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(f"data.tokenizer={path!r} is not a directory (give a local Hugging Face "
                                    "tokenizer directory, or 'builtin')")
        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = str(path)
        self.vocab_size = len(self.hf)  # includes added special tokens
        self.eos_id: Optional[int] = self.hf.eos_token_id
        self.bos_id: Optional[int] = self.hf.bos_token_id
        pad = self.hf.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(spec: str):
    """'builtin' -> ByteTokenizer; anything else is a local Hugging Face tokenizer directory."""
    if spec == "builtin":
        return ByteTokenizer()
    return HFTokenizer(spec)
