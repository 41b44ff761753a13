"""Triton backend: what only it has (tile and launch knobs, the logits-cache layout and budget, grid
planning, launcher checks), on top of the shared harness in test_backends.py.

The kernels run on `kernel_device()` (helpers/kernel_device.py): the interpreter on CPU tensors without
CUDA, the compiled kernels on a GPU. Oracle and pass rule: tests/helpers/backends.py.
"""
import pytest
import torch

from areal_lce.op.backends.reference import shard_logits  # noqa: E402
from areal_lce.op.backends.triton import configs, launch  # noqa: E402
from areal_lce.op.backends.triton.launch import TritonBackend  # noqa: E402
from areal_lce.op.types import LCEParams  # noqa: E402
from helpers.backends import case_by_id, lse_ent, make_shard, run_case  # noqa: E402
from helpers.kernel_device import kernel_device, needs_kernels  # noqa: E402

DEV = kernel_device() or torch.device("cpu")
pytestmark = [needs_kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # numpy inf*0 (interpreter)


@pytest.fixture(autouse=True)
def small_workspace(monkeypatch):
    """A 64 KiB d_logits budget: every case runs several vocab chunks (the multi-chunk path)."""
    monkeypatch.setattr(configs, "WORKSPACE_BYTES", 64 * 1024)
    monkeypatch.setattr(configs, "MIN_WORKSPACE_BYTES", 64 * 1024)


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.slow
@pytest.mark.parametrize("knob", ["pointer_loads", "programs_per_sm"])
def test_launch_knobs(knob, monkeypatch):
    """The non-TMA load path on an aligned layout; 3 persistent backward programs striding over the
    chunk's tiles (the interpreter has one SM slot, so by default one program walks them all). Same
    harness and pass rule as every backend."""
    if knob == "pointer_loads":
        monkeypatch.setattr(configs, "USE_TMA", False)
        run_case(case_by_id("pad_shard"), TritonBackend(), DEV)
    else:
        monkeypatch.setattr(configs, "BWD_PROGRAMS_PER_SM", 3)
        run_case(case_by_id("bf16_cache_tensor_temp"), TritonBackend(), DEV)


@pytest.mark.parametrize("cid", ["cache_fp32", "bf16_cache_tensor_temp"])
def test_cache_holds_the_tempered_logits(cid):
    h, w, y, it, p, _, _ = make_shard(case_by_id(cid), "triton", device=DEV)
    st = TritonBackend().forward(h, w, y, it, p, keep_cache=True)
    z = shard_logits(h.float(), w.float(), it, p)[:, : p.shard_valid]
    assert (launch.cache_logits(st.cache, p.shard_valid) - z).abs().max() < 1e-4


@pytest.mark.slow
def test_cache_budget():
    h, w, y, it, p, g_lp, g_ent = make_shard(case_by_id("n17_v3007"), "triton", device=DEV)
    be = TritonBackend()
    n, v = h.shape[0], w.shape[0]
    assert be.forward(h, w, y, it, p, keep_cache=True).cache is None  # cache_bytes = 0
    tight = LCEParams(**{**p.__dict__, "cache_bytes": n * v * 4 - 1})
    assert be.forward(h, w, y, it, tight, keep_cache=True).cache is None  # one byte short
    fits = LCEParams(**{**p.__dict__, "cache_bytes": n * v * 4})
    assert be.forward(h, w, y, it, fits, keep_cache=True).cache is not None
    assert be.forward(h, w, y, it, fits, keep_cache=False).cache is None
    st = be.forward(h, w, y, it, p, keep_cache=False)
    lse, ent = lse_ent(st)
    cached = be.forward(h, w, y, it, fits, keep_cache=True)
    a = be.backward(h, w, y, it, p, None, lse, ent, g_lp, g_ent, True, True)
    b = be.backward(h, w, y, it, fits, cached.cache, lse, ent, g_lp, g_ent, True, True)
    assert rel(b[0], a[0].double()) < 1e-6 and rel(b[1], a[1].double()) < 1e-6  # cache read = recompute


def test_bad_inputs_raise():
    h, w, y, it, p, g_lp, g_ent = make_shard(case_by_id("empty_shard"), "triton", device=DEV)
    p = LCEParams(**{**p.__dict__, "shard_valid": w.shape[0]})
    be = TritonBackend()
    with pytest.raises(TypeError, match="dtype"):
        be.forward(h.double(), w.double(), y, it, p, False)
    with pytest.raises(ValueError, match="H"):
        be.forward(h[:, :16], w, y, it, p, False)
    with pytest.raises(ValueError, match="labels"):
        be.forward(h, w, y[:3], it, p, False)
    with pytest.raises(ValueError, match="cache"):
        be.backward(h, w, y, it, p, torch.zeros(2, 2), torch.zeros(5), torch.zeros(5), g_lp, g_ent, True, True)


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
        if N >= 8192:  # workspace + fp32 d_hidden within the backward budget, which is at most 0.5 GiB
            assert N * w * 2 + 4 * N * H <= configs.BACKWARD_BYTES <= 2**29


@pytest.mark.slow
def test_public_op_with_triton_backend():
    from areal_lce import linear_logprobs_entropy
    from areal_lce.op.reference import logprobs_entropy as reference_logprobs_entropy

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
