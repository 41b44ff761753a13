"""Ascend backend ("triton_ascend") against the materialised reference, on CPU under the Triton interpreter.

The kernels are the ones that run on an NPU through Triton-Ascend; here TRITON_INTERPRET=1 (set by
tests/conftest.py on machines without a GPU, before any kernel is defined) executes them on CPU tensors.
Pass rule: the kernel's max error against the fp64 oracle is at most FACTOR times the error of the
materialised fp32 torch computation on the same inputs, plus a small atol.
"""
import os
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from areal_lce.backends.ascend import configs
from areal_lce.backends.reference import ReferenceBackend, reference_logprobs_entropy
from areal_lce.types import LCEParams

pytest.importorskip("triton")
from areal_lce.backends.ascend.launch import AscendBackend  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Kernel runs use CPU tensors, so they need the interpreter; without it (a GPU machine) they are skipped
# and the calculator / compiler tests below still run.
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="kernels run on CPU tensors only under TRITON_INTERPRET=1")

FACTOR = 4.0
REF = ReferenceBackend()
MIN_UB = max(configs.ub_bytes(k, 16, 16, 16, 4) for k in configs.KINDS)  # fits only 16x16x16 tiles


@dataclass
class Case:
    id: str
    why: str
    n: int = 17
    h: int = 32
    v: int = 1001
    dtype: torch.dtype = torch.float32
    shard_valid: Optional[int] = None  # default: all rows real
    vocab_start: int = 0
    temp: object = 1.0  # float, or "tensor" for per-token inv_t
    peaked: bool = False
    labels: str = "random"  # random | edges | outside
    g: str = "both"  # both | lp | ent (which upstream grads are nonzero)
    shift: float = 0.0  # added to every raw logit (through hidden column 0 = 1, W column 0 = shift)
    ub: Optional[int] = None
    max_programs: Optional[int] = None
    extra: dict = field(default_factory=dict)


CASES = [
    Case("n1_v1001", "a single token; V odd and not a multiple of any block", n=1),
    Case("n17_v1001_peaked_edges", "peaked rows expose entropy/padding bugs; labels at columns 0 and V-1",
         peaked=True, labels="edges"),
    Case("flat_temp", "flat logits with a scalar temperature", n=9, temp=0.7),
    Case("padding_shard", "shard_valid < V: padding rows must act as -inf, labels on padding give zy=0",
         n=20, v=200, shard_valid=131, peaked=True, labels="edges"),
    Case("padding_shard_negative", "flat, all-negative logits: a padding column read as 0 instead of -inf "
         "would win the max and add to s, a", n=9, v=300, shard_valid=201, temp=0.8, shift=-6.0),
    Case("offset_shard", "vocab_start != 0 and labels outside the shard on both sides",
         n=20, v=150, vocab_start=300, labels="outside", peaked=True),
    Case("per_token_temp", "per-token inv_t tensor", n=20, v=300, temp="tensor", peaked=True),
    Case("bf16_peaked", "bf16 inputs (upcast after load), per-token temperature",
         n=20, v=300, dtype=torch.bfloat16, temp="tensor", peaked=True, labels="edges"),
    Case("fp16", "fp16 inputs", n=10, v=257, dtype=torch.float16, temp=1.3),
    Case("g_ent_zero", "entropy gradient off", n=12, v=130, g="lp", peaked=True),
    Case("g_lp_zero", "logprob gradient off", n=12, v=130, g="ent", peaked=True),
    Case("tiny_ub_grid3", "minimal tiles and a 3-program grid: persistent loops over many tiles",
         n=52, h=20, v=70, shard_valid=67, vocab_start=16, ub=MIN_UB, max_programs=3,
         labels="edges", temp="tensor"),
    Case("empty_shard", "shard_valid = 0: m=-inf, s=a=0, mn=+inf, zero grads", n=5, v=64, shard_valid=0),
]


