"""NeMo-RL adapter, packed THD and context parallelism: the fused form of NeMo-RL's
`nemo_rl.distributed.model_utils.from_parallel_logits_to_logprobs_packed_sequences` (snapshot 7ea279a),
taking the last stage's hidden states and the LM-head weight shard instead of the [1, T/cp, V/tp] logits.

    from areal_lce.integrations.nemo_rl_packed import from_parallel_hidden_states_to_logprobs_packed_sequences
    lp = from_parallel_hidden_states_to_logprobs_packed_sequences(
        hidden_states, output_weight, input_ids, packed_seq_params.cu_seqlens_q_padded, unpacked_seqlen,
        vocab_start_index, vocab_end_index, tp_group, cp_group=cp_group, temperature=generation_temperature)

is, outputs and gradients, NeMo-RL's
    logits = (hidden_states · output_weightᵀ) in the model's dtype, [1, T/cp, V/tp], / temperature
    lp = from_parallel_logits_to_logprobs_packed_sequences(logits, input_ids, cu_seqlens_padded,
                                                           unpacked_seqlen, vocab_start_index, ...)
  tensor_parallel_hidden_states [T/(cp·tp), 1, H]: the decoder's output on this rank: the CP rank's share of
      the packed sequences (megatron's zigzag: per sequence chunks r and 2cp-1-r of 2cp), and under tensor
      parallelism its sequence-parallel shard (all-gathered inside, d_hidden reduce-scattered back).
  output_weight_layer [V/tp, H]: this rank's vocab shard [vocab_start_index, vocab_end_index) = rank·V/tp...
  target: [1, T] the packed input ids (rolled by -1 within each sequence inside), or with
      target_is_pre_rolled=True [1, T/cp], already rolled and CP-sharded (NeMo-RL's two forms).
  cu_seqlens_padded [B+1]: the packed sequences' padded bounds (full, not CP-adjusted); every length a multiple
      of 2·cp when cp > 1 (NeMo-RL pads them so).
  Returns fp32 logprobs [B, unpacked_seqlen - 1]: sequence i's first min(len_i - 1, unpacked_seqlen - 1)
  positions, zero past them (NeMo-RL's layout), the same on every CP rank.
  Gradients (NeMo-RL's conventions): the CP all-gather's backward SUMS the output gradient over the CP group
  before each rank takes its rows (NeMo-RL's AllGatherCPTensor: every CP rank computes the loss on the
  gathered logprobs and megatron averages the gradients over CP); d_weight is this rank's shard's.

Semantics and tolerances as `areal_lce.integrations.nemo_rl` (softmax over the whole shard, padding included;
bf16 logits for bf16 inputs; exact mode with vocab_size= and logits_precision="fp32"). temperature: NeMo-RL
divides the logits by the generation temperature (`apply_temperature_scaling`) before this call; here it is
an argument. Refused: top-k / top-p sampling params (NeMo-RL's *WithSampling masks the [T, V/tp] logits,
the tensor the fused op never builds) and a chunk_size other than an int or None (chunking is moot: no logits).
`..._and_entropy` (same arguments) also returns the entropy [B, unpacked_seqlen - 1] of the same softmax,
differentiable, gathered the same way (NeMo-RL's loss has no entropy term; for a loss of one's own).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..op import comms
from ..op.api import linear_logprobs_entropy
from ..op.types import VocabParallel
from ._common import NO_IGNORE_INDEX, check_no_negative_labels, check_op_options, consistency_options, op_value
from .nemo_rl import check_vocab_range, default_precision

_NAME = "areal_lce.integrations.nemo_rl_packed.from_parallel_hidden_states_to_logprobs_packed_sequences"


class AllGatherRowsSummedGrad(torch.autograd.Function):
    """forward: all-gather of each CP rank's [n, ...] rows in rank order; backward: the SUM of the gradient
    over the group, this rank's block of it (a reduce-scatter): NeMo-RL's AllGatherCPTensor convention."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return comms.all_gather_rows(t, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # SUM over CP ranks of the (per-rank) gradient of the gathered rows, each rank keeping its own block
        return comms.reduce_scatter_rows(g, ctx.group), None


