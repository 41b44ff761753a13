"""Core attention for megatron-core's local layer spec (no Transformer Engine): `SDPAttention`.

Plugged in as `layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention`; it has
the constructor and forward signature of megatron-core's `DotProductAttention`. Causal masks only.
Modes, chosen per call from the inputs:

* BSHD (`packed_seq_params is None`; q/k/v `[s, b, heads, dim]`): one torch SDPA call (flash /
  memory-efficient kernels on GPU; the [b, heads, s, s] probabilities are never stored).
* THD (`packed_seq_params.qkv_format == "thd"`; q/k/v `[t, heads, dim]`): causal attention within
  each packed sequence of `cu_seqlens_q_padded` (else `cu_seqlens_q`). On CUDA in bf16/fp16 one
  `torch.nn.attention.varlen.varlen_attn` call (flash varlen); otherwise (CPU, fp32, dropout, older
  torch) one SDPA call per sequence, exact. Padding slots of `cu_seqlens_q_padded` (each sequence's
  tokens past its `cu_seqlens_q` length) output zeros; real tokens never see them (causal, pads last).
  The lengths come from the PackedLayout the engine's PackedSeqParams carry (`PackedLayout.of`: its host
  copy, no read of a device tensor); a PackedSeqParams without one is read once per forward.
* Context parallel (the CP group of `pg_collection.cp` has > 1 rank; megatron's `all_gather`
  cp_comm_type): K and V are all-gathered over the CP group (megatron's
  `gather_from_sequence_parallel_region`: forward all-gather, backward reduce-scatter of dK/dV), put
  back in sequence order, and every local query chunk (chunks r and 2cp−1−r of each sequence, see
  `context_parallel.py`) attends to the key prefix up to its own global position. BSHD: two SDPA calls
  with a lower-right causal mask; THD: the same segments through varlen / per-segment SDPA.

Every attention call here is causal with the queries aligned to the END of their keys ("lower right":
query j of a segment with lq queries and lk keys sees keys 0..lk−lq+j), which is also what decoding
with a KV cache needs (lq < lk); `SDPAttention.forward` hands those shapes to `cached_attention`
(kv_attention.py) under megatron's static inference context.
"""
from __future__ import annotations

import functools
import inspect
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ...megatron.context_parallel import CPGroup, gathered_to_packed, zigzag_positions
from .kv_attention import cached_attention
from ...megatron.packing import PackedLayout, host_to_device, ranges, sequence_lengths


def causal_attention(q, k, v, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """SDPA on [b, n, sq, d] queries and [b, n, sk, d] keys (sq <= sk), causal aligned lower right."""
    if q.shape[-2] == k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[-2], k.shape[-2])  # flash / efficient kernels on GPU, no [sq, sk] mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout)


