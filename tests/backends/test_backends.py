"""Every backend against the fp64 oracle under one harness and one pass rule (tests/helpers/backends.py).

Backends: torch (chunked), triton and triton_ascend (their kernels through the Triton interpreter on CPU
tensors: TRITON_INTERPRET=1 is set by tests/conftest.py on machines without a GPU; on a GPU the Triton
backend's CUDA run is `python -m benchmark.gpu_check`). The reference backend is the oracle. Cases that
only one backend has (tile knobs, the Ascend unified-buffer calculator, launcher internals) live in
test_triton_backend.py and test_ascend_backend.py, which use the same harness.

Every buffer a launcher allocates starts as NaN under the tests (tests/conftest.py), so a partial write
fails here.
"""
import pytest
import torch

from areal_lce.backends import get_backend
from helpers.backends import SHARD_CASES, STATS, case_by_id, lse_ent, make_shard, run_case
from helpers.inputs import available_backends

BACKENDS = [b for b in available_backends() if b != "reference"]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf*0 inside the interpreter


@pytest.fixture(autouse=True)
def small_triton_workspace(monkeypatch):
    """A 64 KiB d_logits budget for the triton backend: every case runs several backward vocab chunks."""
    if "triton" in BACKENDS:
        from areal_lce.backends.triton import configs

        monkeypatch.setattr(configs, "WORKSPACE_BYTES", 64 * 1024)
        monkeypatch.setattr(configs, "MIN_WORKSPACE_BYTES", 64 * 1024)


@pytest.mark.parametrize("case", SHARD_CASES, ids=[c.id for c in SHARD_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_against_fp64_oracle(backend, case):
    run_case(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    be = get_backend(backend)
    h, w, y, it, p, _, _ = make_shard(case_by_id("n17_v3007"), backend)
    st = be.forward(h[:0], w, y[:0], None, p, keep_cache=False)
    assert all(getattr(st, k).shape == (0,) for k in STATS)