def check_sampling(sampling_params, where: str) -> float:
    """The temperature of NeMo-RL's TrainingSamplingParams (1 for None). Top-k / top-p filtering (NeMo-RL's
    rule: top_k > 0 or top_p != 1) is refused: it masks the [T, V/tp] logits the op never builds."""
    if sampling_params is None:
        return 1.0
    top_k, top_p = getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0)
    if (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0):
        raise NotImplementedError(f"{where}: top-k / top-p sampling (top_k={top_k}, top_p={top_p}) masks the "
                                  "[T, V/tp] logits (NeMo-RL's *WithSampling), the tensor the fused op never builds; "
                                  "set policy.generation.top_k=null and top_p=1.0, or "
                                  "policy.megatron_cfg.use_fused_linear_logprobs=false")
    return float(getattr(sampling_params, "temperature", 1.0))


def zigzag_index(lengths: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Packed positions of CP rank `cp_rank`'s tokens in its local order: per sequence chunks r, 2cp-1-r of 2cp
    (megatron's and NeMo-RL's load-balanced split; lengths multiples of 2cp). cp = 1: every position, in order
    (lengths of any parity: no split)."""
    if cp == 1:
        return torch.arange(int(lengths.sum()))
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    offset = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths)[seg]
    chunk = offset // (lengths // (2 * cp)).clamp(min=1)[seg]
    return ((chunk == cp_rank) | (chunk == 2 * cp - 1 - cp_rank)).nonzero().squeeze(1)


def _lengths(cu_seqlens_padded, cp: int) -> torch.Tensor:
    cu = torch.as_tensor(cu_seqlens_padded).detach().to("cpu", torch.int64).reshape(-1)
    lengths = cu[1:] - cu[:-1]
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"{_NAME}: cu_seqlens_padded must be cumulative lengths [0, l0, l0+l1, ...], got "
                         f"{cu[:8].tolist()}")
    if cp > 1 and bool((lengths % (2 * cp)).any()):
        raise ValueError(f"{_NAME}: with a cp_group of {cp} ranks every padded sequence length must be a multiple "
                         f"of 2·cp = {2 * cp} (megatron's load-balanced split), got {lengths.tolist()[:8]}")
    return lengths


def _local_labels(target, lengths, cp, cp_rank, pre_rolled):
    total = int(lengths.sum())
    if pre_rolled:
        if not torch.is_tensor(target) or target.numel() != total // cp:
            raise ValueError(f"{_NAME}: a pre-rolled target must be this CP rank's [1, T/cp] = [1, {total // cp}], "
                             f"got {tuple(getattr(target, 'shape', ()))}")
        return target.reshape(-1)
    if not torch.is_tensor(target) or target.dim() != 2 or target.shape[0] != 1 or target.shape[1] != total:
        raise ValueError(f"{_NAME}: target must be the packed [1, T] = [1, {total}] input ids (cu_seqlens_padded[-1]); "
                         f"got {tuple(getattr(target, 'shape', ()))}")
    t = target.reshape(-1)
    starts = (torch.cumsum(lengths, 0) - lengths).to(t.device)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=t.device), lengths.to(t.device))
    pos = torch.arange(total, device=t.device)
    nxt = torch.where(pos + 1 < (starts + lengths.to(t.device))[seg], pos + 1, starts[seg])  # roll -1 per sequence
    return t[nxt].index_select(0, zigzag_index(lengths, cp, cp_rank).to(t.device))


def _unpack(local: torch.Tensor, lengths, cp: int, cp_group, unpacked_seqlen: int) -> torch.Tensor:
    """This rank's [T/cp] per-token values -> [B, unpacked_seqlen - 1] in NeMo-RL's layout."""
    if cp > 1:
        gathered = AllGatherRowsSummedGrad.apply(local, cp_group)  # [cp · T/cp], rank-major
        order = torch.cat([zigzag_index(lengths, cp, r) for r in range(cp)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        local = gathered.index_select(0, inverse.to(gathered.device))  # packed order
    width = unpacked_seqlen - 1
    keep = (lengths - 1).clamp(min=0).clamp(max=width)
    starts = torch.cumsum(lengths, 0) - lengths
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), keep)
    offset = torch.arange(int(keep.sum())) - (torch.cumsum(keep, 0) - keep)[seg]
    src, dst = (starts[seg] + offset).to(local.device), (seg * width + offset).to(local.device)
    out = local.new_zeros(lengths.numel() * width)
    return out.index_copy(0, dst, local.index_select(0, src)).view(lengths.numel(), width)


def _packed(hidden, weight, target, cu_seqlens_padded, unpacked_seqlen, vocab_start_index, vocab_end_index,
            tp_group, inference_only, cp_group, chunk_size, sampling_params, target_is_pre_rolled, temperature,
            vocab_size, logits_precision, invariant, check_labels, op_options, entropy: bool):
    check_op_options(op_options, _NAME)
    check_sampling(sampling_params, _NAME)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"{_NAME}: chunk_size must be an int or None, got {chunk_size!r}")
    if isinstance(unpacked_seqlen, bool) or not isinstance(unpacked_seqlen, int) or unpacked_seqlen < 1:
        raise ValueError(f"{_NAME}: unpacked_seqlen must be an int >= 1, got {unpacked_seqlen!r}")
    opts = op_value(op_options, _NAME, temperature)
    tp = comms.checked_group_size(tp_group, f"{_NAME}: tp_group")
    cp = comms.checked_group_size(cp_group, f"{_NAME}: cp_group")
    lengths = _lengths(cu_seqlens_padded, cp)
    local_tokens = int(lengths.sum()) // cp
    if not torch.is_tensor(hidden) or hidden.dim() != 3 or hidden.shape[1] != 1 \
            or hidden.shape[0] * tp != local_tokens:
        raise ValueError(f"{_NAME}: tensor_parallel_hidden_states must be [T/(cp·tp), 1, H] = [{local_tokens}/{tp}, 1, H] "
                         f"(T = cu_seqlens_padded[-1], cp {cp}, tp {tp}: the sequence-parallel shard of this CP "
                         f"rank's tokens), got {tuple(getattr(hidden, 'shape', ()))}")
    check_vocab_range(weight, vocab_start_index, vocab_end_index, tp_group, _NAME)
    consistency = consistency_options(invariant, default_precision(hidden.dtype, logits_precision, _NAME), _NAME)
    labels = _local_labels(target, lengths, cp, comms.group_rank(cp_group), target_is_pre_rolled)
    check_no_negative_labels(labels, check_labels, tp, _NAME)
    vp = VocabParallel(tp_group, d_hidden="reduce_scatter" if tp > 1 else "all_reduce")
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        out = linear_logprobs_entropy(hidden[:, 0], weight, labels, opts, vocab_parallel=vp,
                                      vocab_size=vocab_size, ignore_index=NO_IGNORE_INDEX, check_labels=check_labels,
                                      **consistency)
        lp = _unpack(out.logprobs, lengths, cp, cp_group, unpacked_seqlen)
        return (lp, _unpack(out.entropy, lengths, cp, cp_group, unpacked_seqlen)) if entropy else lp


def from_parallel_hidden_states_to_logprobs_packed_sequences(
    tensor_parallel_hidden_states: torch.Tensor, output_weight_layer: torch.Tensor, target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor, unpacked_seqlen: int, vocab_start_index: int, vocab_end_index: int,
    tp_group, inference_only: bool = False, cp_group=None, chunk_size: Optional[int] = None,
    sampling_params=None, target_is_pre_rolled: bool = False, *, temperature: float = 1.0,
    vocab_size: Optional[int] = None, logits_precision: Optional[str] = None, invariant: Optional[bool] = None,
    check_labels=True, _entropy: bool = False, **op_options,
) -> torch.Tensor:
    """NeMo-RL's packed log-prob function on hidden states -> fp32 [B, unpacked_seqlen - 1] (module docstring)."""
    return _packed(tensor_parallel_hidden_states, output_weight_layer, target, cu_seqlens_padded, unpacked_seqlen,
                   vocab_start_index, vocab_end_index, tp_group, inference_only, cp_group, chunk_size,
                   sampling_params, target_is_pre_rolled, temperature, vocab_size, logits_precision, invariant,
                   check_labels, op_options, entropy=_entropy)


def from_parallel_hidden_states_to_logprobs_and_entropy_packed_sequences(*args, **kwargs):
    """(logprobs, entropy), each fp32 [B, unpacked_seqlen - 1], of the same call: the arguments of
    `from_parallel_hidden_states_to_logprobs_packed_sequences` (module docstring)."""
    return from_parallel_hidden_states_to_logprobs_packed_sequences(*args, _entropy=True, **kwargs)
