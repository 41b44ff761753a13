"""Core attention for megatron-core's KV-cache inference (static context), on torch SDPA.

What megatron's `Attention` hands the core attention when given a `StaticInferenceContext`
(`_adjust_key_value_for_inference`, megatron-core 0.16-0.19): the new queries [sq, b, heads, d] and the
keys/values of every cached slot [sk, b, groups, d], RoPE applied at the slot positions, and the
`attention_mask` the caller passed to GPTModel.forward unchanged. Prefill is sq == sk at offset 0 with
the layer's causal mask type; decode is sq == 1 against sk cached keys with mask type `no_mask`. The
queries are always the LAST sq slots, so query i may see keys j <= sk - sq + i; a per-sequence mask
([b|1, 1, sq|1, sk] bool, True = masked out, megatron's convention, as its DotProductAttention reads
it) hides more keys per row, e.g. the left padding of shorter prompts (generate.py).

`cached_attention` implements that contract for the engine's `SDPAttention`:
  * grouped-query heads are folded into the query rows ([b, groups, heads/groups * sq, d] against
    [b, groups, sk, d]), so the cached K/V are never repeated per head (SDPAttention's training path
    repeats them; a decode step would copy the whole cache per layer);
  * a row whose keys are all masked (a padding query) sees every key instead of producing NaN, which
    would otherwise reach the cache through that row's next-layer keys and values (0 * NaN = NaN);
  * every layer of one forward receives the same mask object, so the SDPA-form mask (inverted,
    causal offset folded in, expanded to the folded rows) is built once per forward and reused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_last_mask: list = [None, None, None]  # (megatron mask, (version, sq, sk, rep), SDPA mask) of the last call


def sdpa_mask(attention_mask: Optional[torch.Tensor], sq: int, sk: int, rep: int, device) -> Optional[torch.Tensor]:
    """SDPA boolean mask (True = attend) [b|1, 1, rep * sq, sk] for queries at the last sq of sk slots,
    `rep` query heads per K/V head folded into the rows; None when every query sees every key."""
    key = (attention_mask._version, sq, sk, rep) if attention_mask is not None else None
    if attention_mask is not None and _last_mask[0] is attention_mask and _last_mask[1] == key:
        return _last_mask[2]  # the same mask object, not modified in place since
    allowed = None
    if sq > 1:  # causal, offset by the cached prefix sk - sq
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)[None, None]
    if attention_mask is not None:
        keep = ~attention_mask.to(device=device, dtype=torch.bool)
        allowed = keep if allowed is None else allowed & keep
    if allowed is not None:
        allowed = (allowed | ~allowed.any(-1, keepdim=True)).expand(-1, 1, sq, sk)
        allowed = allowed.unsqueeze(2).expand(-1, 1, rep, sq, sk).reshape(-1, 1, rep * sq, sk)
    if attention_mask is not None:
        _last_mask[:] = [attention_mask, key, allowed]
    return allowed


def cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """query [sq, b, heads, d], key/value [sk, b, groups, d] (sq <= sk) -> [sq, b, heads * d]."""
    (sq, b, heads, d), sk, groups = query.shape, key.shape[0], key.shape[2]
    rep = heads // groups
    if sq > sk or rep * groups != heads:
        raise ValueError(f"cached_attention: query {tuple(query.shape)} and key {tuple(key.shape)}: the query "
                         "length must not exceed the key length, and key/value heads must divide query heads")
    q = query.reshape(sq, b, groups, rep, d).permute(1, 2, 3, 0, 4).reshape(b, groups, rep * sq, d)
    out = F.scaled_dot_product_attention(q, key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                                         attn_mask=sdpa_mask(attention_mask, sq, sk, rep, query.device),
                                         scale=scale, dropout_p=dropout_p)
    return out.reshape(b, groups, rep, sq, d).permute(3, 0, 1, 2, 4).reshape(sq, b, heads * d)
