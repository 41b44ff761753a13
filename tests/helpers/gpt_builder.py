"""A user's own megatron-core GPTModel (no engine) and megatron's own oracle for token_stats tests.

Used in-process by tests/megatron/test_token_stats.py (TP=1), by tests/megatron/token_stats_worker.py (TP=2,
gloo) and by the seam tests of tests/op/, tests/engine/ and tests/integrations/.
The model is built the way a Megatron user builds one: TransformerConfig + the local layer spec, with
a core attention that handles packed THD batches, the vocabulary padded as Megatron pads it. The oracle
is megatron-core's `tensor_parallel.vocab_parallel_cross_entropy` on the model's own materialised
logits (padding columns masked to -inf) for logprobs, and an fp64 softmax of the gathered logits for
the entropy and logit extremes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

VOCAB = 300  # true vocabulary; padded to 384 at TP=1 and to 512 at TP=2 (shards of 256)
H = 64


@pytest.fixture(autouse=True)
def megatron_on_cpu():
    """Test modules that drive a megatron model themselves import this fixture: every test runs inside
    areal_lce's CPU shims (a no-op with CUDA), as the engine's own calls do."""
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():
        yield


def padded_vocab(tp: int) -> int:
    from areal_lce.engine.model.builder import padded_vocab_size

    return padded_vocab_size(VOCAB, 128, tp)


def init(tp: int = 1, sp: bool = False, seed: int = 1234):
    """torch.distributed (gloo on CPU) + megatron's parallel_state for TP=tp, seeded."""
    from areal_lce.engine.config import ParallelConfig
    from areal_lce.engine.parallel import init_distributed

    return init_distributed(ParallelConfig(tensor_parallel=tp, sequence_parallel=sp), seed)


def build_gpt(tp: int = 1, sp: bool = False, tied: bool = False, mtp_layers: int = 0, seed: int = 1234,
              head_scale: float = 4.0):
    """GPTModel of 2 layers, H=64, GQA 4/2 heads, RoPE, RMSNorm, SwiGLU. `head_scale` multiplies the
    LM-head weight so the softmax is peaked (flat random logits hide entropy and padding bugs)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from areal_lce.engine.model.attention import SDPAttention
    from areal_lce.engine.model.builder import _local_rms_norm_class

    init(tp, sp, seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=H, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True, params_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        mtp_num_layers=mtp_layers or None)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    norm = _local_rms_norm_class()
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    # the block's final norm too: megatron's default torch norm refuses sequence parallelism
    spec = TransformerBlockSubmodules(layer_specs=[spec] * cfg.num_layers, layer_norm=norm)
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if mtp_layers else None
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(tp), max_sequence_length=128,
                     parallel_output=True, share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                     rotary_base=10000, mtp_block_spec=mtp_spec)
    with torch.no_grad():
        model.shared_embedding_or_output_weight().mul_(head_scale)
    return model


def oracle(model, input_ids, labels, temperature, *, position_ids=None, packed_seq_params=None):
    """(logprobs, entropy, max_logit, min_logit) from the model's materialised vocab-parallel logits:
    logprobs by megatron's vocab_parallel_cross_entropy, the rest by an fp64 softmax of gathered logits."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    logits = model(input_ids, position_ids, None, packed_seq_params=packed_seq_params)  # [b, s, V/tp]
    v_shard = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * v_shard
    pad_cols = (torch.arange(v_shard) + start) >= VOCAB
    logits = logits.masked_fill(pad_cols, float("-inf"))
    t = temperature if torch.is_tensor(temperature) else torch.tensor(float(temperature))
    t = torch.broadcast_to(t, labels.shape)
    z = logits / t[..., None]
    valid = labels != -100
    ce = tensor_parallel.vocab_parallel_cross_entropy(z.clone(), labels.clamp(min=0))
    full = tensor_parallel.gather_from_tensor_model_parallel_region(z)[..., :VOCAB].double()
    logp = torch.log_softmax(full, -1)
    ent = -(logp.exp() * logp).sum(-1).float()
    raw = full.detach() * t[..., None].double()
    zero = torch.zeros_like(ce)
    return (torch.where(valid, -ce, zero), torch.where(valid, ent, zero),
            torch.where(valid, raw.max(-1).values.float(), zero), torch.where(valid, raw.min(-1).values.float(), zero))


def weighted_loss(logprobs, entropy, labels, seed: int = 5):
    """Σ over valid tokens of a·logprob + c·entropy with fixed random per-token weights (RL-like)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(labels.shape, generator=g) + 0.5
    c = torch.rand(labels.shape, generator=g) * 0.2
    valid = (labels != -100).float()
    return (valid * (a * logprobs + c * entropy)).sum()


def grads(model, loss) -> dict:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, gs)}


def batch(seed: int, b: int = 3, s: int = 16):
    """Right-padded next-token batch: row lengths s, s-5, 7; labels at the TP shard edge (255, 256) and
    at the last real id (VOCAB - 1); ignore_index on padding and on every row's last token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    lengths = [min(s, max(2, n)) for n in ([s, s - 5, 7] + [2 + r for r in range(b)])[:b]]
    ids[0, 1], ids[0, 2], ids[min(1, b - 1), min(3, s - 1)] = 255, 256, VOCAB - 1
    labels = torch.full((b, s), -100, dtype=torch.long)
    for r, n in enumerate(lengths):
        labels[r, : n - 1] = ids[r, 1:n]
        ids[r, n:] = 0
    return ids, labels, lengths


def max_rel(a: dict, b: dict) -> float:
    """max over parameters of max |a - b| / max |b|."""
    worst = 0.0
    for n in b:
        scale = b[n].abs().max().clamp(min=1e-12)
        worst = max(worst, float((a[n] - b[n]).abs().max() / scale))
    return worst


def compare_routes(model, ids, labels, temperature, **kw):
    """token_stats (fused and fused=False) against `oracle`: ({metric: error}, {fused: TokenStats}) with
    max |Δ| of the four stats (`fused_d_lp`, ..., `mat_d_min`) and the max relative parameter-gradient
    error (`fused_grad_rel`, `mat_grad_rel`) on this rank."""
    from areal_lce.megatron import token_stats

    ref = oracle(model, ids, labels, temperature, position_ids=kw.get("position_ids"),
                 packed_seq_params=kw.get("packed_seq_params"))
    ref_grads = grads(model, weighted_loss(ref[0], ref[1], labels))
    out, stats = {}, {}
    for fused in (True, False):
        st = token_stats(model, ids, labels, vocab_size=VOCAB, temperature=temperature, fused=fused,
                         backend="torch", **kw)
        tag = "fused" if fused else "mat"
        for name, got, want in zip(("lp", "ent", "max", "min"), st, ref):
            out[f"{tag}_d_{name}"] = float((got - want).detach().abs().max())
        out[f"{tag}_grad_rel"] = max_rel(grads(model, weighted_loss(st.logprobs, st.entropy, labels)), ref_grads)
        stats[fused] = st
    return out, stats
