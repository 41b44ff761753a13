"""The engine's core attention (areal_lce/engine/model/attention.py) on one CUDA device (marked `gpu`: skipped
without CUDA). Needs megatron-core, as the rest of the attention tests do.

    python -m pytest -q -m gpu tests/engine/test_gpu_attention.py
    python -m benchmark.gpu_attention_check --out DIR     # the same tests, a timing line, JSON summary

1. Kernels: `causal_varlen_attention` through torch's `varlen_attn` (flash varlen, impl="varlen") against
   one SDPA call per segment (impl="sdpa") at the same dtype, both judged against the fp32 SDPA result on
   the same values: packed self-attention with RL-like lengths, context-parallel segments (queries fewer
   than keys, causal aligned lower right), GQA 14/2 heads d=64 (Qwen2.5-0.5B) and 28/4 d=128 (7B), bf16 and
   fp16; output and dq/dk/dv. Pass rule: err(varlen) <= 4 x err(sdpa) + atol, err = max |Δ| to fp32.
2. GPTModel: the `tiny` preset in bf16, 4 packed THD sequences (varlen path) vs the same sequences one by
   one as BSHD (SDPA), both judged against the BSHD fp32 model: the same pass rule.
"""
from __future__ import annotations

import pytest
import torch

from areal_lce.engine.model.attention import causal_varlen_attention, make_segments, varlen_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
_RL = torch.randint(64, 2049, (8,), generator=torch.Generator().manual_seed(1)).tolist() + [1, 7]  # RL-like + tiny
_C = [96, 40, 256]  # CP=2, rank 0: chunk 0 sees c keys, chunk 3 sees 4c keys
KERNEL_CASES = {  # name: (query lengths, key lengths, heads, kv groups, head dim)
    "packed-rl-0.5b": (_RL, _RL, 14, 2, 64),
    "cp-segments-0.5b": ([n for n in _C for _ in range(2)], [m * n for n in _C for m in (1, 4)], 14, 2, 64),
    "packed-7b": (_RL[:4], _RL[:4], 28, 4, 128),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_varlen_attn_matches_sdpa(name, dtype, record_property):
    q_lens, k_lens, heads, groups, d = KERNEL_CASES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q32 = torch.randn(sum(q_lens), heads, d, device="cuda", generator=g)
    k32, v32 = (torch.randn(sum(k_lens), groups, d, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(q32.shape, device="cuda", generator=g)
    segs = make_segments(torch.tensor(q_lens), torch.tensor(k_lens), "cuda")
    scale = d ** -0.5

    def run(impl, dt):
        q, k, v = (t.detach().to(dt).clone().requires_grad_() for t in (q32, k32, v32))
        out = causal_varlen_attention(q, k, v, segs, scale, impl=impl)
        (out.float() * w).sum().backward()
        return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    ref, sdpa = run("sdpa", torch.float32), run("sdpa", dtype)
    assert varlen_usable(q32.to(dtype), scale, 0.0), "varlen_attn is not usable here"
    varlen = run("varlen", dtype)
    res = {}
    for label, r, s, v in zip(("out", "dq", "dk", "dv"), ref, sdpa, varlen):
        res[f"{label}_err_varlen"], res[f"{label}_err_sdpa"] = float((v - r).abs().max()), float((s - r).abs().max())
    record_property("result", res)
    bad = [k for k in ("out", "dq", "dk", "dv") if res[f"{k}_err_varlen"] > 4 * res[f"{k}_err_sdpa"] + ATOL[dtype]]
    assert not bad, (bad, res)


def test_gpt_tiny_thd_varlen_matches_bshd(record_property):
    from megatron.core.packed_seq_params import PackedSeqParams

    from areal_lce.engine.model import builder as M
    from areal_lce.engine.config import ModelConfig, ParallelConfig
    from areal_lce.engine.parallel import init_distributed

    init_distributed(ParallelConfig(), seed=3)
    cfg = ModelConfig(preset="tiny", max_seq_len=4096)
    arch = M.resolve_arch(cfg)
    m32 = M.build_gpt_model(arch, cfg, ParallelConfig(), torch.float32)
    m16 = M.build_gpt_model(arch, cfg, ParallelConfig(), torch.bfloat16)
    m16.load_state_dict(m32.state_dict())
    kind = type(m16.decoder.layers[0].self_attention.core_attention).__name__
    lengths = [300, 17, 1024, 555]
    ids = torch.randint(0, 512, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths))

    def one_by_one(m):
        return torch.cat([m(i, p, None).float() for i, p in zip(ids.split(lengths, 1), pos.split(lengths, 1))], 1)

    with torch.no_grad():
        ref, bshd = one_by_one(m32), one_by_one(m16)
        thd = m16(ids, pos, None, packed_seq_params=psp).float()
    res = {"core_attention": kind, "err_thd_bf16": float((thd - ref).abs().max()),
           "err_bshd_bf16": float((bshd - ref).abs().max())}
    record_property("result", res)
    assert kind == "SDPAttention", res
    assert res["err_thd_bf16"] <= 4 * res["err_bshd_bf16"] + 1e-2, res
