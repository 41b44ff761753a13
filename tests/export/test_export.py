"""Hugging Face export (areal_lce.export) and the Qwen3 import: round trips through transformers.

Oracles: the exported tensors are bitwise the imported ones (the export only moves and cuts tensors), at
TP=1, TP=2 and PP=2; transformers' model loaded from the export computes the engine's logits; the export
imported back gives bitwise the same token_stats; the built-in byte tokenizer's files reproduce its ids.

Logit bound: the engine and transformers evaluate the same fp32 function with other summation orders
(fused QKV GEMM, SDPA vs eager attention). Each lies within the first-order rounding bound of the exact
(fp64) value, of the size transformers' own fp32 error shows; the engine may not be more than 4x worse,
plus 8 ulp of the largest logit for the case where transformers' own error happens to be tiny.
"""
from __future__ import annotations

import glob
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore")

from helpers.paths import REPO
from areal_lce.megatron.compat import cpu_shims  # noqa: E402
from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402
from areal_lce.engine.model.builder import arch_from_hf  # noqa: E402
from areal_lce.export import export_hf  # noqa: E402
from areal_lce.train.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from export_worker import VOCAB, batch, make_checkpoint, norm_grads  # noqa: E402

U32 = 2.0 ** -24


def engine_of(hf_dir, **model) -> MegatronEngine:
    cfg = EngineConfig(model=ModelConfig(hf_checkpoint_dir=str(hf_dir), max_seq_len=64, **model),
                       lce=LCEConfig(backend="torch"))
    return MegatronEngine(cfg, trainable=False)


def engine_logits(engine, ids) -> torch.Tensor:
    """The engine's fp32 logits [b, s, true vocab] (TP=1: the GPTModel's output layer, padding cut)."""
    with torch.no_grad(), cpu_shims():
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return engine.gpt(input_ids=ids, position_ids=pos, attention_mask=None)[..., :engine.vocab_size]


