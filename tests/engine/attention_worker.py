"""Context-parallel cases for tests/engine/test_attention.py: 2 gloo ranks (CPU), one launch for every case.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/engine/attention_worker.py OUT.json
    # CP=2 x TP=2 with sequence parallelism (not in CI; results in docs/results/):
    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/engine/attention_worker.py OUT.json --tp 2 --sp

Each case returns {metric: value}; metrics are maximum absolute differences (reduced with MAX over the
ranks), so pytest asserts on the worst rank. The helpers at the top (tiny GPTModel with SDPAttention,
batches, parameter gradients) are shared with the in-process cases of the test file.
"""
from __future__ import annotations

import inspect
import json
import traceback
import types
import warnings

import torch

warnings.filterwarnings("ignore")

from areal_lce.op import comms  # noqa: E402
from areal_lce.megatron import context_parallel as CP  # noqa: E402

VOCAB = 512
THD_LENGTHS = [7, 12, 3, 9]  # real lengths: padding to multiples of 2*cp is exercised (7 -> 8, 3 -> 4, 9 -> 12)


def init_parallel(cp: int, tp: int = 1, seed: int = 1234) -> None:
    """Megatron parallel state with context-parallel size `cp` and tensor-parallel size `tp` (PP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from areal_lce.engine.config import ParallelConfig
    from areal_lce.engine.parallel import init_distributed

    if not dist.is_initialized():
        init_distributed(ParallelConfig(), seed)
    if not (mpu.model_parallel_is_initialized() and mpu.get_context_parallel_world_size() == cp
            and mpu.get_tensor_model_parallel_world_size() == tp and mpu.get_pipeline_model_parallel_world_size() == 1):
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                      create_gloo_process_groups=True)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)


def build_tiny(cp: int, state=None, tp: int = 1, sp: bool = False):
    """The `tiny` preset (Qwen2-shaped: 4 heads / 2 KV heads, RoPE, untied) as a GPTModel of the local
    spec with SDPAttention, context-parallel size `cp` (parallel state already initialised)."""
    from areal_lce.engine.model import builder as M
    from areal_lce.engine.config import ModelConfig

    cfg = ModelConfig(preset="tiny", max_seq_len=64)
    par = types.SimpleNamespace(tensor_parallel=tp, pipeline_parallel=1, sequence_parallel=sp, context_parallel=cp)
    gpt = M.build_gpt_model(M.resolve_arch(cfg), cfg, par, torch.float32)
    with torch.no_grad():  # random (not zero) q/k/v biases, as a trained Qwen2 has
        for name, p in gpt.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    if state is not None:
        gpt.load_state_dict(state)
    return gpt


def packed_seq_params(cu, cu_padded=None, max_seqlen=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = CP.sequence_lengths(cu_padded if cu_padded is not None else cu)
    m = max(lengths) if max_seqlen is None else max_seqlen
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=m, max_seqlen_kv=m)


def cu_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def thd_batch(lengths=THD_LENGTHS, seed: int = 5):
    """Packed ids [1, T], per-sequence position ids, cu_seqlens (int32)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos, cu_of(lengths)


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel(a: dict, b: dict) -> float:
    assert set(a) == set(b), (set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-12)) for n in b)


# ------------------------------------------------------------------------------------- 2-rank cases


def _megatron_split(batch: dict, group) -> dict:
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = dict(batch, cu_seqlens=None)
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:  # megatron-core >= 0.18
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def split_case() -> dict:
    """split_for_context_parallel vs megatron's own split (BSHD, and THD sequence by sequence); the
    gather is its exact inverse and its gradient is each rank's own slice (no factor cp)."""
    from megatron.core import parallel_state as mpu

    init_parallel(2)
    group = mpu.get_context_parallel_group()
    g = torch.Generator().manual_seed(0)
    bshd = {"tokens": torch.randint(0, VOCAB, (3, 16), generator=g), "hidden": torch.randn(3, 16, 5, generator=g)}
    ref = _megatron_split({k: v.clone() for k, v in bshd.items()}, group)
    out = {"bshd_split_mismatch": max(float((CP.split_for_context_parallel(v, group) != ref[k]).sum())
                                      for k, v in bshd.items())}
    lengths = [8, 4, 12, 0, 4]  # multiples of 2*cp, one empty sequence
    x = torch.randn(1, sum(lengths), 3, generator=g)
    cu = cu_of(lengths)
    per_seq = [_megatron_split({"x": s}, group)["x"] for s in x.split(lengths, dim=1)]
    out["thd_split_mismatch"] = float((CP.split_for_context_parallel(x, group, cu) != torch.cat(per_seq, 1)).sum())
    for name, full, c in (("bshd", bshd["hidden"], None), ("thd", x, cu)):
        local = CP.split_for_context_parallel(full, group, c).requires_grad_()
        gathered = CP.gather_from_context_parallel(local, group, c)
        weight = torch.randn(full.shape, generator=g)  # same on both ranks: a replicated loss
        (gathered * weight).sum().backward()
        out[f"{name}_gather_inverse"] = float((gathered.detach() != full).sum())
        out[f"{name}_gather_grad"] = float((local.grad - CP.split_for_context_parallel(weight, group, c)).abs().max())
    try:
        CP.split_for_context_parallel(torch.zeros(1, 10), group, cu_of([6, 4]))
        out["bad_length_refused"] = 0.0
    except ValueError as e:
        out["bad_length_refused"] = float("pad_for_context_parallel" in str(e))
    return out


