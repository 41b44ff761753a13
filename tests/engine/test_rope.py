"""Fused RoPE (rope_kernel, megatron/rope.py) against the fp64 formula and megatron-core's unfused RoPE.

Without a GPU the kernel runs through the Triton interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1); with one, on CUDA. Cases: odd lengths and head counts that are not powers of two
(masked heads), partial rotary dims (copied tail), angles per batch row, strided views like megatron's
q/k split of the fused QKV output, large positions, halves with different angles (both halves of the
formula, not only the usual repeated ones), bf16 (error no worse than megatron's own at bf16), the
backward (the transposed rotation), packed THD with table and per-token angles with and without
context parallelism, the fallbacks, the slot install, and a packed engine step end to end. The CUDA-only
cases (bf16 rounding, large angles, graph replay, no host sync, the engine with rope fusion; marked `gpu`)
are at the end.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

from areal_lce.engine.model import rope  # noqa: E402
from helpers.kernel_device import kernel_device, needs_kernels  # noqa: E402

DEV = kernel_device() or torch.device("cpu")
pytestmark = needs_kernels


def oracle(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """fp64 t cos f + rotate_half(t) sin f on the first R dims (megatron's formula, no intermediate rounding)."""
    t64, f64 = t.double(), freqs.double()
    r = f64.shape[-1]
    x, rest = t64[..., :r], t64[..., r:]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x * f64.cos() + torch.cat([-x2, x1], -1) * f64.sin(), rest], -1)


