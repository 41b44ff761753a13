"""Tokenizers of the train jobs: a local Hugging Face tokenizer directory, or a built-in byte tokenizer.

Both expose the same small surface the jobs use: `encode(text) -> list[int]` (no special tokens),
`decode(ids)`, `vocab_size` (true vocabulary, before any Megatron padding), `pad_id`, `bos_id`,
`eos_id`, `name`, and `save_pretrained(directory)`, which writes Hugging Face tokenizer files
(areal_lce.export puts them beside an exported model). The built-in one needs no file and no download:
ids 0..255 are the UTF-8 bytes, 256 = <pad>, 257 = <bos>, 258 = <eos>, so any text round-trips and the
vocabulary is 259.

The model's vocabulary may be larger than the tokenizer's (Qwen2.5: 151936 rows, 151665 tokenizer ids; the
engine samples over all of the model's rows, as vLLM and SGLang do). `decode` turns an id the tokenizer does
not have (>= its `vocab_size`) into nothing, as vLLM's detokenizer does (an out-of-range id decodes to "").

The built-in tokenizer's files: a `tokenizer.json` (tokenizers library) whose byte-level pre-tokenizer
maps every byte to one character of GPT-2's byte alphabet, a BPE model without merges whose vocabulary
gives that character the byte's id, and the three special tokens as added tokens 256..258; plus a
`tokenizer_config.json` with `split_special_tokens: true` (a text "<eos>" is five bytes, as here) and
`clean_up_tokenization_spaces: false`. `PreTrainedTokenizerFast.from_pretrained(dir)` then encodes any
text (`add_special_tokens=False`: nothing is prepended, prepend `bos_token_id` as the jobs' data.add_bos
does) and decodes any ids as `ByteTokenizer` does; invalid UTF-8 becomes U+FFFD in both. So does
`AutoTokenizer`, except beside a qwen2 config.json under transformers 5, which then builds its
Qwen2Tokenizer pipeline from these files: the same ids for text in Unicode NFC form (it normalises to
NFC first: a decomposed "e\u0301" becomes the bytes of "\u00e9").
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 256, 257, 258 of the built-in tokenizer


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte (index = byte value), the alphabet of the tokenizers
    library's ByteLevel pre-tokenizer and decoder: printable Latin-1 bytes stand for themselves, the
    others for the code points from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


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
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special_tokens:  # ids past the tokenizer's (a larger model vocabulary): nothing
                out.extend({self.PAD: b"<pad>", self.BOS: b"<bos>", self.EOS: b"<eos>"}.get(i, b""))
        return out.decode("utf-8", errors="replace")

    def save_pretrained(self, directory) -> list[str]:
        """Write tokenizer.json and tokenizer_config.json (see the module docstring) into `directory`;
        returns the file names."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        alphabet = byte_alphabet()
        tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != [self.PAD, self.BOS, self.EOS]:  # the tokenizers library numbers added tokens in order
            raise RuntimeError(f"built-in tokenizer export: special tokens got ids {ids}, expected 256..258")
        tok.save(os.path.join(directory, "tokenizer.json"))
        # unk_token null: a class that transformers picks by the model's type (Qwen2Tokenizer for a qwen2
        # export) would otherwise add its own unknown token, an id past the model's vocabulary
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<bos>",
                  "eos_token": "<eos>", "unk_token": None, "split_special_tokens": True,
                  "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        return ["tokenizer.json", "tokenizer_config.json"]


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
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]  # ids past the tokenizer's: nothing
        return self.hf.decode(known, skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, directory) -> list[str]:
        """The tokenizer's own files (transformers' save_pretrained) in `directory`; returns their names."""
        return [os.path.basename(p) for p in self.hf.save_pretrained(str(directory))]


def load_tokenizer(spec: str):
    """'builtin' -> ByteTokenizer; anything else is a local Hugging Face tokenizer directory."""
    if spec == "builtin":
        return ByteTokenizer()
    return HFTokenizer(spec)
