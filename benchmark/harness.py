"""What every benchmark here shares: timing, peak memory, the stamp on each result file, and the
cuBLAS floors and exact fp32 reference of the fused op.

Timing
    bench(fn)        triton.testing.do_bench: median with p20/p80 in ms (warm-up 50 ms, then `rep` ms of
                     timed calls, at least MIN_TIMED_CALLS of them; L2 flushed between calls); without
                     CUDA (smoke runs) a host timer
    bench_alternating(fn, ref)  fn and a reference called in turn, each call timed alone: fn's times
                     and the median of the per-pair ratios fn / ref (for two calls that run the same
                     kernels; not for ratios to the cuBLAS floors, see lce_run.paired)
    percentiles(xs)  the same three numbers for host-timed repetitions (bench_tp times ranks this way)
Shapes
    parse_shapes(text, named)  --shapes of a benchmark: its named shapes or NxHxV
Memory
    PeakMemory       CUDA high-water mark of a block: absolute and above what was allocated at entry
                     (0 for CPU tensors)
Stamps
    run_meta()       device, versions, git sha, UTC time and command line, the "meta" of every JSON here
Floors of linear_logprobs_entropy, measured with cuBLAS in the same run (bf16 in, bf16 out):
    fwd floor  = t(h · Wᵀ)                             2NHV FLOPs
    8NHV floor = 2 t(h · Wᵀ) + t(dl · W) + t(dlᵀ · h)  forward + recompute + d_hidden + d_weight
    6NHV floor = t(h · Wᵀ) + t(dl · W) + t(dlᵀ · h)    (no recompute: what a logits cache can reach)
Exact reference: logits with fp32 accumulation of the exact bf16 products, and the gradient GEMMs on a
3-term bf16 split of the fp32 d_logits (error ~2^-24 relative), so it is exact fp32 up to accumulation
order at a few GEMMs' cost.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# -------------------------------------------------------------------------------------------- timing
def sync(device=None):
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


def clean():
    """Free what the last measurement left (between providers and shapes)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


MIN_TIMED_CALLS = 10


def bench(fn, rep=400, grad_to_none=None, warmup=50) -> dict:
    """do_bench of fn: {'ms': median, 'p20', 'p80'} after `warmup` ms of untimed calls. `rep` is raised to
    MIN_TIMED_CALLS times one call, so a call that takes longer than rep / MIN_TIMED_CALLS ms still gets a
    median of several calls (do_bench sizes its loop as rep / estimated time: a 130 ms call under rep=200
    was timed once)."""
    if not torch.cuda.is_available():
        return _host_bench(fn, rep, grad_to_none)
    from triton.testing import do_bench

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    for t in grad_to_none or ():  # the estimate times the same call as the loop (no grad accumulation)
        t.grad = None
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(rep, MIN_TIMED_CALLS * start.elapsed_time(end))
    q = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8], grad_to_none=grad_to_none)
    return {"ms": q[0], "p20": q[1], "p80": q[2]}


def bench_alternating(fn, ref, rep=400, grad_to_none=None):
    """fn and ref called in turn, ref first, each call timed alone after an L2 flush: (fn's {'ms', 'p20',
    'p80'}, the median over the pairs of fn / ref, ref's median ms). Both calls of a pair see the same
    slow clock drift, so two calls that run the same kernels (the public op and its backend) compare
    within a fraction of a percent. Each call also inherits the clock the previous call's power draw left
    (a power-capped GPU), which biases a pair of unlike kernels: the floors stay steady-state loops
    (lce_run.paired). At least MIN_TIMED_CALLS pairs, else about `rep` ms of them; without CUDA, host
    timers."""
    import statistics

    def clear():
        for t in grad_to_none or ():
            t.grad = None

    cuda = torch.cuda.is_available()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cuda else None

    def timed(f):  # -> ms (host) or a pair of recorded events (CUDA)
        clear()
        if not cuda:
            t0 = time.perf_counter()
            f()
            return (time.perf_counter() - t0) * 1e3
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        return a, b

    def ms(t):
        return t if isinstance(t, float) else t[0].elapsed_time(t[1])

    first = [timed(f) for f in (ref, fn, ref, fn)]  # warm-up, then an estimate of one pair
    sync()
    n = max(MIN_TIMED_CALLS, int(rep / max(1e-3, ms(first[2]) + ms(first[3]))))
    pairs = [(timed(ref), timed(fn)) for _ in range(n)]
    sync()
    t_ref = [ms(r) for r, _ in pairs]
    t_fn = [ms(f) for _, f in pairs]
    med, p20, p80 = percentiles(t_fn)
    return ({"ms": med, "p20": p20, "p80": p80}, statistics.median(f / r for f, r in zip(t_fn, t_ref)),
            statistics.median(t_ref))


def _host_bench(fn, rep, grad_to_none) -> dict:
    """CPU smoke runs: one warm-up call, then calls for about `rep` ms (at least two), host-timed."""
    fn()
    times, t_end = [], time.perf_counter() + rep / 1e3
    while len(times) < 2 or time.perf_counter() < t_end:
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    med, p20, p80 = percentiles(times)
    return {"ms": med, "p20": p20, "p80": p80}


def percentiles(xs):
    """(median, p20, p80) of a list of host-timed repetitions."""
    import statistics

    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return statistics.median(xs), q(0.2), q(0.8)


