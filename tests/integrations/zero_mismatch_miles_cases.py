"""miles adapter (areal_lce.integrations.miles) against miles' own functions (snapshot radixark/miles 31f1ca9,
files under PEERS/miles/full/miles/...) and against the fp64 reference, on the worker's gloo ranks.

miles' modules are loaded by path with empty packages standing in for miles' package __init__s and a stub of
`miles.backends.training_utils.parallel` (its real one imports miles' fault-tolerance utilities) whose
`get_parallel_state()` returns the TP / CP groups of the case. torch.compile is switched off (miles compiles
two helpers; on CPU that needs a compiler and changes nothing in the math).
"""
from __future__ import annotations

import os
import sys
import types
from argparse import Namespace

import torch
import torch.distributed as dist

from areal_lce.integrations import miles as lce_miles

H, TEMPERATURE = 16, 0.7


def vocab(top: bool):
    """(rows per TP shard, true vocabulary): true-on-policy runs invariant, whose shards start at multiples of
    128 ids; the normal mode keeps small odd shards."""
    return (128, 250) if top else (40, 75)
_STATE = {}


class _Group:
    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)


def load_miles(peers: str, load):
    """(math_utils, logit_processors, cp_utils) of miles, by path; None when the snapshot is absent."""
    root = os.path.join(peers, "miles", "full", "miles")
    if not os.path.isdir(root):
        return None
    torch._dynamo.config.disable = True
    for pkg, sub in (("miles", ""), ("miles.backends", "backends"),
                     ("miles.backends.training_utils", "backends/training_utils"),
                     ("miles.backends.training_utils.loss_hub", "backends/training_utils/loss_hub")):
        mod = sys.modules.setdefault(pkg, types.ModuleType(pkg))
        mod.__path__ = [os.path.join(root, sub)]
    parallel = types.ModuleType("miles.backends.training_utils.parallel")
    parallel.get_parallel_state = lambda: Namespace(**_STATE)
    sys.modules[parallel.__name__] = parallel
    mods = [load(f"miles.backends.training_utils.{name}", os.path.join(root, "backends", "training_utils",
                                                                        *name.split(".")) + ".py")
            for name in ("cp_utils", "loss_hub.math_utils", "loss_hub.logit_processors")]
    return mods[1], mods[2], mods[0]


def set_groups(tp_group, cp_group):
    _STATE.update(tp=_Group(tp_group), cp=_Group(cp_group))


U = 2 ** -8  # bf16's unit roundoff (8 significant bits)


def rounding_bounds(magnitude, hidden, weight, group, roundings: int, ref_dh, ref_dw):
    """Extra error allowed in d_hidden / d_weight (err()'s units) for `roundings` bf16 roundings (U relative
    each) in miles' backward of a logits gradient whose elements are at most `magnitude` [R, V/tp]: megatron's
    fused cross entropy returns its logits gradient in bf16 even for fp32 logits, and true-on-policy's bf16
    log_softmax / entropy backward round theirs. |Δd_hidden| ≤ r·U·(M·|W|), summed over the vocab shards;
    |Δd_weight| ≤ r·U·(Mᵀ·|H|)."""
    m = magnitude.detach().abs().double()
    dh = m @ weight.detach().abs().double()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(dh, group=group)  # the vocab shards' parts of M·|W|
    dw = m.t() @ hidden.detach().abs().double().reshape(m.shape[0], -1)
    return (roundings * U * float(dh.max()) / max(1.0, float(ref_dh.abs().max())),
            roundings * U * float(dw.max()) / max(1.0, float(ref_dw.abs().max())))


def entropy_magnitude(hidden, weight, shard, true_v, g_ent, temperature):
    """Bound on the intermediate values of miles' bf16 entropy backward for the shard's columns: with
    p, logp the (truncated) softmax, d_logp_v = -g·p_v·(1 + logp_v) (each of its products, exp's backward and
    the sum rounded), then log_softmax's backward G_v = d_logp_v - p_v·Σ d_logp (rounded): |errors| ≤ U per
    rounding of M_v + p_v·Σ M + |G_v|, M_v = |g|·p_v·(1 + |logp_v|)."""
    z = ((hidden.double() @ weight.double().t()).float() / temperature).to(torch.bfloat16).double()[:, :true_v]
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    m = g_ent.double().abs()[:, None] * p * (1 + logp.abs())
    grad = -g_ent.double()[:, None] * p * (1 + logp)
    grad = grad - p * grad.sum(-1, keepdim=True)
    a = m + p * m.sum(-1, keepdim=True) + grad.abs()
    a = torch.cat([a, a.new_zeros(a.shape[0], weight.shape[0] - true_v)], 1)  # the truncated padding: no gradient
    return a[:, shard]