def angles(s: int, r: int, b: int = 1, base: float = 10000.0, start: int = 0, equal_halves: bool = True,
           seed: int = 0) -> torch.Tensor:
    """[s, b, 1, r] fp32 angles: megatron's table (positions x inverse frequencies, halves repeated), or
    random halves that differ."""
    if equal_halves:
        inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        pos = torch.arange(start, start + s, dtype=torch.float64)[:, None] + torch.arange(b)[None, :] * 7
        f = pos[..., None] * inv
        f = torch.cat([f, f], -1)[:, :, None, :]
    else:
        f = torch.rand(s, b, 1, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 50
    return f.float().to(DEV)


CASES = [  # (id, s, b, heads, dim, rotary dims, angle batch, why)
    pytest.param(37, 1, 3, 16, 16, 1, id="odd-s-3-heads"),  # masked heads (BLOCK_H 4), odd length
    pytest.param(5, 2, 4, 24, 16, 1, id="partial-rotary"),  # dims 16..23 copied through (PASS = 8)
    pytest.param(6, 3, 2, 32, 32, 3, id="angles-per-batch-row"),  # freqs [s, b, 1, r]
    pytest.param(1, 1, 14, 64, 64, 1, id="one-token-qwen-heads"),  # decode shape, 14 heads
]


@pytest.mark.parametrize("s,b,h,d,r,fb", CASES)
@pytest.mark.parametrize("equal_halves", [True, False], ids=["table", "unequal-halves"])
def test_forward_and_backward_match_fp64(s, b, h, d, r, fb, equal_halves):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(s, b, 3 * h, d, generator=g).to(DEV)
    t = big[:, :, h:2 * h].requires_grad_(False).clone().requires_grad_(True)
    t_view = big[:, :, h:2 * h]  # a strided view, as megatron's q/k split of the fused QKV output
    f = angles(s, r, fb, equal_halves=equal_halves)
    with torch.no_grad():
        out_view = rope.FusedRotary.apply(t_view, f)
    out = rope.FusedRotary.apply(t, f)
    want = oracle(t.detach(), f)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(out_view, out.detach(), atol=0, rtol=0)
    up = torch.randn(s, b, h, d, generator=g).to(DEV)
    (out * up).sum().backward()
    t64 = t.detach().double().requires_grad_(True)
    (oracle(t64, f) * up.double()).sum().backward()
    torch.testing.assert_close(t.grad.double(), t64.grad, atol=2e-6, rtol=2e-6)


def test_large_positions_fp32():
    """Angles up to 32767 rad (position 32767, inverse frequency 1): cos / sin need full range reduction."""
    t = torch.randn(64, 1, 2, 128, generator=torch.Generator().manual_seed(2)).to(DEV)
    f = angles(64, 128, start=32767 - 63, base=1e6)
    torch.testing.assert_close(rope.FusedRotary.apply(t, f).double(), oracle(t, f), atol=3e-5, rtol=3e-5)


@pytest.mark.slow
def test_bf16_within_one_ulp():
    """bf16 in and out, fp32 inside: every output within one bf16 ulp of the fp64 formula (the interpreter
    truncates fp32 -> bf16; on a GPU, round-to-nearest against megatron's unfused rounding is
    tests/engine/test_rope.py)."""
    t = torch.randn(257, 2, 14, 64, generator=torch.Generator().manual_seed(3)).to(DEV).bfloat16()
    f = angles(257, 64, start=1000)
    want = oracle(t, f)
    out = rope.FusedRotary.apply(t, f)
    assert out.dtype == torch.bfloat16
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    err = (out.double() - want).abs()
    assert bool((err <= ulp * 1.0001).all()), f"max error {float((err / ulp).max()):.2f} ulp"


def _megatron_thd(t, cu, f, cp_size, cp_rank):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    return _apply_rotary_pos_emb_thd(t, cu, f, cp_group=rope._CPRank(cp_size, cp_rank))


THD_CASES = [  # (id, sequence lengths, cp size, cp rank, per-token angles)
    pytest.param([5, 1, 11, 3], 1, 0, False, id="table-cp1-odd-lengths"),
    pytest.param([5, 1, 11, 3], 1, 0, True, id="per-token-cp1"),  # the engine's per_token_rope layout
    pytest.param([8, 4, 12], 2, 0, False, id="table-cp2-rank0"),  # chunks r and 2cp-1-r of each sequence
    pytest.param([8, 4, 12], 2, 1, False, id="table-cp2-rank1"),
    pytest.param([8, 4, 12], 2, 1, True, id="per-token-cp2-rank1"),
]


@pytest.mark.parametrize("lengths,cp,rank,per_token", THD_CASES)
def test_thd_matches_megatron_unfused(lengths, cp, rank, per_token):
    """fp32: the same rotation as megatron's _apply_rotary_pos_emb_thd, forward and backward."""
    total = sum(lengths)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    if per_token:  # angles of every packed token, positions restarting per sequence
        pos = torch.cat([torch.arange(n) for n in lengths])
        f = angles(max(lengths), 16)[pos]
    else:
        f = angles(max(lengths) + 3, 16)  # a table longer than the longest sequence
    g = torch.Generator().manual_seed(4)
    t = torch.randn(total // cp, 3, 24, generator=g).to(DEV)
    up = torch.randn(total // cp, 3, 24, generator=g).to(DEV)
    a, b = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
    ours, want = rope.fused_rope_thd(a, cu, f, cp_size=cp, cp_rank=rank), _megatron_thd(b, cu, f, cp, rank)
    torch.testing.assert_close(ours, want, atol=2e-6, rtol=2e-6)
    (ours * up).sum().backward()
    (want * up).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=2e-6, rtol=2e-6)


def test_thd_errors_name_the_mismatch():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="rotary table has 5 rows"):
        rope.fused_rope_thd(torch.randn(10, 2, 16, device=DEV), cu, angles(5, 16))
    with pytest.raises(ValueError, match="packed tensor has 9 tokens, cu_seqlens"):
        rope.fused_rope_thd(torch.randn(9, 2, 16, device=DEV), cu, angles(12, 16))


def test_unsupported_inputs_fall_back_to_megatron_with_one_warning(monkeypatch):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    monkeypatch.setattr(rope, "_WARNED", set())
    t = torch.randn(4, 1, 2, 24, device=DEV)
    f = angles(4, 24)  # rotary half 12: not a power of two
    with pytest.warns(UserWarning, match="megatron's unfused RoPE runs instead"):
        out = rope.fused_rope_sbhd(t, f)
    torch.testing.assert_close(out, _apply_rotary_pos_emb_bshd(t, f), atol=0, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope.fused_rope_sbhd(t, f)  # the same reason warns once
    f16 = angles(4, 16)
    with pytest.warns(UserWarning, match="interleaved"):
        out = rope.fused_rope_sbhd(t, f16, interleaved=True)
    torch.testing.assert_close(out, _apply_rotary_pos_emb_bshd(t, f16, rotary_interleaved=True), atol=0, rtol=0)


def test_install_fills_only_empty_slots(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    assert rope.install_rope_fusion()
    assert rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope_sbhd
    assert rope_utils.fused_apply_rotary_pos_emb_thd is rope.fused_rope_thd
    te = object()  # what Transformer Engine would have put there
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", te)
    assert not rope.install_rope_fusion() and rope_utils.fused_apply_rotary_pos_emb is te


@pytest.mark.slow
def test_packed_engine_step_equals_unfused(monkeypatch):
    """A packed (THD) engine with model.rope_fusion on (the kernel in megatron's slot, per-token angles)
    gives the unfused engine's statistics and gradient norm; the config says which ran."""
    from megatron.core.models.common.embeddings import rope_utils

    from areal_lce.engine.config import ModelConfig
    from areal_lce.engine.microbatch import MicroBatch
    from helpers.engines import tiny_engine

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    monkeypatch.setattr(rope, "fusion_usable", lambda: True)  # on CPU: the kernel through the interpreter
    calls = []
    real = rope.FusedRotary.apply
    monkeypatch.setattr(rope.FusedRotary, "apply", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 200, (3, 12), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[0, 7:] = -100  # rows of different lengths: three packed sequences
    labels[1, 10:] = -100
    labels[:, -1] = -100
    out = {}
    for fused in (False, True):
        eng = tiny_engine(200, model=dict(max_seq_len=32, rope_fusion=fused), optim=dict(lr=0.0, clip_grad=0.0),
                          seed=3)
        assert eng.gpt.config.apply_rope_fusion == fused
        stats = eng.token_stats(ids, labels)

        def loss(st, mb):
            m = mb.labels.to(st.logprobs.device) != -100
            return -(st.logprobs * m).sum() / m.sum(), {}

        metrics = eng.train_step([MicroBatch(ids, labels)], loss)
        out[fused] = (stats.logprobs, stats.entropy, metrics["grad_norm"])
    assert calls, "the fused engine never called the kernel"
    for a, b in zip(out[True][:2], out[False][:2]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert out[True][2] == pytest.approx(out[False][2], rel=1e-5)
    assert dataclasses.asdict(ModelConfig())["rope_fusion"] is True  # on by default


# --------------------------------------------------------------------------------------------------
# CUDA (marked `gpu`: skipped without a CUDA device)
# The fused RoPE kernel on CUDA:
#
#   bf16_rounding      bf16 outputs are the fp64 formula rounded to nearest (fp32 inside, one rounding) for
#                      all but a few near-tie elements; mean error no worse than megatron's unfused RoPE.
#   large_angles       fp32 at positions near 32k with inverse frequency 1: the GPU's cos / sin reduce the
#                      argument fully (an approximate sine would be off by ~1e-2 there).
#   cuda_graph         forward+backward captured with torch.cuda.graph, replayed on new inputs: equal to eager.
#   sync_free          the packed (THD) slot with host cu_seqlens makes no host sync after its first call.
#   engine             a packed bf16 engine on CUDA builds with apply_rope_fusion (the slots were empty:
#                      no Transformer Engine) and gives the unfused engine's statistics.

def _angles(s: int, r: int, start: int = 0, base: float = 1e6) -> torch.Tensor:
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    f = torch.arange(start, start + s, dtype=torch.float64)[:, None] * inv
    return torch.cat([f, f], -1)[:, None, None, :].float().cuda()


def _oracle(t, f):
    r = f.shape[-1]
    x, rest = t.double()[..., :r], t.double()[..., r:]
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x * f.double().cos() + torch.cat([-x2, x1], -1) * f.double().sin(), rest], -1)


@pytest.mark.gpu
def test_bf16_rounding(record_property):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from areal_lce.engine.model.rope import FusedRotary

    t = torch.randn(2048, 2, 14, 64, device="cuda").bfloat16()
    f = _angles(2048, 64, start=3000)
    want = _oracle(t, f)
    ours, theirs = FusedRotary.apply(t, f), _apply_rotary_pos_emb_bshd(t, f)
    nearest = float((ours == want.to(torch.bfloat16)).float().mean())
    e_ours, e_theirs = ((x.double() - want).abs().mean().item() for x in (ours, theirs))
    record_property("result", {"round_to_nearest": nearest, "mean_err": e_ours, "megatron_mean_err": e_theirs})
    assert nearest > 0.995, f"only {nearest:.4f} of bf16 outputs are the rounded fp64 formula"
    assert e_ours <= e_theirs, f"mean error {e_ours:.3e} vs megatron unfused {e_theirs:.3e}"


@pytest.mark.gpu
def test_large_angles(record_property):
    from areal_lce.engine.model.rope import FusedRotary

    t = torch.randn(256, 1, 4, 128, device="cuda")
    f = _angles(256, 128, start=32768 - 256, base=1e6)
    err = (FusedRotary.apply(t, f).double() - _oracle(t, f)).abs().max().item()
    record_property("result", {"max_err": err})
    assert err < 3e-5


def _fwd_bwd(t, f, up):
    from areal_lce.engine.model.rope import FusedRotary

    x = t.detach().requires_grad_()
    out = FusedRotary.apply(x, f)
    (dx,) = torch.autograd.grad((out * up).sum(), x)
    return out, dx


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(record_property):
    shape = (512, 2, 14, 64)
    t, up = (torch.randn(shape, device="cuda").bfloat16() for _ in range(2))
    f = _angles(512, 64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _fwd_bwd(t, f, up)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_dx = _fwd_bwd(t, f, up)
    t.copy_(torch.randn(shape, device="cuda"))
    up.copy_(torch.randn(shape, device="cuda"))
    graph.replay()
    e_out, e_dx = _fwd_bwd(t, f, up)
    record_property("result", {"max_diff": float((g_out - e_out).abs().max())})
    assert torch.equal(g_out, e_out) and torch.equal(g_dx, e_dx)


@pytest.mark.gpu
def test_packed_slot_is_sync_free():
    from areal_lce.engine.model.rope import fused_rope_thd

    cu = torch.tensor([0, 300, 301, 1024], dtype=torch.int32)  # host cu_seqlens, as the engine keeps them
    f = _angles(1024, 64)
    t = torch.randn(1024, 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fused_rope_thd(t, cu, f).sum().backward()  # first call: builds the layout's index
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fused_rope_thd(t, cu, f).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_engine_with_rope_fusion_matches_unfused(record_property):
    from areal_lce.engine.config import LCEConfig
    from areal_lce.engine.model.builder import use_te_spec
    from helpers.engines import tiny_engine

    if use_te_spec():
        pytest.skip("Transformer Engine installed: its own fused RoPE fills megatron's slots")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 96), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[1, 40:] = -100
    labels[3, 70:] = -100
    labels[:, -1] = -100
    stats = {}
    for fused in (True, False):
        eng = tiny_engine(500, model=dict(dtype="bf16", max_seq_len=128, rope_fusion=fused), lce=LCEConfig(), seed=1)
        assert eng.gpt.config.apply_rope_fusion == fused
        stats[fused] = eng.token_stats(ids, labels)
        del eng
    m = labels != -100
    diff = (stats[True].logprobs - stats[False].logprobs)[m].abs().max().item()
    record_property("result", {"max_dlogp": diff})
    assert diff < 5e-2  # bf16 activations: the two RoPEs round differently, nothing more
