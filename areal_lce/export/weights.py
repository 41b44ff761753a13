"""The engine's parameters as Hugging Face tensors, gathered from every tensor- and pipeline-parallel rank.

    for name, tensor in hf_tensors(engine):   # collective: every rank of the job iterates
        ...                                   # tensor on global rank 0, None elsewhere

The inverse of `megatron.model.hf_to_megatron_shard`. Each megatron parameter is first made whole over
the tensor-parallel group (its shards joined in rank order along the dimension the layer splits), then
its pipeline stage's copy is gathered over the pipeline group: every stage builds the same number of
layers (the builder requires it) with the same shapes, so local layer i of every stage travels in one
all-gather, and the stage's first layer number (gathered alongside) places it. Only global rank 0 keeps
the results, on the host; the gathers are exact (no arithmetic), so the export of one set of weights is
bitwise the same at every layout. Padded vocabulary rows (megatron pads the vocabulary to a multiple of
make_vocab_size_divisible_by x tensor_parallel) are cut: the embedding and LM head keep the engine's true
vocabulary.

Refused with an error naming it: any parameter outside the mapped set (e.g. MoE experts, a layer spec
with other modules).
"""
from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

from ..op import comms

# how the tensor-parallel shards of a layer parameter join into the whole tensor
REPLICATED, ROWS, COLUMNS, GATE_UP = "replicated", "rows", "columns", "gate_up"
LAYER_PARAMS = {  # megatron local-spec name inside decoder.layers.<i>. -> how its TP shards join
    "input_layernorm.weight": REPLICATED,
    "self_attention.linear_qkv.weight": ROWS,  # whole query groups per rank
    "self_attention.linear_qkv.bias": ROWS,
    "self_attention.q_layernorm.weight": REPLICATED,
    "self_attention.k_layernorm.weight": REPLICATED,
    "self_attention.linear_proj.weight": COLUMNS,  # row-parallel linear: input columns split
    "pre_mlp_layernorm.weight": REPLICATED,
    "mlp.linear_fc1.weight": GATE_UP,  # each rank holds [its gate rows | its up rows]
    "mlp.linear_fc2.weight": COLUMNS,
}
# Transformer Engine's spec fuses the pre-norms into the following linear layer
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
GLOBAL_PARAMS = {"embedding.word_embeddings.weight": ROWS, "decoder.final_layernorm.weight": REPLICATED,
                 "output_layer.weight": ROWS}  # vocabulary rows split over TP; the norm on every rank


def local_parameters(gpt) -> Tuple[Dict[str, torch.Tensor], Dict[int, Dict[str, torch.Tensor]]]:
    """(this rank's global parameters by name, {local layer index: {layer param name: tensor}}), local-spec
    names; any other parameter raises."""
    glob: Dict[str, torch.Tensor] = {}
    layers: Dict[int, Dict[str, torch.Tensor]] = {}
    for name, p in gpt.named_parameters():
        if name in GLOBAL_PARAMS:
            glob[name] = p.detach()
            continue
        parts = name.split(".", 3)
        if parts[:2] == ["decoder", "layers"] and len(parts) == 4:
            key = TE_NAMES.get(parts[3], parts[3])
            if key in LAYER_PARAMS:
                layers.setdefault(int(parts[2]), {})[key] = p.detach()
                continue
        raise ValueError(f"HF export: megatron parameter {name!r} has no Hugging Face counterpart here "
                         f"(mapped: {', '.join(GLOBAL_PARAMS)} and decoder.layers.<i>.{{{', '.join(LAYER_PARAMS)}}})")
    return glob, layers


def _whole(t: torch.Tensor, how: str, tp_group) -> torch.Tensor:
    """The whole parameter from this rank's tensor-parallel shard `t`."""
    tp = comms.group_size(tp_group)
    if how == REPLICATED or tp == 1:
        return t
    if how == ROWS:
        return comms.all_gather_rows(t, tp_group)  # TP shards of output rows -> the whole matrix
    if how == COLUMNS:
        return comms.all_gather_rows(t.t(), tp_group).t()  # TP shards of input columns -> the whole matrix
    rows = comms.all_gather_rows(t, tp_group)  # [gate_0 | up_0 | gate_1 | up_1 ...] -> [gate | up]
    per_rank = rows.reshape(tp, 2, -1, *rows.shape[1:])
    return torch.cat([per_rank[:, 0].flatten(0, 1), per_rank[:, 1].flatten(0, 1)])


def _stage_copies(t: torch.Tensor, pp_group) -> torch.Tensor:
    """[pp, ...]: every pipeline stage's `t` (the same shape on every stage), in stage order."""
    return comms.all_gather_rows(t.unsqueeze(0), pp_group)  # one tensor per stage -> all stages' copies