# -------------------------------------------------------------------------------------------- memory
class PeakMemory:
    """CUDA memory high-water mark of the `with` block on one device.

        with PeakMemory() as pm:
            step()
        pm.peak_gib, pm.extra_gib  # absolute; above what was allocated when the block began
    """

    def __init__(self, device=None):
        self.device = device
        self.cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        self.base = self.peak = 0

    def __enter__(self):
        if self.cuda:
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        return False

    @property
    def extra_bytes(self) -> int:
        return self.peak - self.base

    @property
    def extra_gib(self) -> float:
        return self.extra_bytes / 2**30

    @property
    def peak_gib(self) -> float:
        return self.peak / 2**30


# -------------------------------------------------------------------------------------------- stamps
def git_sha() -> str:
    """GIT_SHA from the environment (set by benchmark/gpu_session.sh: the tree sent to a device has no
    .git), else the checkout's short HEAD, with '-dirty' when tracked source files differ from it."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10)  # noqa: E731
        sha = run("rev-parse", "--short", "HEAD")
        if sha.returncode != 0:
            return "unknown"
        dirty = run("status", "--porcelain", "--untracked-files=no", "areal_lce", "benchmark", "torchrun").stdout
        return sha.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_meta(device=None, **extra) -> dict:
    """The stamp of a result file: device, versions (torch, CUDA, triton, megatron-core when loaded,
    Python), git sha, UTC time and the command line, plus `extra`."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    m = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
         "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        pass
    if "megatron.core" in sys.modules:  # only where the benchmark uses it
        from megatron.core import package_info

        m["megatron_core"] = package_info.__version__
    m.update(git_sha=git_sha(), time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), argv=sys.argv)
    m.update(extra)
    return m


def write_json(out_dir, name: str, obj) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


# -------------------------------------------------------------------------------------------- shapes
def parse_shapes(text: str, named: dict) -> list:
    """--shapes "a,b,NxHxV" -> [(name, (N, H, V))]: names from `named`, or explicit N×H×V."""
    out = []
    for tok in text.split(","):
        if tok in named:
            out.append((tok, named[tok]))
            continue
        try:
            n, h, v = (int(x) for x in tok.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {tok!r} is neither one of {list(named)} nor NxHxV") from None
        out.append((tok, (n, h, v)))
    return out


# ----------------------------------------------------------------- floors and reference of the fused op
def gemm_floors(h, W) -> dict:
    """cuBLAS times of the op's three GEMM shapes and the floors built from them (module docstring)."""
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


def _mm32(a, b, acc=None, out=None):
    """fp32 a·b (+ acc) of bf16 operands: exact products, fp32 accumulation. CUDA: out_dtype GEMMs; CPU
    has none, so the operands are upcast there (the same exact products)."""
    kw = {"out_dtype": torch.float32}
    if a.device.type != "cuda":
        a, b, kw = a.float(), b.float(), {}
    if acc is None:
        return torch.mm(a, b, **kw)
    return torch.addmm(acc, a, b, **kw) if out is None else torch.addmm(acc, a, b, out=out, **kw)


def _split3(x):
    a = x.to(torch.bfloat16)
    r = x - a.float()
    b = r.to(torch.bfloat16)
    c = (r - b.float()).to(torch.bfloat16)
    return a, b, c


@torch.no_grad()
def exact_reference(h, W, y, with_ent: bool, chunk=2048) -> dict:
    """fp32-exact logp, entropy, dh, dW for loss = -sum(logp) [- sum(entropy)] (bf16 h, W)."""
    N, H = h.shape
    lp = torch.empty(N, device=h.device)
    ent = torch.empty(N, device=h.device)
    dh = torch.empty(N, H, device=h.device)
    dW = torch.zeros(W.shape, device=h.device)
    for s in range(0, N, chunk):
        hc, yc = h[s:s + chunk], y[s:s + chunk]
        z = _mm32(hc, W.t())
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
            acc = _mm32(part, W, acc)
            _mm32(part.t(), hc, dW, out=dW)
        dh[s:s + chunk] = acc
        del dz, p, acc
    return {"logp": lp, "ent": ent, "dh": dh, "dW": dW}


def rel_l2(x, ref) -> float:
    return (torch.linalg.vector_norm((x.float() - ref).flatten()) / torch.linalg.vector_norm(ref.flatten())).item()


def paired_ratios(times, base) -> tuple:
    """(median, [min, max]) of the per-round ratios times[i] / base[i] of two timings taken round by round."""
    ratios = [a / b for a, b in zip(times, base)]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def checks_then_costs(name: str, shapes: dict, checks, cost, default: str = "small,qwen7b,llama8b,wide_n") -> dict:
    """The CLI of a check + cost benchmark (bench_select, bench_softcap): `--out DIR --shapes ... --rounds R`;
    runs checks() once, then cost(shape_name, n, h, v, rounds) per shape, writing DIR/name after each."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=default)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    result = {"meta": run_meta(), "checks": checks(), "cost": {}}
    log(f"checks: {result['checks']}")
    write_json(args.out, name, result)
    for shape, (n, h, v) in parse_shapes(args.shapes, shapes):
        result["cost"][shape] = cost(shape, n, h, v, args.rounds)
        write_json(args.out, name, result)
    return result