def block_case(err, bounds, dtype, tp, group, rank, peer, top: bool, temperature: float):
    """The kernel on 20 rows (peaked rows, shard-edge tokens): outputs, and the gradients of the log-prob part
    and of the entropy part of the loss separately (each its own rounding bound): normal mode (fp32 logits
    of the bf16 / fp32 GEMM, whole shard) or true-on-policy (bf16, softmax over the first TRUE_V ids;
    gradients at temperature 1 only: at t != 1 miles' logits are another bf16 rounding of the same values)."""
    V_SHARD, TRUE_V = vocab(top)
    g = torch.Generator().manual_seed(37)
    hidden = torch.randn(20, H, generator=g)
    weight = torch.randn(2 * V_SHARD, H, generator=g) * 0.5
    weight[[3, 44]] = hidden[[1, 5]] * 1.5
    tokens = torch.randint(0, TRUE_V if top else 2 * V_SHARD, (20,), generator=g)
    tokens[2], tokens[3] = V_SHARD - 1, V_SHARD
    g_lp, g_ent = torch.randn(20, generator=g), torch.randn(20, generator=g)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    shard = slice(rank * V_SHARD, (rank + 1) * V_SHARD) if tp > 1 else slice(None)
    true_v = TRUE_V if top else None

    def side(ours: bool, part: str):
        h, w = hidden.clone().requires_grad_(), weight[shard].clone().requires_grad_()
        if ours:
            lp, ent = lce_miles.calculate_log_probs_and_entropy(h, w, tokens, group, True, True, 5, top, true_v,
                                                                temperature=temperature, backend="torch")
            logits = None
        else:
            logits = (h @ w.t()).float() / temperature
            if top:
                logits = logits.to(dtype)  # miles' get_responses in true-on-policy mode
            logits.retain_grad()
            lp, ent = peer.calculate_log_probs_and_entropy(logits, tokens, group, with_entropy=True,
                                                           entropy_requires_grad=True, chunk_size=5,
                                                           true_on_policy=top, vocab_size=true_v)
        (lp.float().reshape(-1) * g_lp if part == "lp" else ent.float() * g_ent).sum().backward()
        dh = h.grad.clone()
        if not ours and tp > 1:
            dist.all_reduce(dh, group=group)  # miles' logits gradient is vocab-partial: its mapping reduces it
        return lp, ent, dh, w.grad, (None if logits is None else logits.grad)

    b = bounds(dtype, roundings=2)
    out_bound = b["out"]
    if top and temperature != 1.0:  # miles rounds logits / t to bf16, the op the unscaled logits
        out_bound += U * float(((hidden.float() @ weight.float().t()) / temperature).abs().max())
    res = {}
    for part in ("lp", "ent"):
        ours, theirs = side(True, part), side(False, part)
        if part == "lp":  # true-on-policy entropy: miles' bf16 exp and products (U·H each), its sum's and both
            # sides' output rounding (U·H each): 4·U relative
            ent_bound = out_bound + (2 * U if top else 0.0)
            res["logprobs"], res["entropy"] = [err(ours[0], theirs[0]), out_bound], [err(ours[1], theirs[1]),
                                                                                      ent_bound]
            res["shape_dtype"] = [float((ours[0].shape, ours[0].dtype, ours[1].dtype)
                                        != (theirs[0].shape, theirs[0].dtype, theirs[1].dtype)), 0.0]
        if top and temperature != 1.0:
            continue
        if part == "lp":  # megatron's cast (1) / true-on-policy: g's bf16 cast and log_softmax's backward (2)
            gh, gw = rounding_bounds(theirs[4], hidden, weight[shard], group, 2 if top else 1, theirs[2], theirs[3])
        elif top:  # the entropy's bf16 backward: 5 roundings of the terms bounded by entropy_magnitude
            a = entropy_magnitude(hidden, weight, shard, true_v, g_ent, temperature)
            gh, gw = rounding_bounds(a, hidden, weight[shard], group, 5, theirs[2], theirs[3])
        else:  # miles' entropy backward is fp32
            gh = gw = 0.0
        res[f"d_hidden_{part}"] = [err(ours[2], theirs[2]), b["grad"] + gh]
        res[f"d_weight_{part}"] = [err(ours[3], theirs[3]), b["grad"] + gw]
    return res