def make_inputs(c: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    valid = c.v if c.shard_valid is None else c.shard_valid
    h = torch.randn(c.n, c.h, generator=g)
    w = torch.randn(c.v, c.h, generator=g) * 0.2
    if c.shift:
        h[:, 0] = 1.0
        w[:, 0] = c.shift
    lo, hi = c.vocab_start, c.vocab_start + max(valid, 1)
    y = torch.randint(lo, hi, (c.n,), generator=g)
    if c.labels == "edges":
        edges = [lo, lo + valid - 1, lo + c.v - 1, lo + valid // 2]
        for i, e in enumerate(edges[: c.n]):
            y[i] = e
    elif c.labels == "outside":
        y[0::3] = torch.randint(0, max(lo, 1), (len(y[0::3]),), generator=g)  # below the shard
        y[1::3] = lo + c.v + torch.randint(0, 50, (len(y[1::3]),), generator=g)  # above the shard
    if c.peaked and valid > 0:
        # Copy token rows into W so a few columns dominate (z ~ 0.6·|h|^2): low entropy, spiky softmax.
        cols = torch.randint(0, valid, (c.n,), generator=g)
        w[cols] = 0.6 * h
        y[c.n // 2:] = cols[c.n // 2:] + lo  # half the labels on the peak, half elsewhere
    inv_t = None
    temp = c.temp
    if temp == "tensor":
        inv_t = 1.0 / (0.5 + 1.5 * torch.rand(c.n, generator=g))
        temp = None
    params = LCEParams(inv_t=None if temp is None else 1.0 / temp, vocab_size=c.vocab_start + c.v, vocab_start=c.vocab_start,
                       shard_valid=valid, backend="triton_ascend")
    g_lp = torch.randn(c.n, generator=g)
    g_ent = torch.randn(c.n, generator=g)
    if c.n > 2:
        g_lp[1] = g_ent[1] = 0.0  # a row with no upstream gradient contributes nothing
    if c.g == "lp":
        g_ent.zero_()
    elif c.g == "ent":
        g_lp.zero_()
    return h.to(c.dtype), w.to(c.dtype), y, inv_t, params, g_lp, g_ent


def check(name, got, oracle, torch_val, atol, floor=0.0):
    """max|got - oracle| <= FACTOR * max|torch_val - oracle| + atol·max(1, |oracle|) + floor;
    infinities must match exactly."""
    got, oracle, torch_val = got.double(), oracle.double(), torch_val.double()
    inf = torch.isinf(oracle)
    assert torch.equal(got[inf], oracle[inf]), f"{name}: infinite entries differ"
    assert not torch.isnan(got).any(), f"{name}: NaN in kernel output"
    fin = ~inf
    err = (got[fin] - oracle[fin]).abs().max().item() if fin.any() else 0.0
    ref_err = (torch_val[fin] - oracle[fin]).abs().max().item() if fin.any() else 0.0
    scale = oracle[fin].abs().max().item() if fin.any() else 0.0
    bound = FACTOR * ref_err + atol * max(1.0, scale) + floor
    assert err <= bound, f"{name}: kernel err {err:.3e} > bound {bound:.3e} (torch fp32 err {ref_err:.3e})"


def oracle_stats(h, w, y, inv_t, params):
    ref64 = REF.forward(h.double(), w.double(), y, None if inv_t is None else inv_t.double(), params, False)
    ref32 = REF.forward(h.float(), w.float(), y, inv_t, params, False)
    return ref64, ref32


def lse_ent(st):
    """(lse, entropy) of one shard's stats in their own precision, as the Function's finish_stats does."""
    log_s = torch.log(st.s)
    return st.m + log_s, log_s - st.a / st.s


@needs_interpreter
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_forward_backward_vs_reference(c: Case):
    h, w, y, inv_t, params, g_lp, g_ent = make_inputs(c)
    be = AscendBackend(ub_bytes=c.ub, max_programs=c.max_programs)
    st = be.forward(h, w, y, inv_t, params, keep_cache=True)
    ref64, ref32 = oracle_stats(h, w, y, inv_t, params)
    for k in ("m", "mn", "mx", "zy"):
        check(k, getattr(st, k), getattr(ref64, k), getattr(ref32, k), atol=1e-6)
    if params.shard_valid == 0:
        assert torch.equal(st.s, torch.zeros_like(st.s)) and torch.equal(st.a, torch.zeros_like(st.a))
        lse = lse32 = klse = torch.zeros(c.n)
        ent = ent32 = kent = torch.zeros(c.n)
    else:
        (lse, ent), (lse32, ent32), (klse, kent) = lse_ent(ref64), lse_ent(ref32), lse_ent(st)
        check("lse", klse, lse, lse32, atol=1e-6)
        check("entropy", kent, ent, ent32, atol=1e-5)
    # Each path runs its backward on its own forward's lse/entropy, as the Function does: with a
    # near-one-hot row (entropy ~1e-11) dz = -g·p·(log p + H) is only resolvable when log p comes from
    # the same rounding of z as lse did.
    dh, dw = be.backward(h, w, y, inv_t, params, st.cache, klse, kent, g_lp, g_ent, True, True)
    assert dh.dtype == torch.float32 and dh.shape == h.shape
    assert dw.dtype == w.dtype and dw.shape == w.shape
    args64 = (h.double(), w.double(), y, None if inv_t is None else inv_t.double(), params, None,
              lse.double(), ent.double())
    rdh, rdw = REF.backward(*args64, g_lp.double(), g_ent.double(), True, True)
    tdh, tdw = REF.backward(h.float(), w.float(), y, inv_t, params, None, lse32, ent32,
                            g_lp, g_ent, True, True)
    # fp32 logit resolution: the backward recomputes z with other tiles than the forward, so z - lse
    # carries up to a few ulp(|z|) where the materialised torch path reuses one z (and, on a near-one-hot
    # row, cancels exactly). That shifts each d_logit by <= ulp(|z|)·|g|·p·inv_t, hence this floor.
    ulp_z = torch.finfo(torch.float32).eps * max(ref64.m[torch.isfinite(ref64.m)].abs().max().item()
                                                 if params.shard_valid else 0.0, 1.0)
    g_max = max(g_lp.abs().max().item(), g_ent.abs().max().item())
    t_max = params.inv_t if inv_t is None else inv_t.max().item()
    floor = 8 * ulp_z * g_max * t_max
    check("d_hidden", dh, rdh, tdh, atol=1e-5, floor=floor * w.float().abs().max().item())
    check("d_weight", dw, rdw, tdw.to(w.dtype), atol=1e-5, floor=floor * h.float().abs().max().item())
    if params.shard_valid < c.v:
        assert torch.equal(dw[params.shard_valid:], torch.zeros_like(dw[params.shard_valid:])), "padding rows"


def test_tiny_ub_grid3_really_loops():
    """The tiny-UB / 3-program case must give each program several tiles in every kernel."""
    c = next(c for c in CASES if c.id == "tiny_ub_grid3")
    be = AscendBackend(ub_bytes=c.ub, max_programs=c.max_programs)
    h = torch.empty(c.n, c.h)
    for kind, tiles_of in (("fwd", lambda t: -(-c.n // t.block_n)), ("bwd_dh", lambda t: -(-c.n // t.block_n)),
                           ("bwd_dw", lambda t: -(-c.shard_valid // t.block_v))):
        t = be.tiles(kind, h, c.n, c.shard_valid)
        assert (t.block_n, t.block_v, t.block_h) == (16, 16, 16)
        assert tiles_of(t) > 3 and be.programs(tiles_of(t), h.device) == 3


@pytest.fixture
def nan_empty(monkeypatch):
    """Poison every fresh floating allocation with NaN so an unwritten output element fails the test."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


@needs_interpreter
@pytest.mark.parametrize("cid", ["tiny_ub_grid3", "padding_shard"])
def test_nan_poisoned_outputs_fully_written(nan_empty, cid):
    c = next(c for c in CASES if c.id == cid)
    h, w, y, inv_t, params, g_lp, g_ent = make_inputs(c, seed=1)
    be = AscendBackend(ub_bytes=c.ub, max_programs=c.max_programs)
    st = be.forward(h, w, y, inv_t, params, keep_cache=False)
    for k in ("m", "s", "a", "zy", "mn", "mx"):
        assert not torch.isnan(getattr(st, k)).any(), k
    lse, ent = lse_ent(st)
    dh, dw = be.backward(h, w, y, inv_t, params, None, lse, ent, g_lp, g_ent, True, True)
    assert not torch.isnan(dh).any() and not torch.isnan(dw).any()


@needs_interpreter
def test_need_flags_and_determinism():
    c = Case("det", "", n=24, v=200, shard_valid=190, peaked=True, temp="tensor")
    h, w, y, inv_t, params, g_lp, g_ent = make_inputs(c, seed=2)
    be = AscendBackend()
    st1 = be.forward(h, w, y, inv_t, params, False)
    st2 = be.forward(h, w, y, inv_t, params, False)
    for k in ("m", "s", "a", "zy", "mn", "mx"):
        assert torch.equal(getattr(st1, k), getattr(st2, k)), k
    lse, ent = lse_ent(st1)
    args = (h, w, y, inv_t, params, None, lse, ent, g_lp, g_ent)
    dh1, dw1 = be.backward(*args, True, True)
    dh2, dw2 = be.backward(*args, True, True)
    assert torch.equal(dh1, dh2) and torch.equal(dw1, dw2), "backward is not bitwise deterministic"
    dh_only, none_w = be.backward(*args, True, False)
    none_h, dw_only = be.backward(*args, False, True)
    assert none_w is None and none_h is None
    assert torch.equal(dh_only, dh1) and torch.equal(dw_only, dw1)


def test_rejects_bad_inputs():
    be = AscendBackend()
    h, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.int64)
    p = LCEParams(inv_t=1.0, vocab_size=16, shard_valid=16)
    with pytest.raises(TypeError, match="dtype"):
        be.forward(h.double(), w.double(), y, None, p, False)
    with pytest.raises(ValueError, match="disagree on H"):
        be.forward(h, torch.randn(16, 9), y, None, p, False)
    with pytest.raises(ValueError, match="shard_valid"):
        be.forward(h, w, y, None, LCEParams(inv_t=1.0, vocab_size=32, shard_valid=17), False)
    with pytest.raises(ValueError, match="max_programs"):
        AscendBackend(max_programs=0)
    with pytest.raises(ValueError, match="ub_bytes"):
        AscendBackend(ub_bytes=0)


# ---- tile calculator ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", configs.KINDS)
@pytest.mark.parametrize("elt", [2, 4])
@pytest.mark.parametrize("budget", [MIN_UB, 64 * 1024, configs.DEFAULT_UB_BYTES, 1 << 20])
@pytest.mark.parametrize("hidden", [48, 4096])
def test_pick_tiles_fits_budget(kind, elt, budget, hidden):
    t = configs.pick_tiles(kind, hidden=hidden, elt_bytes=elt, ub_budget=budget)
    assert t.ub_bytes == configs.ub_bytes(kind, t.block_n, t.block_v, t.block_h, elt) <= budget
    for b in (t.block_n, t.block_v, t.block_h):
        assert b >= configs.MIN_BLOCK and b & (b - 1) == 0
    assert t.block_h <= max(16, 1 << (hidden - 1).bit_length())  # capped at the next power of two
    # maximal: doubling any side would not fit (or exceeds the cap)
    for grown in ((2 * t.block_n, t.block_v, t.block_h), (t.block_n, 2 * t.block_v, t.block_h)):
        assert configs.ub_bytes(kind, *grown, elt) > budget or max(grown) > configs.MAX_BLOCK


def test_pick_tiles_910b_default_is_smaller_than_gpu_tiles():
    # The GPU-style 128x256x32 bf16 forward tile overflows the 192 KiB unified buffer; ours fits.
    assert configs.ub_bytes("fwd", 128, 256, 32, 2) > configs.DEFAULT_UB_BYTES
    t = configs.pick_tiles("fwd", hidden=4096, elt_bytes=2)
    assert t.ub_bytes <= configs.DEFAULT_UB_BYTES and t.block_n * t.block_v >= 64 * 64


def test_pick_tiles_caps_at_problem_size_and_grows_with_budget():
    small = configs.pick_tiles("fwd", hidden=20, elt_bytes=4, n_tokens=3, vocab=40)
    assert (small.block_n, small.block_v, small.block_h) == (16, 64, 32)
    sizes = [configs.pick_tiles("bwd_dh", hidden=4096, elt_bytes=2, ub_budget=b).block_n
             * configs.pick_tiles("bwd_dh", hidden=4096, elt_bytes=2, ub_budget=b).block_v
             for b in (MIN_UB, 48 * 1024, 192 * 1024, 1 << 20)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_pick_tiles_errors():
    with pytest.raises(ValueError, match="cannot hold the smallest"):
        configs.pick_tiles("bwd_dw", hidden=64, elt_bytes=4, ub_budget=MIN_UB - 1)
    with pytest.raises(ValueError, match="kind"):
        configs.pick_tiles("sideways", hidden=64, elt_bytes=4)
    with pytest.raises(ValueError, match="elt_bytes"):
        configs.pick_tiles("fwd", hidden=64, elt_bytes=8)


def test_env_knobs(monkeypatch):
    monkeypatch.setenv(configs.ENV_UB_BYTES, "65536")
    monkeypatch.setenv(configs.ENV_MAX_PROGRAMS, "7")
    be = AscendBackend()
    assert (be.ub_bytes, be.max_programs) == (65536, 7)
    monkeypatch.setenv(configs.ENV_MAX_PROGRAMS, "70000")
    with pytest.raises(ValueError, match="max_programs"):
        AscendBackend()
    monkeypatch.setenv(configs.ENV_UB_BYTES, "lots")
    with pytest.raises(ValueError, match=configs.ENV_UB_BYTES):
        AscendBackend(max_programs=1)


# ---- end to end through the public API ------------------------------------------------------------

@needs_interpreter
def test_api_end_to_end_with_autograd():
    from areal_lce import linear_logprobs_entropy

    g = torch.Generator().manual_seed(3)
    b, s, hd, v, vocab = 2, 9, 32, 203, 190  # rows >= 190 of W are vocabulary padding
    hidden = torch.randn(b, s, hd, generator=g)
    weight = torch.randn(v, hd, generator=g) * 0.2
    weight[:18] = 0.6 * hidden.reshape(-1, hd)  # peaked
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :2] = -100
    labels[1, 0], labels[1, 1] = 0, vocab - 1
    temp = 0.5 + torch.rand(b, 1, generator=g)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_logprobs_entropy(h1, w1, labels, temperature=temp, vocab_size=vocab, return_stats=True,
                                  backend="triton_ascend")
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_logprobs_entropy(h2, w2, labels, temperature=temp.expand(b, s).double(), vocab_size=vocab)
    for name, got, want in zip(("logprobs", "entropy", "max_logit", "min_logit", "lse"), out, ref):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5, msg=name)
    wl, we = torch.randn(b, s, generator=g), torch.randn(b, s, generator=g)
    ((out.logprobs * wl).sum() + (out.entropy * we).sum()).backward()
    ((ref[0] * wl.double()).sum() + (ref[1] * we.double()).sum()).backward()
    torch.testing.assert_close(h1.grad.double(), h2.grad, rtol=1e-4, atol=1e-5, msg="d_hidden")
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-4, atol=1e-5, msg="d_weight")
    assert torch.equal(w1.grad[vocab:], torch.zeros_like(w1.grad[vocab:]))


# ---- the kernels through a real Triton compiler ------------------------------------------------------

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from areal_lce.backends.ascend import kernels as K

SCALARS = {"N": "i32", "H": "i32", "shard_valid": "i32", "vocab_start": "i64", "inv_t_scalar": "fp32"}
for fn, has_t in ((K.lce_fwd_kernel, True), (K.lce_bwd_dh_kernel, False), (K.lce_bwd_dw_kernel, True)):
    sig = {}
    for a in fn.arg_names:
        if a.endswith("_ptr"):
            sig[a] = "*bf16" if a in ("h_ptr", "w_ptr") else "*i64" if a == "y_ptr" else "*fp32"
        elif a in SCALARS:
            sig[a] = SCALARS[a]
        elif a.startswith("stride"):
            sig[a] = "i64"
        else:
            sig[a] = "constexpr"
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={"HAS_INV_T": has_t, "BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32})
    k = triton.compile(src, target=GPUTarget("cuda", 80, 32))
    assert "cubin" in k.asm, fn.__name__
    print("compiled", fn.__name__)
"""


def test_kernels_compile_with_the_triton_compiler(tmp_path):
    """The interpreter checks values, not typing: compile the bf16 kernels for real (sm_80, offline,
    with the ptxas bundled in the triton wheel) so type errors in loop-carried values or masks show up.
    Triton-Ascend shares this frontend (TTIR) up to its own NPU lowering."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this triton install has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 3