def hf_logits(hf_dir, ids, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_logits_close(got, hf_dir, ids) -> None:
    """The module docstring's bound, against transformers in fp64 (the oracle) and in fp32."""
    exact, hf32 = hf_logits(hf_dir, ids, torch.float64), hf_logits(hf_dir, ids).double()
    own = (hf32 - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    bound = 4 * own + 8 * U32 * exact.abs().max().item()
    assert err <= bound, f"engine logits vs fp64: {err:.3e} > bound {bound:.3e} (transformers fp32: {own:.3e})"


def safetensors_of(directory) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} differs"


# -------------------------------------------------------------------------------------------- tokenizer
# the last text is not in Unicode NFC form (a tokenizer that normalises would change its bytes)
ODD_TEXTS = ["", " ", "  two  spaces ", "\t\r\n\x00\x7f", "héllo wörld", "世界 🙂 \u200b", "<eos>",
             "a<bos>b<pad>", "Ġ Ċ ĉ", "\\u00ff \U0010ffff", "e\u0301 \u212b"]
ODD_IDS = [[0xFF], [0xC3], [0xE4, 0xB8], [0xF0, 0x9F, 0x99], [0xED, 0xA0, 0x80], [0xC0, 0x80], [0xF5, 0x41],
           [0x80, 0x41, 0xBF], list(range(256)), [257, 72, 258, 105, 256, 256], [0xE4, 0xB8, 258, 0x96]]


def test_byte_tokenizer_files_reproduce_its_ids(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bt = ByteTokenizer()
    assert sorted(bt.save_pretrained(tmp_path)) == ["tokenizer.json", "tokenizer_config.json"]
    rows = [json.loads(line) for line in (REPO / "areal_lce/train/data/sft_tiny.jsonl").read_text().splitlines()]
    texts = [r[k] for r in rows for k in ("prompt", "response")] + ODD_TEXTS
    for hf in (AutoTokenizer.from_pretrained(tmp_path, local_files_only=True),
               PreTrainedTokenizerFast.from_pretrained(tmp_path, local_files_only=True)):
        assert len(hf) == bt.vocab_size == 259
        assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (bt.pad_id, bt.bos_id, bt.eos_id)
        for text in texts:
            ids = hf.encode(text, add_special_tokens=False)
            assert ids == bt.encode(text), text
            assert hf.decode(ids) == text
        for ids in ODD_IDS + [bt.encode(t) for t in ODD_TEXTS]:  # invalid UTF-8 -> U+FFFD in both
            for skip in (True, False):
                assert hf.decode(ids, skip_special_tokens=skip) == bt.decode(ids, skip_special_tokens=skip), (ids, skip)
    # a Hugging Face tokenizer directory (data.tokenizer) is exported as its own save_pretrained files
    again = HFTokenizer(str(tmp_path))
    assert "tokenizer.json" in again.save_pretrained(tmp_path / "again")
    assert HFTokenizer(str(tmp_path / "again")).encode(ODD_TEXTS[-1]) == bt.encode(ODD_TEXTS[-1])


# -------------------------------------------------------------------------------------------- import / export
def test_attention_bias_with_its_o_proj_bias_is_refused():
    from transformers import LlamaConfig, Qwen3Config

    # o_proj carries a bias too under attention_bias=True; the builder once mapped only the q/k/v ones and
    # dropped o_proj.bias without a word
    for cfg in (LlamaConfig(attention_bias=True), Qwen3Config(attention_bias=True)):
        with pytest.raises(ValueError, match="attention_bias=True is not supported"):
            arch_from_hf(cfg)


@pytest.mark.parametrize("family,tied", [pytest.param("qwen2", False, id="qwen2-untied"),
                                         pytest.param("llama", True, id="llama-tied"),
                                         pytest.param("qwen3", True, id="qwen3-tied")])
def test_export_round_trip_through_transformers(tmp_path, family, tied):
    src, out = tmp_path / "src", tmp_path / "out"
    make_checkpoint(src, family, tied)
    e = engine_of(src)
    assert e.gpt.config.qk_layernorm == (family == "qwen3") and e.arch.head_dim == (24 if family == "qwen3" else 16)
    assert e.gpt.vocab_size == 384 and e.vocab_size == VOCAB
    ids, labels = batch()
    logits = engine_logits(e, ids)
    assert_logits_close(logits, src, ids)  # the import: the engine computes transformers' model
    # shards of at most 40 kB: several files and their index
    export_hf(e, out, max_shard_bytes=40_000)
    assert_same_tensors(safetensors_of(out), safetensors_of(src))  # bitwise, padding rows cut
    assert len(glob.glob(str(out / "model-*-of-*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (family, VOCAB, tied)
    assert_logits_close(logits, out, ids)  # transformers' model of the export
    back = engine_of(out)  # the export imported back
    a, b = e.token_stats(ids, labels), back.token_stats(ids, labels)
    for name in ("logprobs", "entropy"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if family == "qwen3" and tied:  # greedy decoding (KV cache, q/k norms on every new token) as transformers
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
        ours = e.generate(prompts, 6, temperature=0.0)
        for p, mine in zip(prompts, ours):
            got = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None)
            assert got[0, len(p):].tolist() == mine


def test_export_refusals(tmp_path):
    cfg = EngineConfig(model=ModelConfig(preset="tiny-qwen3", max_seq_len=32), lce=LCEConfig(backend="torch"))
    e = MegatronEngine(cfg, vocab_size=ByteTokenizer().vocab_size, trainable=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        export_hf(e, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]

    big = ByteTokenizer()
    big.vocab_size = 1000  # more ids than the model's vocabulary
    with pytest.raises(ValueError, match="tokenizer has 1000 ids"):
        export_hf(e, tmp_path / "big", tokenizer=big)
    with pytest.raises(ValueError, match="float64"):  # an unsupported dtype
        export_hf(e, tmp_path / "f64", dtype=torch.float64)
    e.gpt.decoder.layers[0].register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match="decoder.layers.0.extra"):
        export_hf(e, tmp_path / "extra")
    assert sorted(os.listdir(tmp_path)) == ["full"]
    del e.gpt.decoder.layers[0].extra
    e.gpt.decoder.layers[1].self_attention.k_layernorm = None  # a Qwen3 layer without its k norm
    with pytest.raises(ValueError, match=r"decoder.layers.1 holds .* maps exactly"):
        export_hf(e, tmp_path / "no_k_norm")


@pytest.mark.slow
@pytest.mark.distributed
def test_export_at_tp2_and_pp2_equals_the_tp1_export(tmp_path):
    from helpers.launch import torchrun

    from areal_lce.engine.config import ParallelConfig

    # untied Qwen2 (q/k/v biases, an LM head of its own on the last stage); the export of TP=2 + sequence
    # parallelism and of PP=2 must be bitwise the TP=1 export, which is bitwise the imported checkpoint
    qwen2, qwen3 = tmp_path / "qwen2", tmp_path / "qwen3"
    make_checkpoint(qwen2, "qwen2", tied=False)
    make_checkpoint(qwen3, "qwen3", tied=True)
    export_hf(engine_of(qwen2), tmp_path / "tp1")
    result = torchrun(Path(__file__).with_name("export_worker.py"), qwen2, qwen3, tmp_path, timeout=300,
                      result=tmp_path / "worker.json")
    assert "error" not in result, result.get("error")
    tp1 = safetensors_of(tmp_path / "tp1")
    for layout in ("tp2", "pp2"):
        assert_same_tensors(safetensors_of(tmp_path / layout), tp1)
        assert (tmp_path / layout / "config.json").read_text() == (tmp_path / "tp1" / "config.json").read_text()
    # Qwen3 trains at TP=2: each rank norms only its own heads with the replicated q/k norm weights, so their
    # gradients are partial sums until megatron's finalize_model_grads adds them over TP (by name). Reduced,
    # they are the TP=1 gradients up to fp32 summation order (~1e-6 relative); a missing or doubled reduction
    # is off by O(1)
    want = norm_grads(qwen3, ParallelConfig())
    got = torch.load(tmp_path / "norm_grads.pt", weights_only=True)
    assert sorted(got) == sorted(want) and any("q_layernorm" in n for n in got)
    for name, g in want.items():
        err = (got[name] - g).abs().max().item()
        assert err <= 1e-4 * g.abs().max().item(), f"{name}: TP=2 vs TP=1 gradient |Δ| = {err:.3e}"


@pytest.mark.slow
def test_export_cli_of_an_sft_run_generates_as_the_engine(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from areal_lce.export.__main__ import job_config, load_weights, main
    from areal_lce.train import checkpoint as ckpt
    from areal_lce.train import sft
    from areal_lce.train.config import load_config

    run, out = tmp_path / "run", tmp_path / "hf"
    # three steps at a small lr: the weights stay near their random init, whose greedy answers are varied
    # tokens (at the config's lr, a few steps teach the tiny model to answer <eos> at once)
    sft.run(load_config(REPO / "configs" / "sft_tiny.yaml", [
        f"trainer.output_dir={run}", "trainer.steps=3", "trainer.save_interval=3", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4", "trainer.progress=false", "trainer.sample_prompts=0",
        "engine.optim.warmup_steps=0", "engine.optim.lr=1e-4", "engine.optim.min_lr=0"]))
    step = ckpt.latest_checkpoint(run)
    assert main([str(run), str(out)]) == 2 and "not a complete checkpoint" in capsys.readouterr().err
    assert main([str(step), str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 259  # the config's; megatron's 384 cut back

    cfg = job_config(step)  # the run's engine at TP=1, with the step's weights
    engine = MegatronEngine(cfg.engine, trainable=False)
    load_weights(engine, step)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    exact = PreTrainedTokenizerFast.from_pretrained(out, local_files_only=True)
    bt = ByteTokenizer()
    # transformers 5 builds its Qwen2Tokenizer pipeline beside a qwen2 config (NFC first): the byte ids of
    # every embedded text; PreTrainedTokenizerFast keeps tokenizer.json's pipeline: those of any text
    assert len(tok) == len(exact) == 259
    texts = [r[k] for r in map(json.loads, (REPO / "areal_lce/train/data/sft_tiny.jsonl").read_text().splitlines())
             for k in ("prompt", "response")]
    assert all(tok.encode(t, add_special_tokens=False) == bt.encode(t) for t in texts)
    assert all(exact.encode(t, add_special_tokens=False) == bt.encode(t) for t in texts + ODD_TEXTS)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    answers = []
    for row in map(json.loads, (REPO / "areal_lce/train/data/sft_tiny.jsonl").read_text().splitlines()[:3]):
        prompt = [tok.bos_token_id] + tok.encode(row["prompt"], add_special_tokens=False)  # as data.add_bos
        ours = engine.generate([prompt], 8, temperature=0.0, eos_id=tok.eos_token_id)[0]
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
        assert got.sequences[0, len(prompt):].tolist() == ours, row
        # each greedy choice won by more than any fp32 difference between the two models could move it
        top2 = torch.stack([s[0].topk(2).values for s in got.scores])
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
        answers.append(ours)
    assert len({t for a in answers for t in a}) > 3, answers  # not an <eos> at once
