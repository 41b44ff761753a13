"""Fused linear logprobs + entropy: areal_lce against torch and the peers, side by side, on one GPU.

    python -m benchmark.bench_lce --shapes small,qwen7b --providers all [--out DIR]
    python -m benchmark.bench_lce --shapes qwen7b --sweep        # tile sweep of the Triton kernels

Providers: areal_triton (cache_bytes=0), areal_triton_cache (cache budget >= the fp32 logits),
areal_triton_nochecks (check_labels=False, compact_ignored=False), areal_torch (chunked torch
backend), torch_eager / torch_compile (materialised logits), and liger / cce / verl when importable
(through /work/shared/peers/bench_peers.py's loader, found via --peers-script). The areal_lce
providers go through the public `areal_lce.linear_logprobs_entropy` with its default options (deferred
label checks and the device-side partition of ignored rows: no host sync) unless named otherwise.

Per provider and shape: forward-only time (no grad), fwd+bwd time of loss = -sum(logp) - sum(entropy)
(-sum(logp) for providers without entropy), triton.testing.do_bench median with p20/p80; peak extra
memory of one fwd+bwd step beyond inputs and their gradients; accuracy against an exact fp32 reference
(max |dlogp|, max |dentropy|, rel-L2 of dh and dW).

Floors, measured with cuBLAS in the same run (bf16 in, bf16 out):
    fwd floor  = t(h · Wᵀ)                           2NHV FLOPs
    8NHV floor = 2 t(h · Wᵀ) + t(dl · W) + t(dlᵀ · h)  forward + recompute + d_hidden + d_weight
    6NHV floor = t(h · Wᵀ) + t(dl · W) + t(dlᵀ · h)    (no recompute: what a logits cache can reach)
The exact reference computes logits with fp32 accumulation of the exact bf16 products and the
gradient GEMMs on a 3-term bf16 split of the fp32 d_logits (error ~2^-24 relative), so it is exact
fp32 up to accumulation order at a few GEMMs' cost.

Writes bench_lce.json, bench_lce.csv and bench_lce.png under --out, stamped with device, versions
and git sha; prints a table with ratios to the floors and to the targets (targets are not asserted).
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

SHAPES = {
    "small": (4096, 896, 151936),
    "qwen7b": (8192, 4096, 151936),
    "llama8b": (16384, 4096, 128256),
    "wide_n": (32768, 2048, 151936),
}
PROVIDERS = ["areal_triton", "areal_triton_cache", "areal_triton_nochecks", "areal_torch", "torch_eager",
             "torch_compile", "liger", "cce", "verl"]
ENT_PROVIDERS = {"areal_triton", "areal_triton_cache", "areal_triton_nochecks", "areal_torch", "torch_eager",
                 "torch_compile", "verl"}
LOGIT_STD = 4.0  # W ~ N(0, 16/H), h ~ N(0, 1): logits ~ N(0, 16), entropy ~ 3-4 nats
TARGETS = {"fwdbwd_x8": 1.05, "fwdbwd_x8_small": 1.25, "fwd_x2": 1.10, "cache_x8": 0.85,
           "mem_gib_wide_n": 0.5, "logp": 2e-4, "ent": 5e-4, "dh": 2e-3, "dw": 2e-3}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def clean():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def bench(fn, rep=400, grad_to_none=None):
    from triton.testing import do_bench

    q = do_bench(fn, warmup=50, rep=rep, quantiles=[0.5, 0.2, 0.8], grad_to_none=grad_to_none)
    return {"ms": q[0], "p20": q[1], "p80": q[2]}


# --------------------------------------------------------------------------------------- providers
def _areal(backend, cache, checks=True):
    from areal_lce import linear_logprobs_entropy

    off = {} if checks else {"check_labels": False, "compact_ignored": False}

    def fn(h, W, y):
        cb = 4 * h.shape[0] * W.shape[0] + 1 if cache else 0
        o = linear_logprobs_entropy(h, W, y, backend=backend, cache_bytes=cb, **off)
        return o.logprobs, o.entropy
    return fn


def _torch_lp_ent(h, W, y):
    z = (h @ W.t()).float()
    lpa = torch.log_softmax(z, dim=-1)
    lp = lpa.gather(1, y[:, None]).squeeze(1)
    ent = -(lpa.exp() * lpa).sum(-1)
    return lp, ent


_compiled = None


def _torch_compile(h, W, y):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_torch_lp_ent, dynamic=False)
    return _compiled(h, W, y)


def load_providers(names, peers_script):
    out, versions = {}, {}
    for n in names:
        if n == "areal_triton":
            out[n] = _areal("triton", False)
        elif n == "areal_triton_cache":
            out[n] = _areal("triton", True)
        elif n == "areal_triton_nochecks":
            out[n] = _areal("triton", False, checks=False)
        elif n == "areal_torch":
            out[n] = _areal("torch", False)
        elif n == "torch_eager":
            out[n] = _torch_lp_ent
        elif n == "torch_compile":
            out[n] = _torch_compile
    peers = [n for n in names if n in ("liger", "cce", "verl")]
    if peers:
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(peers_script)))
            import bench_peers  # the shared peer loader: imports the peers' packages, no code copied

            bench_peers.load_third_party()
            versions.update(bench_peers.VERSIONS)
            key = {"liger": "liger_none", "cce": "cce", "verl": "verl"}
            for n in peers:
                f = bench_peers.THIRD.get(key[n])
                if callable(f):
                    out[n] = (lambda f: lambda h, W, y: f(h, W, y, 1.0)[:2])(f)
                else:
                    out[n] = f"unavailable: {f}"
        except Exception as e:  # noqa: BLE001
            for n in peers:
                out[n] = f"unavailable: {type(e).__name__}: {e}"
    return out, versions


# ------------------------------------------------------------------------------- floors, reference
def gemm_floors(h, W):
    z = torch.mm(h, W.t())
    res = {"fwd_gemm": bench(lambda: torch.mm(h, W.t(), out=z))["ms"]}
    dh = torch.empty_like(h)
    res["dh_gemm"] = bench(lambda: torch.mm(z, W, out=dh))["ms"]
    dW = torch.empty_like(W)
    res["dw_gemm"] = bench(lambda: torch.mm(z.t(), h, out=dW))["ms"]
    del z, dh, dW
    res["floor_fwd"] = res["fwd_gemm"]
    res["floor_8nhv"] = 2 * res["fwd_gemm"] + res["dh_gemm"] + res["dw_gemm"]
    res["floor_6nhv"] = res["fwd_gemm"] + res["dh_gemm"] + res["dw_gemm"]
    N, H = h.shape
    res["fwd_tflops"] = 2 * N * H * W.shape[0] / res["fwd_gemm"] / 1e9
    return res


def _split3(x):
    a = x.to(torch.bfloat16)
    r = x - a.float()
    b = r.to(torch.bfloat16)
    c = (r - b.float()).to(torch.bfloat16)
    return a, b, c


@torch.no_grad()
def exact_reference(h, W, y, with_ent: bool, chunk=2048):
    """fp32-exact logp, entropy, dh, dW for loss = -sum(logp) [- sum(entropy)] (bf16 h, W)."""
    N, H = h.shape
    lp = torch.empty(N, device=h.device)
    ent = torch.empty(N, device=h.device)
    dh = torch.empty(N, H, device=h.device)
    dW = torch.zeros(W.shape, device=h.device)
    for s in range(0, N, chunk):
        hc, yc = h[s:s + chunk], y[s:s + chunk]
        z = torch.mm(hc, W.t(), out_dtype=torch.float32)
        lse = torch.logsumexp(z, -1)
        z -= lse[:, None]  # log p
        p = z.exp()
        en = -(p * z).sum(-1)
        lp[s:s + chunk] = z.gather(1, yc[:, None])[:, 0]
        ent[s:s + chunk] = en
        # g_lp = -1, g_ent = -1 (or 0): dz = -(1[j=y] - p) + p (log p + H)
        dz = p
        if with_ent:
            dz = dz + p * (z + en[:, None])
        del z
        dz.scatter_add_(1, yc[:, None], -torch.ones(yc.shape[0], 1, device=h.device))
        acc = None
        for part in _split3(dz):
            acc = torch.mm(part, W, out_dtype=torch.float32) if acc is None else \
                torch.addmm(acc, part, W, out_dtype=torch.float32)
            torch.addmm(dW, part.t(), hc, out_dtype=torch.float32, out=dW)
        dh[s:s + chunk] = acc
        del dz, p, acc
    return {"logp": lp, "ent": ent, "dh": dh, "dW": dW}


def _rel(x, ref):
    return (torch.linalg.vector_norm((x.float() - ref).flatten()) / torch.linalg.vector_norm(ref.flatten())).item()


def _loss(lp, en, with_ent):
    return -lp.sum() - en.sum() if (with_ent and en is not None) else -lp.sum()


# --------------------------------------------------------------------------------------- one shape
def run_shape(name, shape, providers, args):
    N, H, V = shape
    log(f"=== {name}: N={N} H={H} V={V}")
    g = torch.Generator(device="cuda").manual_seed(1234 + N + H)
    h0 = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    W0 = (torch.randn(V, H, device="cuda", generator=g) * (LOGIT_STD / math.sqrt(H))).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
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
    grad_bytes = h.nbytes + W.nbytes
    for pname, fn in providers.items():
        r = {}
        res["providers"][pname] = r
        if not callable(fn):
            r["error"] = fn
            log(pname, "skipped:", fn)
            continue
        with_ent = pname in ENT_PROVIDERS
        try:
            # accuracy (first call also compiles)
            h.grad = W.grad = None
            lp, en = fn(h, W, y)
            _loss(lp, en, with_ent).backward()
            ref = refs[with_ent]
            r["logp_maxabs"] = (lp.detach().float() - ref["logp"]).abs().max().item()
            if with_ent:
                r["ent_maxabs"] = (en.detach().float() - ref["ent"]).abs().max().item()
            r["dh_rel"] = _rel(h.grad, ref["dh"])
            r["dw_rel"] = _rel(W.grad, ref["dW"])
            del lp, en
            h.grad = W.grad = None
            clean()
            # forward only, no grad
            with torch.no_grad():
                m0 = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn(h0, W0, y)
                torch.cuda.synchronize()
                r["fwd_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - m0) / 2**30
                r["fwd"] = bench(lambda: fn(h0, W0, y), rep=args.rep)
            clean()
            # one fwd+bwd step: peak extra memory beyond inputs and their gradients
            m0 = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            lp, en = fn(h, W, y)
            _loss(lp, en, with_ent).backward()
            torch.cuda.synchronize()
            r["fwdbwd_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - m0 - grad_bytes) / 2**30
            del lp, en
            h.grad = W.grad = None
            clean()

            def step():
                lp, en = fn(h, W, y)
                _loss(lp, en, with_ent).backward()

            r["fwdbwd"] = bench(step, rep=args.rep, grad_to_none=[h, W])
            fl = res["floors"]
            r["fwd_x_floor"] = r["fwd"]["ms"] / fl["floor_fwd"]
            r["fwdbwd_x_8nhv"] = r["fwdbwd"]["ms"] / fl["floor_8nhv"]
            r["fwdbwd_x_6nhv"] = r["fwdbwd"]["ms"] / fl["floor_6nhv"]
            log(pname, json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))
        except Exception as e:  # noqa: BLE001 - OOM or a peer failing: record, go on
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(pname, "FAILED", r["error"])
            if "out of memory" not in str(e).lower():
                traceback.print_exc(limit=4)
        h.grad = W.grad = None
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


def breakdown(h, W, y, args, cache=False):
    """Time the Triton backend's pieces: forward kernels, backward kernel alone, cuBLAS GEMMs."""
    from areal_lce.backends.triton import launch
    from areal_lce.types import LCEParams

    be = launch.TritonBackend()
    N, V = h.shape[0], W.shape[0]
    p = LCEParams(temperature=1.0, vocab_size=V, shard_valid=V, cache_bytes=(4 * N * V + 1) if cache else 0,
                  backend="triton")
    st = be.forward(h, W, y, None, p, cache)
    lse = st.m + st.s.log()
    ent = st.s.log() - st.a / st.s
    g = -torch.ones(N, device=h.device)
    out = {"fwd_backend": bench(lambda: be.forward(h, W, y, None, p, False), rep=args.rep)["ms"]}

    def bwd():
        be.backward(h, W, y, None, p, st.cache, lse, ent, g, g, True, True)

    out["bwd_backend"] = bench(bwd, rep=args.rep)["ms"]
    kernels = launch.TritonBackend(backward_gemms=False)
    out["bwd_kernel_only"] = bench(lambda: kernels.backward(h, W, y, None, p, st.cache, lse, ent, g, g, True, True),
                                   rep=args.rep)["ms"]
    out["bwd_gemms"] = out["bwd_backend"] - out["bwd_kernel_only"]
    return out


