"""GPU check of the engine's core attention (areal_lce/megatron/attention.py) on one CUDA device.

    pip install --no-deps megatron-core==0.19.2     # the GPU image has none (a cp312 wheel will do)
    python -m benchmark.gpu_attention_check --out DIR

1. Kernels: `causal_varlen_attention` through torch's `varlen_attn` (flash varlen, impl="varlen")
   against one SDPA call per segment (impl="sdpa") at the same dtype, both judged against the fp32
   SDPA result on the same values: packed self-attention with RL-like lengths, context-parallel
   segments (queries fewer than keys, causal aligned lower right), GQA 14/2 heads d=64 (Qwen2.5-0.5B)
   and 28/4 d=128 (7B), bf16 and fp16; output and dq/dk/dv. Pass rule:
   err(varlen) <= 4 x err(sdpa) + atol, where err is the max |Δ| to the fp32 result.
2. GPTModel: the `tiny` preset in bf16 on CUDA, 4 packed THD sequences (varlen path) vs the same
   sequences one by one as BSHD (SDPA), both judged against the BSHD fp32 model: same pass rule.
3. Timing (informational): forward+backward of one pack of 16 sequences with lengths uniform in
   64..2048 (0.5B heads), varlen vs per-sequence SDPA vs padded BSHD SDPA [16, longest].
Prints one line per case, writes gpu_attention_check.json; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from areal_lce.megatron.attention import causal_varlen_attention, make_segments, varlen_usable

ATOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _case(name, q_lens, k_lens, heads, groups, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
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
    row = {"case": name, "dtype": str(dtype).split(".")[-1]}
    ok = True
    for label, r, s, v in zip(("out", "dq", "dk", "dv"), ref, sdpa, varlen):
        e_s, e_v = float((s - r).abs().max()), float((v - r).abs().max())
        row[f"{label}_err_varlen"], row[f"{label}_err_sdpa"] = e_v, e_s
        ok &= e_v <= 4 * e_s + ATOL[dtype]
    row["pass"] = ok
    return row


def kernel_cases():
    g = torch.Generator().manual_seed(1)
    rl = torch.randint(64, 2049, (8,), generator=g).tolist() + [1, 7]  # RL-like plus tiny sequences
    c = [96, 40, 256]  # CP=2, rank 0: chunk 0 sees c keys, chunk 3 sees 4c keys
    cp_q = [n for n in c for _ in range(2)]
    cp_k = [m * n for n in c for m in (1, 4)]
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        rows.append(_case("packed-rl-0.5b", rl, rl, 14, 2, 64, dtype))
        rows.append(_case("cp-segments-0.5b", cp_q, cp_k, 14, 2, 64, dtype))
        rows.append(_case("packed-7b", rl[:4], rl[:4], 28, 4, 128, dtype))
    return rows


def model_case():
    from megatron.core.packed_seq_params import PackedSeqParams

    from areal_lce.megatron import model as M
    from areal_lce.megatron.config import ModelConfig, ParallelConfig
    from areal_lce.megatron.parallel import init_distributed

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
    e_thd, e_bshd = float((thd - ref).abs().max()), float((bshd - ref).abs().max())
    return {"case": "gpt-tiny-thd-vs-bshd", "core_attention": kind, "err_thd_bf16": e_thd, "err_bshd_bf16": e_bshd,
            "pass": kind == "SDPAttention" and e_thd <= 4 * e_bshd + 1e-2}


def _time(fn, iters=10):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timing():
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(64, 2049, (16,), generator=g).tolist()
    heads, groups, d = 14, 2, 64
    segs = make_segments(torch.tensor(lengths), torch.tensor(lengths), "cuda")
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(sum(lengths), heads, d), mk(sum(lengths), groups, d), mk(sum(lengths), groups, d)
    L = max(lengths)
    qp, kp, vp = mk(16, heads, L, d), mk(16, heads, L, d), mk(16, heads, L, d)
    res = {"lengths": lengths, "tokens": sum(lengths), "padded_tokens": 16 * L}
    for impl in ("varlen", "sdpa"):
        res[f"{impl}_ms"] = _time(lambda: causal_varlen_attention(q, k, v, segs, d ** -0.5, impl=impl).sum().backward())
    res["padded_bshd_ms"] = _time(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True).sum().backward())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    rows = kernel_cases() + [model_case()]
    for r in rows:
        print(("PASS " if r["pass"] else "FAIL ") + " ".join(f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}"
                                                            for k, v in r.items() if k != "pass"))
    t = timing()
    print(f"timing: {t['tokens']} tokens in 16 sequences (padded {t['padded_tokens']}): varlen {t['varlen_ms']:.2f} ms, "
          f"per-sequence SDPA {t['sdpa_ms']:.2f} ms, padded BSHD SDPA {t['padded_bshd_ms']:.2f} ms (fwd+bwd)")
    from benchmark.harness import run_meta, write_json

    write_json(args.out, "gpu_attention_check.json", {"meta": run_meta(), "cases": rows, "timing": t})
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
