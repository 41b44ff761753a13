"""Every backend against the fp64 oracle under one harness and one pass rule (tests/helpers/backends.py).

Backends: torch (chunked), triton and triton_ascend (their kernels through the Triton interpreter on CPU
tensors: TRITON_INTERPRET=1 is set by tests/conftest.py on machines without a GPU; on a GPU the Triton
backend's CUDA cases are at the end of this file, marked `gpu`, run by `python -m benchmark.op.gpu_check`).
The reference backend is the oracle. Cases that
only one backend has (tile knobs, the Ascend unified-buffer calculator, launcher internals) live in
test_triton_backend.py and test_ascend_backend.py, which use the same harness.

Every buffer a launcher allocates starts as NaN under the tests (tests/conftest.py), so a partial write
fails here.
"""
import functools
import json
from dataclasses import replace

import pytest
import torch

import areal_lce
from areal_lce.op.backends import get_backend
from areal_lce.op.backends.reference import ReferenceBackend, grad_logits
from areal_lce.op.reference import logprobs_entropy as reference_logprobs_entropy
from areal_lce.op.types import LCEParams
from helpers.backends import SHARD_CASES, STATS, ShardCase, case_by_id, lse_ent, make_shard, run_case
from helpers.inputs import PER_TOKEN, available_backends

BACKENDS = [b for b in available_backends() if b != "reference"]
# The inner loop (-m "not slow") keeps torch and the Triton kernels on every case; the Ascend kernels
# through the interpreter (seconds a case on CPU) and the 3007-column cases run in the full suite only.
SLOW = pytest.mark.slow
BACKEND_PARAMS = [pytest.param(b, marks=SLOW) if b == "triton_ascend" else b for b in BACKENDS]
CASE_PARAMS = [pytest.param(c, id=c.id, marks=SLOW if c.v >= 3000 else ()) for c in SHARD_CASES]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf*0 inside the interpreter


@pytest.fixture(autouse=True)
def small_triton_workspace(monkeypatch, request):
    """A 64 KiB d_logits budget for the triton backend: every case runs several backward vocab chunks
    (not in the CUDA cases at the end, which run the shipped budgets)."""
    if "triton" in BACKENDS and request.node.get_closest_marker("gpu") is None:
        from areal_lce.op.backends.triton import configs

        monkeypatch.setattr(configs, "WORKSPACE_BYTES", 64 * 1024)
        monkeypatch.setattr(configs, "MIN_WORKSPACE_BYTES", 64 * 1024)


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_against_fp64_oracle(backend, case):
    run_case(case, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_deterministic_and_need_flags(backend):
    """Bitwise the same run to run; d_hidden / d_weight alone equal the pair; rows without upstream
    gradient contribute exactly nothing."""
    be = get_backend(backend)
    h, w, y, it, p, g_lp, g_ent = make_shard(case_by_id("bf16_cache_tensor_temp"), backend, seed=2)
    runs = []
    for _ in range(2):
        st = be.forward(h, w, y, it, p, keep_cache=False)
        lse, ent = lse_ent(st)
        runs.append([getattr(st, k) for k in STATS] + list(be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent,
                                                                       True, True)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    dh, dw = runs[0][-2:]
    dh_only, none_w = be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, True, False)
    none_h, dw_only = be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, False, True)
    assert none_w is None and none_h is None
    assert torch.equal(dh, dh_only) and torch.equal(dw, dw_only)
    assert be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, False, False) == (None, None)
    zero = torch.zeros_like(g_lp)
    dz_h, dz_w = be.backward(h, w, y, it, p, None, lse, ent, zero, zero, True, True)
    assert (dz_h == 0).all() and (dz_w == 0).all()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_nan_row_poisons_only_itself(backend):
    be = get_backend(backend)
    h, w, y, it, p, _, _ = make_shard(case_by_id("peaked"), backend)
    clean = be.forward(h, w, y, it, p, keep_cache=False)
    h = h.clone()
    h[5, 3] = float("nan")
    st = be.forward(h, w, y, it, p, keep_cache=False)
    assert torch.isnan(st.s[5]) and torch.isnan(st.m[5]) and torch.isnan(st.mn[5]) and torch.isnan(st.mx[5])
    others = torch.arange(h.shape[0]) != 5
    for k in STATS:
        assert torch.equal(getattr(st, k)[others], getattr(clean, k)[others]), k
    h[7, 0] = float("inf")  # an Inf hidden value: the row's softmax is undefined, so NaN too
    assert torch.isnan(be.forward(h, w, y, it, p, keep_cache=False).s[7])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_empty_batch(backend):
    be = get_backend(backend)
    h, w, y, it, p, _, _ = make_shard(case_by_id("n17_v3007"), backend)
    st = be.forward(h[:0], w, y[:0], None, p, keep_cache=False)
    assert all(getattr(st, k).shape == (0,) for k in STATS)


