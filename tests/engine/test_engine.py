"""MegatronEngine: HF config -> GPTModel mapping, HF checkpoint loading (TP=1 here, TP=2 through the
shared worker launch), save/load round trip, generation and the lr schedule."""
from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref

import pytest
import torch

warnings.filterwarnings("ignore")

from helpers import megatron_worker as W  # noqa: E402
from helpers.engines import tiny_config, tiny_engine  # noqa: E402
from helpers.megatron_worker import results as worker_results  # noqa: E402

from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from areal_lce.engine.config import LCEConfig, ModelConfig, OptimConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine, lr_at  # noqa: E402
from areal_lce.engine.model.builder import padded_vocab_size, resolve_arch  # noqa: E402

HF_ATOL = 2e-5  # fp32; Megatron and transformers differ only in attention/matmul summation order


def _engine(model: ModelConfig, *, fused: bool = True, lr: float = 0.0, vocab=None) -> MegatronEngine:
    return tiny_engine(vocab, model=model, optim=dict(lr=lr), use_fused_linear_ce=fused,
                       pack_sequences=model.attention == "sdpa")  # megatron's attention takes no packed rows


@pytest.mark.parametrize("family,tied", [pytest.param("qwen2", False, id="qwen2-untied"),
                                         pytest.param("llama", True, id="llama-tied")])
def test_hf_config_maps_to_gpt_model(tmp_path, family, tied):
    from transformers import LlamaConfig, Qwen2Config

    kw = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, rms_norm_eps=3e-6, rope_theta=12345.0, tie_word_embeddings=tied)
    (Qwen2Config(**kw) if family == "qwen2" else LlamaConfig(**kw)).save_pretrained(tmp_path)
    e = _engine(ModelConfig(hf_config_dir=str(tmp_path), max_seq_len=32))
    c = e.gpt.config
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size) == (3, 96, 160)
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (6, 2, 16)
    assert c.layernorm_epsilon == 3e-6 and c.normalization == "RMSNorm" and c.gated_linear_unit
    assert c.add_qkv_bias == (family == "qwen2") and not c.add_bias_linear
    assert e.gpt.rotary_pos_emb.inv_freq[1].item() == pytest.approx(12345.0 ** (-2 / 16))
    assert e.gpt.share_embeddings_and_output_weights == tied
    assert e.gpt.vocab_size == padded_vocab_size(300, 128, 1) == 384 and e.vocab_size == 300


def test_presets_have_real_shapes():
    a = resolve_arch(ModelConfig(preset="qwen2.5-0.5b"))
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_heads, a.num_kv_heads) == (24, 896, 4864, 14, 2)
    assert a.vocab_size == 151936 and a.tie_word_embeddings and a.rope_theta == 1e6 and a.qkv_bias
    b = resolve_arch(ModelConfig(preset="qwen2.5-7b", num_layers=4))
    assert (b.num_layers, b.hidden_size, b.ffn_hidden_size, b.num_heads, b.num_kv_heads) == (4, 3584, 18944, 28, 4)
    assert b.vocab_size == 152064 and not b.tie_word_embeddings


@pytest.mark.parametrize("family,tied", [pytest.param("qwen2", False, id="qwen2-untied"),
                                         pytest.param("llama", True, id="llama-tied")])
def test_hf_checkpoint_matches_transformers_tp1(tmp_path, family, tied):
    W.make_hf_checkpoint(str(tmp_path), family=family, tied=tied)
    ref = torch.load(tmp_path / "reference.pt")
    mask = ref["labels"] != -100
    for fused in (True, False):
        e = _engine(ModelConfig(hf_checkpoint_dir=str(tmp_path), max_seq_len=64), fused=fused, vocab=ref["vocab"])
        st = e.token_stats(ref["ids"], ref["labels"])
        for name in ("logprobs", "entropy"):
            err = (getattr(st, name) - ref[name])[mask].abs().max().item()
            assert err <= HF_ATOL, f"fused={fused} {name}: engine vs transformers max |Δ| = {err:.3e}"
        assert e.generate(W.GREEDY_PROMPTS, W.GREEDY_TOKENS, temperature=0.0) == ref["greedy"]


@pytest.mark.distributed
def test_hf_checkpoint_matches_transformers_tp2():
    r = worker_results()["tp2-hf-checkpoint"]  # TP=2 with sequence parallelism
    assert "error" not in r, r.get("error")
    for k, v in r.items():
        if k.startswith("greedy"):
            assert v == 0.0, f"TP=2 greedy generation differs from transformers ({k})"
        else:
            assert v <= HF_ATOL, f"TP=2 {k} = {v:.3e}"