# ------------------------------------------------------------------------------------------- sweep
def sweep(shapes, args):
    """Time forward and backward-kernel tiles of the Triton backend on each shape (bf16)."""
    from areal_lce.backends.triton import configs
    from areal_lce.backends.triton.configs import TileConfig as T

    cands = [  # (tile, TMA loads, backward tiles per program)
        (T(128, 256, 64, 16, 8, 3), True, 1), (T(128, 256, 64, 16, 8, 3), False, 1),
        (T(128, 128, 64, 16, 8, 4), True, 1), (T(128, 256, 64, 16, 8, 3), True, 2),
    ]
    rows = []
    for name, (N, H, V) in shapes:
        g = torch.Generator(device="cuda").manual_seed(7)
        h = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
        W = (torch.randn(V, H, device="cuda", generator=g) * (LOGIT_STD / math.sqrt(H))).to(torch.bfloat16)
        y = torch.randint(0, V, (N,), device="cuda", generator=g)
        fl = gemm_floors(h, W)
        from areal_lce.backends.triton import launch
        from areal_lce.types import LCEParams

        be, kernels = launch.TritonBackend(), launch.TritonBackend(backward_gemms=False)
        p = LCEParams(temperature=1.0, vocab_size=V, shard_valid=V, backend="triton")
        st = be.forward(h, W, y, None, p, False)
        lse, ent = st.m + st.s.log(), st.s.log() - st.a / st.s
        gg = -torch.ones(N, device=h.device)
        for c, tma, tpp in cands:
            for kind in ("fwd", "bwd"):
                if kind == "fwd" and tpp != 1:
                    continue
                try:
                    with configs.tuning(**{kind: c}, use_tma=tma, bwd_tiles_per_program=tpp):
                        if kind == "fwd":
                            ms = bench(lambda: be.forward(h, W, y, None, p, False), rep=200)["ms"]
                        else:
                            ms = bench(lambda: kernels.backward(h, W, y, None, p, None, lse, ent, gg, gg, True, True),
                                       rep=200)["ms"]
                    rows.append({"shape": name, "kind": kind, "tile": str(c), "tma": tma, "tpp": tpp, "ms": ms,
                                 "x_gemm": ms / fl["fwd_gemm"]})
                except Exception as e:  # noqa: BLE001
                    rows.append({"shape": name, "kind": kind, "tile": str(c), "tma": tma,
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                log(json.dumps(rows[-1]))
        clean()
    return rows


def chunk_gemms(shapes, widths, args):
    """cuBLAS time of the backward's two GEMMs summed over the vocabulary, per chunk width: d_weight
    rows = dlᵀ·h (bf16 out) and d_hidden += dl·W_chunk (fp32 accumulator, out_dtype GEMMs)."""
    rows = []
    for name, (N, H, V) in shapes:
        h = torch.randn(N, H, device="cuda").to(torch.bfloat16)
        W = torch.randn(V, H, device="cuda").to(torch.bfloat16)
        dW = torch.empty_like(W)
        dh = torch.empty(N, H, device="cuda")
        for wdt in widths:
            dl = torch.randn(N * wdt, device="cuda").to(torch.bfloat16)

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


# -------------------------------------------------------------------------------------------- main
def meta():
    m = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        m["git_sha"] = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        m["git_dirty"] = bool(subprocess.check_output(["git", "status", "--porcelain", "areal_lce", "benchmark"], text=True).strip())
    except Exception:  # noqa: BLE001
        m["git_sha"] = os.environ.get("GIT_SHA", "unknown")
    return m


def merge(files, out_dir):
    """Combine result files (e.g. two device runs) into one CSV/PNG and a markdown table on stdout."""
    results, metas = [], []
    for f in files:
        with open(f) as fh:
            d = json.load(fh)
        metas.append(d["meta"])
        for s in d["shapes"]:
            s["source"] = f"{os.path.basename(os.path.dirname(f))} ({d['meta'].get('git_sha', '?')})"
            results.append(s)
    m = dict(metas[0])
    m["git_sha"] = ",".join(sorted({x.get("git_sha", "?") for x in metas}))
    write_outputs(results, out_dir, m)
    f2 = lambda v, f: (f % v) if isinstance(v, (int, float)) else "-"  # noqa: E731
    print("| N×H×V | provider | fwd ms | ×2NHV | fwd+bwd ms (p20–p80) | ×8NHV | extra GiB | max abs Δlogp | "
          "max abs Δent | dh rel-L2 | dW rel-L2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in results:
        for p, r in s["providers"].items():
            fb = r.get("fwdbwd", {})
            if r.get("error"):
                print(f"| {s['N']}×{s['H']}×{s['V']} | {p} | {r['error'][:40]} | | | | | | | | |")
                continue
            print(f"| {s['N']}×{s['H']}×{s['V']} | {p} | {f2(r['fwd']['ms'], '%.2f')} | {f2(r['fwd_x_floor'], '%.2f')} | "
                  f"{fb['ms']:.2f} ({fb['p20']:.2f}–{fb['p80']:.2f}) | {f2(r['fwdbwd_x_8nhv'], '%.2f')} | "
                  f"{f2(r['fwdbwd_peak_extra_gib'], '%.2f')} | {f2(r.get('logp_maxabs'), '%.1e')} | "
                  f"{f2(r.get('ent_maxabs'), '%.1e')} | {f2(r['dh_rel'], '%.2e')} | {f2(r['dw_rel'], '%.2e')} |")
    print()
    print("| N×H×V | fwd GEMM ms | 8NHV floor ms | 6NHV floor ms | Triton fwd ms | recompute kernel ms | cuBLAS dh+dW ms | source |")
    print("|---|---|---|---|---|---|---|---|")
    for s in results:
        fl, bd = s["floors"], s.get("breakdown", {})
        print(f"| {s['N']}×{s['H']}×{s['V']} | {fl['fwd_gemm']:.2f} | {fl['floor_8nhv']:.2f} | {fl['floor_6nhv']:.2f} | "
              f"{f2(bd.get('fwd_backend'), '%.2f')} | {f2(bd.get('bwd_kernel_only'), '%.2f')} | "
              f"{f2(bd.get('bwd_gemms'), '%.2f')} | {s['source']} |")
    return 0


def parse_shapes(s):
    out = []
    for tok in s.split(","):
        if tok in SHAPES:
            out.append((tok, SHAPES[tok]))
        else:
            n, hh, v = (int(x) for x in tok.lower().split("x"))
            out.append((tok, (n, hh, v)))
    return out


def write_outputs(results, out_dir, m):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_lce.json"), "w") as f:
        json.dump({"meta": m, "targets": TARGETS, "shapes": results}, f, indent=1, default=str)
    rows = []
    for s in results:
        for p, r in s["providers"].items():
            rows.append({
                "shape": s["shape"], "N": s["N"], "H": s["H"], "V": s["V"], "provider": p,
                "fwd_ms": r.get("fwd", {}).get("ms"), "fwdbwd_ms": r.get("fwdbwd", {}).get("ms"),
                "fwdbwd_p20": r.get("fwdbwd", {}).get("p20"), "fwdbwd_p80": r.get("fwdbwd", {}).get("p80"),
                "fwd_x_floor": r.get("fwd_x_floor"), "fwdbwd_x_8nhv": r.get("fwdbwd_x_8nhv"),
                "fwdbwd_peak_extra_gib": r.get("fwdbwd_peak_extra_gib"), "fwd_peak_extra_gib": r.get("fwd_peak_extra_gib"),
                "logp_maxabs": r.get("logp_maxabs"), "ent_maxabs": r.get("ent_maxabs"),
                "dh_rel": r.get("dh_rel"), "dw_rel": r.get("dw_rel"),
                "floor_fwd_ms": s["floors"]["floor_fwd"], "floor_8nhv_ms": s["floors"]["floor_8nhv"],
                "floor_6nhv_ms": s["floors"]["floor_6nhv"], "error": r.get("error"),
                "device": m["device"], "git_sha": m.get("git_sha"),
            })
    if rows:
        with open(os.path.join(out_dir, "bench_lce.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5))
        provs = [p for p in PROVIDERS if any(r["provider"] == p and r["fwdbwd_x_8nhv"] for r in rows)]
        width = 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            xs, ys = [], []
            for j, s in enumerate(results):
                r = s["providers"].get(p, {})
                if r.get("fwdbwd_x_8nhv"):
                    xs.append(j + i * width)
                    ys.append(r["fwdbwd_x_8nhv"])
            ax.bar(xs, ys, width, label=p)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))])
        ax.set_xticklabels([f"{s['N']}x{s['H']}x{s['V']}" for s in results])
        ax.set_ylabel("fwd+bwd time / 8NHV cuBLAS floor")
        ax.set_title(f"fused linear logprobs+entropy, bf16, {m['device']}")
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "bench_lce.png"), dpi=110)
    except Exception as e:  # noqa: BLE001
        log("plot failed", e)


