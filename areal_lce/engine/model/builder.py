"""Build a megatron-core GPTModel from a Hugging Face config or a preset, and load HF weights into it.

Supported families: Qwen2 (q/k/v bias), Llama (no attention bias) and Qwen3 (no attention bias, RMSNorm of
each query and key head over head_dim before RoPE: megatron's qk_layernorm; head_dim from the config):
grouped-query attention, RoPE (default rope type, any theta), RMSNorm, SwiGLU MLP, tied or untied
embeddings. `attention_bias=True` (Llama, Qwen3) is refused: it also puts a bias on o_proj, which
megatron adds only together with biases on every MLP linear (add_bias_linear). Layer spec: the
Transformer Engine spec when `transformer_engine` imports (GPU only), else megatron-core's local spec
with a torch RMSNorm that marks its weight `sequence_parallel` (Megatron then all-reduces those
grads over TP when sequence parallelism is on, as it does for its own fused norms) and, by default,
causal attention through torch SDPA (`model.attention`).

Weight layout (HF -> Megatron, per tensor-parallel rank r of t):
  q/k/v_proj      -> linear_qkv: per query group g, rows [q heads of g | k_g | v_g]; groups split over t
  q_norm / k_norm -> q_layernorm / k_layernorm (Qwen3; [head_dim], the same on every rank)
  o_proj          -> linear_proj (row parallel: columns split over t)
  gate/up_proj    -> linear_fc1 = [gate rows of r | up rows of r]
  down_proj       -> linear_fc2 (row parallel)
  embed_tokens / lm_head -> rows padded with zeros to the padded vocabulary, then split over t
"""
from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from ...megatron.compat import cpu_shims, quiet_gpt_deprecation
from ..config import ModelConfig, ParallelConfig

TINY_VOCAB = 512
FAMILIES = ("qwen2", "llama", "qwen3")  # HF model_type values the builder maps


@dataclass(frozen=True)
class ArchSpec:
    """The architecture numbers the builder needs, whatever their source."""

    family: str  # "qwen2" | "llama" | "qwen3"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    qk_norm: bool = False  # RMSNorm of every query and key head over head_dim (Qwen3)


def _preset_hf_config(name: str):
    from transformers import LlamaConfig, Qwen2Config

    if name == "tiny":
        return Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=2048)
    if name == "tiny-llama":
        return LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                           rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=2048)
    if name == "tiny-qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=2048)
    if name == "qwen2.5-0.5b":  # Qwen/Qwen2.5-0.5B config.json
        return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768)
    if name == "qwen2.5-7b":  # Qwen/Qwen2.5-7B config.json
        return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=131072)
    raise ValueError(f"model.preset={name!r} is not a known preset")


def _rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise ValueError(f"rope type {rope_type!r} of the HF config is not supported (only default RoPE)")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def arch_from_hf(hf) -> ArchSpec:
    """ArchSpec of a transformers Qwen2Config / LlamaConfig / Qwen3Config (clear errors for what is not
    mapped)."""
    family = getattr(hf, "model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"HF model_type={family!r} is not supported ({', '.join(FAMILIES)})")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported (SwiGLU/silu only)")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if family in ("qwen2", "qwen3") and getattr(hf, "use_sliding_window", False):
        raise ValueError(f"{family} use_sliding_window=True is not supported")
    if family != "qwen2" and getattr(hf, "attention_bias", False):
        raise ValueError(f"{family} attention_bias=True is not supported: it puts a bias on o_proj too, which "
                         "megatron's layers have only together with biases on every MLP linear")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return ArchSpec(
        family=family, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
        vocab_size=hf.vocab_size, rope_theta=_rope_theta(hf), rms_norm_eps=hf.rms_norm_eps,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
    )