def _expand_kv(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Grouped-query attention: repeat each K/V head for the query heads that share it."""
    return t if t.shape[dim] == heads else t.repeat_interleave(heads // t.shape[dim], dim=dim)


class VarlenSegments(NamedTuple):
    """Segment i: queries q[bounds_q[i]:bounds_q[i+1]] attend keys k[bounds_k[i]:bounds_k[i+1]]."""

    bounds_q: List[int]
    bounds_k: List[int]
    cu_q: torch.Tensor  # int32 device copies of the bounds (varlen_attn's cu_seq_q / cu_seq_k)
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def make_segments(q_lens: torch.Tensor, k_lens: torch.Tensor, device) -> VarlenSegments:
    """Segments of these query / key lengths (host int tensors; empty segments dropped)."""
    if q_lens.shape != k_lens.shape or bool((q_lens > k_lens).any()):
        raise ValueError(f"every segment needs at least as many keys as queries: {q_lens.tolist()[:8]} queries, "
                         f"{k_lens.tolist()[:8]} keys")
    keep = q_lens > 0
    q_lens, k_lens = q_lens[keep], k_lens[keep]
    bq = [0] + torch.cumsum(q_lens, 0).tolist()
    bk = [0] + torch.cumsum(k_lens, 0).tolist()
    as_dev = lambda b: host_to_device(torch.tensor(b, dtype=torch.int32), device)  # noqa: E731
    return VarlenSegments(bq, bk, as_dev(bq), as_dev(bk), int(q_lens.max()) if len(bq) > 1 else 0,
                          int(k_lens.max()) if len(bk) > 1 else 0)


@functools.lru_cache(maxsize=None)
def _varlen_api():
    """(varlen_attn, its keyword names) or None: torch >= 2.10 (causal via is_causal=True in 2.10,
    window_size=(-1, 0) from 2.11; `scale` and `enable_gqa` only in some releases)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = set(inspect.signature(varlen_attn).parameters)
    return (varlen_attn, params) if params & {"window_size", "is_causal"} else None


def varlen_usable(q: torch.Tensor, scale: float, dropout: float) -> bool:
    """Whether varlen_attn (flash) can run this call: CUDA, bf16/fp16, head dim % 8 == 0 and <= 256,
    no dropout, and a softmax scale it can express."""
    api = _varlen_api()
    d = q.shape[-1]
    return (api is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0
            and d <= 256 and dropout == 0.0 and ("scale" in api[1] or abs(scale - d ** -0.5) < 1e-12 * scale))


def causal_varlen_attention(q, k, v, segs: VarlenSegments, scale: float, dropout: float = 0.0,
                            impl: str = "auto") -> torch.Tensor:
    """Causal (lower-right) attention per segment. q [Tq, n, d]; k, v [Tk, g, d] (g divides n).

    impl: "varlen" (torch varlen_attn, CUDA bf16/fp16), "sdpa" (one SDPA call per segment, any device
    and dtype, exact), "auto" (varlen where usable, else sdpa)."""
    if segs.bounds_q[-1] != q.shape[0] or segs.bounds_k[-1] != k.shape[0]:
        raise ValueError(f"segments cover {segs.bounds_q[-1]} queries / {segs.bounds_k[-1]} keys, tensors "
                         f"hold {q.shape[0]} / {k.shape[0]}")
    if impl not in ("auto", "varlen", "sdpa"):
        raise ValueError(f"impl={impl!r}: expected auto, varlen or sdpa")
    use_varlen = impl == "varlen" or (impl == "auto" and varlen_usable(q, scale, dropout))
    if not use_varlen and q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("THD attention under CUDA-graph capture runs only through varlen_attn (CUDA bf16/fp16, "
                           f"head dim % 8 == 0 and <= 256, no dropout); got {q.dtype}, d={q.shape[-1]}, "
                           f"dropout={dropout}")
    if use_varlen:
        if not varlen_usable(q, scale, dropout):
            raise RuntimeError("impl='varlen' needs torch >= 2.10 varlen_attn on CUDA in bf16/fp16, head dim "
                               f"% 8 == 0 and <= 256, no dropout (got {q.device}, {q.dtype}, d={q.shape[-1]}, "
                               f"dropout={dropout})")
        fn, params = _varlen_api()
        kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        if "scale" in params:
            kw["scale"] = scale
        if "enable_gqa" in params and k.shape[1] != q.shape[1]:
            kw["enable_gqa"] = True
        else:
            k, v = _expand_kv(k, q.shape[1], 1), _expand_kv(v, q.shape[1], 1)
        return fn(q, k, v, segs.cu_q, segs.cu_k, segs.max_q, segs.max_k, **kw)
    k, v = _expand_kv(k, q.shape[1], 1), _expand_kv(v, q.shape[1], 1)
    outs = []
    for (q0, q1), (k0, k1) in zip(zip(segs.bounds_q, segs.bounds_q[1:]), zip(segs.bounds_k, segs.bounds_k[1:])):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))  # [1, n, l, d]
        outs.append(causal_attention(qs, ks, vs, scale, dropout)[0].transpose(0, 1))
    return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)


