"""The true vocabulary of an HF checkpoint with more embedding rows (520) than the tokenizer has ids (the
builtin tokenizer's 259), built as the jobs build it (train.job.model_vocab_size): every route and the
sampler run over all 520 rows, as vLLM and SGLang do; only megatron's padding (rows 520-639) stays out.

Oracles: the fused route's logprobs against the exact (fp64) log_softmax over all 520 rows of the same
hidden states, within the fp32 rounding bound of tests/helpers/bounds.py; the padding rows are set to
dominate every logit, so any of them entering the softmax or the sampler fails by O(1).
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

from helpers.bounds import assert_within, op_bounds  # noqa: E402
from helpers.paths import REPO  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402
from areal_lce.megatron.compat import cpu_shims  # noqa: E402
from areal_lce.train.config import load_config  # noqa: E402
from areal_lce.train.job import model_vocab_size  # noqa: E402
from areal_lce.train.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

ROWS, PADDED, TOKENIZER = 520, 640, 259


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return path


def job_engine(checkpoint, *overrides) -> MegatronEngine:
    """The engine the SFT job builds on `checkpoint` with the builtin tokenizer; padding rows made dominant."""
    cfg = load_config(REPO / "configs" / "sft_tiny.yaml", [
        f"engine.model.hf_checkpoint_dir={checkpoint}", "engine.model.vocab_size=0", "engine.model.max_seq_len=64",
        "data.max_seq_len=64", "engine.lce.backend=torch", *overrides])
    engine = MegatronEngine(cfg.engine, vocab_size=model_vocab_size(cfg, ByteTokenizer()), trainable=False)
    assert (engine.vocab_size, engine.gpt.vocab_size) == (ROWS, PADDED)
    w = engine.gpt.output_layer.weight
    with torch.no_grad():  # +-50x row 300: whatever the hidden state, half the padding rows dominate
        w[ROWS:] = 50 * w[300] * torch.tensor([1.0, -1.0]).repeat((PADDED - ROWS) // 2)[:, None]
    return engine


# the fused route, and the materialised one (use_fused_linear_ce=false: token_stats builds the logits)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
def test_logprobs_normalise_over_every_row_of_the_checkpoint(checkpoint, fused):
    engine = job_engine(checkpoint, f"engine.use_fused_linear_ce={str(fused).lower()}", "engine.pack_sequences=false")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TOKENIZER, (2, 12), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[0, :4] = torch.tensor([259, 400, ROWS - 1, 5])  # ids past the tokenizer's: rows of the model
    labels[:, -1] = -100
    seen = {}
    hook = engine.gpt.decoder.register_forward_hook(lambda _m, _i, out: seen.setdefault("h", out))
    try:
        lp = engine.token_stats(ids, labels).logprobs
    finally:
        hook.remove()
    h = seen["h"].transpose(0, 1).reshape(-1, seen["h"].shape[-1])  # the final-normed hidden states [s, b, H]
    live = labels.reshape(-1) != -100
    w = engine.gpt.output_layer.weight.detach()
    y = labels.reshape(-1)[live]
    exact = torch.log_softmax(h[live].double() @ w[:ROWS].double().t(), -1).gather(1, y[:, None]).squeeze(1)
    bound = op_bounds(h[live], w[:ROWS], y, 1.0).logprobs
    assert_within("logprobs", lp.reshape(-1)[live], exact, bound)


def test_the_sampler_draws_from_every_row_and_never_past_the_true_vocabulary(checkpoint):
    engine = job_engine(checkpoint)
    w = engine.gpt.output_layer.weight
    with torch.no_grad():
        w[TOKENIZER:ROWS] *= 4  # the rows the tokenizer lacks win the argmax (the padding would, unmasked)
    prompts = [[1, 2, 3, 4], [72, 105]]
    greedy = engine.generate(prompts, 6, temperature=0.0)
    drawn = engine.generate(prompts * 4, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    flat = [t for seq in greedy + drawn for t in seq]
    assert all(0 <= t < ROWS for t in flat), flat
    assert all(TOKENIZER <= t for seq in greedy for t in seq), greedy  # the model's own rows are drawn
    assert sum(t >= TOKENIZER for seq in drawn for t in seq) > len(flat) // 4, drawn
    # and a tokenizer that lacks them decodes them to nothing, as vLLM's detokenizer does
    seq = greedy[0] + [72, 105]
    assert ByteTokenizer().decode(seq) == ByteTokenizer().decode(seq, skip_special_tokens=False) == "Hi"


def test_a_tokenizer_with_fewer_ids_decodes_the_models_extra_ids_to_nothing(tmp_path):
    ByteTokenizer().save_pretrained(tmp_path)
    hf = HFTokenizer(str(tmp_path))
    for skip in (True, False):
        assert hf.decode([72, 300, ROWS - 1, 105], skip_special_tokens=skip) == "Hi"
        assert ByteTokenizer().decode([72, 300, ROWS - 1, 105], skip_special_tokens=skip) == "Hi"


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(checkpoint):
    cfg = load_config(REPO / "configs" / "sft_tiny.yaml", [f"engine.model.hf_checkpoint_dir={checkpoint}",
                                                             "engine.model.vocab_size=0"])
    big = ByteTokenizer()
    big.vocab_size = ROWS + 1
    with pytest.raises(ValueError, match=r"vocabulary of 520 ids \(the vocab_size of .*\) is smaller than the "
                                         r"tokenizer's 521 ids"):
        model_vocab_size(cfg, big)
    over = dataclasses.replace(cfg.engine.model, vocab_size=ROWS + 1)
    with pytest.raises(ValueError, match=r"engine.model.vocab_size=521 exceeds the 520 rows"):
        MegatronEngine(dataclasses.replace(cfg.engine, model=over), trainable=False)
