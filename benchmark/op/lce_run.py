"""The measurements of `bench_lce` on one shape: every provider against the floors and the exact
reference, the Triton backend's own pieces, the tile sweep and the chunked-GEMM timing.

Per provider and shape (run_shape): forward-only time (no grad); fwd+bwd time of loss = -sum(logp) -
sum(entropy) (-sum(logp) for providers without entropy), each in --rounds rounds paired with a timing
of the shape's forward GEMM (the ratios are medians of per-round ratios: measure / paired); peak extra
memory of the forward and of one fwd+bwd step beyond the inputs and their gradients (none for CPU tensors); accuracy against
harness.exact_reference (max |dlogp|, max |dentropy|, rel-L2 of dh and dW). Inputs: bf16 h ~ N(0, 1),
W ~ N(0, 16/H), so the logits are ~ N(0, 16) and the entropy 3-4 nats; uniform labels.

The backend-level timings (breakdown, sweep) call the Triton backend's contract directly
(areal_lce/op/backends/base.py) and use its public tuning knobs: `configs.tuning(...)` for tiles and load
options, `TritonBackend(backward_gemms=False)` for the backward kernels without the cuBLAS GEMMs.
"""
from __future__ import annotations

import json
import math
import statistics
import traceback

import torch

from ..harness import PeakMemory, bench, bench_alternating, clean, exact_reference, gemm_floors, log, rel_l2
from .lce_providers import ENT_PROVIDERS

LOGIT_STD = 4.0  # W ~ N(0, 16/H), h ~ N(0, 1): logits ~ N(0, 16), entropy ~ 3-4 nats


def make_inputs(N, H, V, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(N, H, device=device, generator=g).to(torch.bfloat16)
    W = (torch.randn(V, H, device=device, generator=g) * (LOGIT_STD / math.sqrt(H))).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device=device, generator=g)
    return h, W, y


def _loss(lp, en, with_ent):
    return -lp.sum() - en.sum() if (with_ent and en is not None) else -lp.sum()


PAIRED_WARMUP_MS = 500  # each loop of a paired round first runs its own calls this long (do_bench warm-up)
PAIRED_DISCARD = 1  # paired rounds run first and dropped: the first round after a provider's accuracy
#                     and memory steps still ran its GEMM 10-15% off its later rounds (wide_n 34.3 vs 29.6 ms)


def paired(fn, gemm, rounds, rep, grad_to_none=None):
    """`rounds` rounds of (a bench() loop of the forward GEMM, then one of fn): (the median over the
    rounds of fn's median, p20 and p80 in ms, [fn / GEMM per round], [GEMM ms per round]). The ratio of
    each round divides by a GEMM timed seconds before, so a clock that drifts during a long shape run
    (H100 medians moved by 5-15% within one lease) moves both terms together. Each is a loop of its own
    calls, in the steady state the floor is defined in, reached by PAIRED_WARMUP_MS of warm-up calls: on
    a power-capped H100 the clock follows each kernel's power draw with a lag, and after 50 ms of
    warm-up a loop still ran at the clock the previous loop's kernel left (16384x4096 forward rounds
    1.15 -> 1.08 in one provider, benchmark/results/archive/h100_op_warm_rounds). Alternating the GEMM and fn
    call by call instead (bench_alternating) hands every call the other's clock and cost the fused kernels
    3-8%. The first PAIRED_DISCARD rounds are run and dropped."""
    times, ratios, gemms = [], [], []
    for i in range(max(1, rounds) + PAIRED_DISCARD):
        g = bench(gemm, rep=rep, warmup=PAIRED_WARMUP_MS)["ms"]
        t = bench(fn, rep=rep, grad_to_none=grad_to_none, warmup=PAIRED_WARMUP_MS)
        if i < PAIRED_DISCARD:
            continue
        times.append(t)
        ratios.append(t["ms"] / g)
        gemms.append(g)
    med = {k: statistics.median(t[k] for t in times) for k in ("ms", "p20", "p80")}
    return med, ratios, gemms


