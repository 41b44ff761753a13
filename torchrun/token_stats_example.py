"""Bring your own GPTModel: per-token logprobs and entropy with areal_lce.megatron.token_stats.

    torchrun --nproc_per_node=2 torchrun/token_stats_example.py            # TP=2 + sequence parallel
    python torchrun/token_stats_example.py                                  # one process, TP=1

Runs on CPU (gloo) or GPU (NCCL). The model is an ordinary megatron-core GPTModel built by the caller;
areal_lce only replaces its LM head for the call. Shown: a right-padded BSHD batch and the same
sequences packed as THD, a GRPO-style loss through logprobs and entropy, backward into every parameter.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 1000  # the true vocabulary (an HF config's vocab_size); Megatron pads the embedding to a multiple of 128 x TP


def build_model(tp: int, sequence_parallel: bool):
    """What a Megatron user already has: parallel state, a TransformerConfig, a layer spec, a GPTModel."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from areal_lce.engine.model.attention import SDPAttention  # local-spec core attention with THD support
    from areal_lce.engine.config import ParallelConfig
    from areal_lce.engine.model.builder import _local_rms_norm_class, padded_vocab_size
    from areal_lce.engine.parallel import init_distributed

    # torch.distributed + parallel_state.initialize_model_parallel + model_parallel_cuda_manual_seed
    init_distributed(ParallelConfig(tensor_parallel=tp, sequence_parallel=sequence_parallel), seed=0)
    cfg = TransformerConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                            num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                            attention_dropout=0.0, tensor_model_parallel_size=tp,
                            sequence_parallel=sequence_parallel, use_cpu_initialization=True,
                            params_dtype=torch.float32, gradient_accumulation_fusion=False,
                            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                            apply_rope_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    norm = _local_rms_norm_class()  # a torch RMSNorm that Megatron accepts under sequence parallelism
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
    spec = TransformerBlockSubmodules(layer_specs=[spec] * cfg.num_layers, layer_norm=norm)  # + final norm
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab_size(VOCAB, 128, tp),
                     max_sequence_length=256, parallel_output=True, position_embedding_type="rope")
    return model.cuda() if torch.cuda.is_available() else model


def main(tp: int = 1, sequence_parallel: bool = False) -> dict:
    from areal_lce.megatron import packed_next_token_labels, token_stats

    model = build_model(tp, sequence_parallel)
    device = next(model.parameters()).device
    torch.manual_seed(0)  # the same batch on every rank (a data loader would give TP ranks the same rows)

    # BSHD: 4 right-padded sequences of lengths 40, 33, 17, 24; labels are the next tokens (shifted by
    # the caller), -100 on the last token of each sequence and on padding.
    lengths = [40, 33, 17, 24]
    ids = torch.randint(0, VOCAB, (4, 40), device=device)
    labels = torch.full_like(ids, -100)
    for r, n in enumerate(lengths):
        labels[r, : n - 1] = ids[r, 1:n]
    advantages = torch.randn(4, 1, device=device)
    st = token_stats(model, ids, labels, vocab_size=VOCAB, temperature=1.0)
    mask = labels != -100
    loss = -((advantages * st.logprobs + 0.01 * st.entropy) * mask).sum() / mask.sum()
    loss.backward()

    # THD: the same sequences packed into one row, as AReaL / verl feed Megatron: input_ids [1, T],
    # cu_seqlens at the sequence boundaries, position ids restarting per sequence; labels shifted
    # within each sequence by packed_next_token_labels (the last token of each sequence gets -100).
    from megatron.core.packed_seq_params import PackedSeqParams

    seqs = [ids[r, :n] for r, n in enumerate(lengths)]
    if sequence_parallel:  # T must be a multiple of TP: one padding sequence at the end
        pad = -sum(lengths) % tp
        seqs += [ids.new_zeros(pad)] if pad else []
    seq_lens = torch.tensor([len(x) for x in seqs])
    cu_seqlens = F.pad(seq_lens.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
    packed_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(len(x), device=device) for x in seqs])[None]
    packed_labels = packed_next_token_labels(packed_ids, cu_seqlens)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                          max_seqlen_q=int(seq_lens.max()), max_seqlen_kv=int(seq_lens.max()))
    st_thd = token_stats(model, packed_ids, packed_labels, vocab_size=VOCAB, position_ids=position_ids,
                         packed_seq_params=psp)
    starts = cu_seqlens[:-1].long().tolist()
    as_bshd = torch.zeros(4, 40, 2, device=device)  # back to the padded layout, row by row
    for r, n in enumerate(lengths):
        as_bshd[r, :n, 0] = st_thd.logprobs[0, starts[r]:starts[r] + n].detach()
        as_bshd[r, :n, 1] = st_thd.entropy[0, starts[r]:starts[r] + n].detach()
    result = {
        "loss": float(loss),
        "thd_vs_bshd_logprobs": float((as_bshd[..., 0] - st.logprobs.detach()).abs().max()),
        "thd_vs_bshd_entropy": float((as_bshd[..., 1] - st.entropy.detach()).abs().max()),
        "logprobs_max": float(st.logprobs[mask].max()),
        "head_grad_norm": float(model.output_layer.weight.grad.norm()),
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print(result)
    return result


if __name__ == "__main__":
    from areal_lce.megatron.compat import cpu_shims

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with cpu_shims():  # megatron-core on a CPU-only host (a no-op with CUDA)
        main(tp=world, sequence_parallel=world > 1)