class ThdPlan(NamedTuple):
    """What the THD attention of one packed micro-batch needs, computed once and shared by all layers."""

    segments: VarlenSegments
    k_index: Optional[torch.Tensor]  # CP: gathered-K row of every segment key (None: keys = local K)
    real: Optional[torch.Tensor]  # bool [t_local]: real token (None: no padding slots)


def _host(t, name: str) -> List[int]:
    return sequence_lengths(t, f"packed_seq_params.{name}")


def captured_plan(psp, local_tokens: int, cp_size: int) -> ThdPlan:
    """The plan while a CUDA graph is being captured: nothing is read on the host, so what a replay
    gets is what its inputs hold then. cu_seqlens_q (= cu_seqlens_kv, no padded variants) must be a
    CUDA int32 tensor whose segments (zero-length ones allowed) cover the `local_tokens` packed tokens,
    and max_seqlen_q an upper bound of every segment for every replay (the packed length is one); the
    varlen kernel takes them as they are. One CP rank, self-attention over the same sequences."""
    cu, cu_k = psp.cu_seqlens_q, psp.cu_seqlens_kv
    if cp_size != 1:
        raise ValueError("SDPAttention THD under CUDA-graph capture: context parallelism reads the "
                         "sequence lengths on the host; capture with one CP rank")
    if not (torch.is_tensor(cu) and cu.is_cuda and cu.dtype == torch.int32 and cu.dim() == 1):
        raise ValueError("SDPAttention THD under CUDA-graph capture: packed_seq_params.cu_seqlens_q must be a "
                         f"1-D int32 CUDA tensor (the graph's input), got {getattr(cu, 'dtype', type(cu))} on "
                         f"{getattr(cu, 'device', '?')}")
    if cu_k is not cu or any(getattr(psp, n, None) not in (None, cu)
                             for n in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        raise ValueError("SDPAttention THD under CUDA-graph capture: packed_seq_params.cu_seqlens_kv(_padded) "
                         "and cu_seqlens_q_padded must be None or the cu_seqlens_q tensor itself")
    longest = psp.max_seqlen_q
    if not isinstance(longest, int) or longest < 1 or psp.max_seqlen_kv != longest:
        raise ValueError(f"SDPAttention THD under CUDA-graph capture: max_seqlen_q = max_seqlen_kv must be a "
                         f"positive int bounding every segment of every replay, got {psp.max_seqlen_q} / "
                         f"{psp.max_seqlen_kv}")
    bounds = [0, local_tokens]  # only the token count is checked against the tensors
    return ThdPlan(VarlenSegments(bounds, bounds, cu, cu, longest, longest), None, None)


def thd_plan(psp, local_tokens: int, cp_size: int, cp_rank: int, device) -> ThdPlan:
    """Segments, CP key index and padding mask of `psp` (megatron PackedSeqParams, qkv_format "thd")."""
    if psp.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format='thd'")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return captured_plan(psp, local_tokens, cp_size)
    padded_name = "cu_seqlens_q_padded" if psp.cu_seqlens_q_padded is not None else "cu_seqlens_q"
    layout = PackedLayout.of(psp, "packed_seq_params")  # the engine's carries its layout: no host reads
    lengths, real = list(layout.padded_lengths), list(layout.lengths)
    if psp.cu_seqlens_kv is None:
        raise ValueError("packed_seq_params.cu_seqlens_kv is required (megatron's THD RoPE of the keys reads "
                         "it): set it, and cu_seqlens_kv_padded, equal to the query ones")
    q_padded = psp.cu_seqlens_q if psp.cu_seqlens_q_padded is None else psp.cu_seqlens_q_padded
    kv_padded = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
    same_kv = psp.cu_seqlens_kv is psp.cu_seqlens_q and kv_padded is q_padded  # self-attention's one layout
    if not same_kv and (_host(psp.cu_seqlens_kv, "cu_seqlens_kv") != real
                        or _host(kv_padded, "cu_seqlens_kv_padded") != lengths):
        raise NotImplementedError("packed_seq_params.cu_seqlens_kv(_padded) differ from cu_seqlens_q(_padded): "
                                  "only self-attention over the same packed sequences is supported")
    if getattr(psp, "local_cp_size", None) not in (None, cp_size):
        raise NotImplementedError(f"packed_seq_params.local_cp_size={psp.local_cp_size} (hybrid context "
                                  f"parallelism) is not supported; the CP group has {cp_size} ranks")
    if sum(lengths) != local_tokens * cp_size:
        raise ValueError(f"packed_seq_params.{padded_name}[-1] = {sum(lengths)} but attention got "
                         f"{local_tokens} tokens" + (f" x cp {cp_size}" if cp_size > 1 else ""))
    longest = max(getattr(psp, "max_seqlen_q", None) or 0, getattr(psp, "max_seqlen_kv", None) or 0)
    if longest < max(lengths) or (longest == sum(lengths) and sum(n > 0 for n in lengths) > 1):
        raise ValueError(f"packed_seq_params.max_seqlen_q/kv = {longest}: it must be the longest (padded) "
                         f"sequence, {max(lengths)} (megatron sizes RoPE by it; equal to the packed length "
                         f"{sum(lengths)} it reads positions as continuing across sequences)")
    L, R = torch.tensor(lengths), torch.tensor(real)
    if cp_size == 1:
        positions, k_index = None, None
        segments = make_segments(L, L, device)
    else:
        positions = zigzag_positions(lengths, cp_size, cp_rank)  # global packed position of each local token
        starts = torch.cumsum(L, 0) - L
        c = L // (2 * cp_size)
        q_lens = torch.stack([c, c], 1).reshape(-1)  # per sequence: chunk r, then chunk 2cp-1-r
        k_lens = torch.stack([(cp_rank + 1) * c, (2 * cp_size - cp_rank) * c], 1).reshape(-1)  # key prefixes
        k_pos = ranges(starts.repeat_interleave(2), k_lens)
        k_index = gathered_to_packed(lengths, cp_size)[k_pos].to(device)
        segments = make_segments(q_lens, k_lens, device)
    if real == lengths:  # no padding slots (what packing builds without CP): no mask, no per-token host work
        return ThdPlan(segments, k_index, None)
    # over the whole packed row: each sequence's real tokens, then its padding slots
    is_real = torch.repeat_interleave(torch.tensor([True, False]).repeat(len(lengths)),
                                      torch.stack([R, L - R], 1).reshape(-1))
    if positions is not None:
        is_real = is_real[positions]
    return ThdPlan(segments, k_index, None if bool(is_real.all()) else is_real.to(device))


class SDPAttention(MegatronModule):
    """Causal core attention (BSHD, packed THD, context parallel) from torch's own kernels: SDPA and
    varlen_attn; see the module docstring. Same constructor/forward as megatron's DotProductAttention."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_unused):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got {attn_mask_type}")
        from megatron.core import parallel_state as mpu

        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp = pg_collection.tp.size()
        else:
            tp = mpu.get_tensor_model_parallel_world_size()
        cp = getattr(pg_collection, "cp", None)
        if cp is None:
            cp = mpu.get_context_parallel_group() if mpu.model_parallel_is_initialized() else None
        cp = CPGroup.of(cp)  # megatron's pg_collection / parallel state, converted once
        self.cp_group, self.cp_size, self.cp_rank = cp.group, cp.size, cp.rank
        if self.cp_size > 1 and cp_comm_type is not None and str(cp_comm_type).replace("_", "").lower() != "allgather":
            raise ValueError(f"SDPAttention runs context parallelism by all-gathering K/V: cp_comm_type="
                             f"{cp_comm_type!r} is not supported; set TransformerConfig.cp_comm_type='all_gather'")
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is None and (key.shape[0] != query.shape[0]
                                          or (attention_mask is not None and attention_mask.shape[0] > 1)):
            # KV-cache generation (megatron's static inference context): decode shapes (queries fewer than
            # the cached keys, mask type no_mask) and per-sequence padding masks, kv_attention.py
            if self.cp_size > 1:
                raise ValueError("SDPAttention: KV-cache decoding under context parallelism is not supported")
            return cached_attention(query, key, value, attention_mask, self.scale, dropout)
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got attn_mask_type={attn_mask_type}")
        if packed_seq_params is None:
            return self._bshd(query, key, value, dropout)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"SDPAttention: packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}; "
                             "only 'thd' packed sequences are supported")
        return self._thd(query, key, value, packed_seq_params, dropout)

    def _gather_kv(self, key, value):
        """K and V of every CP rank, concatenated in rank order along dim 0 (one all-gather; its backward
        reduce-scatters dK/dV: every rank's queries contributed to every rank's keys)."""
        kv = torch.cat([key, value], dim=-1)
        kv = tensor_parallel.gather_from_sequence_parallel_region(kv, tensor_parallel_output_grad=True,
                                                                  group=self.cp_group)
        return kv.split([key.shape[-1], value.shape[-1]], dim=-1)

    def _bshd(self, query, key, value, dropout):
        s, b = query.shape[0], query.shape[1]
        if self.cp_size > 1:
            if s % 2:
                raise ValueError(f"context parallel: the local sequence ({s} tokens) must hold two equal chunks")
            key, value = self._gather_kv(key, value)
            inv = _unzigzag_index(s * self.cp_size, self.cp_size, key.device)
            key, value = key.index_select(0, inv), value.index_select(0, inv)  # sequence order
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        k, v = _expand_kv(k, self.heads, 1), _expand_kv(v, self.heads, 1)
        if self.cp_size == 1:
            out = causal_attention(q, k, v, self.scale, dropout)
        else:  # local chunks r and 2cp-1-r, each against the keys up to its end
            c = s // 2
            out = torch.cat([causal_attention(q[:, :, h * c:(h + 1) * c], k[:, :, :(j + 1) * c], v[:, :, :(j + 1) * c],
                                              self.scale, dropout)
                             for h, j in enumerate((self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank))], dim=2)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def _thd(self, query, key, value, psp, dropout):
        if query.dim() != 3 or key.dim() != 3:
            raise ValueError(f"SDPAttention THD: expected query/key [t, heads, dim], got {tuple(query.shape)} / "
                             f"{tuple(key.shape)}")
        plan = self._plan(psp, query)
        if plan.k_index is not None:
            key, value = self._gather_kv(key, value)
            key, value = key.index_select(0, plan.k_index), value.index_select(0, plan.k_index)
        out = causal_varlen_attention(query, key, value, plan.segments, self.scale, dropout)
        if plan.real is not None:
            out = out.masked_fill(~plan.real[:, None, None], 0.0)  # padding slots: zeros
        return out.reshape(query.shape[0], self.heads * self.head_dim)

    def _plan(self, psp, query) -> ThdPlan:
        # Shared by every layer of one forward: cached on the PackedSeqParams object. The entry keeps its
        # cu_seqlens tensors alive and is matched by identity and version, so a replaced or modified
        # tensor recomputes the plan.
        tensors = (psp.cu_seqlens_q, psp.cu_seqlens_q_padded, psp.cu_seqlens_kv, psp.cu_seqlens_kv_padded)
        key = (self.cp_size, self.cp_rank, query.shape[0], str(query.device), psp.max_seqlen_q, psp.max_seqlen_kv,
               getattr(psp, "local_cp_size", None), tuple(getattr(t, "_version", None) for t in tensors))
        store = getattr(psp, "__dict__", {})
        cached = store.get("_areal_lce_thd_plan")
        if cached is None or cached[1] != key or any(a is not b for a, b in zip(cached[0], tensors)):
            cached = (tensors, key, thd_plan(psp, query.shape[0], self.cp_size, self.cp_rank, query.device))
            store["_areal_lce_thd_plan"] = cached
        return cached[2]


@functools.lru_cache(maxsize=64)
def _unzigzag_index(tokens: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """BSHD: gathered (rank-ordered) rows -> sequence order."""
    return gathered_to_packed([tokens], cp_size).to(device)