def measure(r: dict, fn, with_ent, h0, W0, y, h, W, ref, floors, rep, rounds=1, gemm=None) -> None:
    """One provider on one shape into r: accuracy, forward memory and time, fwd+bwd memory and time
    (r keeps what was measured before an error). With `gemm` (the shape's forward GEMM, a callable), the
    times come from `rounds` paired rounds (paired()): fwd_x_floor is the median of fwd / GEMM over the
    rounds, fwdbwd_x_8nhv the median of fwd+bwd / (floor_8nhv scaled by that round's GEMM time over
    the floors' GEMM time); without it, single measurements over the shape's floors."""
    grad_bytes = h.nbytes + W.nbytes
    # accuracy (the first call also compiles)
    h.grad = W.grad = None
    lp, en = fn(h, W, y)
    _loss(lp, en, with_ent).backward()
    r["logp_maxabs"] = (lp.detach().float() - ref["logp"]).abs().max().item()
    if with_ent:
        r["ent_maxabs"] = (en.detach().float() - ref["ent"]).abs().max().item()
    r["dh_rel"] = rel_l2(h.grad, ref["dh"])
    r["dw_rel"] = rel_l2(W.grad, ref["dW"])
    del lp, en
    h.grad = W.grad = None
    clean()
    # forward only, no grad
    with torch.no_grad():
        with PeakMemory(h.device) as pm:
            fn(h0, W0, y)
        r["fwd_peak_extra_gib"] = pm.extra_gib if pm.cuda else None
        if gemm is None:
            r["fwd"] = bench(lambda: fn(h0, W0, y), rep=rep)
        else:
            r["fwd"], r["fwd_x_gemm_rounds"], _ = paired(lambda: fn(h0, W0, y), gemm, rounds, rep)
    clean()
    # one fwd+bwd step: peak extra memory beyond inputs and their gradients
    with PeakMemory(h.device) as pm:
        lp, en = fn(h, W, y)
        _loss(lp, en, with_ent).backward()
    r["fwdbwd_peak_extra_gib"] = (pm.extra_bytes - grad_bytes) / 2**30 if pm.cuda else None
    del lp, en
    h.grad = W.grad = None
    clean()

    def step():
        lp, en = fn(h, W, y)
        _loss(lp, en, with_ent).backward()

    if gemm is None:
        r["fwdbwd"] = bench(step, rep=rep, grad_to_none=[h, W])
        r["fwd_x_floor"] = r["fwd"]["ms"] / floors["floor_fwd"]
        r["fwdbwd_x_8nhv"] = r["fwdbwd"]["ms"] / floors["floor_8nhv"]
        r["fwdbwd_x_6nhv"] = r["fwdbwd"]["ms"] / floors["floor_6nhv"]
        return
    r["fwdbwd"], fb_ratios, r["gemm_ms_rounds"] = paired(step, gemm, rounds, rep, grad_to_none=[h, W])
    # fwd+bwd / GEMM per round, times the floors' GEMM over their 8NHV (6NHV) sum
    r["fwdbwd_x_8nhv_rounds"] = [x * floors["fwd_gemm"] / floors["floor_8nhv"] for x in fb_ratios]
    r["fwd_x_floor"] = statistics.median(r["fwd_x_gemm_rounds"])
    r["fwdbwd_x_8nhv"] = statistics.median(r["fwdbwd_x_8nhv_rounds"])
    r["fwdbwd_x_6nhv"] = statistics.median(fb_ratios) * floors["fwd_gemm"] / floors["floor_6nhv"]


