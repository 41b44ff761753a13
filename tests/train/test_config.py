"""Job config (YAML + typed dotted overrides + checks) and the SFT data pipeline (labels, masking, padding)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers.paths import REPO
from areal_lce.train.__main__ import DEFAULT_CONFIG
from areal_lce.train.__main__ import main as train_main
from areal_lce.train.__main__ import parse_args
from areal_lce.train.config import (ConfigError, DataConfig, JobConfig, dump_yaml, format_help, iter_fields,
                                    load_config, load_yaml)
from areal_lce.train.data import IGNORE_INDEX, Example, SFTDataset, collate, make_labels, tokenize_example
from areal_lce.train.tokenizer import ByteTokenizer

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


# ---------------------------------------------------------------- loading and overrides

@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = load_config(path)
    assert cfg.job == path.name.split("_")[0]  # sft_*.yaml, grpo_*.yaml, ppo_*.yaml
    # dump -> load gives the same config (every field is YAML-representable and settable)
    assert load_config(_write(tmp_path, dump_yaml(cfg))) == cfg


def test_yaml_sets_nested_fields(tmp_path):
    p = _write(tmp_path, """
job: sft
engine:
  use_fused_linear_ce: false
  parallel: {tensor_parallel: 2}
  optim: {lr: 1.0e-3, betas: [0.8, 0.99]}
trainer: {steps: 7, resume: auto}
""")
    cfg = load_config(p)
    assert cfg.engine.use_fused_linear_ce is False
    assert cfg.engine.parallel.tensor_parallel == 2
    assert cfg.engine.optim.betas == (0.8, 0.99)
    assert cfg.trainer.steps == 7 and cfg.trainer.resume == "auto"
    assert cfg.engine.optim.total_steps == 7  # the SFT lr schedule spans trainer.steps


def test_overrides_are_typed_by_the_field(tmp_path):
    p = _write(tmp_path, "trainer: {steps: 5}\n")
    cfg = load_config(p, [
        "trainer.steps=12",                       # int
        "engine.optim.lr=2e-4",                   # float
        "engine.use_fused_linear_ce=false",       # bool
        "data.tokenizer=builtin",                 # str
        "engine.optim.betas=0.85,0.9",            # tuple of floats, comma form
        "trainer.resume=true",                    # bool | str -> bool
        "engine.model.tie_word_embeddings=null",  # Optional[bool] -> None
        "trainer.output_dir=/tmp/x=y",            # value may contain '='
    ])
    assert cfg.trainer.steps == 12 and isinstance(cfg.trainer.steps, int)
    assert cfg.engine.optim.lr == pytest.approx(2e-4) and isinstance(cfg.engine.optim.lr, float)
    assert cfg.engine.use_fused_linear_ce is False
    assert cfg.engine.optim.betas == (0.85, 0.9)
    assert cfg.trainer.resume is True
    assert cfg.engine.model.tie_word_embeddings is None
    assert cfg.trainer.output_dir == "/tmp/x=y"
    assert load_config(None, ["trainer.resume=auto"]).trainer.resume == "auto"
    assert load_config(None, ["engine.optim.betas=[0.5, 0.6]"]).engine.optim.betas == (0.5, 0.6)


@pytest.mark.parametrize("override, named", [
    ("trainer.stepz=3", "trainer.stepz"),                          # typo in a leaf
    ("engine.paralel.tensor_parallel=2", "engine.paralel"),        # typo in a section
    ("nothing=1", "nothing"),                                      # unknown top-level key
    ("trainer.steps=three", "trainer.steps"),                      # wrong type
    ("engine.use_fused_linear_ce=maybe", "engine.use_fused_linear_ce"),
    ("engine.parallel=2", "engine.parallel"),                      # a section is not a value
    ("trainer.steps", "trainer.steps"),                            # no '='
])
def test_bad_override_is_rejected_naming_the_option(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("yaml_text, named", [
    ("trainer: {stepz: 3}\n", "trainer.stepz"),
    ("engine: {parallel: {tensor_paralel: 2}}\n", "engine.parallel.tensor_paralel"),
    ("extra_section: {a: 1}\n", "extra_section"),
    ("trainer: {steps: 2.5}\n", "trainer.steps"),                 # float where an int is expected
    ("engine: {use_fused_linear_ce: 1}\n", "engine.use_fused_linear_ce"),  # int is not a bool
    ("trainer: 3\n", "trainer"),                                   # a section must be a mapping
])
def test_bad_yaml_is_rejected_naming_the_option(tmp_path, yaml_text, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(_write(tmp_path, yaml_text))


@pytest.mark.parametrize("overrides, named", [
    (["job=dpo"], "job"),
    (["trainer.global_batch_size=6", "trainer.micro_batch_size=4"], "trainer.global_batch_size"),
    (["trainer.resume=later"], "trainer.resume"),
    (["data.format=chat"], "data.format"),
    (["data.max_seq_len=1024", "engine.model.max_seq_len=512"], "data.max_seq_len"),
    (["engine.parallel.sequence_parallel=true"], "sequence_parallel"),   # needs tensor_parallel > 1
    (["engine.parallel.context_parallel=2", "engine.parallel.pipeline_parallel=2"], "context_parallel"),
    (["trainer.steps=10", "trainer.stop_at=10"], "trainer.stop_at"),
    (["trainer.steps=4", "engine.optim.lr_schedule=cosine", "engine.optim.warmup_steps=4"], "warmup_steps"),
    (["job=grpo", "rl.group_size=1"], "rl.group_size"),  # rl.advantage=auto is the group estimator for grpo
    (["rl.prompts_per_step=3", "rl.group_size=2", "rl.minibatches=4"], "rl.minibatches"),
])
def test_cross_field_checks_name_the_option(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, overrides)


# ---------------------------------------------------------------- engine.lce: the LM head's options

def test_lce_group_from_yaml_and_overrides(tmp_path):
    p = _write(tmp_path, """