# --------------------------------------------------------------------------------------------------
# CUDA (marked `gpu`: skipped without a CUDA device): correctness of the Triton backend and the public op.
#
#     python -m pytest -q -m gpu tests/op/backends/test_backends.py tests/op/test_compile.py
#     python -m benchmark.op.gpu_check [--out DIR]   # the same tests, one PASS/FAIL line each, gpu_check.json
#
# Oracle: the materialised fp64 reference (ReferenceBackend on the same values upcast to fp64). Pass rule:
# error <= 4 x torch's own error at the same precision + atol, where torch's error is ReferenceBackend in
# fp32 for the statistics and fp32 gradients, and for bf16/fp16 gradients the materialised torch path with
# d_logits rounded to the input dtype (what a bf16 torch step does). Each backend case also runs the forward
# with the raw-logit row sums on (Σr, Σr² against fp64, every other statistic bitwise unchanged), a second
# time (bitwise equal: deterministic) and with a NaN in one hidden row (only that row's statistics NaN).
# The public `linear_logprobs_entropy(..., backend="triton")` is checked against fp64 autograd.
# A failing case prints its errors next to torch's.


def _cuda_case(id: str, n: int, h: int, v: int, why: str, **kw) -> ShardCase:
    """A shard case at CUDA sizes: bf16 and T = 0.8 unless the case says otherwise."""
    return ShardCase(id, why, n=n, h=h, v=v, **{"dtype": torch.bfloat16, "temperature": 0.8, **kw})


CASES = [
    _cuda_case("tiny_n1", 1, 256, 1001, "one token: a grid of vocab splits only"),
    _cuda_case("n17_v3007_fp32", 17, 192, 3007, "fp32 IEEE dots, odd sizes", dtype=torch.float32),
    _cuda_case("n17_v3007_bf16_peaked", 17, 192, 3007, "near one-hot rows hide padding bugs", peaked=True),
    _cuda_case("ragged_h", 300, 200, 5003, "H not a multiple of BLOCK_K (TMA zero-fills the K tail)"),
    _cuda_case("unaligned_h", 300, 100, 5003, "rows not 16-byte aligned: pointer loads with a K mask"),
    _cuda_case("pad_shard", 513, 512, 4096, "padding rows + vocab_start != 0", valid=3999, start=4096),
    _cuda_case("tensor_temp", 257, 256, 8192, "per-token inverse temperature", temperature=PER_TOKEN, peaked=True),
    _cuda_case("fp16", 129, 256, 2048, "fp16 path", dtype=torch.float16),
    _cuda_case("cache_bf16", 640, 512, 10007, "logits cache read in backward", cache=True, peaked=True),
    _cuda_case("cache_fp32", 64, 128, 3001, "cache, fp32", dtype=torch.float32, cache=True),
    _cuda_case("qwen_vocab", 1024, 896, 151936, "real vocabulary, several workspace chunks", peaked=True),
    _cuda_case("big_h", 2048, 4096, 32000, "large H: long K loop"),
]
BY_NAME = {c.id: c for c in CASES}