def run_shape(name, shape, providers, args) -> dict:
    N, H, V = shape
    log(f"=== {name}: N={N} H={H} V={V}")
    h0, W0, y = make_inputs(N, H, V, seed=1234 + N + H, device=args.device)
    res = {"shape": name, "N": N, "H": H, "V": V, "providers": {}}
    res["floors"] = gemm_floors(h0, W0)
    log("floors", {k: round(v, 3) for k, v in res["floors"].items()})
    clean()
    refs = {}
    for with_ent in (True, False):
        refs[with_ent] = exact_reference(h0, W0, y, with_ent)
    clean()
    h = h0.clone().requires_grad_(True)
    W = W0.clone().requires_grad_(True)
    # the paired GEMM allocates its [N, V] output per call (the caching allocator hands the block back),
    # so no logits-sized buffer is held while the providers run
    gemm = (lambda: torch.mm(h0, W0.t())) if args.rounds > 1 else None  # noqa: E731
    for pname, fn in providers.items():
        r = res["providers"][pname] = {}
        if not callable(fn):
            r["error"] = fn
            log(pname, "skipped:", fn)
            continue
        with_ent = pname in ENT_PROVIDERS
        try:
            measure(r, fn, with_ent, h0, W0, y, h, W, refs[with_ent], res["floors"], args.rep,
                    rounds=args.rounds, gemm=gemm)
            log(pname, json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))
        except Exception as e:  # noqa: BLE001 - OOM or a peer failing: record, go on
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(pname, "FAILED", r["error"])
            if "out of memory" not in str(e).lower():
                traceback.print_exc(limit=4)
        h.grad = W.grad = None
        clean()
    del gemm
    clean()
    if "areal_triton" in providers and callable(providers["areal_triton"]):
        try:
            res["breakdown"] = breakdown(h0, W0, y, args)
            log("breakdown", {k: round(v, 3) for k, v in res["breakdown"].items()})
        except Exception as e:  # noqa: BLE001
            res["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    del refs
    clean()
    return res


# ------------------------------------------------------------------------------- the Triton backend
def _backend_call(h, W, y, cache=False):
    """(backend, params, forward stats, lse, entropy, upstream -1 grads) for direct contract calls."""
    from areal_lce.op.backends.triton.launch import TritonBackend
    from areal_lce.op.types import LCEParams

    be = TritonBackend()
    N, V = h.shape[0], W.shape[0]
    p = LCEParams(inv_t=1.0, vocab_size=V, shard_valid=V, cache_bytes=(4 * N * V + 1) if cache else 0,
                  backend=be)
    st = be.forward(h, W, y, None, p, cache)
    lse = st.m + st.s.log()
    ent = st.s.log() - st.a / st.s
    return be, p, st, lse, ent, -torch.ones(N, device=h.device)


def breakdown(h, W, y, args, cache=False) -> dict:
    """Time the Triton backend's pieces: forward kernels, backward kernels alone, cuBLAS GEMMs; and the
    public op's forward over the backend's (op_fwd_over_backend: the two called in turn, each call timed
    alone, the median of the per-pair ratios: what the API, checks and output assembly add)."""
    from areal_lce import linear_logprobs_entropy
    from areal_lce.op.backends.triton.launch import TritonBackend

    be, p, st, lse, ent, g = _backend_call(h, W, y, cache)
    kernels = TritonBackend(backward_gemms=False)
    out = {"fwd_backend": bench(lambda: be.forward(h, W, y, None, p, False), rep=args.rep)["ms"]}
    with torch.no_grad():
        out["op_fwd_over_backend"] = bench_alternating(lambda: linear_logprobs_entropy(h, W, y, backend="triton"),
                                                       lambda: be.forward(h, W, y, None, p, False), rep=args.rep)[1]
    out["bwd_backend"] = bench(lambda: be.backward(h, W, y, None, p, st.cache, lse, ent, g, g, True, True),
                               rep=args.rep)["ms"]
    out["bwd_kernel_only"] = bench(lambda: kernels.backward(h, W, y, None, p, st.cache, lse, ent, g, g, True, True),
                                   rep=args.rep)["ms"]
    out["bwd_gemms"] = out["bwd_backend"] - out["bwd_kernel_only"]
    return out


def sweep(shapes, args) -> list:
    """Time forward and backward-kernel tiles of the Triton backend on each shape (bf16)."""
    from areal_lce.op.backends.triton import configs
    from areal_lce.op.backends.triton.configs import TileConfig as T
    from areal_lce.op.backends.triton.launch import TritonBackend

    cands = [  # (tile, TMA loads, persistent backward programs per SM)
        (T(128, 256, 64, 16, 8, 3), True, 1), (T(128, 256, 64, 16, 8, 3), False, 1),
        (T(128, 128, 64, 16, 8, 4), True, 1), (T(128, 128, 64, 16, 8, 3), True, 2),
    ]
    rows = []
    for name, (N, H, V) in shapes:
        h, W, y = make_inputs(N, H, V, seed=7, device=args.device)
        fl = gemm_floors(h, W)
        be, p, _, lse, ent, gg = _backend_call(h, W, y)
        kernels = TritonBackend(backward_gemms=False)
        for c, tma, pps in cands:
            for kind in ("fwd", "bwd"):
                if kind == "fwd" and pps != 1:
                    continue
                try:
                    with configs.tuning(**{kind: c}, use_tma=tma, bwd_programs_per_sm=pps):
                        if kind == "fwd":
                            ms = bench(lambda: be.forward(h, W, y, None, p, False), rep=200)["ms"]
                        else:
                            ms = bench(lambda: kernels.backward(h, W, y, None, p, None, lse, ent, gg, gg, True, True),
                                       rep=200)["ms"]
                    rows.append({"shape": name, "kind": kind, "tile": str(c), "tma": tma, "pps": pps, "ms": ms,
                                 "x_gemm": ms / fl["fwd_gemm"]})
                except Exception as e:  # noqa: BLE001
                    rows.append({"shape": name, "kind": kind, "tile": str(c), "tma": tma,
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                log(json.dumps(rows[-1]))
        clean()
    return rows


def chunk_gemms(shapes, widths, args) -> list:
    """cuBLAS time of the backward's two GEMMs summed over the vocabulary, per chunk width: d_weight
    rows = dlᵀ·h (bf16 out) and d_hidden += dl·W_chunk (fp32 accumulator, out_dtype GEMMs)."""
    rows = []
    for name, (N, H, V) in shapes:
        h = torch.randn(N, H, device=args.device).to(torch.bfloat16)
        W = torch.randn(V, H, device=args.device).to(torch.bfloat16)
        dW = torch.empty_like(W)
        dh = torch.empty(N, H, device=args.device)
        for wdt in widths:
            dl = torch.randn(N * wdt, device=args.device).to(torch.bfloat16)

            def run():
                for c0 in range(0, V, wdt):
                    w = min(wdt, V - c0)
                    d = dl[: N * w].view(N, w)
                    torch.mm(d.t(), h, out=dW[c0:c0 + w])
                    if c0 == 0:
                        torch.mm(d, W[c0:c0 + w], out_dtype=torch.float32, out=dh)
                    else:
                        torch.addmm(dh, d, W[c0:c0 + w], out_dtype=torch.float32, out=dh)

            ms = bench(run, rep=args.rep)["ms"]
            rows.append({"shape": name, "width": wdt, "chunks": -(-V // wdt), "ms": ms})
            log(json.dumps(rows[-1]))
            del dl
        clean()
    return rows