def _loss_weight(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def gpt_case(tp: int = 1, sp: bool = False) -> dict:
    """GPTModel at CP=2 vs CP=1 on the same weights (fp32): gathered logits and CP-summed parameter
    gradients, BSHD (b=2, s=16) and THD (4 packed sequences padded to multiples of 2*cp*tp). With
    tp > 1 (4 ranks) logits and gradients are this rank's tensor-parallel shards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    b, s = 2, 16
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s)[None].expand(b, s)
    t_ids, t_pos, cu = thd_batch()
    w_bshd, w_thd = _loss_weight((b, s, VOCAB), 11), _loss_weight((1, sum(THD_LENGTHS), VOCAB), 12)

    init_parallel(1, tp)  # reference: CP=1 (every CP rank computes it: data parallel on the same data)
    shard = lambda w: w.chunk(tp, -1)[mpu.get_tensor_model_parallel_rank()]  # noqa: E731
    w_bshd, w_thd = shard(w_bshd), shard(w_thd)
    pad = CP.pad_for_context_parallel(cu, 2, multiple=4 * tp)  # the CP=2 layout
    ref_model = build_tiny(1, tp=tp, sp=sp)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ref_model.state_dict().items()}
    ref_bshd = ref_model(ids, pos, None)
    (ref_bshd * w_bshd).sum().backward()
    ref_bshd_grads = grads(ref_model)
    ref_model.zero_grad()
    if tp == 1:  # unpadded pack
        ref_thd = ref_model(t_ids, t_pos, None, packed_seq_params=packed_seq_params(cu))
    else:  # sequence parallelism splits the packed tokens: the padded pack (real tokens kept)
        ref_thd = ref_model(CP.pad_packed(t_ids, pad), CP.pad_packed(t_pos, pad), None,
                            packed_seq_params=packed_seq_params(cu, pad.cu_seqlens_padded, pad.max_seqlen))
        ref_thd = ref_thd.index_select(1, pad.index)
    (ref_thd * w_thd).sum().backward()
    ref_thd_grads = grads(ref_model)

    init_parallel(2, tp)
    group = mpu.get_context_parallel_group()
    model = build_tiny(2, state, tp=tp, sp=sp)
    out = {}

    def cp_summed_grads():
        gs = grads(model)
        for v in gs.values():
            dist.all_reduce(v, group=group)  # what DDP over data x context parallel adds up
        model.zero_grad()
        return gs

    # BSHD: every rank holds chunks r and 3-r of both rows; the loss is local (its own tokens).
    split = lambda t: CP.split_for_context_parallel(t, group)  # noqa: E731
    logits = model(split(ids), split(pos), None)
    (logits * split(w_bshd)).sum().backward()
    out["bshd_logits"] = float((CP.gather_from_context_parallel(logits.detach(), group) - ref_bshd).abs().max())
    out["bshd_grad_rel"] = max_rel(cp_summed_grads(), ref_bshd_grads)
    out["logits_scale"] = float(ref_bshd.abs().max())
    # Negative control: contiguous halves instead of the zigzag give wrong positions and masks.
    r = mpu.get_context_parallel_rank()
    with torch.no_grad():
        naive = model(ids[:, r * s // 2:(r + 1) * s // 2], pos[:, r * s // 2:(r + 1) * s // 2], None)
    gathered_naive = comms.all_gather_rows(naive.transpose(0, 1).contiguous(), group).transpose(0, 1)
    out["bshd_contiguous_split_error"] = float((gathered_naive - ref_bshd).abs().max())

    # THD: pad every sequence to a multiple of 2*cp*tp, split per sequence, gather, drop the padding;
    # every rank computes the same loss on the gathered logits (the gather's backward keeps own slices).
    psp = packed_seq_params(cu, pad.cu_seqlens_padded, pad.max_seqlen)
    local_ids = CP.split_for_context_parallel(CP.pad_packed(t_ids, pad), group, pad.cu_seqlens_padded)
    local_pos = CP.split_for_context_parallel(CP.pad_packed(t_pos, pad), group, pad.cu_seqlens_padded)
    logits = model(local_ids, local_pos, None, packed_seq_params=psp)
    full = CP.gather_from_context_parallel(logits, group, pad.cu_seqlens_padded).index_select(1, pad.index)
    (full * w_thd).sum().backward()
    out["thd_logits"] = float((full.detach() - ref_thd).abs().max())
    out["thd_grad_rel"] = max_rel(cp_summed_grads(), ref_thd_grads)
    out["thd_local_tokens"] = float(logits.shape[1])
    return out


def refusal_case() -> dict:
    """SDPAttention under CP refuses a cp_comm_type it does not implement, naming the option."""
    from megatron.core.transformer.enums import AttnMaskType

    from areal_lce.engine.model.attention import SDPAttention

    init_parallel(2)
    config = build_tiny(2).config
    try:
        SDPAttention(config, 1, AttnMaskType.causal, cp_comm_type="p2p")
        return {"p2p_refused": 0.0}
    except ValueError as e:
        return {"p2p_refused": float("cp_comm_type" in str(e))}


def main() -> None:
    """OUT.json [--tp N [--sp]]: with --tp 2 on 4 ranks the GPTModel case runs CP=2 x TP=2 (x SP)."""
    import argparse

    import torch.distributed as dist

    from areal_lce.megatron.compat import megatron_version

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args()
    init_parallel(2)
    results = {"meta": {"megatron_version": list(megatron_version()), "tp": args.tp, "sp": args.sp,
                        "world": dist.get_world_size()}}
    for name, fn in (("split", split_case), ("gpt", lambda: gpt_case(args.tp, args.sp)), ("refusal", refusal_case)):
        try:
            res = fn()
            vals = torch.tensor([float(v) for v in res.values()], dtype=torch.float64)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the worst rank
            results[name] = dict(zip(res, vals.tolist()))
        except Exception:  # report, keep going: pytest shows which case failed and why
            results[name] = {"error": traceback.format_exc()}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():  # megatron-core on a CPU-only host
        main()
