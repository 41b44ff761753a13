"""TP=2 cases of the framework adapters (gloo, CPU), for tests/integrations/test_integrations.py.

Launched by pytest:  python -m torch.distributed.run --nproc_per_node=2 tests/integrations/integrations_worker.py OUT.json
Every rank builds the same full inputs, keeps its vocab shard of the weight (and its sequence rows where
the framework hands the op sequence-parallel shards), and calls the adapter the way the framework does:
  verl   hidden gathered by megatron's own gather_from_sequence_parallel_region (verl's SP path; its
         backward reduce-scatter is the only reduction of d_hidden), weight shard, dist_process_group.
  AReaL  a real megatron ColumnParallelLinear (tp_group given, no parallel_state) as output_layer, with
         and without sequence parallel.
Rank 0 writes {case: {metric: error}} with errors max |Δ| / max(1, max |ref|), the worst over ranks,
against verl's own torch op (full weight) and the fp64 AReaL oracle.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))

from helpers import adapter_oracles as I  # noqa: E402
from areal_lce.integrations import areal as lce_areal  # noqa: E402
from areal_lce.integrations import verl as lce_verl  # noqa: E402

T, H, V_SHARD = 12, 16, 37  # odd shard: labels at 36 / 37 sit on the shard edge (invariant=False: off the
# 128-id grid the invariant mode needs); the invariant case uses megatron's padding, 128 ids per shard


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, 1, H, generator=g)
    weight = torch.randn(2 * V_SHARD, H, generator=g) * 0.5
    labels = torch.randint(0, 2 * V_SHARD, (1, T), generator=g)
    labels[0, :4] = torch.tensor([V_SHARD - 1, V_SHARD, 0, 2 * V_SHARD - 1])
    return hidden, weight, labels, torch.randn(T, generator=g), torch.randn(T, generator=g)


def verl_case(group, reduction: str, backend: str) -> dict:
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    rank = dist.get_rank(group)
    hidden, weight, labels, g_lp, g_ent = inputs(1)
    if reduction != "none":
        g_lp = g_lp[0]
    rows, cols = slice(rank * T // 2, (rank + 1) * T // 2), slice(rank * V_SHARD, (rank + 1) * V_SHARD)
    h_loc = hidden[rows].clone().requires_grad_()
    w_loc = weight[cols].clone().requires_grad_()
    h_full = gather_from_sequence_parallel_region(h_loc, True, group)
    lp, ent = lce_verl.linear_cross_entropy(h_full, w_loc, labels, 0.7, reduction, group, backend=backend,
                                            invariant=False)
    lp_term = (lp * g_lp).sum() if reduction == "none" else g_lp * lp
    (lp_term + (ent * g_ent).sum()).backward()
    r_lp, r_ent, r_dh, r_dw = I.verl_reference(hidden, weight, labels, 0.7, g_lp, g_ent, reduction)
    r_lp = {"none": r_lp, "sum": r_lp.sum(), "mean": r_lp.mean()}[reduction]
    return dict(logprobs=I.scaled_err(lp, r_lp), entropy=I.scaled_err(ent, r_ent),
                d_hidden=I.scaled_err(h_loc.grad.reshape(-1, H), r_dh[rows]),
                d_weight=I.scaled_err(w_loc.grad, r_dw[cols]))


def column_parallel_linear(group, sp: bool, vocab: int = 2 * V_SHARD):
    """megatron-core's ColumnParallelLinear LM head over `group` (tp_group given, no parallel_state)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=2,
                            sequence_parallel=sp, use_cpu_initialization=True, gradient_accumulation_fusion=False)
    return ColumnParallelLinear(H, vocab, config=cfg, init_method=lambda t: t, bias=False,
                                gather_output=False, skip_weight_param_allocation=True, tp_group=group)