@pytest.fixture(scope="module", autouse=True)
def _ieee_fp32_matmul():
    """torch's fp32 error is the yardstick: no TF32 in its matmuls."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _rel(x, ref):
    x = x.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _max(x, ref):
    return (x.double() - ref).abs().max().item()


def _failed(res: dict, checks) -> str:
    return f"{res['case']}: failed {[c for c in checks if not res['checks'][c]]}\n" + json.dumps(res, indent=1, default=str)


def make_inputs(c: ShardCase, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(c.n, c.h, generator=g)
    w = torch.randn(c.v, c.h, generator=g) * (4.0 / c.h ** 0.5)
    if c.peaked:  # a few weight rows are scaled copies of hidden rows: p(label) ~ 1 for those tokens
        k = min(c.n, c.v, 8)
        w[:k] = h[:k] * (3.0 / c.h ** 0.5)
    valid = c.v if c.valid is None else c.valid
    y = torch.randint(c.start, c.start + valid, (c.n,), generator=g)
    y[0] = c.start
    if c.n > 1:
        y[1] = c.start + valid - 1
    if c.n > 3:
        y[2] = c.start - 1 if c.start > 0 else c.start + c.v + 5  # owned by another shard
    if c.peaked:
        y[: min(c.n, c.v, 8)] = torch.arange(min(c.n, c.v, 8)) + c.start
    inv_t = (0.5 + torch.rand(c.n, generator=g)) if c.temperature == PER_TOKEN else None
    params = LCEParams(inv_t=None if inv_t is not None else 1 / c.temperature, vocab_size=c.start + valid,
                       vocab_start=c.start, shard_valid=valid,
                       cache_bytes=(1 << 40) if c.cache else 0, backend=get_backend("triton"))
    h, w = h.to(c.dtype), w.to(c.dtype)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(h), mv(w), mv(y), mv(inv_t), params


def torch_lowp_grads(z32, h, w, labels, inv_t, params, lse, ent, g_lp, g_ent):
    """Torch at the input precision: fp32 d_logits rounded to the input dtype, GEMMs in that dtype."""
    dz = grad_logits(z32, labels, lse, ent, g_lp, g_ent, params)
    dl = dz * (inv_t[:, None] if inv_t is not None else params.inv_t)
    dl = dl.to(h.dtype)
    return (dl @ w).double(), (dl.t() @ h).double()


@functools.lru_cache(maxsize=None)
def backend_case(name: str) -> dict:
    """One run of a case through the Triton backend: the measured errors and the named checks (floats and
    bools only, so the cache holds no GPU memory); each test below asserts some of the checks."""
    c, be, device = BY_NAME[name], get_backend("triton"), torch.device("cuda")
    h, w, y, inv_t, params = make_inputs(c, device)
    ref = ReferenceBackend()
    h64, w64 = h.double(), w.double()
    it64 = inv_t.double() if inv_t is not None else None
    r64 = ref.forward(h64, w64, y, it64, params, False)
    r32 = ref.forward(h.float(), w.float(), y, inv_t, params, True)
    st = be.forward(h, w, y, inv_t, params, keep_cache=True)
    res = {"case": c.id, "why": c.why, "dtype": str(c.dtype).replace("torch.", ""),
           "cache_used": st.cache is not None, "checks": {}}
    checks = res["checks"]
    checks["stats"] = True
    for k in STATS:
        e_k = _max(getattr(st, k), getattr(r64, k)) / max(1.0, getattr(r64, k).abs().max().item())
        e_t = _max(getattr(r32, k), getattr(r64, k)) / max(1.0, getattr(r64, k).abs().max().item())
        res[f"{k}_err"], res[f"{k}_torch"] = e_k, e_t
        checks["stats"] &= e_k <= 4 * e_t + 1e-5
    lse64 = r64.m + torch.log(r64.s)
    ent64 = torch.log(r64.s) - r64.a / r64.s
    lse_k = st.m.double() + torch.log(st.s.double())
    res["logp_err"] = _max(st.zy.double() - lse_k, r64.zy - lse64)
    _logit_sums(res, be, ref, h, w, y, inv_t, params, st)
    g = torch.Generator(device="cpu").manual_seed(1)
    g_lp = torch.randn(c.n, generator=g).to(device)
    g_ent = torch.randn(c.n, generator=g).to(device)
    dh, dw = be.backward(h, w, y, inv_t, params, st.cache, lse64.float(), ent64.float(), g_lp, g_ent, True, True)
    rh, rw = ref.backward(h64, w64, y, it64, params, None, lse64, ent64, g_lp.double(), g_ent.double(), True, True)
    if c.dtype == torch.float32:
        th, tw = ref.backward(h, w, y, inv_t, params, r32.cache, lse64.float(), ent64.float(), g_lp, g_ent, True, True)
        th, tw = th.double(), tw.double()
    else:
        th, tw = torch_lowp_grads(r32.cache, h, w, y, inv_t, params, lse64.float(), ent64.float(), g_lp, g_ent)
    res.update(dh_err=_rel(dh, rh), dh_torch=_rel(th, rh), dw_err=_rel(dw, rw), dw_torch=_rel(tw, rw))
    checks["grads"] = res["dh_err"] <= 4 * res["dh_torch"] + 1e-6 and res["dw_err"] <= 4 * res["dw_torch"] + 1e-6
    checks["grad_dtypes"] = dh.dtype == torch.float32 and dw.dtype == w.dtype
    # determinism: a second run is bitwise equal
    st2 = be.forward(h, w, y, inv_t, params, keep_cache=True)
    dh2, dw2 = be.backward(h, w, y, inv_t, params, st2.cache, lse64.float(), ent64.float(), g_lp, g_ent, True, True)
    det = all(torch.equal(getattr(st, k), getattr(st2, k)) for k in STATS)
    checks["deterministic"] = bool(det and torch.equal(dh, dh2) and torch.equal(dw, dw2))
    # a NaN hidden row poisons its own statistics and no others
    if c.n > 2:
        hn = h.clone()
        hn[1, 0] = float("nan")
        sn = be.forward(hn, w, y, inv_t, params, keep_cache=False)
        row_nan = bool(torch.isnan(sn.s[1]) and torch.isnan(sn.m[1]))
        checks["nan_row"] = row_nan and bool(torch.isfinite(torch.cat([sn.s[:1], sn.s[2:]])).all())
    res["checks"] = {k: bool(v) for k, v in checks.items()}
    return res


def _logit_sums(res, be, ref, h, w, y, inv_t, params, st) -> None:
    """The HAS_SUMS forward: Σr, Σr² against fp64 (allowance: fp32 summation over the row, scaled by
    Σ|r| <= sqrt(V·Σr²)), and m, s, a, zy, mn the same bits as without the sums."""
    ps = replace(params, logit_sums=True)
    ss = be.forward(h, w, y, inv_t, ps, keep_cache=False)
    r64 = ref.forward(h.double(), w.double(), y, inv_t.double() if inv_t is not None else None, ps, False)
    r32 = ref.forward(h.float(), w.float(), y, inv_t, ps, False)
    scale = {"lsum": (r64.lsq * max(1, params.shard_valid)).sqrt(), "lsq": r64.lsq}
    ok = True
    for k in ("lsum", "lsq"):
        e_k = ((getattr(ss, k).double() - getattr(r64, k)).abs() / scale[k].clamp_min(1.0)).max().item()
        e_t = ((getattr(r32, k).double() - getattr(r64, k)).abs() / scale[k].clamp_min(1.0)).max().item()
        res[f"{k}_err"], res[f"{k}_torch"] = e_k, e_t
        # 1e-5 floor: the kernel adds its per-tile partial sums one vocab tile after another (~600 tiles at
        # V=151936), an fp32 running sum whose relative error reaches ~2e-6, while torch's fp32 reference
        # sums pairwise (~1e-7), so 4x torch's error alone is too tight for Σr² at the large shapes
        ok &= e_k <= 4 * e_t + 1e-5
    res["checks"]["sums"] = ok
    res["checks"]["sums_leave_stats"] = all(torch.equal(getattr(ss, k), getattr(st, k)) for k in STATS)


def _ids(cases):
    return pytest.mark.parametrize("name", [c.id for c in cases], ids=[c.id for c in cases])


@pytest.mark.gpu
@_ids(CASES)
def test_stats_and_grads_within_torch_error(name, record_property):
    """m, s, a, zy, mn and d_hidden, d_weight against fp64: within 4x torch's own error at the same dtype."""
    res = backend_case(name)
    record_property("result", res)
    assert res["checks"]["stats"] and res["checks"]["grads"] and res["checks"]["grad_dtypes"], \
        _failed(res, ("stats", "grads", "grad_dtypes"))


