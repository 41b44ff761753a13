"""The Triton launcher's tuning and profiling knobs that `benchmark.op.bench_lce` uses instead of patching
launcher internals: `configs.tuning(...)` (tiles, TMA loads, backward tiles per program for a block of
calls) and `TritonBackend(backward_gemms=False)` (the backward's Triton kernels without its cuBLAS
GEMMs). The kernels run on `kernel_device()`: the interpreter on CPU tensors without CUDA.
"""
import pytest
import torch

from areal_lce.op.backends.triton import configs, launch  # noqa: E402
from areal_lce.op.backends.triton.configs import TileConfig  # noqa: E402
from areal_lce.op.backends.triton.launch import TritonBackend  # noqa: E402
from areal_lce.op.types import LCEParams  # noqa: E402
from helpers.bounds import assert_within, op_bounds  # noqa: E402
from helpers.kernel_device import kernel_device, needs_kernels  # noqa: E402

DEV = kernel_device() or torch.device("cpu")
pytestmark = [needs_kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # numpy inf*0 (interpreter)
N, H, V = 17, 32, 1001
SMALL = TileConfig(block_n=16, block_v=64, block_k=16, group_n=2, num_warps=4, num_stages=1)


def _state():
    tiles = [configs.tile(k, fp32=f, interpret=i, H=h) for k in ("fwd", "bwd") for f in (False, True)
             for i in (False, True) for h in (16, 4096)]
    return tiles, configs.USE_TMA, configs.BWD_PROGRAMS_PER_SM


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * (3.0 / H ** 0.5)
    y = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = -torch.ones(N), torch.full((N,), -0.5)
    return h, w, y, 1 / 0.7, g_lp, g_ent


def _backward(be):
    h, w, y, inv_t, g_lp, g_ent = (t.to(DEV) if torch.is_tensor(t) else t for t in _inputs())
    p = LCEParams(inv_t=inv_t, vocab_size=V, shard_valid=V, backend=TritonBackend())
    st = TritonBackend().forward(h, w, y, None, p, keep_cache=False)
    lse, ent = st.m + st.s.log(), st.s.log() - st.a / st.s
    return be.backward(h, w, y, None, p, None, lse, ent, g_lp, g_ent, True, True)


def test_tuning_sets_the_options_inside_the_block_and_restores_them():
    before = _state()
    fwd0 = configs.tile("fwd", fp32=False, interpret=False, H=4096)
    with configs.tuning(bwd=SMALL, use_tma=not configs.USE_TMA, bwd_programs_per_sm=3):
        assert configs.tile("bwd", fp32=True, interpret=False, H=4096) is SMALL  # whatever dtype and H
        assert configs.tile("bwd", fp32=False, interpret=True, H=16) is SMALL
        assert configs.tile("fwd", fp32=False, interpret=False, H=4096) == fwd0  # not named: kept
        assert configs.USE_TMA is (not before[1]) and configs.BWD_PROGRAMS_PER_SM == 3
        with configs.tuning(fwd=SMALL):  # nested blocks add to the outer one
            assert configs.tile("fwd", fp32=False, interpret=False, H=4096) is SMALL
            assert configs.tile("bwd", fp32=False, interpret=False, H=4096) is SMALL
            assert configs.BWD_PROGRAMS_PER_SM == 3
        assert configs.tile("fwd", fp32=False, interpret=False, H=4096) == fwd0
        assert configs.tile("bwd", fp32=False, interpret=False, H=4096) is SMALL
    assert _state() == before
    with pytest.raises(KeyError):  # an error inside the block restores too
        with configs.tuning(fwd=SMALL, use_tma=False):
            raise KeyError("x")
    assert _state() == before


@pytest.mark.parametrize("kw, named", [
    (dict(fwd=(128, 256, 64)), "fwd must be a TileConfig"),
    (dict(bwd="128x256"), "bwd must be a TileConfig"),
    (dict(bwd_programs_per_sm=0), "bwd_programs_per_sm"),
    (dict(bwd_programs_per_sm=2.0), "bwd_programs_per_sm"),
    (dict(bwd_programs_per_sm=True), "bwd_programs_per_sm"),
])
def test_tuning_rejects_bad_values_naming_them(kw, named):
    before = _state()
    with pytest.raises((TypeError, ValueError), match=named):
        with configs.tuning(**kw):
            pass
    assert _state() == before


@pytest.mark.slow
def test_swept_options_give_the_same_gradients():
    """A sweep point (other tiles, pointer loads, 3 vocab tiles per backward program) computes the same
    gradients as the defaults, up to fp32 summation order: both runs lie within the fp32 rounding bound B
    of the exact gradients (tests/helpers/bounds.py, from these tensors), so they differ by at most 2·B."""
    dh, dw = _backward(TritonBackend())
    with configs.tuning(fwd=SMALL, bwd=SMALL, use_tma=False, bwd_programs_per_sm=3):
        dh2, dw2 = _backward(TritonBackend())
    b = op_bounds(*_inputs())
    for name, a, c, bound in (("d_hidden", dh2, dh, b.d_hidden), ("d_weight", dw2, dw, b.d_weight)):
        assert 2 * bound.max() < 1e-3 * c.abs().max(), f"{name}: the bound is too loose to catch a wrong tile"
        assert_within(name, a, c, 2 * bound)


def test_backward_without_gemms_runs_the_kernels_only(monkeypatch):
    """backward_gemms=False: the d_logits workspace is written (the kernels ran), the gradient buffers are
    not (no GEMM ran), nothing is returned; a default instance is unaffected."""
    allocs = []

    def poisoned(shape, dtype, device):
        t = torch.full(shape, float("nan"), dtype=dtype, device=device)
        allocs.append(t)
        return t

    ref_dh, ref_dw = _backward(TritonBackend())
    monkeypatch.setattr(launch, "alloc", poisoned)
    assert _backward(TritonBackend(backward_gemms=False)) == (None, None)
    backward_allocs = allocs[-3:]  # dh [N, H], dw [V, H], then the workspace [N * chunk]
    dh_buf, dw_buf, ws = backward_allocs
    assert dh_buf.shape == (N, H) and dw_buf.shape == (V, H) and ws.dim() == 1
    assert torch.isnan(dh_buf).all() and torch.isnan(dw_buf).all()
    assert torch.isfinite(ws[: N * V]).all()  # one chunk of d_logits [N, V]
    monkeypatch.undo()
    dh, dw = _backward(TritonBackend())
    assert torch.equal(dh, ref_dh) and torch.equal(dw, ref_dw)
