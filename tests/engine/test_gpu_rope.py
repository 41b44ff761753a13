"""The fused RoPE kernel on CUDA (marked `gpu`: skipped without CUDA; CPU coverage is tests/engine/test_rope.py):

  bf16_rounding      bf16 outputs are the fp64 formula rounded to nearest (fp32 inside, one rounding) for
                     all but a few near-tie elements; mean error no worse than megatron's unfused RoPE.
  large_angles       fp32 at positions near 32k with inverse frequency 1: the GPU's cos / sin reduce the
                     argument fully (an approximate sine would be off by ~1e-2 there).
  cuda_graph         forward+backward captured with torch.cuda.graph, replayed on new inputs: equal to eager.
  sync_free          the packed (THD) slot with host cu_seqlens makes no host sync after its first call.
  engine             a packed bf16 engine on CUDA builds with apply_rope_fusion (the slots were empty:
                     no Transformer Engine) and gives the unfused engine's statistics.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _angles(s: int, r: int, start: int = 0, base: float = 1e6) -> torch.Tensor:
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    f = torch.arange(start, start + s, dtype=torch.float64)[:, None] * inv
    return torch.cat([f, f], -1)[:, None, None, :].float().cuda()


def _oracle(t, f):
    r = f.shape[-1]
    x, rest = t.double()[..., :r], t.double()[..., r:]
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x * f.double().cos() + torch.cat([-x2, x1], -1) * f.double().sin(), rest], -1)


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


def test_engine_with_rope_fusion_matches_unfused(record_property):
    from areal_lce.engine.config import EngineConfig, ModelConfig
    from areal_lce.engine.engine import MegatronEngine
    from areal_lce.engine.model.builder import use_te_spec

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
        cfg = EngineConfig(model=ModelConfig(preset="tiny", dtype="bf16", max_seq_len=128, rope_fusion=fused), seed=1)
        eng = MegatronEngine(cfg, vocab_size=500)
        assert eng.gpt.config.apply_rope_fusion == fused
        stats[fused] = eng.token_stats(ids, labels)
        del eng
    m = labels != -100
    diff = (stats[True].logprobs - stats[False].logprobs)[m].abs().max().item()
    record_property("result", {"max_dlogp": diff})
    assert diff < 5e-2  # bf16 activations: the two RoPEs round differently, nothing more