@pytest.mark.gpu
@_ids(CASES)
def test_logit_sums_leave_other_stats_bitwise(name, record_property):
    res = backend_case(name)
    record_property("result", {k: res[k] for k in ("lsum_err", "lsum_torch", "lsq_err", "lsq_torch")})
    assert res["checks"]["sums"] and res["checks"]["sums_leave_stats"], _failed(res, ("sums", "sums_leave_stats"))


@pytest.mark.gpu
@_ids(CASES)
def test_deterministic(name):
    """Forward and backward twice: bitwise equal statistics and gradients."""
    res = backend_case(name)
    assert res["checks"]["deterministic"], _failed(res, ("deterministic",))


@pytest.mark.gpu
@_ids([c for c in CASES if c.n > 2])
def test_nan_row_poisons_only_its_own_stats(name):
    res = backend_case(name)
    assert res["checks"]["nan_row"], _failed(res, ("nan_row",))


# ------------------------------------------------------------------------------ the public op on CUDA

API_N, API_H, API_V, API_VOCAB = 777, 512, 12800, 12345  # padded vocab
API_IGNORED = [slice(5, 40), slice(256, 384)]  # a block that mixes ignored and valid rows, one all ignored
API_VARIANTS = {"triton": dict(backend="triton"), "triton_cache": dict(backend="triton", cache_bytes=1 << 34),
                "triton_sums": dict(backend="triton", return_logit_sums=True),
                "triton_compact": dict(backend="triton", compact_ignored=True)}