def _split_qkv(w: torch.Tensor, heads: int, groups: int, head_dim: int):
    """megatron's interleaved [q heads of group g | k_g | v_g] rows -> HF's q, k, v."""
    per_group = w.reshape(groups, (heads // groups + 2) * head_dim, *w.shape[1:])
    q_rows = heads // groups * head_dim
    q = per_group[:, :q_rows].reshape(heads * head_dim, *w.shape[1:])
    k = per_group[:, q_rows:q_rows + head_dim].reshape(groups * head_dim, *w.shape[1:])
    v = per_group[:, q_rows + head_dim:].reshape(groups * head_dim, *w.shape[1:])
    return q, k, v


def layer_to_hf(params: Dict[str, torch.Tensor], arch, prefix: str) -> Dict[str, torch.Tensor]:
    """HF tensors of one whole megatron layer (`prefix` = 'model.layers.<i>.')."""
    out = {prefix + "input_layernorm.weight": params["input_layernorm.weight"],
           prefix + "post_attention_layernorm.weight": params["pre_mlp_layernorm.weight"]}
    q, k, v = _split_qkv(params["self_attention.linear_qkv.weight"], arch.num_heads, arch.num_kv_heads,
                         arch.head_dim)
    out.update({prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v})
    if arch.qkv_bias:
        q, k, v = _split_qkv(params["self_attention.linear_qkv.bias"], arch.num_heads, arch.num_kv_heads,
                             arch.head_dim)
        out.update({prefix + "self_attn.q_proj.bias": q, prefix + "self_attn.k_proj.bias": k,
                    prefix + "self_attn.v_proj.bias": v})
    if arch.qk_norm:
        out[prefix + "self_attn.q_norm.weight"] = params["self_attention.q_layernorm.weight"]
        out[prefix + "self_attn.k_norm.weight"] = params["self_attention.k_layernorm.weight"]
    out[prefix + "self_attn.o_proj.weight"] = params["self_attention.linear_proj.weight"]
    gate, up = params["mlp.linear_fc1.weight"].chunk(2)
    out.update({prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": params["mlp.linear_fc2.weight"]})
    return out


def _check_layer(params: Dict[str, torch.Tensor], arch, where: str) -> None:
    expected = {"input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    expected |= {"self_attention.linear_qkv.bias"} if arch.qkv_bias else set()
    expected |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"} if arch.qk_norm else set()
    if set(params) != expected:
        raise ValueError(f"HF export: {where} holds {sorted(params)}; the {arch.family} architecture maps "
                         f"exactly {sorted(expected)}")


def check_mappable(engine) -> None:
    """Raise ValueError naming what of this rank's model has no Hugging Face counterpart (no collective)."""
    _glob, layers = local_parameters(engine.gpt)
    n_local = len(engine.gpt.decoder.layers)
    if sorted(layers) != list(range(n_local)):
        raise ValueError(f"HF export: parameters found for layers {sorted(layers)}, the stage builds {n_local}")
    for i, params in layers.items():
        _check_layer(params, engine.arch, f"decoder.layers.{i}")


def hf_tensors(engine, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, Optional[torch.Tensor]]]:
    """Collective over the engine's ranks: yields (HF name, tensor) in a fixed order, the tensor (contiguous,
    on the host, in `dtype` or the parameter's own) on global rank 0 and None on the other ranks. Every
    rank must run it to the end (check_mappable first: it raises before any collective)."""
    gpt, arch, d = engine.gpt, engine.arch, engine.dist
    keep = d.rank == 0
    check_mappable(engine)
    glob, layers = local_parameters(gpt)
    n_local = len(gpt.decoder.layers)

    def host(t: torch.Tensor) -> Optional[torch.Tensor]:
        return t.to("cpu", dtype or t.dtype).contiguous() if keep else None

    def from_stage(name: str, stage: int, shape) -> torch.Tensor:
        """The whole global parameter `name` of pipeline stage `stage`, on every rank."""
        t = glob.get(name)
        if t is not None:
            t = _whole(t, GLOBAL_PARAMS[name], d.tp_group)
        else:  # not on this stage: a placeholder of the same shape for the gather
            t = torch.zeros(shape, dtype=next(iter(layers[0].values())).dtype, device=d.device)
        return _stage_copies(t, d.pp_group)[stage] if d.pp_size > 1 else t

    vocab, padded, hidden = engine.vocab_size, gpt.vocab_size, arch.hidden_size
    yield "model.embed_tokens.weight", host(from_stage("embedding.word_embeddings.weight", 0, (padded, hidden))[:vocab])
    first = torch.tensor([gpt.decoder.layers[0].layer_number - 1], device=d.device)  # this stage's first layer
    firsts = _stage_copies(first, d.pp_group)[:, 0].tolist() if d.pp_size > 1 else first.tolist()
    for i in range(n_local):
        whole = {k: _whole(t, LAYER_PARAMS[k], d.tp_group) for k, t in sorted(layers[i].items())}
        copies = {k: _stage_copies(t, d.pp_group) for k, t in whole.items()} if d.pp_size > 1 else None
        for stage, first_layer in enumerate(firsts):
            params = {k: c[stage] for k, c in copies.items()} if copies is not None else whole
            for name, t in layer_to_hf(params, arch, f"model.layers.{first_layer + i}.").items():
                yield name, host(t)
    last = d.pp_size - 1
    yield "model.norm.weight", host(from_stage("decoder.final_layernorm.weight", last, (hidden,)))
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", host(from_stage("output_layer.weight", last, (padded, hidden))[:vocab])
