"""Ascend backend ("triton_ascend"): what only it has (the unified-buffer tile calculator, capped persistent
grids, its knobs, the kernels through a real Triton compiler), on top of the shared harness in
test_backends.py.

The kernels are the ones that run on an NPU through Triton-Ascend; here TRITON_INTERPRET=1 (set by
helpers/kernel_device.py on machines without a GPU, before any kernel is defined) executes them on CPU tensors.
Oracle and pass rule: tests/helpers/backends.py.
"""
import os

import pytest
import torch

from areal_lce.op.backends.ascend import configs
from areal_lce.op.backends.ascend.launch import AscendBackend
from areal_lce.op.reference import logprobs_entropy as reference_logprobs_entropy
from areal_lce.op.types import LCEParams
from helpers.backends import ShardCase, run_case
from helpers.inputs import PER_TOKEN
from helpers.kernel_device import needs_interpreter
from helpers.paths import REPO

# Kernel runs use CPU tensors, so they need the interpreter (`needs_interpreter`); without it (a GPU machine)
# they are skipped and the calculator / compiler tests below still run.

MIN_UB = max(configs.ub_bytes(k, 16, 16, 16, 4) for k in configs.KINDS)  # fits only 16x16x16 tiles
# Minimal tiles and a 3-program grid: every kernel's persistent loop runs over many tiles.
TINY_UB_GRID3 = ShardCase("tiny_ub_grid3", "minimal tiles, 3 programs: persistent loops over many tiles",
                          n=52, h=20, v=70, valid=67, start=16, temperature=PER_TOKEN)


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("case", [TINY_UB_GRID3, ShardCase("grid2_peaked", "a 2-program grid on peaked rows",
                                                           n=40, v=300, valid=290, peaked=True)], ids=lambda c: c.id)
def test_capped_grids_against_the_oracle(case):
    run_case(case, AscendBackend(ub_bytes=MIN_UB if case is TINY_UB_GRID3 else None,
                                 max_programs=3 if case is TINY_UB_GRID3 else 2))


def test_tiny_ub_grid3_really_loops():
    """The tiny-UB / 3-program case must give each program several tiles in every kernel."""
    c = TINY_UB_GRID3
    be = AscendBackend(ub_bytes=MIN_UB, max_programs=3)
    h = torch.empty(c.n, c.h)
    for kind, tiles_of in (("fwd", lambda t: -(-c.n // t.block_n)), ("bwd_dh", lambda t: -(-c.n // t.block_n)),
                           ("bwd_dw", lambda t: -(-c.valid // t.block_v))):
        t = be.tiles(kind, h, c.n, c.valid)
        assert (t.block_n, t.block_v, t.block_h) == (16, 16, 16)
        assert tiles_of(t) > 3 and be.programs(tiles_of(t), h.device) == 3


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
    with pytest.raises(ValueError, match="one device"):  # the same checks as the triton backend (base.check_shard)
        be.forward(h, w.to("meta"), y, None, p, False)
    with pytest.raises(ValueError, match=r"inv_t must be \[N=4\]"):
        be.backward(h, w, y, torch.ones(3), p, None, *torch.zeros(4, 4), True, True)
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
from areal_lce.op.backends.ascend import kernels as K

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


@pytest.mark.slow
def test_kernels_compile_with_the_triton_compiler(tmp_path):
    """The interpreter checks values, not typing: compile the bf16 kernels for real (sm_80, offline,
    with the ptxas bundled in the triton wheel) so type errors in loop-carried values or masks show up.
    Triton-Ascend shares this frontend (TTIR) up to its own NPU lowering."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = str(REPO)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this triton install has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 3
