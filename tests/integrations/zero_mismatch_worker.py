"""NeMo-RL and slime adapters against the stacks' real functions and the fp64 reference, on 1 or 2 gloo ranks.

    python -m torch.distributed.run --nproc_per_node=N tests/integrations/zero_mismatch_worker.py OUT.json [PEERS]

PEERS: a folder holding NeMo-RL's nemo_rl/distributed/model_utils.py (+ nemo_rl/algorithms/
logits_sampling_utils.py, its one import) as PEERS/nemo_rl/{model_utils,logits_sampling_utils}.py and
slime's slime/utils/ppo_utils.py as PEERS/slime/ppo_utils.py (and, for its log-prob step, loss.py with what it
imports of slime under PEERS/slime/full/slime/...), extracted from snapshots (PEERS/COMMITS names
them; tests/integrations/test_integrations_zero_mismatch.py says how). Loaded by file path in this process only: never
inside pytest. Without PEERS only the reference cases run.
Every rank builds the same full inputs; TP=1 cases run on each rank alone (a one-rank group), TP=2 cases
(world size 2) shard the weight by vocabulary and, for NeMo-RL, the hidden by sequence (its SP contract).
Rank 0 writes {case: {metric: [error, bound]}}: error = max |Δ| / max(1, max |ref|), the worst over ranks.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))

from areal_lce.integrations import nemo_rl as lce_nemo  # noqa: E402
from areal_lce.integrations import miles as lce_miles  # noqa: E402
from areal_lce.integrations import nemo_rl_packed as lce_packed  # noqa: E402
from areal_lce.integrations import slime as lce_slime  # noqa: E402
from zero_mismatch_miles_cases import run_miles_cases  # noqa: E402
from zero_mismatch_packed_cases import run_packed_cases, run_slime_cp_cases  # noqa: E402

S, B, H, V_SHARD, TRUE_V = 12, 2, 16, 40, 75  # 2 shards of 40 rows; ids 75..79 are padding in exact mode
TEMPERATURE = 0.7


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_peers(peers: str):
    """(NeMo-RL's model_utils, slime's ppo_utils), by path; model_utils imports one NeMo-RL module by name."""
    for pkg in ("nemo_rl", "nemo_rl.algorithms"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    load("nemo_rl.algorithms.logits_sampling_utils", os.path.join(peers, "nemo_rl", "logits_sampling_utils.py"))
    return (load("peer_nemo_rl_model_utils", os.path.join(peers, "nemo_rl", "model_utils.py")),
            load("peer_slime_ppo_utils", os.path.join(peers, "slime", "ppo_utils.py")))


def load_slime_loss(peers: str, ppo_utils):
    """slime's loss module (slime/backends/megatron_utils/loss.py) and what it imports of slime, by path, from
    PEERS/slime/full/; the package __init__s (megatron patches, HTTP client) are not run: empty packages
    stand in, and slime.utils.http_utils is a stub (misc.py imports one function of it)."""
    root = os.path.join(peers, "slime", "full", "slime")
    for pkg, sub in (("slime", ""), ("slime.utils", "utils"), ("slime.backends", "backends"),
                     ("slime.backends.megatron_utils", "backends/megatron_utils")):
        mod = sys.modules.setdefault(pkg, types.ModuleType(pkg))
        mod.__path__ = [os.path.join(root, sub)]
    http = sys.modules.setdefault("slime.utils.http_utils", types.ModuleType("slime.utils.http_utils"))
    http.is_port_available = lambda port: True
    sys.modules["slime.utils.ppo_utils"] = ppo_utils
    for name in ("utils.misc", "utils.types", "utils.distributed_utils", "backends.megatron_utils.cp_utils",
                 "backends.megatron_utils.loss"):
        load(f"slime.{name}", os.path.join(root, *name.split(".")) + ".py")
    return sys.modules["slime.backends.megatron_utils.loss"]


class StubMPU:
    """megatron's parallel_state as slime's loss module asks it (TP group; CP = 1)."""

    def __init__(self, tp_group):
        self.tp_group = tp_group

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_context_parallel_world_size(self):
        return 1

    def get_context_parallel_rank(self):
        return 0


class ContractLoss:
    """A stand-in of slime's loss module at CP = 1 (no snapshot): its documented token shift and slicing."""

    def __init__(self, tp_group):
        self.mpu = StubMPU(tp_group)

    @staticmethod
    def _build_shifted_tokens(T, device, unconcat_tokens, total_lengths, response_lengths, allgather_cp):
        out, offset = torch.zeros(T, dtype=torch.long), 0
        for tokens, n in zip(unconcat_tokens, total_lengths):
            out[offset:offset + n - 1] = tokens[1:n]
            offset += n
        return out

    @staticmethod
    def _extract_per_sample(lp, ent, total_lengths, response_lengths, allgather_cp):
        lps, ents, offset = [], [], 0
        for n, r in zip(total_lengths, response_lengths):
            lps.append(lp[offset + n - r - 1:offset + n - 1])
            if ent is not None:
                ents.append(ent[offset + n - r - 1:offset + n - 1])
            offset += n
        return lps, ents


