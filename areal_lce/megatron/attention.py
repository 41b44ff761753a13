"""Core attention for megatron-core's local layer spec: causal attention through torch SDPA.

`SDPAttention` has the constructor and forward signature of megatron-core's `DotProductAttention`
(`layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention`).
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """Causal core attention through torch.nn.functional.scaled_dot_product_attention (flash /
    memory-efficient kernels on GPU): never stores the [b, heads, s, s] probabilities that
    megatron's local DotProductAttention keeps. Same constructor/forward as DotProductAttention;
    only causal masking (the engine's batches are right-padded, so causal is exact)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_unused):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got {attn_mask_type}")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state as mpu

            tp = mpu.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias are not supported")
        s, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        if self.heads != self.groups:  # grouped-query attention: share each K/V head
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