def step_case(err, bounds, dtype, rank, tp_group, cp_group, mods, allgather: bool, top: bool):
    """miles' step on 3 packed THD samples, entropy with gradient (temperature 0.7; 1 in true-on-policy mode):
    the fused step on this rank's hidden rows against miles' own step on the logits (h·Wᵀ).float() of the
    same rows; gradients of the log-prob part (bounded as in block_case) and, in normal mode, of the
    entropy part (fp32 in miles)."""
    math_utils, logit_processors, cp_utils = mods
    set_groups(tp_group, cp_group)
    tp, cp, tp_rank = dist.get_world_size(tp_group), dist.get_world_size(cp_group), dist.get_rank(tp_group)
    total, resp = [9, 6, 11], [4, 2, 5]
    V_SHARD, TRUE_V = vocab(top)
    local_t = -(-sum(total) // cp) if allgather else (sum(2 * -(-n // (2 * cp)) for n in total) if cp > 1
                                                      else sum(total))
    g = torch.Generator().manual_seed(41)
    unconcat = [torch.randint(0, TRUE_V, (n,), generator=g) for n in total]
    weight = (torch.randn(2 * V_SHARD, H, generator=g) * 0.5).to(dtype)
    hidden = torch.randn(cp, local_t, H, generator=g)[dist.get_rank(cp_group)].to(dtype)
    weight[[4, 60]] = hidden[[1, 3]] * 1.5
    g_lp, g_ent = [torch.randn(r, generator=g) for r in resp], [torch.randn(r, generator=g) for r in resp]
    shard = slice(tp_rank * V_SHARD, (tp_rank + 1) * V_SHARD) if tp > 1 else slice(None)
    args = Namespace(rollout_temperature=1.0 if top else TEMPERATURE, log_probs_chunk_size=5, allgather_cp=allgather,
                     qkv_format="thd", true_on_policy_mode=top, bf16=dtype == torch.bfloat16, vocab_size=TRUE_V)

    def side(ours: bool, part: str):
        h, w = hidden.clone().unsqueeze(0).requires_grad_(), weight[shard].clone().requires_grad_()
        if ours:
            step, inp = lce_miles.log_probs_step(lambda: w, logit_processors=logit_processors, cp_utils=cp_utils,
                                                 backend="torch"), h.float()
        else:
            step, inp = logit_processors.get_log_probs_and_entropy, (h @ w.t()).float()
            inp.retain_grad()
        res = step(inp, args=args, unconcat_tokens=unconcat, total_lengths=total, response_lengths=resp,
                   with_entropy=True, entropy_requires_grad=True)
        key, gs = ("log_probs", g_lp) if part == "lp" else ("entropy", g_ent)
        sum((a.float() * b[:a.shape[0]]).sum() for a, b in zip(res[key], gs)).backward()
        dh = h.grad[0].clone()
        if not ours and tp > 1:
            dist.all_reduce(dh, group=tp_group)
        return (torch.cat(res["log_probs"]), torch.cat(res["entropy"]), dh, w.grad,
                None if ours else inp.grad[0], [t.shape[0] for t in res["log_probs"]])

    b = bounds(dtype, roundings=2)
    out = {}
    for part in (("lp",) if top else ("lp", "ent")):
        ours, theirs = side(True, part), side(False, part)
        if part == "lp":
            out["logprobs"] = [err(ours[0], theirs[0]), b["out"]]
            out["entropy"] = [err(ours[1], theirs[1]), b["out"] + (2 * U if top else 0.0)]  # as in block_case
            out["per_sample_lengths"] = [float(ours[5] != theirs[5]), 0.0]
            gh, gw = rounding_bounds(theirs[4], hidden, weight[shard], tp_group, 2 if top else 1, theirs[2],
                                     theirs[3])
        else:
            gh = gw = 0.0
        out[f"d_hidden_{part}"] = [err(ours[2], theirs[2]), b["grad"] + gh]
        out[f"d_weight_{part}"] = [err(ours[3], theirs[3]), b["grad"] + gw]
    return out


def run_miles_cases(results, load, err, bounds, rank, world, singles, peers):
    mods = load_miles(peers, load) if peers else None
    if mods is None or world != 2:
        return
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).split(".")[-1]
        for tp, group in ((1, singles[rank]), (2, dist.group.WORLD)):
            set_groups(group, singles[rank])
            results[f"miles-peer-tp{tp}-{dn}"] = block_case(err, bounds, dtype, tp, group, rank, mods[0], False,
                                                            TEMPERATURE)
            results[f"miles-step-peer-tp{tp}-{dn}"] = step_case(err, bounds, dtype, rank, group, singles[rank],
                                                                mods, False, False)
        for allgather in (False, True):
            results[f"miles-step-peer-cp2-{'allgather' if allgather else 'zigzag'}-{dn}"] = step_case(
                err, bounds, dtype, rank, singles[rank], dist.group.WORLD, mods, allgather, False)
    for tp, group in ((1, singles[rank]), (2, dist.group.WORLD)):
        set_groups(group, singles[rank])
        for t in (1.0, TEMPERATURE):
            results[f"miles-true-on-policy-peer-tp{tp}-t{t}"] = block_case(err, bounds, torch.bfloat16, tp, group,
                                                                           rank, mods[0], True, t)
        results[f"miles-true-on-policy-step-peer-tp{tp}"] = step_case(err, bounds, torch.bfloat16, rank, group,
                                                                      singles[rank], mods, False, True)