def slime_step_case(dtype, tp, group, rank, sp, loss_module=None):
    """The log-prob step on 3 packed samples (THD, padded to 20 rows), temperature 0.7, entropy with gradient:
    per-sample log_probs / entropy and the gradients, against slime's own step on the logits (loss_module)
    or against the fp64 reference sliced by the documented rule."""
    from argparse import Namespace

    from areal_lce.integrations import slime as lce

    g = torch.Generator().manual_seed(17)
    total, resp, T = [7, 5, 6], [3, 2, 4], 20
    hidden = torch.randn(T, 1, H, generator=g).to(dtype)
    weight = (torch.randn(2 * V_SHARD, H, generator=g) * 0.5).to(dtype)
    unconcat = [torch.randint(0, 2 * V_SHARD, (n,), generator=g) for n in total]
    args = Namespace(rollout_temperature=TEMPERATURE, log_probs_chunk_size=5, allgather_cp=False, entropy_coef=0.01)
    shard = slice(rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else slice(None)
    rows = slice(rank * T // tp, (rank + 1) * T // tp) if sp and tp > 1 else slice(None)
    g_lp = [torch.randn(r, generator=g) for r in resp]
    g_ent = [torch.randn(r, generator=g) for r in resp]

    def run(step, h, w, logits_fn):
        _, res = step(logits_fn(h, w), args=args, unconcat_tokens=unconcat, total_lengths=total,
                      response_lengths=resp, with_entropy=True)
        loss = sum((a * b).sum() for a, b in zip(res["log_probs"], g_lp))
        (loss + sum((a * b).sum() for a, b in zip(res["entropy"], g_ent))).backward()
        return torch.cat(res["log_probs"]), torch.cat(res["entropy"])

    contract = loss_module or ContractLoss(group)
    if loss_module is not None:
        loss_module.mpu = StubMPU(group)
    step = lce.log_probs_step(contract, lambda: w, sequence_parallel=sp, backend="torch")
    h, w = hidden[rows].clone().requires_grad_(), weight[shard].clone().requires_grad_()
    lp, ent = run(step, h, w, lambda h, w: h.float())  # Float16Module's fp32 upcast of the last stage
    if loss_module is not None:  # slime's step on (h·Wᵀ) as its model computes it; d_hidden vocab-partial
        h2, w2 = hidden.clone().requires_grad_(), weight[shard].clone().requires_grad_()
        ref_lp, ref_ent = run(loss_module.get_log_probs_and_entropy, h2, w2,
                              lambda h, w: (h[:, 0] @ w.t()).float().unsqueeze(0))
        ref_dh, ref_dw = h2.grad.clone(), w2.grad
        dist.all_reduce(ref_dh, group=group)
        ref_dh = ref_dh[rows]
    else:
        tokens = ContractLoss._build_shifted_tokens(T, None, unconcat, total, resp, False)
        spans = torch.cat([torch.arange(o + n - r - 1, o + n - 1) for o, n, r in
                           zip([0, 7, 12], total, resp)])
        g_lp_full, g_ent_full = torch.zeros(T), torch.zeros(T)
        g_lp_full[spans], g_ent_full[spans] = torch.cat(g_lp), torch.cat(g_ent)
        ref = reference(hidden[:, 0], weight, tokens, g_lp_full, g_ent_full, dtype, False, TEMPERATURE)
        ref_lp, ref_ent, ref_dh, ref_dw = ref[0][spans], ref[1][spans], ref[2].unsqueeze(1)[rows], ref[3][shard]
    b = bounds(dtype, roundings=2 if loss_module is not None else 1)
    return {"logprobs": [err(lp, ref_lp), b["out"]], "entropy": [err(ent, ref_ent), b["out"]],
            "d_hidden": [err(h.grad, ref_dh), b["grad"]], "d_weight": [err(w.grad, ref_dw), b["grad"]]}


def inputs(dtype, tp: int):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(2 * V_SHARD, H, generator=g) * 0.5
    weight[[3, 44, 71]] = hidden[[1, 5, 9], 0] * 1.5  # peaked rows on both shards (and in the padding)
    target = torch.randint(0, 2 * V_SHARD if tp else TRUE_V, (B, S), generator=g)
    target[0, 2], target[1, 3] = V_SHARD - 1, V_SHARD  # the shard edge
    return hidden.to(dtype), weight[: 2 * V_SHARD].to(dtype), target


def err(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / max(1.0, float(ref.abs().max())))


def bounds(dtype, roundings: int = 1) -> dict:
    """Outputs: fp32 reductions in another order (fp32), plus one bf16 ulp of a logit when the two sides round
    the same logit differently at a tie (bf16). Gradients: fp32 accumulation over H and V (1e-4), or for bf16
    2^-8 (relative) per rounding on either side: the op's one, plus the other side's `roundings` (against the
    fp64 reference: 1, the op's bf16 operands of its backward GEMMs; NeMo-RL: d_weight rounded to bf16 once per chunk; slime: the logits gradient rounded to
    bf16 by the backward of `.float()`, then the bf16 GEMM's output)."""
    if dtype == torch.bfloat16:
        return dict(out=2 ** -7, grad=(roundings + 1) * 2 ** -8)
    return dict(out=1e-5, grad=1e-4)


def reference(hidden, weight, labels, g_lp, g_ent, dtype, exact: bool, temperature=1.0):
    """fp64 oracle of the documented semantics on the full weight; rows of hidden [N, H], labels [N]:
    logits h·Wᵀ rounded to the input dtype (default mode) or not (exact), padding columns kept (default)
    or masked (exact, vocab TRUE_V), / temperature; (lp, ent, d_hidden, d_weight) of Σ g_lp·lp + Σ g_ent·ent."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    r = h @ w.t()
    if not exact and dtype == torch.bfloat16:
        r = r + (r.detach().to(torch.bfloat16).double() - r.detach())  # rounded forward, identity gradient
    if exact:
        r = r.masked_fill(torch.arange(w.shape[0]) >= TRUE_V, float("-inf"))
    logp = torch.log_softmax(r / temperature, -1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    ent = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def nemo_case(fn, dtype, tp, group, rank, peer=None, exact=False, entropy=False):
    hidden, weight, target = inputs(dtype, 1 if not exact else 0)
    g = torch.Generator().manual_seed(11)
    g_lp, g_ent = torch.randn(B, S - 1, generator=g), torch.randn(B, S - 1, generator=g)
    rows = slice(rank * S // tp, (rank + 1) * S // tp) if tp > 1 else slice(None)
    shard = slice(rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else slice(None)
    h = hidden[rows].clone().requires_grad_()
    w = weight[shard].clone().requires_grad_()
    v0, v1 = (rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else (0, 2 * V_SHARD)
    opts = dict(vocab_size=TRUE_V, logits_precision="fp32") if exact else {}
    if entropy:
        lp, ent = lce_nemo.from_parallel_hidden_states_to_logprobs_and_entropy(
            h, w, False, target, v0, v1, group, chunk_size=5, backend="torch", **opts)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    else:
        lp = fn(h, w, False, target, v0, v1, group, chunk_size=5, **({} if peer else dict(backend="torch", **opts)))
        (lp * g_lp).sum().backward()
        ent = None
    if peer is None:  # fp64 oracle over the [S, B] rows, sliced to this rank
        labels = target.roll(-1, -1)
        ref = reference(hidden.transpose(0, 1)[:, :-1], weight, labels[:, :-1], g_lp,
                        g_ent if entropy else torch.zeros_like(g_ent), dtype, exact)
        d_h = ref[2].transpose(0, 1)
        d_h = torch.cat([d_h, torch.zeros(1, B, H, dtype=d_h.dtype)])  # the dropped last position
        out = {"logprobs": err(lp, ref[0]), "d_hidden": err(h.grad, d_h[rows]), "d_weight": err(w.grad, ref[3][shard])}
        if entropy:
            out["entropy"] = err(ent, ref[1])
        b = bounds(dtype)
    else:  # NeMo-RL's own function on the same shards
        h2, w2 = hidden[rows].clone().requires_grad_(), weight[shard].clone().requires_grad_()
        lp2 = peer.from_parallel_hidden_states_to_logprobs(h2, w2, False, target, v0, v1, group, chunk_size=5)
        (lp2 * g_lp).sum().backward()
        out = {"logprobs": err(lp, lp2), "d_hidden": err(h.grad, h2.grad), "d_weight": err(w.grad, w2.grad)}
        b = bounds(dtype, roundings=-(-S // 5))
    return {k: [v, b["out"] if k in ("logprobs", "entropy") else b["grad"]] for k, v in out.items()}


def slime_case(dtype, tp, group, rank, peer=None, exact=False, with_entropy=True, with_entropy_grad=True):
    hidden, weight, target = inputs(dtype, 1 if not exact else 0)
    hidden, tokens = hidden[:, 0], target[0]
    g = torch.Generator().manual_seed(13)
    g_lp, g_ent = torch.randn(S, 1, generator=g), torch.randn(S, generator=g)
    shard = slice(rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else slice(None)
    h, w = hidden.clone().requires_grad_(), weight[shard].clone().requires_grad_()
    opts = dict(vocab_size=TRUE_V, logits_precision="fp32") if exact else {}
    lp, ent = lce_slime.calculate_log_probs_and_entropy(h, w, tokens, group, with_entropy, TEMPERATURE,
                                                        with_entropy_grad, backend="torch", **opts)
    use_ent = with_entropy and with_entropy_grad
    ((lp * g_lp).sum() + ((ent * g_ent).sum() if use_ent else 0)).backward()
    if peer is None:
        ref = reference(hidden, weight, tokens, g_lp[:, 0], g_ent if use_ent else torch.zeros(S), dtype, exact,
                        TEMPERATURE)
        ref_lp, ref_ent, ref_dh, ref_dw = ref[0].unsqueeze(-1), ref[1], ref[2], ref[3][shard]
    else:  # slime's own function on the logits of the same shard; its d_hidden is vocab-partial: reduce it
        h2, w2 = hidden.clone().requires_grad_(), weight[shard].clone().requires_grad_()
        logits = (h2 @ w2.t()).float() / TEMPERATURE
        ref_lp, ref_ent = peer.calculate_log_probs_and_entropy(logits, tokens, group, with_entropy=with_entropy,
                                                               chunk_size=5, with_entropy_grad=with_entropy_grad)
        ((ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if use_ent else 0)).backward()
        ref_dh, ref_dw = h2.grad.clone(), w2.grad
        dist.all_reduce(ref_dh, group=group)
    b = bounds(dtype, roundings=2 if peer is not None else 1)
    out = {"logprobs": [err(lp, ref_lp), b["out"]], "d_hidden": [err(h.grad, ref_dh), b["grad"]],
           "d_weight": [err(w.grad, ref_dw), b["grad"]], "shape": [float(tuple(lp.shape) != (S, 1)), 0.0]}
    if with_entropy:
        out["entropy"] = [err(ent, ref_ent), b["out"]]
        out["entropy_requires_grad"] = [float(ent.requires_grad != with_entropy_grad), 0.0]
    else:
        out["entropy_is_none"] = [float(ent is not None), 0.0]
    return out


def invariant_tp(rank, tp, group) -> dict:
    """A token's logprob through each adapter, TP=1 vs this TP (invariant mode, 128-id shards): bitwise."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(S, B, H, generator=g), torch.randn(256, H, generator=g)
    target = torch.randint(0, 256, (B, S), generator=g)
    shard, rows = slice(rank * 256 // tp, (rank + 1) * 256 // tp), slice(rank * S // tp, (rank + 1) * S // tp)
    kw = dict(invariant=True, backend="torch")
    one = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden, weight, False, target, 0, 256, None, **kw)
    v0 = rank * 256 // tp
    many = lce_nemo.from_parallel_hidden_states_to_logprobs(hidden[rows], weight[shard], False, target, v0,
                                                            v0 + 256 // tp, group, **kw)
    s_one = lce_slime.calculate_log_probs_and_entropy(hidden[:, 0], weight, target[0], None, True, 0.7, **kw)
    s_many = lce_slime.calculate_log_probs_and_entropy(hidden[:, 0], weight[shard], target[0], group, True, 0.7, **kw)
    cu, t2 = torch.tensor([0, 4, S]), target[:1]  # two packed sequences of the first row
    p_one = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences(
        hidden[:, :1], weight, t2, cu, S, 0, 256, None, **kw)
    p_many = lce_packed.from_parallel_hidden_states_to_logprobs_packed_sequences(
        hidden[rows, :1], weight[shard], t2, cu, S, v0, v0 + 256 // tp, group, **kw)
    hb, wb, tm = hidden[:, 0].to(torch.bfloat16), weight.to(torch.bfloat16), target[0].clamp(max=249)
    m_one = lce_miles.calculate_log_probs_and_entropy(hb, wb, tm, None, True, True, -1, True, 250, backend="torch")
    m_many = lce_miles.calculate_log_probs_and_entropy(hb, wb[shard], tm, group, True, True, -1, True, 250,
                                                       backend="torch")  # true-on-policy: invariant by default
    n_one = lce_miles.calculate_log_probs_and_entropy(hidden[:, 0], weight, tm, None, temperature=0.7, **kw)
    n_many = lce_miles.calculate_log_probs_and_entropy(hidden[:, 0], weight[shard], tm, group, temperature=0.7, **kw)
    return {"nemo_rl": [float(not torch.equal(one, many)), 0.0],
            "nemo_rl_packed": [float(not torch.equal(p_one, p_many)), 0.0],
            "miles_true_on_policy": [float(not (torch.equal(m_one[0], m_many[0]) and torch.equal(m_one[1], m_many[1]))),
                                     0.0],
            "miles": [float(not torch.equal(n_one[0], n_many[0])), 0.0],
            "slime": [float(not (torch.equal(s_one[0], s_many[0]) and torch.equal(s_one[1], s_many[1]))), 0.0]}


def main():
    out_path, peers = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    nemo_peer = slime_peer = slime_loss = None
    if peers:
        nemo_peer, slime_peer = load_peers(peers)
        slime_loss = load_slime_loss(peers, slime_peer)
    results = {}
    for tp, group in ((1, singles[rank]), (2, dist.group.WORLD)):
        if tp > world or (tp == 1 and world > 1 and not peers):  # TP=1 against the reference: pytest in-process
            continue
        for dtype in (torch.float32, torch.bfloat16):
            dn = str(dtype).split(".")[-1]
            results[f"nemo-ref-tp{tp}-{dn}"] = nemo_case(lce_nemo.from_parallel_hidden_states_to_logprobs, dtype,
                                                         tp, group, rank)
            results[f"nemo-entropy-ref-tp{tp}-{dn}"] = nemo_case(None, dtype, tp, group, rank, entropy=True)
            results[f"slime-ref-tp{tp}-{dn}"] = slime_case(dtype, tp, group, rank)
            results[f"slime-noentgrad-ref-tp{tp}-{dn}"] = slime_case(dtype, tp, group, rank, with_entropy_grad=False)
            results[f"slime-noent-ref-tp{tp}-{dn}"] = slime_case(dtype, tp, group, rank, with_entropy=False)
            if nemo_peer is not None:
                results[f"nemo-peer-tp{tp}-{dn}"] = nemo_case(lce_nemo.from_parallel_hidden_states_to_logprobs,
                                                              dtype, tp, group, rank, peer=nemo_peer)
                results[f"slime-peer-tp{tp}-{dn}"] = slime_case(dtype, tp, group, rank, peer=slime_peer)
                results[f"slime-noentgrad-peer-tp{tp}-{dn}"] = slime_case(dtype, tp, group, rank, peer=slime_peer,
                                                                         with_entropy_grad=False)
        for dtype in (torch.float32, torch.bfloat16):
            dn = str(dtype).split(".")[-1]
            for sp in ((False, True) if tp > 1 else (False,)):
                name = f"tp{tp}{'-sp' if sp else ''}-{dn}"
                results[f"slime-step-ref-{name}"] = slime_step_case(dtype, tp, group, rank, sp)
                if slime_loss is not None:
                    results[f"slime-step-peer-{name}"] = slime_step_case(dtype, tp, group, rank, sp, slime_loss)
        results[f"nemo-exact-ref-tp{tp}"] = nemo_case(lce_nemo.from_parallel_hidden_states_to_logprobs,
                                                      torch.float32, tp, group, rank, exact=True)
        results[f"slime-exact-ref-tp{tp}"] = slime_case(torch.bfloat16, tp, group, rank, exact=True)
    if world > 1:
        results["invariant-tp1-vs-tp2"] = invariant_tp(rank, world, dist.group.WORLD)
    run_packed_cases(results, reference, err, bounds, rank, world, singles, nemo_peer)
    run_slime_cp_cases(results, err, bounds, rank, world, singles, slime_loss)
    run_miles_cases(results, load, err, bounds, rank, world, singles, peers)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        worst = {c: {m: [max(g[c][m][0] for g in gathered), v[1]] for m, v in ms.items()} for c, ms in results.items()}
        worst["peers"] = {"present": [float(bool(peers)), 0.0]}
        with open(out_path, "w") as f:
            json.dump(worst, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