def areal_case(group, sp: bool, backend: str) -> dict:
    rank = dist.get_rank(group)
    layer = column_parallel_linear(group, sp)
    hidden, weight, labels, g_lp, _ = inputs(2)
    rows = slice(rank * T // 2, (rank + 1) * T // 2) if sp else slice(None)
    cols = slice(rank * V_SHARD, (rank + 1) * V_SHARD)
    h_in = hidden[rows].clone().requires_grad_()
    w_loc = weight[cols].clone().requires_grad_()
    out = lce_areal.chunked_lm_head_logprobs_entropy(layer, h_in, w_loc, labels.reshape(T, 1), temperature=0.7,
                                                     chunk_size=4, logit_scale=1.3, backend=backend, invariant=False)
    (out.logprobs * g_lp).sum().backward()
    refs, r_dh, r_dw = I.areal_oracle(hidden, weight, labels, 0.7, 1.3, g_lp)
    errs = {name: I.scaled_err(o, r) for name, o, r in zip(I.AREAL_FIELDS, out, refs)}
    errs.update(d_hidden=I.scaled_err(h_in.grad.reshape(-1, H), r_dh[rows]),
                d_weight=I.scaled_err(w_loc.grad, r_dw[cols]),
                allreduce_dgrad=float(layer.allreduce_dgrad != (not sp)),  # megatron's own flag: 1 = mismatch
                entropy_grad=float(out.entropy.requires_grad))
    return errs


def areal_sp_batch_case(group, backend: str) -> dict:
    """Sequence parallel with b = 2: hidden [s/tp, b, H] per rank, labels [s, b] (AReaL's engine transposes
    its [b, s] ids to sequence-major); the transposed [b, s] labels, same count, must be refused."""
    rank = dist.get_rank(group)
    layer = column_parallel_linear(group, True)
    hidden, weight, labels, g_lp, _ = inputs(3)
    s, b = T // 2, 2
    hidden, labels = hidden.reshape(s, b, H), labels.reshape(s, b)
    rows, cols = slice(rank * s // 2, (rank + 1) * s // 2), slice(rank * V_SHARD, (rank + 1) * V_SHARD)
    h_in = hidden[rows].clone().requires_grad_()
    w_loc = weight[cols].clone().requires_grad_()
    call = lambda y: lce_areal.chunked_lm_head_logprobs_entropy(layer, h_in, w_loc, y, temperature=0.7,  # noqa: E731
                                                                chunk_size=4, backend=backend, invariant=False)
    try:
        call(labels.t())
        transposed_accepted = 1.0
    except ValueError:
        transposed_accepted = 0.0
    out = call(labels)
    (out.logprobs * g_lp).sum().backward()
    refs, r_dh, _ = I.areal_oracle(hidden, weight, labels, 0.7, 1.0, g_lp)
    errs = {name: I.scaled_err(o, r) for name, o, r in zip(I.AREAL_FIELDS, out, refs)}
    errs.update(d_hidden=I.scaled_err(h_in.grad.reshape(-1, H), r_dh.reshape(s, b, H)[rows].reshape(-1, H)),
                transposed_accepted=transposed_accepted)
    return errs


def negative_label_case(group) -> dict:
    """A -100 label under TP = 2 (CPU: synchronous checks): every rank raises, none waits in a collective."""
    hidden, weight, labels, _, _ = inputs(4)
    labels[0, 5] = -100
    cols = slice(dist.get_rank(group) * V_SHARD, (dist.get_rank(group) + 1) * V_SHARD)
    accepted = {}
    for name, call in (("verl", lambda: lce_verl.linear_cross_entropy(hidden, weight[cols], labels, 1.0, "none",
                                                                       group, invariant=False)),
                       ("areal", lambda: lce_areal.chunked_lm_head_logprobs_entropy(
                           column_parallel_linear(group, False), hidden, weight[cols], labels.reshape(T, 1),
                           temperature=1.0, chunk_size=4, invariant=False))):
        try:
            call()
            accepted[f"{name}_accepted"] = 1.0
        except ValueError as e:
            accepted[f"{name}_accepted"] = float("-100" not in str(e))
    return accepted


def invariant_case(group) -> dict:
    """invariant=True through both adapters: TP = 2 (megatron-padded shards of 128 ids; verl through megatron's SP
    gather, AReaL with and without sequence parallel) gives the TP = 1 call's outputs bitwise. Returns, per
    adapter, the number of output tensors that differ in any bit."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, 1, H, generator=g) * 3
    weight = torch.randn(256, H, generator=g) * 0.5
    labels = torch.randint(0, 256, (T, 1), generator=g)
    labels[:2, 0] = torch.tensor([127, 128])  # the shard edge
    rows, cols = slice(rank * T // 2, (rank + 1) * T // 2), slice(rank * 128, (rank + 1) * 128)
    opts = dict(backend="torch", invariant=True)
    differ = {}
    one = lce_verl.linear_cross_entropy(hidden, weight, labels.t(), 0.7, "none", None, **opts)
    two = lce_verl.linear_cross_entropy(gather_from_sequence_parallel_region(hidden[rows], True, group),
                                        weight[cols], labels.t(), 0.7, "none", group, **opts)
    differ["verl"] = float(sum(not torch.equal(a, b) for a, b in zip(one, two)))
    one = lce_areal.chunked_lm_head_logprobs_entropy(I.output_layer(H, 256), hidden, weight, labels, temperature=0.7,
                                                     chunk_size=4, logit_scale=1.3, **opts)
    for sp in (False, True):
        two = lce_areal.chunked_lm_head_logprobs_entropy(
            column_parallel_linear(group, sp, vocab=256), hidden[rows] if sp else hidden, weight[cols], labels,
            temperature=0.7, chunk_size=4, logit_scale=1.3, **opts)
        differ[f"areal_sp{int(sp)}"] = float(sum(not torch.equal(a, b) for a, b in zip(one, two)))
    return differ


def main() -> int:
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    cases = {}
    for backend in ("torch", "reference"):
        for red in ("none", "sum", "mean"):
            cases[f"verl-{red}-{backend}"] = (verl_case, (group, red, backend))
        for sp in (False, True):
            cases[f"areal-sp{int(sp)}-{backend}"] = (areal_case, (group, sp, backend))
        cases[f"areal-sp1-b2-{backend}"] = (areal_sp_batch_case, (group, backend))
    cases["negative-labels"] = (negative_label_case, (group,))
    cases["invariant"] = (invariant_case, (group,))
    results = {}
    for name, (fn, args) in cases.items():
        try:
            res = fn(*args)
        except Exception:  # reported, not raised: every rank goes on to the same reductions
            res = {"error": traceback.format_exc()[-3000:]}
        keys = sorted(k for k in res if k != "error")
        t = torch.tensor([res[k] for k in keys] + [float("error" in res)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[name] = dict(zip(keys, t[:-1].tolist()))
        if t[-1] > 0:
            results[name]["error"] = res.get("error", "failed on another rank")
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():  # megatron's SP gather allocates on torch.cuda.current_device()
        sys.exit(main())