def resolve_arch(cfg: ModelConfig) -> ArchSpec:
    """ArchSpec from the model config: checkpoint dir, config dir or preset, plus the overrides. With a
    checkpoint, `vocab_size` stays the checkpoint config's (its embedding rows); `model.vocab_size` then
    only sets the true vocabulary (`true_vocab_size`), which may not exceed it."""
    import dataclasses

    if cfg.hf_checkpoint_dir or cfg.hf_config_dir:
        from transformers import AutoConfig

        path = cfg.hf_checkpoint_dir or cfg.hf_config_dir
        if not os.path.isfile(os.path.join(path, "config.json")):
            opt = "model.hf_checkpoint_dir" if cfg.hf_checkpoint_dir else "model.hf_config_dir"
            raise FileNotFoundError(f"{opt}={path!r} has no config.json")
        hf = AutoConfig.from_pretrained(path)
    else:
        hf = _preset_hf_config(cfg.preset)
    arch = arch_from_hf(hf)
    over = {}
    if cfg.tie_word_embeddings is not None:
        over["tie_word_embeddings"] = cfg.tie_word_embeddings
    if cfg.num_layers:
        over["num_layers"] = cfg.num_layers
    if cfg.vocab_size and not cfg.hf_checkpoint_dir:  # a checkpoint's rows are its own (the engine checks)
        over["vocab_size"] = cfg.vocab_size
    return dataclasses.replace(arch, **over) if over else arch


def true_vocab_size(cfg: ModelConfig, arch: ArchSpec, caller: Optional[int] = None) -> int:
    """The model's true vocabulary: `model.vocab_size` when set, else `caller` (an engine's `vocab_size`
    argument) when given, else the checkpoint config's / HF config's / preset's `vocab_size` (what vLLM and
    SGLang normalise over). Only megatron's own padding, the rows past it, stays out of the softmax. A
    tokenizer may have fewer ids."""
    vocab = cfg.vocab_size or caller or arch.vocab_size
    if cfg.hf_checkpoint_dir and vocab > arch.vocab_size:
        raise ValueError(f"engine.model.vocab_size={vocab} exceeds the {arch.vocab_size} rows of "
                         f"engine.model.hf_checkpoint_dir={cfg.hf_checkpoint_dir!r} (its config's vocab_size)")
    return vocab


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _local_rms_norm_class():
    class LocalRMSNorm(torch.nn.RMSNorm):
        """torch RMSNorm with Megatron's norm constructor signature; under sequence parallelism its
        weight is marked so Megatron's finalize_model_grads all-reduces its grad over TP."""

        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
            super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
            setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    return LocalRMSNorm


def _sdpa_attention_class():
    """The engine's core attention class (areal_lce.engine.model.attention.SDPAttention; imports megatron)."""
    from .attention import SDPAttention

    return SDPAttention


def use_te_spec() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_transformer_config(arch: ArchSpec, parallel: ParallelConfig, dtype: torch.dtype, recompute: bool = False,
                             rope_fusion: bool = False, cross_entropy_loss_fusion: bool = False):
    """megatron-core TransformerConfig of the architecture. `rope_fusion`: set apply_rope_fusion (the fused
    RoPE slots must be filled first: rope.install_rope_fusion). `cross_entropy_loss_fusion`: megatron's
    own labels= loss through fused_vocab_parallel_cross_entropy (model.cross_entropy_loss_fusion)."""
    from megatron.core.transformer import TransformerConfig

    cpu = not torch.cuda.is_available()
    cp = getattr(parallel, "context_parallel", 1)
    with warnings.catch_warnings():  # megatron-core 0.19's own default cuda_graph_modules: nothing to act on
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        return TransformerConfig(
            num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
            num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
            normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
            hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            sequence_parallel=parallel.sequence_parallel, context_parallel_size=cp,
            # context parallelism of the local spec's SDPAttention: K/V all-gathered over the CP group
            cp_comm_type="all_gather" if cp > 1 else None,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
            use_cpu_initialization=cpu, gradient_accumulation_fusion=False, persist_layer_norm=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=rope_fusion, cross_entropy_loss_fusion=cross_entropy_loss_fusion,
            attention_softmax_in_fp32=True,
            recompute_granularity="full" if recompute else None, recompute_method="uniform" if recompute else None,
            recompute_num_layers=1 if recompute else None,
            # CPU/gloo: plain isend/irecv between pipeline stages (no batched p2p + device sync).
            batch_p2p_comm=not cpu,
        )