engine:
  lce:
    backend: torch
    cache_bytes: auto
    compact_ignored: false
    invariant: true
    logits_precision: bf16
""")
    lce = load_config(p).engine.lce
    assert (lce.backend, lce.cache_bytes, lce.compact_ignored, lce.invariant, lce.logits_precision) == (
        "torch", "auto", False, True, "bf16")
    lce = load_config(p, ["engine.lce.invariant=false", "engine.lce.logits_precision=fp32",
                          "engine.lce.cache_bytes=4096"]).engine.lce
    assert (lce.invariant, lce.logits_precision, lce.cache_bytes) == (False, "fp32", 4096)
    assert load_config(p, ["engine.lce.invariant=null"]).engine.lce.invariant is None
    default = JobConfig().engine.lce
    assert (default.invariant, default.logits_precision) == (None, "fp32")  # None: the backend's default


@pytest.mark.parametrize("override, named", [
    ("engine.lce.logits_precision=fp16", "engine.lce.logits_precision"),
    ("engine.lce.invariant=sometimes", "engine.lce.invariant"),
    ("engine.lce.backend=torhc", "engine.lce.backend"),
    ("engine.lce.cache_bytes=-1", "engine.lce.cache_bytes"),
    ("engine.lce.compact_ignored=maybe", "engine.lce.compact_ignored"),
    ("engine.lce.invarient=true", "engine.lce.invarient"),
])
def test_bad_lce_option_is_named(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_shipped_configs_use_the_current_spellings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for path in CONFIGS:
            load_config(path)


def test_batch_splits_over_data_parallel_ranks():
    from areal_lce.train.config import split_global_batch
    from areal_lce.train.rl_config import RLConfig

    assert split_global_batch(8, 2, dp_size=2) == 4
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=4 x data-parallel size 2"):
        split_global_batch(12, 4, dp_size=2)  # 6 examples per rank: not whole micro-batches of 4
    # rl: 8 prompts x 4 responses on 2 ranks = 16 sequences per rank, 2 minibatches of 8, micro-batches of 4
    rl = RLConfig(prompts_per_step=8, group_size=4, minibatches=2)
    assert rl.rank_split(2, micro_batch_size=4) == (4, 4)
    assert rl.rank_split(2, micro_batch_size=32) == (4, 8)  # capped at the minibatch
    assert rl.rank_split(2) == (4, 8)
    with pytest.raises(ValueError, match="trainer.micro_batch_size=3"):
        rl.rank_split(2, micro_batch_size=3)
    with pytest.raises(ValueError, match="rl.prompts_per_step=8 must be a multiple of the data-parallel size 3"):
        rl.rank_split(3)
    with pytest.raises(ValueError, match="rl.minibatches=4 must divide the 2 sequences"):
        RLConfig(prompts_per_step=8, group_size=2, minibatches=4).rank_split(8)  # fine on one rank
    assert rl.advantage_for("grpo") == "group" and rl.advantage_for("ppo") == "batch"


def test_every_option_has_help_and_help_lists_it():
    fields = list(iter_fields(JobConfig))
    assert len(fields) > 40
    missing = [name for name, _, _, text in fields if not text]
    assert not missing, f"options without a help string: {missing}"
    text = format_help(JobConfig)
    for name, *_ in fields:
        assert f"  {name}  (" in text


def test_cli_help_and_bad_override(capsys):
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "engine.use_fused_linear_ce" in out and "trainer.resume" in out
    assert train_main([str(REPO / "configs" / "sft_tiny.yaml"), "trainer.nope=1"]) == 2
    assert "trainer.nope" in capsys.readouterr().err
    assert parse_args(["c.yaml", "a.b=1", "help"]) == ("c.yaml", ["a.b=1"], True)
    assert parse_args(["trainer.steps=3"]) == (None, ["trainer.steps=3"], False)
    # no CONFIG.yaml: the embedded default, the fused route on
    assert parse_args([]) == (None, [], False)
    default = load_config(DEFAULT_CONFIG)
    assert default.job == "sft" and default.engine.use_fused_linear_ce is True


def test_empty_yaml_gives_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == JobConfig()
    assert load_yaml(_write(tmp_path, "# only a comment\n")) == {}


# ---------------------------------------------------------------- data

def test_labels_are_next_tokens_with_prompt_masked():
    tok = ByteTokenizer()
    cfg = DataConfig(max_seq_len=64)
    ex = tokenize_example({"prompt": "ab", "response": "xy"}, cfg, tok)
    # ids: BOS a b | x y EOS; the first target is x, predicted at position of 'b'
    assert list(ex.ids) == [tok.BOS, 97, 98, 120, 121, tok.EOS]
    assert ex.loss_start == 3
    labels = make_labels(ex.ids, ex.loss_start)
    assert labels == [IGNORE_INDEX, IGNORE_INDEX, 120, 121, tok.EOS, IGNORE_INDEX]
    # format=text trains on every next token
    tex = tokenize_example({"text": "hi"}, DataConfig(format="text"), tok)
    assert make_labels(tex.ids, tex.loss_start) == [104, 105, tok.EOS, IGNORE_INDEX]


def test_collate_right_pads_and_ignores_padding():
    tok = ByteTokenizer()
    a = Example(ids=(1, 2, 3, 4, 5), loss_start=2)
    b = Example(ids=(7, 8, 9), loss_start=1)
    batch = collate([a, b], tok.pad_id, pad_to_multiple_of=4)
    assert batch.input_ids.shape == (2, 8)
    assert batch.input_ids[1].tolist() == [7, 8, 9] + [tok.pad_id] * 5
    assert batch.labels[0].tolist() == [-100, 3, 4, 5, -100, -100, -100, -100]
    assert batch.labels[1].tolist() == [8, 9, -100, -100, -100, -100, -100, -100]
    assert batch.input_ids.dtype == torch.long and batch.labels.dtype == torch.long


def test_truncation_and_examples_without_targets(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 20, "response": "yy"}) + "\n"
                    + json.dumps({"prompt": "p", "response": "rrrr"}) + "\n")
    with pytest.warns(UserWarning, match="data.max_seq_len"):
        ds = SFTDataset(DataConfig(path=str(path), max_seq_len=8), tok)
    assert len(ds) == 1 and len(ds.examples[0].ids) == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "a", "response": "b"}) + "\n")
    with pytest.raises(ValueError, match="data.prompt_key"):
        SFTDataset(DataConfig(path=str(bad)), tok)
    with pytest.raises(FileNotFoundError, match="data.path"):
        SFTDataset(DataConfig(path="builtin:nope.jsonl"), tok)


def test_batch_order_is_a_function_of_step_and_dp_slices_partition_it():
    tok = ByteTokenizer()
    ds = SFTDataset(DataConfig(), tok)
    ds2 = SFTDataset(DataConfig(), tok)
    n = len(ds)
    # same seed -> same order at any step (no iterator state), including across epoch boundaries
    for step in (0, 3, n // 8 + 1):
        assert ds.global_batch_indices(step, 8) == ds2.global_batch_indices(step, 8)
    # an epoch visits every example once
    per_epoch = sum((ds.global_batch_indices(s, 8) for s in range(n // 8)), [])
    assert sorted(per_epoch) == list(range(n))
    # a different seed gives a different order
    other = SFTDataset(DataConfig(shuffle_seed=7), tok)
    assert other.global_batch_indices(0, 8) != ds.global_batch_indices(0, 8)
    # the DP ranks' micro-batches together hold exactly the global batch
    whole = ds.microbatches(5, 8, 4, dp_rank=0, dp_size=1)
    ranks = [ds.microbatches(5, 8, 2, dp_rank=r, dp_size=2) for r in range(2)]
    rows = lambda mbs: sorted(tuple(r[r != tok.pad_id].tolist()) for mb in mbs for r in mb.input_ids)
    assert rows(whole) == rows(ranks[0] + ranks[1])
    assert rows(ranks[0]) != rows(ranks[1])
    with pytest.raises(ValueError, match="trainer.global_batch_size"):
        ds.microbatches(0, 8, 3, 0, 2)


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "Grüße, 世界!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.BOS] + tok.encode("a") + [tok.EOS]) == "a"
    assert max(tok.encode(text)) < tok.vocab_size == 259


def test_hf_tokenizer_directory(tmp_path):
    # A local Hugging Face tokenizer directory (built offline) goes through AutoTokenizer.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from areal_lce.train.tokenizer import load_tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5, "!": 6}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (7, 0, 1, 2)
    ex = tokenize_example({"prompt": "hello", "response": "world !"}, DataConfig(), tok)
    assert list(ex.ids) == [1, 4, 5, 6, 2] and ex.loss_start == 2
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_the_docs_options_reference_is_the_generated_one():
    """docs/training.md's "Options reference" is `python -m areal_lce.train help-markdown` verbatim: every option's
    type, default and help as the dataclasses declare them (regenerate it after changing one)."""
    from areal_lce.train.config import format_markdown

    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    assert text.split("## Options reference\n\n", 1)[1] == format_markdown(), \
        "regenerate: python -m areal_lce.train help-markdown > the tail of docs/training.md"