def print_table(results):
    hdr = f"{'shape':>22} {'provider':>19} {'fwd ms':>8} {'x2NHV':>6} {'f+b ms':>8} {'x8NHV':>6} {'GiB':>6} " \
          f"{'|dlogp|':>8} {'|dent|':>8} {'dh rel':>8} {'dW rel':>8}"
    print(hdr)
    fmt = lambda v, f: (f % v) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for s in results:
        for p, r in s["providers"].items():
            print(f"{s['N']}x{s['H']}x{s['V']:>6} {p:>19} {fmt(r.get('fwd', {}).get('ms'), '%8.2f')} "
                  f"{fmt(r.get('fwd_x_floor'), '%6.2f')} {fmt(r.get('fwdbwd', {}).get('ms'), '%8.2f')} "
                  f"{fmt(r.get('fwdbwd_x_8nhv'), '%6.2f')} {fmt(r.get('fwdbwd_peak_extra_gib'), '%6.2f')} "
                  f"{fmt(r.get('logp_maxabs'), '%8.1e')} {fmt(r.get('ent_maxabs'), '%8.1e')} "
                  f"{fmt(r.get('dh_rel'), '%8.1e')} {fmt(r.get('dw_rel'), '%8.1e')}"
                  + (f"  [{r['error'][:60]}]" if r.get("error") else ""))
        fl = s["floors"]
        print(f"{'':>22} {'floors':>19} fwd {fl['floor_fwd']:.2f} ms, 8NHV {fl['floor_8nhv']:.2f} ms, "
              f"6NHV {fl['floor_6nhv']:.2f} ms ({fl['fwd_tflops']:.0f} TFLOP/s)")
        if "breakdown" in s:
            print(f"{'':>22} {'triton breakdown':>19} " + ", ".join(f"{k} {v:.2f}" for k, v in s["breakdown"].items()
                                                                   if isinstance(v, float)))
        tr = s["providers"].get("areal_triton", {})
        tc = s["providers"].get("areal_triton_cache", {})
        tn = s["providers"].get("areal_triton_nochecks", {})
        small = s["H"] < 1024
        if tr.get("fwdbwd_x_8nhv"):
            tgt = TARGETS["fwdbwd_x8_small" if small else "fwdbwd_x8"]
            print(f"{'':>22} {'vs targets':>19} fwd+bwd {tr['fwdbwd_x_8nhv']:.2f}/{tgt} x8NHV, "
                  f"fwd {tr['fwd_x_floor']:.2f}/{TARGETS['fwd_x2']}"
                  + (f" ({tn['fwd_x_floor']:.2f} checks off)" if tn.get("fwd_x_floor") else "")
                  + (f", cached {tc['fwdbwd_x_8nhv']:.2f}/{TARGETS['cache_x8']}" if tc.get("fwdbwd_x_8nhv") else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small,qwen7b,llama8b,wide_n")
    ap.add_argument("--providers", default="all")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--rep", type=int, default=400, help="do_bench rep (ms) per measurement")
    ap.add_argument("--peers-script", default=os.environ.get("PEERS_SCRIPT", "/work/shared/peers/bench_peers.py"))
    ap.add_argument("--sweep", action="store_true", help="tile sweep of the Triton kernels instead")
    ap.add_argument("--merge", default="", help="comma list of bench_lce.json files: write one combined "
                    "CSV/PNG and print a markdown table (no GPU needed)")
    ap.add_argument("--chunks", default="", help="comma list of backward chunk widths: time the GEMMs only")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge.split(","), args.out)
    if not torch.cuda.is_available():
        print("bench_lce: needs a CUDA device")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    m = meta()
    shapes = parse_shapes(args.shapes)
    if args.chunks:
        rows = chunk_gemms(shapes, [int(x) for x in args.chunks.split(",")], args)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "chunks.json"), "w") as f:
            json.dump({"meta": m, "rows": rows}, f, indent=1)
        return 0
    if args.sweep:
        rows = sweep(shapes, args)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump({"meta": m, "rows": rows}, f, indent=1)
        return 0
    names = PROVIDERS if args.providers == "all" else args.providers.split(",")
    providers, versions = load_providers(names, args.peers_script)
    m["peer_versions"] = versions
    log("meta", m)
    results = []
    for name, shape in shapes:
        results.append(run_shape(name, shape, providers, args))
        write_outputs(results, args.out, m)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