def build_gpt_model(arch: ArchSpec, model_cfg: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype):
    """A megatron-core GPTModel for this rank's pipeline stage (parallel_state must be initialised)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from . import rope

    if arch.num_heads % parallel.tensor_parallel or arch.num_kv_heads % parallel.tensor_parallel:
        raise ValueError(f"parallel.tensor_parallel={parallel.tensor_parallel} must divide the attention "
                         f"heads ({arch.num_heads}) and key/value heads ({arch.num_kv_heads})")
    if arch.num_layers % parallel.pipeline_parallel:
        raise ValueError(f"parallel.pipeline_parallel={parallel.pipeline_parallel} must divide the "
                         f"number of layers ({arch.num_layers})")
    te = use_te_spec()
    # megatron's fused-RoPE slots hold Transformer Engine's kernels when it is installed; else ours
    fuse_rope = model_cfg.rope_fusion and not te and rope.fusion_usable() and rope.install_rope_fusion()
    config = build_transformer_config(arch, parallel, dtype, recompute=model_cfg.activation_recompute,
                                      rope_fusion=fuse_rope,
                                      cross_entropy_loss_fusion=model_cfg.cross_entropy_loss_fusion)
    if te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        if model_cfg.attention != "sdpa" and config.context_parallel_size > 1:
            raise ValueError(f"model.attention={model_cfg.attention!r} (megatron's DotProductAttention) does not "
                             "support context parallelism; use model.attention: sdpa")
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        norm = _local_rms_norm_class()
        attention = layer_spec.submodules.self_attention.submodules
        if model_cfg.attention == "sdpa":
            attention.core_attention = _sdpa_attention_class()
        if arch.qk_norm:  # megatron sums these weights' grads over TP by name (each rank norms its own heads)
            attention.q_layernorm = attention.k_layernorm = norm
        layer_spec.submodules.input_layernorm = norm
        layer_spec.submodules.pre_mlp_layernorm = norm
        layer_spec = TransformerBlockSubmodules(
            layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=norm
        )
    vocab = padded_vocab_size(arch.vocab_size, model_cfg.make_vocab_size_divisible_by, parallel.tensor_parallel)
    # cpu_shims: on a CPU-only host, tied embeddings under PP; quiet_gpt_deprecation: megatron-core 0.19's
    # GPTModel deprecation notice, and only it (the engine's GPTModel is deliberate: docs/megatron.md)
    with cpu_shims(), quiet_gpt_deprecation(), warnings.catch_warnings():
        # megatron's local spec builds its MLP without ffn_hidden_size (it falls back to the config's, ours)
        warnings.filterwarnings("ignore", message="MLP requires ffn_hidden_size", category=DeprecationWarning)
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=vocab,
            max_sequence_length=max(model_cfg.max_seq_len, 1),
            pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
            parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope", rotary_base=arch.rope_theta,
        )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


# ----------------------------------------------------------------------------------------- weights


def read_safetensors_dir(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model.hf_checkpoint_dir={path!r} holds no *.safetensors files")
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def _split(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank]


def _vocab_shard(w: torch.Tensor, padded: int, tp: int, rank: int) -> torch.Tensor:
    full = torch.zeros(padded, w.shape[1], dtype=w.dtype)
    full[: w.shape[0]] = w
    return _split(full, 0, tp, rank)


def hf_to_megatron_shard(hf: Dict[str, torch.Tensor], arch: ArchSpec, padded_vocab: int, tp: int, rank: int,
                         layer_ids: Dict[int, int], pre_process: bool, post_process: bool) -> Dict[str, torch.Tensor]:
    """Megatron local-spec state-dict entries of TP rank `rank` from HF tensors.

    `layer_ids` maps this stage's local layer index -> global HF layer index.
    """
    g, d, H = arch.num_kv_heads, arch.head_dim, arch.hidden_size
    hpg = arch.num_heads // g
    out: Dict[str, torch.Tensor] = {}
    if pre_process:
        out["embedding.word_embeddings.weight"] = _vocab_shard(hf["model.embed_tokens.weight"], padded_vocab, tp, rank)
    if post_process:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not arch.tie_word_embeddings:
            if "lm_head.weight" not in hf:
                raise KeyError("checkpoint has untied embeddings but no lm_head.weight")
            out["output_layer.weight"] = _vocab_shard(hf["lm_head.weight"], padded_vocab, tp, rank)
    for local, glob_i in layer_ids.items():
        src, dst = f"model.layers.{glob_i}.", f"decoder.layers.{local}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        q = hf[src + "self_attn.q_proj.weight"].reshape(g, hpg * d, H)
        k = hf[src + "self_attn.k_proj.weight"].reshape(g, d, H)
        v = hf[src + "self_attn.v_proj.weight"].reshape(g, d, H)
        out[dst + "self_attention.linear_qkv.weight"] = _split(torch.cat([q, k, v], 1), 0, tp, rank).reshape(-1, H)
        if arch.qkv_bias:
            qb = hf[src + "self_attn.q_proj.bias"].reshape(g, hpg * d)
            kb = hf[src + "self_attn.k_proj.bias"].reshape(g, d)
            vb = hf[src + "self_attn.v_proj.bias"].reshape(g, d)
            out[dst + "self_attention.linear_qkv.bias"] = _split(torch.cat([qb, kb, vb], 1), 0, tp, rank).reshape(-1)
        if arch.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = _split(hf[src + "self_attn.o_proj.weight"], 1, tp, rank)
        gate = _split(hf[src + "mlp.gate_proj.weight"], 0, tp, rank)
        up = _split(hf[src + "mlp.up_proj.weight"], 0, tp, rank)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[dst + "mlp.linear_fc2.weight"] = _split(hf[src + "mlp.down_proj.weight"], 1, tp, rank)
    return out


_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@torch.no_grad()
def load_hf_checkpoint(model, path: str, arch: ArchSpec) -> None:
    """Copy an HF safetensors checkpoint into `model` (the bare GPTModel of this rank), TP-sharded."""
    from megatron.core import parallel_state as mpu

    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    hf = read_safetensors_dir(path)
    if arch.tie_word_embeddings and "model.embed_tokens.weight" not in hf and "lm_head.weight" in hf:
        hf["model.embed_tokens.weight"] = hf["lm_head.weight"]
    layer_ids = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    padded = model.vocab_size
    shard = hf_to_megatron_shard(hf, arch, padded, tp, rank, layer_ids, model.pre_process, model.post_process)
    params = dict(model.state_dict(keep_vars=True))
    te = any(k.endswith("layer_norm_weight") for k in params)
    for name, value in shard.items():
        key = name
        if te:
            for a, b in _TE_RENAMES.items():
                key = key.replace(a, b)
        if key not in params:
            raise KeyError(f"megatron parameter {key!r} not found while loading {path!r}")
        target = params[key]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"shape mismatch for {key}: megatron {tuple(target.shape)} vs checkpoint "
                             f"{tuple(value.shape)}")
        target.copy_(value.to(target.dtype))
    if arch.tie_word_embeddings and model.post_process and not model.pre_process:
        # Last stage of a pipeline with tied embeddings keeps its own copy of the embedding matrix.
        model.output_layer.weight.copy_(_vocab_shard(hf["model.embed_tokens.weight"], padded, tp, rank))