@pytest.fixture(scope="module")
def api_reference():
    """Inputs of the public-op cases and the fp64 autograd oracle on them."""
    g = torch.Generator(device="cpu").manual_seed(3)
    h = torch.randn(API_N, API_H, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(API_V, API_H, generator=g) * (4.0 / API_H ** 0.5)).to(torch.bfloat16).cuda()
    y = torch.randint(0, API_VOCAB, (API_N,), generator=g).cuda()
    for rows in API_IGNORED:
        y[rows] = -100
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp, en, mx, mn, lse = reference_logprobs_entropy(hr, wr, y, temperature=0.9, vocab_size=API_VOCAB)
    (lp.sum() + 0.3 * en.sum()).backward()
    raw = (hr.detach() @ wr.detach()[:API_VOCAB].t()) * (y != -100).double()[:, None]  # over the true vocab
    return (h, w, y), dict(lp=lp.detach(), en=en.detach(), mx=mx, mn=mn, lse=lse, dh=hr.grad, dw=wr.grad,
                           sum=raw.sum(1), abs_sum=raw.abs().sum(1).max().item(), sumsq=(raw * raw).sum(1))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(API_VARIANTS))
def test_public_op_matches_fp64_autograd(variant, api_reference, record_property):
    from areal_lce import linear_logprobs_entropy

    (h, w, y), ref = api_reference
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    o = linear_logprobs_entropy(hh, ww, y, temperature=0.9, vocab_size=API_VOCAB, return_stats=True,
                                **API_VARIANTS[variant])
    (o.logprobs.sum() + 0.3 * o.entropy.sum()).backward()
    r = {"logp": _max(o.logprobs, ref["lp"]), "ent": _max(o.entropy, ref["en"]), "max": _max(o.max_logit, ref["mx"]),
         "min": _max(o.min_logit, ref["mn"]), "lse": _max(o.lse, ref["lse"]), "dh": _rel(hh.grad, ref["dh"]),
         "dw": _rel(ww.grad, ref["dw"])}
    if variant == "triton_sums":
        r["sum"] = _max(o.sum_logit, ref["sum"]) / ref["abs_sum"]
        r["sumsq"] = _max(o.sumsq_logit, ref["sumsq"]) / ref["sumsq"].max().item()
    record_property("result", r)
    assert r["logp"] < 2e-4 and r["ent"] < 5e-4 and r["dh"] < 1e-2 and r["dw"] < 1e-2, r
    assert all(bool((hh.grad[rows] == 0).all()) for rows in API_IGNORED), "ignored rows got a d_hidden"
    if variant == "triton_sums":
        assert r["sum"] < 1e-5 and r["sumsq"] < 1e-5, r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d_weight_fp32_into_main_grad_on_cuda(dtype):
    """The main_grad path of gradient_accumulation_fusion on CUDA: cuBLAS writes d_weight in fp32 from the
    half-precision operands into main_grad; the plain call's d_weight is within one rounding of it, and
    main_grad is closer to the fp64 gradient."""
    from areal_lce.op.main_grad import linear_logprobs_entropy_into_main_grad

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(512, 256, device=dev, generator=g).to(dtype)
    w = (torch.randn(3000, 256, device=dev, generator=g) * 0.1).to(dtype)
    y = torch.randint(0, 3000, (512,), device=dev, generator=g)
    wr = w.clone().requires_grad_()
    out = areal_lce.linear_logprobs_entropy(h, wr, y)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    plain = wr.grad
    wm = w.clone().requires_grad_()
    wm.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=dev)
    wm.grad_added_to_main_grad = False  # megatron's DDP sets the attribute; the op sets it True
    out = linear_logprobs_entropy_into_main_grad(h, wm, y)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    fp32 = wm.main_grad
    assert getattr(wm, "grad_added_to_main_grad", False)
    # one rounding apart: at most an ulp of the half type (its subnormal spacing below its normal range),
    # whatever cuBLAS's kernel for each output dtype
    fi = torch.finfo(dtype)
    assert ((plain.float() - fp32).abs() <= fi.eps * fp32.abs() + fi.smallest_normal * fi.eps).all()
    w64 = w.double().requires_grad_()
    z = torch.log_softmax(h.double() @ w64.t(), -1)
    (z.gather(1, y[:, None]).sum() - (z.exp() * z).sum()).backward()
    err32 = (fp32.double() - w64.grad).abs().max()
    err_half = (plain.double() - w64.grad).abs().max()
    assert err32 < err_half, (float(err32), float(err_half))
