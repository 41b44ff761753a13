"""Triton backend against the materialised fp64 oracle (ReferenceBackend on the same values in fp64).

Without CUDA the kernels run in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set below
before the kernels' module is imported; tests/conftest.py sets it too). Pass rule: the kernel's error
against the fp64 oracle is at most 4x torch's own error at the same precision plus a small atol, where
torch's error is ReferenceBackend in fp32 (stats, fp32 grads) or, for bf16/fp16 grads, the materialised
torch path whose d_logits are rounded to the input dtype. Both errors are printed on failure.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from areal_lce.backends.reference import ReferenceBackend, grad_logits  # noqa: E402
from areal_lce.backends.triton import configs, launch  # noqa: E402
from areal_lce.backends.triton.launch import TritonBackend  # noqa: E402
from areal_lce.types import LCEParams  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf*0 inside the interpreter
STATS = ("m", "s", "a", "zy", "mn", "mx")


@pytest.fixture(autouse=True)
def small_workspace(monkeypatch):
    """A 64 KiB d_logits budget: every case runs several vocab chunks (the multi-chunk path)."""
    monkeypatch.setattr(configs, "WORKSPACE_BYTES", 64 * 1024)
    monkeypatch.setattr(configs, "MIN_WORKSPACE_BYTES", 64 * 1024)


def make(N, H, V, dtype=torch.float32, *, valid=None, start=0, peaked=False, flat=False, temp="scalar",
         cache=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    valid = V if valid is None else valid
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * (0.02 if flat else 3.0 / H ** 0.5)
    if peaked:  # weight rows = scaled hidden rows: those tokens put p ~ 1 on one column
        k = min(N, valid, 6)
        w[:k] = h[:k] * (4.0 / H ** 0.5)
    y = torch.randint(start, start + valid, (N,), generator=g)
    y[0] = start  # first column of the shard
    if N > 1:
        y[1] = start + valid - 1  # last real column
    if N > 2:
        y[2] = start + V + 3  # owned by another shard: zy = 0
    if N > 3 and start > 0:
        y[3] = start - 1
    if peaked:
        k = min(N, valid, 6)
        y[:k] = start + torch.arange(k)
    inv_t = (0.4 + torch.rand(N, generator=g)) if temp == "tensor" else None
    p = LCEParams(inv_t=None if inv_t is not None else 1 / 0.7, vocab_size=start + valid, vocab_start=start,
                  shard_valid=valid, cache_bytes=(1 << 30) if cache else 0, backend="triton")
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return to(h.to(dtype)), to(w.to(dtype)), to(y), to(inv_t), p


def upstream(N, mode="both", seed=1):
    g = torch.Generator().manual_seed(seed)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    if mode == "lp":
        g_ent.zero_()
    if mode == "ent":
        g_lp.zero_()
    return g_lp.to(DEV), g_ent.to(DEV)


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def lse_ent(st):
    return st.m + torch.log(st.s), torch.log(st.s) - st.a / st.s


def check_forward(st, h, w, y, it, p):
    ref = ReferenceBackend()
    it64 = None if it is None else it.double()
    r64 = ref.forward(h.double(), w.double(), y, it64, p, False)
    r32 = ref.forward(h.float(), w.float(), y, None if it is None else it.float(), p, False)
    for k in STATS:
        scale = max(1.0, getattr(r64, k).abs().max().item())
        e_k = (getattr(st, k).double() - getattr(r64, k)).abs().max().item() / scale
        e_t = (getattr(r32, k).double() - getattr(r64, k)).abs().max().item() / scale
        assert e_k <= 4 * e_t + 2e-6, f"{k}: kernel err {e_k:.3e} vs torch fp32 err {e_t:.3e}"
    lse64, ent64 = lse_ent(r64)
    lse, ent = lse_ent(st)
    assert (lse.double() - lse64).abs().max() < 1e-4
    assert (ent.double() - ent64).abs().max() < 1e-4
    return lse64, ent64


def check_backward(dh, dw, h, w, y, it, p, lse64, ent64, g_lp, g_ent):
    ref = ReferenceBackend()
    it64 = None if it is None else it.double()
    rh, rw = ref.backward(h.double(), w.double(), y, it64, p, None, lse64, ent64, g_lp.double(), g_ent.double(),
                          True, True)
    if h.dtype == torch.float32:
        th, tw = ref.backward(h, w, y, it, p, None, lse64.float(), ent64.float(), g_lp, g_ent, True, True)
    else:  # torch at bf16/fp16: fp32 d_logits rounded to the input dtype, GEMMs in that dtype
        from areal_lce.backends.reference import shard_logits

        z = shard_logits(h.float(), w.float(), it, p)
        dl = grad_logits(z, y, lse64.float(), ent64.float(), g_lp, g_ent, p)
        dl = (dl * (it[:, None] if it is not None else p.inv_t)).to(h.dtype)
        th, tw = (dl.float() @ w.float()), (dl.t().float() @ h.float()).to(w.dtype)
    assert dh.dtype == torch.float32 and dh.shape == h.shape
    assert dw.dtype == w.dtype and dw.shape == w.shape
    for name, x, r, t in (("d_hidden", dh, rh, th), ("d_weight", dw, rw, tw)):
        e_k, e_t = rel(x, r), rel(t, r)
        assert e_k <= 4 * e_t + 1e-6, f"{name}: kernel rel err {e_k:.3e} vs torch err {e_t:.3e}"
    if p.shard_valid < w.shape[0]:
        assert (dw[p.shard_valid:] == 0).all(), "vocabulary padding rows must get exactly 0"


# name -> (make kwargs, upstream mode); why each case exists is in its comment
CASES = {
    "n1_v1001": (dict(N=1, H=32, V=1001), "both"),  # one token: the grid is vocab splits only
    "n17_v3007": (dict(N=17, H=32, V=3007), "both"),  # odd V, not a multiple of any block; 3 splits
    "ragged_h": (dict(N=17, H=30, V=1001), "both"),  # H not a multiple of BLOCK_K; rows not 16-byte
    # aligned, so pointer loads with a K mask instead of TMA descriptors
    "peaked": (dict(N=17, H=32, V=1001, peaked=True), "both"),  # p ~ 1: exposes padding/entropy bugs
    "flat": (dict(N=17, H=32, V=1001, flat=True), "both"),  # near-uniform: entropy ~ log V
    "pad_shard": (dict(N=17, H=32, V=1001, valid=990, start=2002), "both"),  # padding rows, vocab_start
    "tensor_temp": (dict(N=17, H=32, V=1001, temp="tensor", peaked=True), "both"),  # per-token 1/T
    "cache_fp32": (dict(N=17, H=32, V=1001, cache=True, valid=999), "both"),  # backward reads cached z
    "bf16": (dict(N=17, H=32, V=1001, dtype=torch.bfloat16, peaked=True), "both"),
    "bf16_cache": (dict(N=17, H=32, V=3007, dtype=torch.bfloat16, cache=True), "both"),
    "fp16_pad": (dict(N=17, H=32, V=1001, dtype=torch.float16, valid=1000, start=1001), "both"),
    "g_ent_zero": (dict(N=17, H=32, V=1001, peaked=True), "lp"),  # logprob-only loss
    "g_lp_zero": (dict(N=17, H=32, V=1001, peaked=True), "ent"),  # entropy-only loss
}


@pytest.mark.parametrize("case", list(CASES) + ["pointer_loads", "tiles_per_program"])
def test_matches_reference(case, monkeypatch):
    if case == "pointer_loads":  # the non-TMA load path on an aligned layout
        monkeypatch.setattr(configs, "USE_TMA", False)
        case = "pad_shard"
    if case == "tiles_per_program":  # backward programs looping over 3 vocab tiles (ragged last group)
        monkeypatch.setattr(configs, "BWD_TILES_PER_PROGRAM", 3)
        case = "bf16_cache"
    kw, mode = CASES[case]
    h, w, y, it, p = make(**kw)
    be = TritonBackend()
    st = be.forward(h, w, y, it, p, keep_cache=True)
    assert (st.cache is not None) == kw.get("cache", False)
    if st.cache is not None:  # the cache holds exactly the tempered logits of the valid columns
        from areal_lce.backends.reference import shard_logits

        z = shard_logits(h.float(), w.float(), it, p)[:, : p.shard_valid]
        assert (launch.cache_logits(st.cache, p.shard_valid) - z).abs().max() < 1e-4
    lse64, ent64 = check_forward(st, h, w, y, it, p)
    g_lp, g_ent = upstream(h.shape[0], mode)
    dh, dw = be.backward(h, w, y, it, p, st.cache, lse64.float(), ent64.float(), g_lp, g_ent, True, True)
    check_backward(dh, dw, h, w, y, it, p, lse64, ent64, g_lp, g_ent)


def test_need_flags_and_cache_budget():
    h, w, y, it, p = make(17, 32, 1001)
    be = TritonBackend()
    st = be.forward(h, w, y, it, p, keep_cache=True)
    assert st.cache is None  # cache_bytes = 0
    tight = LCEParams(**{**p.__dict__, "cache_bytes": 17 * 1001 * 4 - 1})
    assert be.forward(h, w, y, it, tight, keep_cache=True).cache is None  # one byte short
    fits = LCEParams(**{**p.__dict__, "cache_bytes": 17 * 1001 * 4})
    assert be.forward(h, w, y, it, fits, keep_cache=True).cache is not None
    assert be.forward(h, w, y, it, fits, keep_cache=False).cache is None
    lse, ent = lse_ent(st)
    g_lp, g_ent = upstream(17)
    dh, dw = be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, True, True)
    dh_only, none_w = be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, True, False)
    none_h, dw_only = be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, False, True)
    assert none_w is None and none_h is None
    assert torch.equal(dh, dh_only) and torch.equal(dw, dw_only)
    assert be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, False, False) == (None, None)
    zero = torch.zeros_like(g_lp)
    dz_h, dz_w = be.backward(h, w, y, it, p, None, lse, ent, zero, zero, True, True)
    assert (dz_h == 0).all() and (dz_w == 0).all()  # rows with g_lp = g_ent = 0 contribute nothing


def test_poisoned_buffers_are_fully_written(monkeypatch):
    """Every buffer the launcher allocates starts as NaN: a partial write would leave NaN behind."""
    h, w, y, it, p = make(17, 40, 3007, valid=3000, start=3007, temp="tensor", cache=True)
    be = TritonBackend()
    g_lp, g_ent = upstream(17)
    clean = be.forward(h, w, y, it, p, keep_cache=True)
    lse, ent = lse_ent(clean)
    dh0, dw0 = be.backward(h, w, y, it, p, clean.cache, lse, ent, g_lp, g_ent, True, True)
    monkeypatch.setattr(launch, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                   device=device))
    st = be.forward(h, w, y, it, p, keep_cache=True)
    for k in STATS:
        assert torch.isfinite(getattr(st, k)).all(), k
        assert torch.equal(getattr(st, k), getattr(clean, k)), k
    assert torch.isfinite(launch.cache_logits(st.cache, p.shard_valid)).all()
    dh, dw = be.backward(h, w, y, it, p, st.cache, lse, ent, g_lp, g_ent, True, True)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert torch.equal(dh, dh0) and torch.equal(dw, dw0)


def test_nan_row_poisons_only_itself():
    h, w, y, it, p = make(17, 32, 1001)
    be = TritonBackend()
    clean = be.forward(h, w, y, it, p, keep_cache=False)
    h = h.clone()
    h[5, 3] = float("nan")
    st = be.forward(h, w, y, it, p, keep_cache=False)
    assert torch.isnan(st.s[5]) and torch.isnan(st.m[5]) and torch.isnan(st.mn[5]) and torch.isnan(st.mx[5])
    others = torch.arange(17, device=DEV) != 5
    for k in STATS:
        assert torch.equal(getattr(st, k)[others], getattr(clean, k)[others]), k
    h[7, 0] = float("inf")  # an Inf hidden value: the row's softmax is undefined, so NaN too
    st = be.forward(h, w, y, it, p, keep_cache=False)
    assert torch.isnan(st.s[7])


def test_deterministic():
    h, w, y, it, p = make(17, 40, 3007, dtype=torch.bfloat16, temp="tensor")
    be = TritonBackend()
    g_lp, g_ent = upstream(17)
    runs = []
    for _ in range(2):
        st = be.forward(h, w, y, it, p, keep_cache=False)
        lse, ent = lse_ent(st)
        runs.append([getattr(st, k) for k in STATS] + list(be.backward(h, w, y, it, p, None, lse, ent, g_lp,
                                                                       g_ent, True, True)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_empty_shard_and_empty_batch():
    h, w, y, it, p = make(5, 32, 300)
    empty = LCEParams(**{**p.__dict__, "shard_valid": 0})
    be = TritonBackend()
    st = be.forward(h, w, y, it, empty, keep_cache=True)
    assert (st.m == float("-inf")).all() and (st.s == 0).all() and (st.a == 0).all()
    assert (st.zy == 0).all() and (st.mn == float("inf")).all() and (st.mx == float("-inf")).all()
    lse = torch.zeros(5, device=DEV)
    dh, dw = be.backward(h, w, y, it, empty, None, lse, lse, *upstream(5), True, True)
    assert (dh == 0).all() and (dw == 0).all()
    st0 = be.forward(h[:0], w, y[:0], None, p, keep_cache=False)
    assert st0.m.shape == (0,)


def test_bad_inputs_raise():
    h, w, y, it, p = make(5, 32, 300)
    be = TritonBackend()
    with pytest.raises(TypeError, match="dtype"):
        be.forward(h.double(), w.double(), y, it, p, False)
    with pytest.raises(ValueError, match="H"):
        be.forward(h[:, :16], w, y, it, p, False)
    with pytest.raises(ValueError, match="labels"):
        be.forward(h, w, y[:3], it, p, False)
    with pytest.raises(ValueError, match="cache"):
        be.backward(h, w, y, it, p, torch.zeros(2, 2), torch.zeros(5), torch.zeros(5), *upstream(5), True, True)


def test_split_plan_fills_the_gpu():
    # host-side grid planning of the GPU path (no kernel runs): small N still gets many programs,
    # large N keeps splits wide; the splits always cover the shard exactly once
    for N, valid in ((1, 151936), (4096, 151936), (32768, 151936), (17, 3007)):
        width, n = launch._split_plan(N, valid, 128, 132, False)
        assert width % configs.SPLIT_UNIT == 0 and width <= configs.MAX_SPLIT
        assert (n - 1) * width < valid <= n * width
        if N == 1 and valid > 100000:
            assert n >= 100  # one wave of ~132 programs


def test_backward_chunks_cover_the_shard_within_budget():
    for N, H, valid in ((8192, 4096, 151936), (32768, 2048, 151936), (17, 32, 1001), (1, 64, 100)):
        w = launch._chunk_width(N, H, valid, 2)
        assert w % configs.SPLIT_UNIT == 0 and w >= min(valid, configs.SPLIT_UNIT)
        n_chunks = -(-valid // w)
        assert (n_chunks - 1) * w < valid  # no empty chunk
        if N >= 8192:  # workspace + fp32 d_hidden within the backward budget
            assert N * w * 2 + 4 * N * H <= configs.BACKWARD_BYTES


def test_public_op_with_triton_backend():
    pytest.importorskip("areal_lce.api")
    from areal_lce import linear_logprobs_entropy
    from areal_lce.backends.reference import reference_logprobs_entropy

    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 9, 32, generator=g).to(DEV)
    w = (torch.randn(700, 32, generator=g) * 0.4).to(DEV)
    y = torch.randint(0, 690, (2, 9), generator=g).to(DEV)
    y[0, :3] = -100
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    o = linear_logprobs_entropy(hh, ww, y, temperature=0.8, vocab_size=690, backend="triton", return_stats=True)
    (o.logprobs.sum() - 0.5 * o.entropy.sum()).backward()
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp, en, mx, mn, lse = reference_logprobs_entropy(h64, w64, y, temperature=0.8, vocab_size=690)
    (lp.sum() - 0.5 * en.sum()).backward()
    for a, b in ((o.logprobs, lp), (o.entropy, en), (o.max_logit, mx), (o.min_logit, mn), (o.lse, lse)):
        assert (a.double() - b).abs().max() < 2e-5
    assert rel(hh.grad, h64.grad) < 1e-5 and rel(ww.grad, w64.grad) < 1e-5
    assert (hh.grad[0, :3] == 0).all()