def test_save_load_roundtrip(tmp_path):
    mbs = [[MicroBatch(i, l)] for i, l in (W.batch(10 + k) for k in range(4))]
    cfg = tiny_config(optim=dict(lr=1e-2, warmup_steps=2, lr_schedule="cosine", total_steps=6, weight_decay=0.1))
    e = MegatronEngine(cfg, vocab_size=W.VOCAB)
    for k in range(2):
        e.train_step(mbs[k], W.pg_loss)
    e.save(str(tmp_path / "ckpt"))
    cont = [e.train_step(mbs[k], W.pg_loss) for k in (2, 3)]
    cfg2 = dataclasses.replace(cfg, seed=99)  # different init
    e2 = MegatronEngine(cfg2, vocab_size=W.VOCAB)
    e2.load(str(tmp_path / "ckpt"))
    resumed = [e2.train_step(mbs[k], W.pg_loss) for k in (2, 3)]
    for a, b in zip(cont, resumed):
        assert a["loss"] == b["loss"] and a["lr"] == b["lr"], (a, b)
    for n, p in e.parameters_named().items():
        assert torch.equal(p, e2.parameters_named()[n]), n
    with pytest.raises(FileNotFoundError):
        e2.load(str(tmp_path / "missing"))


def test_train_step_reports():
    e = _engine(ModelConfig(preset="tiny", max_seq_len=64), lr=1e-3, vocab=W.VOCAB)
    ref = _engine(ModelConfig(preset="tiny", max_seq_len=64), vocab=W.VOCAB)  # e.g. an RL reference policy
    for n, p in ref.parameters_named().items():  # same seed -> same initial parameters
        assert torch.equal(p, e.parameters_named()[n]), n
    ids, labels = W.batch(4)
    out = e.train_step([MicroBatch(ids, labels), MicroBatch(ids, labels)], W.pg_loss)
    assert set(out) >= {"loss", "grad_norm", "lr", "peak_mem_gib", "tokens", "entropy"}
    assert out["tokens"] == 2 * int((labels != -100).sum()) and out["grad_norm"] > 0 and out["peak_mem_gib"] > 0
    with pytest.raises(TypeError, match="MicroBatch.*pre-packed cu_seqlens are not taken"):
        e.train_step([{"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor([0, 5])}], W.pg_loss)
    with pytest.raises(ValueError, match="MicroBatch.labels .* must match input_ids"):
        MicroBatch(ids, labels[:, :-1])
    with pytest.raises(ValueError, match="at least one microbatch"):
        e.train_step([], W.pg_loss)
    with pytest.raises(ValueError, match="max_seq_len"):
        e.token_stats(torch.zeros(1, 65, dtype=torch.long), torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("fused", [pytest.param(True, id="fused"), pytest.param(False, id="materialised")])
def test_frozen_engine_has_no_grad_state_and_matches_the_trainable_one(tmp_path, fused):
    """trainable=False (the RL reference policy): model only, same statistics and tokens as a trainable
    engine holding the same weights; training refuses, naming the option."""
    from megatron.core.distributed import DistributedDataParallel

    cfg = tiny_config(optim=dict(lr=1e-2), use_fused_linear_ce=fused)
    live = MegatronEngine(cfg, vocab_size=W.VOCAB)
    ids, labels = W.batch(7)
    live.train_step([MicroBatch(ids, labels)], W.pg_loss)  # weights away from the shared init
    frozen = MegatronEngine(dataclasses.replace(cfg, seed=99), vocab_size=W.VOCAB, trainable=False)
    assert isinstance(live.model, DistributedDataParallel) and live.optimizer is not None
    assert frozen.optimizer is None and not isinstance(frozen.model, DistributedDataParallel)
    assert not any(p.requires_grad for p in frozen.model.parameters())
    assert not any(hasattr(p, "main_grad") for p in frozen.model.parameters())  # no grad buffers
    assert frozen.grads() == {}
    with torch.no_grad():  # the RL job's weight copy (rl._copy_parameters)
        for n, p in frozen.parameters_named().items():
            p.copy_(live.parameters_named()[n])
    a, b = live.token_stats(ids, labels), frozen.token_stats(ids, labels)
    for name, x, y in zip(a._fields, a, b):
        assert torch.equal(x, y), name
    prompts = [[1, 2, 3], [4, 5]]
    assert (frozen.generate(prompts, 5, generator=torch.Generator().manual_seed(4))
            == live.generate(prompts, 5, generator=torch.Generator().manual_seed(4)))
    with pytest.raises(RuntimeError, match="trainable=False"):
        frozen.train_step([MicroBatch(ids, labels)], W.pg_loss)
    with pytest.raises(RuntimeError, match="trainable=False"):
        frozen.token_stats(ids, labels, grad=True)
    # save / load: a frozen engine loads a trainable engine's checkpoint (weights only) and writes its own
    live.save(str(tmp_path / "live"))
    other = MegatronEngine(dataclasses.replace(cfg, seed=7), vocab_size=W.VOCAB, trainable=False)
    other.load(str(tmp_path / "live"))
    assert torch.equal(other.token_stats(ids, labels).logprobs, a.logprobs)
    other.save(str(tmp_path / "frozen"))
    with pytest.raises(ValueError, match="trainable=False"):
        live.load(str(tmp_path / "frozen"))


@pytest.mark.slow
def test_generate_is_seeded_and_stops_at_eos():
    e = _engine(ModelConfig(preset="tiny", max_seq_len=64), vocab=W.VOCAB)
    prompts = [[1, 2, 3], [4, 5]]
    a = e.generate(prompts, 6, generator=torch.Generator().manual_seed(3))
    b = e.generate(prompts, 6, generator=torch.Generator().manual_seed(3))
    assert a == b and [len(x) for x in a] == [6, 6] and all(0 <= t < W.VOCAB for x in a for t in x)
    greedy = e.generate([[1, 2, 3]], 1, temperature=0.0)[0][0]
    every = torch.arange(W.VOCAB)  # logprob of every token after the prompt: greedy must be the argmax
    labels = torch.full((W.VOCAB, 3), -100)
    labels[:, 2] = every
    lp = e.token_stats(torch.tensor([[1, 2, 3]]).expand(W.VOCAB, 3), labels).logprobs[:, 2]
    assert int(lp.argmax()) == greedy
    eos = a[0][0]
    stopped = e.generate([[1, 2, 3]], 6, eos_id=eos, generator=torch.Generator().manual_seed(3))[0]
    assert stopped == [eos]


def test_lr_schedule():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, lr_schedule="cosine", total_steps=12)
    assert [lr_at(s, o) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, o) == pytest.approx(1.0) and lr_at(7, o) == pytest.approx(0.55) and lr_at(12, o) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=5, total_steps=5, lr_schedule="cosine")


@pytest.mark.distributed
def test_pipeline_parallel_two_stages():
    """PP=2 (Megatron's 1F1B schedule on gloo): statistics match transformers on the same checkpoint,
    training losses match the materialised route and PP=1, greedy generation matches PP=1."""
    r = worker_results()["pp2"]
    assert "error" not in r, r.get("error")
    for k in ("d_logprobs_pp2_fused1", "d_entropy_pp2_fused1", "d_logprobs_pp2_fused0", "d_entropy_pp2_fused0"):
        assert r[k] <= HF_ATOL, f"{k} = {r[k]:.3e}"
    assert r["rel_loss_pp2_fused_vs_mat"] <= 1e-5 and r["rel_loss_pp2_vs_pp1"] <= 1e-5, r
    assert r["greedy_pp2_differs_from_pp1"] == 0.0
    assert r["tied_copy_mismatch_fused1"] == 0.0 and r["tied_copy_mismatch_fused0"] == 0.0, r
    assert r["rel_loss_pp2_tied_fused_vs_mat"] <= 1e-5, r
    assert r["tokens_pp2_wrong_fused1"] == 0.0 and r["tokens_pp2_wrong_fused0"] == 0.0, r


def test_sdpa_attention_matches_megatron_attention():
    """The default SDPA core attention gives the same statistics as megatron's DotProductAttention."""
    ids, labels = W.batch(6)
    st = {}
    for attn in ("sdpa", "megatron"):
        e = _engine(ModelConfig(preset="tiny", max_seq_len=64, attention=attn), vocab=W.VOCAB)
        kind = type(e.gpt.decoder.layers[0].self_attention.core_attention).__name__
        assert kind == {"sdpa": "SDPAttention", "megatron": "DotProductAttention"}[attn]
        st[attn] = e.token_stats(ids, labels)
    for name, a, b in zip(st["sdpa"]._fields, st["sdpa"], st["megatron"]):
        assert (a - b).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
@pytest.mark.slow
def test_packed_matches_padded(fused):
    """engine.pack_sequences: the same right-padded micro-batches (rows of different lengths, a row
    without targets) train to the same per-step losses packed as THD and padded as BSHD."""
    def run(pack: bool):
        e = tiny_engine(W.VOCAB, optim=dict(lr=3e-3), use_fused_linear_ce=fused, pack_sequences=pack)
        losses = []
        for step in range(3):
            ids, labels = W.batch(10 + step, b=3, s=20)
            labels[2] = -100  # a row with nothing to learn: dropped from the packed row
            mbs = [MicroBatch(ids, labels), MicroBatch(ids[:1, :9], labels[:1, :9])]
            losses.append(e.train_step(mbs, W.pg_loss)["loss"])
        st = e.token_stats(ids, labels, temperature=0.8)
        return losses, st

    (lp, sp), (lb, sb) = run(True), run(False)
    for a, b in zip(lp, lb):
        assert abs(a - b) <= 1e-5 * abs(b), (lp, lb)
    for name, x, y in zip(sp._fields, sp, sb):
        assert x.shape == y.shape and (x - y).abs().max().item() <= 1e-5, name


def test_engine_lce_options_reach_the_head_of_either_route(monkeypatch):
    """engine.lce.invariant and engine.lce.logits_precision: held by the engine's route and handed to the
    head of the fused route (the op) and of the materialised route (logprobs_entropy_from_logits)."""
    from helpers.spies import spy_heads

    lce = LCEConfig(backend="torch", invariant=True, logits_precision="bf16")
    e = tiny_engine(W.VOCAB, lce=lce)
    o = e.route.options
    assert (o.backend, o.invariant, o.logits_precision) == ("torch", True, "bf16")
    seen = spy_heads(monkeypatch)
    ids, labels = W.batch(7)
    e.token_stats(ids, labels)
    e.route = dataclasses.replace(e.route, fused=False)
    e.token_stats(ids, labels)
    options = {"invariant": True, "logits_precision": "bf16"}
    assert seen == [("linear_logprobs_entropy", options), ("logprobs_entropy_from_logits", options)]


def test_per_token_rope_matches_megatrons_per_sequence_rope():
    """The packed-frequencies branch of megatron's THD RoPE (all tokens' own positions at once, what the
    engine uses) gives the same statistics as its per-sequence branch."""
    from areal_lce.engine.batch import per_token_rope
    from areal_lce.megatron.compat import cpu_shims
    from areal_lce.megatron.stats import model_output

    e = _engine(ModelConfig(preset="tiny", max_seq_len=64), vocab=W.VOCAB)
    ids, labels = W.batch(12, b=3, s=20)
    mb = e._prepare(ids, labels)
    assert mb.packed is not None and mb.packed.layout.cu_seqlens.numel() >= 4  # several packed sequences
    kw = dict(vocab_size=W.VOCAB, position_ids=mb.position_ids, packed_seq_params=mb.packed_seq_params,
              backend="torch")
    with torch.no_grad(), cpu_shims():  # the engine's model driven directly, as the engine would
        plain = model_output(e.model, mb.input_ids, mb.labels, **kw)
        with per_token_rope(e.gpt, mb):
            freqs = e.gpt.rotary_pos_emb(7, packed_seq=True)
            fast = model_output(e.model, mb.input_ids, mb.labels, **kw)
    assert freqs.shape[0] == mb.input_ids.shape[1]  # one row per packed token: the packed branch
    assert "forward" not in vars(e.gpt.rotary_pos_emb)  # restored
    assert (fast - plain).abs().max().item() <= 1e-5


def test_device_grad_norm_replaces_only_megatrons_host_syncing_fallback(monkeypatch):
    """compat.use_device_grad_norm: megatron's clipping gets the same L2 norm (its fallback's formula: the
    norm of the per-tensor norms) from a device-side computation; an Apex / TE kernel is left alone."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from areal_lce.megatron import compat

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g) * 3, torch.randn(11, generator=g), torch.zeros(4)]
    norm, per_tensor = compat._l2_norm_on_device(2048 * 32, None, [tensors], False)
    expected = torch.norm(torch.stack([torch.norm(t) for t in tensors]))
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)
    assert abs(float(norm) - float(torch.cat([t.reshape(-1) for t in tensors]).norm())) < 1e-4

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    assert compat.use_device_grad_norm() and compat.use_device_grad_norm()  # idempotent
    assert clip_grads.l2_norm_impl is compat._l2_norm_on_device
    kernel = object()  # stands for amp_C / Transformer Engine's multi_tensor_l2norm
    monkeypatch.setattr(clip_grads, "l2_norm_impl", kernel)
    assert not compat.use_device_grad_norm() and clip_grads.l2_norm_impl is kernel


def test_a_dropped_engine_is_collected():
    """Nothing global holds an engine: after a training step and a logprob pass, `del` and one
    `gc.collect()` free its model and every parameter (docs/megatron.md, "Releasing an engine"). megatron-core's
    DDP hooks put them in reference cycles, so without the collection they stay; a registry that kept the model
    (a capture seam, a patch) would keep them for good, and a second engine in the process would find the
    first one's memory taken."""
    e = tiny_engine(W.VOCAB)
    ids, labels = W.batch(3)
    e.train_step([MicroBatch(ids, labels)], W.pg_loss)
    e.token_stats(ids, labels)
    refs = [weakref.ref(e), weakref.ref(e.model), weakref.ref(e.gpt)] + [weakref.ref(p) for p in e.gpt.parameters()]
    del e
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of the engine, its model and its {len(refs) - 3} parameters outlive it"
