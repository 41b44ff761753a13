"""The model's own vocabulary end to end: an HF checkpoint with more embedding rows than the tokenizer has
ids trains, resumes and exports with all of its rows (the true vocabulary is the checkpoint config's
vocab_size, as vLLM and SGLang take it; the tokenizer's size plays no part).

Oracles: at lr=0 the SFT job changes no weight, so its checkpoint exported by `python -m areal_lce.export`
is bitwise the source checkpoint (the export only moves tensors) with the same config vocab_size; the job's
export's config.json says which vocabulary the run trained with.
"""
from __future__ import annotations

import json

import pytest

from helpers.paths import REPO
from areal_lce.engine.state import CheckpointMismatch
from areal_lce.export.__main__ import main as export_main
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import sft
from areal_lce.train.config import load_config
from export_worker import make_checkpoint
from test_export import assert_same_tensors, safetensors_of

ROWS = 520  # the checkpoint's rows (megatron pads them to 640); the builtin tokenizer has 259 ids


def _sft(src, out, *overrides):
    """One SFT step at lr=0 on checkpoint `src` with the builtin 259-id tokenizer, saved at step 1
    (engine.model.vocab_size: 0, the default, unless an override sets it)."""
    return sft.run(load_config(REPO / "configs" / "sft_tiny.yaml", [
        f"engine.model.hf_checkpoint_dir={src}", "engine.model.vocab_size=0", "engine.model.max_seq_len=64",
        "data.max_seq_len=64", f"trainer.output_dir={out}", "trainer.steps=1", "trainer.save_interval=1",
        "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "trainer.progress=false",
        "trainer.sample_prompts=0", "engine.optim.warmup_steps=0", "engine.optim.lr=0", "engine.optim.min_lr=0",
        "engine.lce.backend=torch", *overrides]))


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sft_then_export_keeps_every_row_of_the_checkpoint(tmp_path, family, tied):
    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "hf"
    make_checkpoint(src, family, tied, vocab=ROWS)
    _sft(src, run)
    assert export_main([str(ckpt.latest_checkpoint(run)), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == ROWS
    assert_same_tensors(safetensors_of(out), safetensors_of(src))  # every row, bitwise


def test_a_run_saved_with_the_tokenizers_vocabulary_resumes_only_when_told(tmp_path):
    # a run trained over the tokenizer's 259 ids of the 520-row checkpoint: resuming it with
    # engine.model.vocab_size: 0 (the checkpoint's 520) is refused naming the option and the value to set;
    # setting it resumes; its export keeps the vocabulary it was trained with (state.pt's)
    src, run = tmp_path / "src", tmp_path / "run"
    make_checkpoint(src, "qwen2", True, vocab=ROWS)
    _sft(src, run, "engine.model.vocab_size=259")
    resume = ("trainer.steps=2", "trainer.resume=auto")
    with pytest.raises(CheckpointMismatch, match=r"vocabulary of 259 tokens, this model has 520 .*"
                                                 r"set engine.model.vocab_size=259"):
        _sft(src, run, *resume)
    assert _sft(src, run, *resume, "engine.model.vocab_size=259")["step"] == 2
    assert export_main([str(ckpt.latest_checkpoint(run)), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 259


def test_grpo_samples_and_decodes_the_ids_the_tokenizer_lacks(tmp_path, monkeypatch):
    from areal_lce.train import rl
    from areal_lce.train.tokenizer import ByteTokenizer

    # a GRPO step on the 520-row checkpoint: the rollouts draw from all 520 rows (about half of a random
    # model's mass lies past the tokenizer's 259 ids), the rewards read their text (those ids decode to "")
    src = tmp_path / "src"
    make_checkpoint(src, "qwen2", True, vocab=ROWS)
    seen = []
    real = ByteTokenizer.decode
    monkeypatch.setattr(ByteTokenizer, "decode", lambda self, ids, **kw: seen.extend(ids) or real(self, ids, **kw))
    res = rl.run(load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"engine.model.hf_checkpoint_dir={src}", "engine.model.vocab_size=0", "engine.lce.backend=torch",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=1", "trainer.save_interval=0",
        "trainer.progress=false", "trainer.plot=false", "trainer.save_final=false", "trainer.micro_batch_size=8",
        "rl.prompts_per_step=2", "rl.group_size=4",
        "rl.max_new_tokens=4", "rl.minibatches=1"]))
    assert res["step"] == 1
    assert max(seen) < ROWS and sum(i >= 259 for i in seen) > len(seen) // 4, seen
