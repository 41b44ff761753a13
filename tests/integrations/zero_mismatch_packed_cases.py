"""NeMo-RL's packed THD / context-parallel seam (areal_lce.integrations.nemo_rl_packed) against NeMo-RL's own
`from_parallel_logits_to_logprobs_packed_sequences` on the materialised logits, and against the fp64 reference.

Three packed sequences of padded lengths 8, 12, 4 (multiples of 2·cp for cp = 2), unpacked_seqlen 11 (the
12-long one is cut, as NeMo-RL cuts it), temperature 0.7, every rank computing the same loss Σ g·lp.
Gradient convention (NeMo-RL's AllGatherCPTensor): the CP gather's backward sums the output gradient over
the CP ranks, so at CP = cp each rank's rows get cp × the single-process gradient, and the CP ranks'
d_weight sum to cp × the single-process one. NeMo-RL's CP backward moves an index tensor with `.cuda()` and cannot run on CPU: its gradients are
taken from the same function at CP = 1 (the same math: CP only moves rows) and scaled by cp; its CP = 2
forward runs as is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from areal_lce.integrations import nemo_rl_packed as lce_packed

LENGTHS, UNPACKED, H, V_SHARD, TEMPERATURE = [8, 12, 4], 11, 16, 40, 0.7


def packed_inputs(dtype):
    g = torch.Generator().manual_seed(23)
    T = sum(LENGTHS)
    hidden = torch.randn(T, 1, H, generator=g)
    weight = torch.randn(2 * V_SHARD, H, generator=g) * 0.5
    weight[[5, 50]] = hidden[[2, 13], 0] * 1.5  # peaked rows on both shards
    target = torch.randint(0, 2 * V_SHARD, (1, T), generator=g)
    target[0, 3], target[0, 9] = V_SHARD - 1, V_SHARD  # the shard edge
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    g_out = torch.randn(len(LENGTHS), UNPACKED - 1, generator=g)
    return hidden.to(dtype), weight.to(dtype), target, cu, g_out


def reference_rows(target):
    """(rows, labels, out_index): packed rows that NeMo-RL's output keeps, their next-token labels and their
    flat position in [B, unpacked_seqlen - 1] — written out per sequence, independently of the adapter."""
    rows, labels, where, start = [], [], [], 0
    for i, n in enumerate(LENGTHS):
        for j in range(min(n - 1, UNPACKED - 1)):
            rows.append(start + j)
            labels.append(int(target[0, start + j + 1]))
            where.append(i * (UNPACKED - 1) + j)
        start += n
    return torch.tensor(rows), torch.tensor(labels), torch.tensor(where)


def nemo_packed_case(reference, err, bounds, dtype, tp, cp, tp_group, cp_group, rank, peer=None, entropy=False):
    """One case at (tp, cp) on this rank (world = tp · cp ≤ 2, the other size 1)."""
    hidden, weight, target, cu, g_out = packed_inputs(dtype)
    T = hidden.shape[0]
    shard = slice(rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else slice(None)
    v0, v1 = (rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else (0, 2 * V_SHARD)
    cp_rows = lce_packed.zigzag_index(torch.tensor(LENGTHS), cp, rank if cp > 1 else 0)
    local = hidden.index_select(0, cp_rows)
    sp_rows = slice(rank * T // tp, (rank + 1) * T // tp) if tp > 1 else slice(None)
    h, w = local[sp_rows].clone().requires_grad_(), weight[shard].clone().requires_grad_()
    g = torch.Generator().manual_seed(29)
    g_ent = torch.randn(g_out.shape, generator=g)
    kw = dict(cp_group=cp_group, chunk_size=5, temperature=TEMPERATURE, backend="torch")
    if entropy:
        lp, ent = lce_packed.from_parallel_hidden_states_to_logprobs_and_entropy_packed_sequences(
            h, w, target, cu, UNPACKED, v0, v1, tp_group, **kw)
        ((lp * g_out).sum() + (ent * g_ent).sum()).backward()
    else:
        lp = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences(
            h, w, target, cu, UNPACKED, v0, v1, tp_group, **kw)
        (lp * g_out).sum().backward()
    if peer is None:  # fp64 reference on the kept rows
        rows, labels, where = reference_rows(target)
        flat_g, flat_ge = g_out.reshape(-1)[where], g_ent.reshape(-1)[where]
        ref = reference(hidden[rows, 0], weight, labels, flat_g, flat_ge if entropy else torch.zeros_like(flat_g),
                        dtype, False, TEMPERATURE)
        ref_lp = torch.zeros(g_out.numel(), dtype=torch.float64).index_copy(0, where, ref[0]).view_as(g_out)
        ref_dh = torch.zeros(T, H, dtype=torch.float64).index_copy(0, rows, ref[2])
        ref_dh, ref_dw = cp * ref_dh.index_select(0, cp_rows)[sp_rows], cp * ref[3][shard]
        out = {"logprobs": err(lp, ref_lp)}
        if entropy:
            ref_ent = torch.zeros(g_out.numel(), dtype=torch.float64).index_copy(0, where, ref[1]).view_as(g_out)
            out["entropy"] = err(ent, ref_ent)
        b = bounds(dtype)
    else:  # NeMo-RL's own packed function on the logits (h·Wᵀ).float() / temperature of the same shards
        def peer_run(cp_g, rows_h):
            h2, w2 = rows_h.clone().requires_grad_(), weight[shard].clone().requires_grad_()
            logits = ((h2[:, 0] @ w2.t()).float() / TEMPERATURE).unsqueeze(0)
            return h2, w2, peer.from_parallel_logits_to_logprobs_packed_sequences(
                logits, target, cu, UNPACKED, v0, v1, tp_group, cp_group=cp_g, chunk_size=5)
        out = {}
        if cp > 1:
            with torch.no_grad():
                out["logprobs"] = err(lp, peer_run(cp_group, local)[2])  # NeMo-RL's CP forward as is
        h2, w2, lp2 = peer_run(None, hidden)  # CP = 1 on every token: the gradients (scaled by cp)
        (lp2 * g_out).sum().backward()
        ref_dh = h2.grad.clone()
        if tp > 1:
            dist.all_reduce(ref_dh, group=tp_group)  # NeMo-RL's logits gradient is vocab-partial: reduce it
        ref_dh, ref_dw = cp * ref_dh.index_select(0, cp_rows)[sp_rows], cp * w2.grad
        out["logprobs_cp1" if cp > 1 else "logprobs"] = err(lp, lp2)
        b = bounds(dtype, roundings=2)
    d_w = w.grad.clone()
    if cp > 1:  # each CP rank's d_weight holds its own rows' part (cp × it): their sum is cp × the whole
        dist.all_reduce(d_w, group=cp_group)
    out["d_hidden"], out["d_weight"] = err(h.grad[:, 0], ref_dh.reshape(-1, H)), err(d_w, ref_dw)
    return {k: [v, b["out"] if k.startswith(("logprobs", "entropy")) else b["grad"]] for k, v in out.items()}


def run_packed_cases(results, reference, err, bounds, rank, world, singles, peer):
    """The packed cases at CP = 2 (TP = 1) and TP = 2 (CP = 1, sequence parallel) on a world of 2."""
    if world != 2:
        return
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).split(".")[-1]
        for name, tp, cp, tpg, cpg in (("cp2", 1, 2, singles[rank], dist.group.WORLD),
                                       ("tp2", 2, 1, dist.group.WORLD, None)):
            args = (reference, err, bounds, dtype, tp, cp, tpg, cpg, rank)
            results[f"nemo-packed-ref-{name}-{dn}"] = nemo_packed_case(*args)
            results[f"nemo-packed-entropy-ref-{name}-{dn}"] = nemo_packed_case(*args, entropy=True)
            if peer is not None:
                results[f"nemo-packed-peer-{name}-{dn}"] = nemo_packed_case(*args, peer=peer)


class CPStubMPU:
    """megatron's parallel_state as slime's loss and cp_utils modules ask it: TP = 1, CP = the world."""

    def __init__(self, tp_group, cp_group):
        self.tp_group, self.cp_group = tp_group, cp_group

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_context_parallel_group(self):
        return self.cp_group

    def get_context_parallel_world_size(self):
        return dist.get_world_size(self.cp_group)

    def get_context_parallel_rank(self):
        return dist.get_rank(self.cp_group)


def slime_cp_case(err, bounds, dtype, rank, tp_group, cp_group, loss_module, allgather: bool):
    """slime's log-prob step at CP = 2 (zigzag ring-attention layout, or --allgather-cp's contiguous chunks)
    on 3 packed samples, temperature 0.7, entropy with gradient: the fused step on this rank's hidden states
    against slime's own step on the logits (h·Wᵀ).float() of the same rows (TP = 1: no vocab reduction)."""
    import sys
    from argparse import Namespace

    from areal_lce.integrations import slime as lce_slime

    stub = CPStubMPU(tp_group, cp_group)
    loss_module.mpu = sys.modules["slime.backends.megatron_utils.cp_utils"].mpu = stub
    total, resp, cp = [9, 6, 11], [4, 2, 5], dist.get_world_size(cp_group)
    if allgather:  # each rank: a contiguous 1/cp of the packed sequences, padded to a multiple of cp
        local_t = -(-sum(total) // cp)
    else:  # each rank: per sample its chunks r and 2cp-1-r, a sample padded to a multiple of 2cp
        local_t = sum(2 * -(-n // (2 * cp)) for n in total)
    g = torch.Generator().manual_seed(31)
    unconcat = [torch.randint(0, 2 * V_SHARD, (n,), generator=g) for n in total]
    weight = (torch.randn(2 * V_SHARD, H, generator=g) * 0.5).to(dtype)
    hidden = torch.randn(cp, local_t, 1, H, generator=g)[rank].to(dtype)  # this rank's rows
    weight[[4, 60]] = hidden[[1, 3], 0] * 1.5  # peaked rows
    g_lp = [torch.randn(r, generator=g) for r in resp]
    g_ent = [torch.randn(r, generator=g) for r in resp]
    args = Namespace(rollout_temperature=TEMPERATURE, log_probs_chunk_size=5, allgather_cp=allgather,
                     entropy_coef=0.01)

    def run(make_step, logits_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        _, res = make_step(w)(logits_fn(h, w), args=args, unconcat_tokens=unconcat, total_lengths=total,
                      response_lengths=resp, with_entropy=True)
        shapes = [t.shape[0] for t in res["log_probs"]]
        loss = sum((a * b[:a.shape[0]]).sum() for a, b in zip(res["log_probs"], g_lp))
        (loss + sum((a * b[:a.shape[0]]).sum() for a, b in zip(res["entropy"], g_ent))).backward()
        return torch.cat(res["log_probs"]), torch.cat(res["entropy"]), h.grad, w.grad, shapes

    ours = run(lambda w: lce_slime.log_probs_step(loss_module, lambda: w, backend="torch"), lambda h, w: h.float())
    theirs = run(lambda w: loss_module.get_log_probs_and_entropy, lambda h, w: (h[:, 0] @ w.t()).float().unsqueeze(0))
    b = bounds(dtype, roundings=2)
    return {"logprobs": [err(ours[0], theirs[0]), b["out"]], "entropy": [err(ours[1], theirs[1]), b["out"]],
            "d_hidden": [err(ours[2], theirs[2]), b["grad"]], "d_weight": [err(ours[3], theirs[3]), b["grad"]],
            "per_sample_lengths": [float(ours[4] != theirs[4]), 0.0]}


def run_slime_cp_cases(results, err, bounds, rank, world, singles, loss_module):
    if world != 2 or loss_module is None:
        return
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).split(".")[-1]
        for allgather in (False, True):
            name = f"slime-step-peer-cp2-{'allgather' if allgather else 'zigzag'}-{dn}"
            results[name] = slime_cp_case(err, bounds, dtype, rank, singles[rank], dist.group.WORLD, loss_module,
                                          allgather)
