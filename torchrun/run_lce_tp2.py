"""Tensor-parallel check of areal_lce against the unsharded fp64 oracle, on real process groups.

    torchrun --nproc_per_node=2 torchrun/run_lce_tp2.py [--quick] [--backends torch,reference] [--dtypes fp32,bf16]
    torchrun --nproc_per_node=2 torchrun/run_lce_tp2.py --quick --bad-input   # plus the clear-error checks
    torchrun --nproc_per_node=2 torchrun/run_lce_tp2.py --cases none --bad-input   # the clear-error checks only

Works with any world size that divides the shapes (2 and 4 are the ones exercised). Picks NCCL on GPUs
(NCCL_NVLS_ENABLE=0 unless already set) and gloo on CPU. Every rank builds the same full inputs from the
seed, keeps its shard (vocab rows [r·V/tp, (r+1)·V/tp) of the weight; under sequence parallel, rows
[r·N/tp, (r+1)·N/tp) of hidden), runs the op, and compares with `reference_logprobs_entropy` in fp64 on
the full inputs (the same bf16 values upcast, for bf16): logprobs, entropy, max/min logit, lse, raw-logit
sums Σr, Σr² (fused), d_hidden (this rank's rows under SP; the full gradient on every rank otherwise) and
d_weight (this rank's rows). Errors are max |Δ| / max(1, max |oracle|), the worst over ranks; `xrank` is the largest
difference of logprobs/entropy (and d_hidden without SP) between a rank and rank 0, which must be 0.
Rank 0 prints one row per case and PASS/FAIL; the exit status is non-zero on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import areal_lce  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_lce import VocabParallel, check_deferred, linear_logprobs_entropy, logprobs_entropy_from_logits  # noqa: E402
from areal_lce.op.backends import get_backend, interpreter_on  # noqa: E402
from areal_lce.op.reference import logprobs_entropy as reference_logprobs_entropy  # noqa: E402

IGNORE = -100
# torch >= 2.13 names the single-tensor collectives *_single (the *_tensor names warn); older keep *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Scaled max error allowed, (forward values, gradients). fp32: the op's fp32 math against fp64 (seen:
# <= 6e-7 values, <= 3e-6 grads). bf16: the oracle sees the same bf16 inputs upcast and the op
# accumulates in fp32, so forward values stay near fp32 accuracy (seen <= 3e-7); gradients carry a bf16
# rounding of d_logits and of the result (2^-8 relative; seen <= 4e-3), so 2e-2 is loose but an order
# of magnitude below a missing, duplicated or misplaced shard contribution (>= 0.1, usually ~1).
TOL = {"fp32": (1e-5, 5e-5), "bf16": (2e-4, 2e-2)}


@dataclass(frozen=True)
class Case:
    id: str
    sp: bool = False  # sequence parallel: hidden is this rank's sequence shard
    temperature: str = "1"  # "1" | "scalar" (0.7) | "tensor" (per token in [0.5, 1.5])
    ignore: str = "none"  # "none" | "some" (30% of rows) | "shard0" (all of rank 0's SP rows) | "all"
    labels: str = "mixed"  # "mixed": random plus every shard edge | "edges": shard edges only
    pad: str = "none"  # "none" | "last" (padding inside the last shard) | "shard" (last shard all padding)
    peaked: bool = False  # some logits ~25 above the rest (weight rows copied from hidden rows)
    cache: bool = False  # logits cache on (cache_bytes large enough) instead of recompute
    route: str = "fused"  # "fused" | "no_reduce" (VocabParallel d_hidden="caller" under a copy-to-TP mapping)
    #                       | "materialised" (logprobs_entropy_from_logits on this rank's logits shard)
    min_tp: int = 2


CASES = [
    Case("base"),  # plain vocab-parallel forward/backward, d_hidden all-reduced inside the op
    Case("sp", sp=True),  # all-gather of hidden rows, reduce-scatter of d_hidden
    Case("temp_scalar", temperature="scalar"),  # 1/T inside logits and in d_logits
    Case("temp_tensor_sp", sp=True, temperature="tensor"),  # per-token T must follow the full sequence
    Case("ignore", ignore="some"),  # ignored rows: zero outputs, exactly zero gradient
    Case("ignore_shard0_sp", sp=True, ignore="shard0"),  # one rank's whole SP shard ignored
    Case("all_ignored", ignore="all"),  # nothing to compute: zeros, and no rank may hang
    Case("edges_sp", sp=True, labels="edges"),  # labels at r·V/tp - 1 and r·V/tp: off-by-one ownership
    Case("pad", pad="last", peaked=True),  # padding rows hold huge logits: must be excluded, not read as 0
    Case("pad_sp_temp", sp=True, pad="last", temperature="tensor", ignore="some"),
    Case("pad_shard", pad="shard", peaked=True, min_tp=3),  # a rank whose shard is all padding
    Case("peaked", peaked=True, temperature="scalar"),  # entropy ~0: cancellation in lse - Σ p z
    Case("peaked_sp", sp=True, peaked=True),
    Case("peaked_cache", peaked=True, cache=True),  # the cached-logits backward matches recompute
    Case("no_reduce", route="no_reduce", peaked=True),  # d_hidden reduced exactly once, outside the op
    Case("mat", route="materialised", peaked=True, ignore="some"),
    Case("mat_sp_pad", route="materialised", sp=True, pad="last", temperature="tensor"),
]


class CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, all-reduce SUM of the grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()  # never reduce autograd's incoming buffer in place
        dist.all_reduce(g, group=ctx.group)  # vocab-partial d_hidden -> total, once
        return g, None


class GatherFromSP(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region: all-gather rows forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        world = dist.get_world_size(ctx.group)
        out = g.new_empty((g.shape[0] // world,) + tuple(g.shape[1:]))
        _reduce_scatter(out, g.contiguous(), group=ctx.group)  # full-seq grads -> own rows
        return out, None


# ---------------------------------------------------------------------------------------------- inputs

# (N, H, V_shard): N divisible by 2, 3 and 4 (sequence shards); V_shard odd, not a multiple of a block.
QUICK_SHAPE, DEFAULT_SHAPE = (36, 32, 75), (264, 96, 1000)


def shapes(base: tuple[int, int, int], tp: int) -> tuple[int, int, int]:
    """(N, H, V_shard) with N rounded up to a multiple of tp."""
    n, h, v_shard = base
    return -(-n // tp) * tp, h, v_shard


def build_inputs(case: Case, n: int, h: int, v_shard: int, tp: int, seed: int):
    """Full, unsharded fp32 inputs on CPU, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    v = v_shard * tp
    vocab = {"none": v, "last": v - v_shard // 2 - 3, "shard": (tp - 1) * v_shard - 5}[case.pad]
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (1.5 / h ** 0.5)  # logits with std ~1.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    edges = sorted({0, vocab - 1} | {e for r in range(1, tp) for e in (r * v_shard - 1, r * v_shard) if e < vocab})
    edge_t = torch.tensor(edges)
    if case.labels == "edges":
        labels = edge_t[torch.randint(0, len(edges), (n,), generator=g)]
    else:
        labels[: len(edges)] = edge_t
    if case.peaked:
        # Row i of hidden copied (scaled) into weight row j: logit z_ij ~ 25, the rest ~N(0, 1.5²).
        # Columns spread over every shard (edges included); half the peaked rows take j as their label.
        cols = sorted(set(edges) | {int(c) for c in torch.randint(0, vocab, (8,), generator=g)})
        rows = torch.randperm(n, generator=g)[: len(cols)]
        for k, (i, j) in enumerate(zip(rows.tolist(), cols)):
            weight[j] = hidden[i] * (25.0 / hidden[i].pow(2).sum())
            if k % 2 == 0:
                labels[i] = j
    if vocab < v:
        # Padding rows look like the best tokens of some rows: a backend reading them loses badly.
        pad_rows = torch.randperm(n, generator=g)[: min(n, v - vocab)]
        for j, i in zip(range(vocab, v), pad_rows.tolist()):
            weight[j] = hidden[i] * (40.0 / hidden[i].pow(2).sum())
    if case.ignore == "some":
        labels[torch.rand(n, generator=g) < 0.3] = IGNORE
    elif case.ignore == "shard0":
        labels[: n // tp] = IGNORE
    elif case.ignore == "all":
        labels[:] = IGNORE
    temperature = {"1": 1.0, "scalar": 0.7, "tensor": torch.rand(n, generator=g) + 0.5}[case.temperature]
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, labels, temperature, vocab, g_lp, g_ent


def oracle(hidden, weight, labels, temperature, vocab, g_lp, g_ent):
    """fp64 values and gradients of sum(g_lp·logprobs + g_ent·entropy) on the full vocabulary."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    t = temperature.double() if torch.is_tensor(temperature) else temperature
    lp, ent, mx, mn, lse = reference_logprobs_entropy(h, w, labels, temperature=t, ignore_index=IGNORE,
                                                      vocab_size=vocab, dtype=torch.float64)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    raw = (h.detach() @ w.detach()[:vocab].t()) * (labels != IGNORE).double()[:, None]
    return dict(lp=lp.detach(), ent=ent.detach(), mx=mx.detach(), mn=mn.detach(), lse=lse.detach(),
                sl=raw.sum(1), sq=(raw * raw).sum(1), dh=h.grad, dw=w.grad)


# ------------------------------------------------------------------------------------------------- run

def run_sharded(case: Case, backend: str, hidden, weight, labels, temperature, vocab, g_lp, g_ent, group):
    """This rank's outputs and gradients. hidden/weight are the full tensors in the test dtype."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    n, v_shard = hidden.shape[0], weight.shape[0] // tp
    w = weight[rank * v_shard:(rank + 1) * v_shard].clone().requires_grad_()
    h = (hidden[rank * (n // tp):(rank + 1) * (n // tp)] if case.sp else hidden).clone().requires_grad_()
    if case.route == "materialised":
        # The model's own LM-head GEMM on its vocab shard, under Megatron's hidden mapping. Logits in
        # fp32 from the test-dtype values, so the comparison isolates the route's communication/autograd.
        h_full = GatherFromSP.apply(h, group) if case.sp else CopyToTP.apply(h, group)
        logits = h_full.float() @ w.float().t()
        out = logprobs_entropy_from_logits(logits, labels, temperature=temperature, ignore_index=IGNORE,
                                           vocab_size=vocab, vocab_parallel=VocabParallel(group))
    else:
        h_in = CopyToTP.apply(h, group) if case.route == "no_reduce" else h
        cache = 1 << 30 if case.cache else 0
        d_hidden = "caller" if case.route == "no_reduce" else "reduce_scatter" if case.sp else "all_reduce"
        out = linear_logprobs_entropy(h_in, w, labels, temperature=temperature, ignore_index=IGNORE,
                                      vocab_size=vocab, return_stats=True, return_logit_sums=True,
                                      backend=backend, cache_bytes=cache,
                                      vocab_parallel=VocabParallel(group, d_hidden))
    (out.logprobs * g_lp + out.entropy * g_ent).sum().backward()
    return out, h.grad, w.grad


def scaled_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x is None:
        return float("inf")
    if ref.numel() == 0:
        return 0.0
    d = (x.double() - ref).abs().max().item()
    return float("nan") if d != d else d / max(1.0, ref.abs().max().item())


def check_case(case: Case, backend: str, dtype_name: str, base: tuple, seed: int, group, device):
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    n, h_dim, v_shard = shapes(base, tp)
    hidden, weight, labels, temperature, vocab, g_lp, g_ent = build_inputs(case, n, h_dim, v_shard, tp, seed)
    dtype = DTYPES[dtype_name]
    hidden, weight = hidden.to(dtype), weight.to(dtype)  # the oracle sees these exact values
    ref = oracle(hidden, weight, labels, temperature, vocab, g_lp, g_ent)
    to = (lambda t: t.to(device) if torch.is_tensor(t) else t)
    out, dh, dw = run_sharded(case, backend, to(hidden), to(weight), to(labels), to(temperature), vocab,
                              to(g_lp), to(g_ent), group)
    rows = slice(rank * (n // tp), (rank + 1) * (n // tp)) if case.sp else slice(None)
    errs = [scaled_err(out.logprobs.cpu(), ref["lp"]), scaled_err(out.entropy.cpu(), ref["ent"]),
            max(scaled_err(getattr(out, k).cpu(), ref[r]) for k, r in (("max_logit", "mx"), ("min_logit", "mn"),
                ("lse", "lse"), ("sum_logit", "sl"), ("sumsq_logit", "sq")) if getattr(out, k) is not None),
            scaled_err(dh.cpu(), ref["dh"][rows]), scaled_err(dw.cpu(), ref["dw"][rank * v_shard:(rank + 1) * v_shard])]
    # Cross-rank identity: outputs (and the replicated d_hidden without SP) are the same bits everywhere.
    same = [out.logprobs.detach().float(), out.entropy.detach().float()]
    if not case.sp:
        same.append(dh.detach().float().reshape(-1))
    mine = torch.cat([t.reshape(-1) for t in same])
    first = mine.clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    errs.append((mine - first).abs().max().item() if mine.numel() else 0.0)
    return errs


def reduce_max(values: list[float], group, device) -> list[float]:
    t = torch.tensor([float("inf") if v != v else v for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# ------------------------------------------------------------------------------------------ bad input

def expect_error(name: str, fn, substring: str, rank: int) -> bool:
    try:
        fn()
    except (ValueError, TypeError) as e:
        ok = substring in str(e)
        if rank == 0:
            print(f"{'PASS' if ok else 'FAIL'} bad-input {name}: {type(e).__name__}: {e}", flush=True)
        return ok
    if rank == 0:
        print(f"FAIL bad-input {name}: no error raised", flush=True)
    return False


def run_bad_input(group, device, backend: str) -> bool:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(1)
    n, h_dim, v_shard = 8 * tp, 16, 24
    hidden = torch.randn(n, h_dim, generator=g).to(device)
    full_w = torch.randn(v_shard * tp, h_dim, generator=g).to(device)
    labels = torch.randint(0, v_shard * tp, (n,), generator=g).to(device)
    shard = full_w[rank * v_shard:(rank + 1) * v_shard]
    base = dict(hidden=hidden, weight=shard, labels=labels, backend=backend, vocab_parallel=VocabParallel(group))
    call = (lambda **kw: linear_logprobs_entropy(**{**base, **kw}))
    checked = lambda **kw: (call(**kw), check_deferred())  # noqa: E731  (label values: deferred on GPUs)
    ok = [
        # rank r holds v_shard + r rows: the shard-size agreement check must fire on every rank
        expect_error("uneven_vocab_shards", lambda: call(weight=full_w[: v_shard + rank]),
                     "differs across the tensor-parallel group", rank),
        expect_error("label_out_of_range", lambda: checked(labels=torch.full_like(labels, v_shard * tp)),
                     "labels", rank),
        expect_error("negative_label", lambda: checked(labels=torch.full_like(labels, -1)), "labels", rank),
        expect_error("label_in_padding", lambda: checked(vocab_size=v_shard * tp - 3, labels=torch.full_like(
            labels, v_shard * tp - 2)), "labels", rank),
        # ranks passing different labels: every rank raises (deferred on GPUs: every logprob NaN until then)
        expect_error("labels_differ_across_ranks", lambda: checked(labels=(labels + rank) % (v_shard * tp)),
                     "labels differ across the tensor-parallel group", rank),
        # the unsharded weight handed in with a vocab-parallel group: caught through the true vocabulary size
        expect_error("full_weight_with_tp_group", lambda: call(weight=full_w, vocab_size=v_shard * tp),
                     "vocab shard", rank),
        # under SP, labels must cover the full sequence, not this rank's rows
        expect_error("sp_local_labels", lambda: call(hidden=hidden[: n // tp], labels=labels[: n // tp],
                                                     vocab_parallel=VocabParallel(group, "reduce_scatter")),
                     "full sequence", rank),
        # a keyword the op does not take (the group goes in VocabParallel): Python's TypeError names it
        expect_error("unknown_keyword", lambda: call(vocab_parallel=None, tp_group=group), "tp_group", rank),
    ]
    return reduce_max([float(not all(ok))], group, device)[0] == 0.0  # every rank must have seen every error


# ------------------------------------------------------------------------------------------------ main

def available_backends(device: torch.device) -> list[str]:
    names = ["triton", "torch", "reference"] if device.type == "cuda" else \
        ["reference", "torch"] + (["triton", "triton_ascend"] if interpreter_on() else [])
    loads = []
    for name in names:
        try:
            loads += [name] if get_backend(name) is not None else []
        except RuntimeError:
            pass
    return loads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized shapes (N=36, H=32, V=75 per rank)")
    ap.add_argument("--backends", default="auto",
                    help="comma list of backends; 'auto' = those available here (GPU: triton,torch,reference; "
                         "CPU: reference,torch, plus triton/triton_ascend under TRITON_INTERPRET=1)")
    ap.add_argument("--dtypes", default="fp32,bf16", help=f"comma list of {sorted(DTYPES)}")
    ap.add_argument("--cases", default="", help="comma list of case ids to run (default: all; 'none': no case)")
    ap.add_argument("--bad-input", action="store_true", help="also check that bad input (uneven vocab shards, bad "
                    "labels, labels differing across ranks, a full weight with a vocab-parallel group, ...) errors on "
                    "every rank")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: one GPU per rank over NCCL when CUDA is available, else CPU over gloo")
    ap.add_argument("--shape", help="N,H,V_SHARD overriding the default shapes (N is rounded up to a multiple of tp)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    base = QUICK_SHAPE if args.quick else DEFAULT_SHAPE
    if args.shape:
        try:
            base = tuple(int(x) for x in args.shape.split(","))
            assert len(base) == 3 and min(base) > 0
        except (ValueError, AssertionError):
            raise SystemExit(f"--shape {args.shape!r}: expected N,H,V_SHARD (three positive ints)")

    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if use_cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=300))
    group = dist.new_group(list(range(dist.get_world_size())))  # a real subgroup, not the default one
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    backends = available_backends(device) if args.backends == "auto" else args.backends.split(",")
    for b in backends:
        get_backend(b)  # an explicitly named backend that cannot load is an error
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(DTYPES):
        raise SystemExit(f"--dtypes: {sorted(set(dtypes) - set(DTYPES))} not in {sorted(DTYPES)}")
    say(f"areal_lce TP check: tp={tp} dist={dist.get_backend(group)} device={device.type} "
        f"backends={','.join(backends)} dtypes={','.join(dtypes)} shapes(N,H,V/tp)={shapes(base, tp)}")

    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in CASES if tp >= c.min_tp and (wanted is None or c.id in wanted)]
    if wanted and wanted != {"none"} and not cases:
        raise SystemExit(f"--cases: none of {sorted(wanted)} exist (ids: {[c.id for c in CASES]})")
    if cases:
        say("tolerances (scaled max error): " + ", ".join(f"{k}: values {v[0]:g}, grads {v[1]:g}"
                                                          for k, v in TOL.items()) + "; xrank must be 0")
        header = f"{'case':<18} {'backend':<13} {'dtype':<5} {'logprobs':>9} {'entropy':>9} {'stats':>9} " \
                 f"{'d_hidden':>9} {'d_weight':>9} {'xrank':>8}  result"
        say(header)
        say("-" * len(header))
    failures = 0
    for case in cases:
        for dtype_name in dtypes:
            for backend in (["-"] if case.route == "materialised" else backends):
                label = "materialised" if backend == "-" else backend
                error = ""
                try:
                    errs = check_case(case, backend if backend != "-" else "reference", dtype_name, base,
                                      args.seed, group, device)
                except Exception as e:  # a raising rank reports; all ranks take part in the MAX below
                    errs, error = [float("inf")] * 6, f" ({type(e).__name__}: {e})"
                errs = reduce_max(errs, group, device)
                tv, tg = TOL[dtype_name]
                ok = (max(errs[:3]) <= tv and max(errs[3:5]) <= tg and errs[5] == 0.0)
                failures += not ok
                say(f"{case.id:<18} {label:<13} {dtype_name:<5} " + " ".join(f"{e:9.2e}" for e in errs[:5])
                    + f" {errs[5]:8.1e}  {'PASS' if ok else 'FAIL'}{error}")
    runs = sum(len(dtypes) * (1 if c.route == "materialised" else len(backends)) for c in cases)
    if cases:
        say(f"{'PASS' if not failures else 'FAIL'}: {runs - failures}/{runs} runs within tolerance (tp={tp})")
    if args.bad_input:
        ok = run_bad_input(group, device, "torch" if device.type == "cpu" else backends[0])
        say("PASS bad-input: all clear errors" if ok else "FAIL bad-input")
        failures += not ok
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
