"""GPU check of the engine's core attention (areal_lce/engine/model/attention.py) on one CUDA device.

    pip install --no-deps megatron-core==0.19.2     # the GPU image has none (a cp312 wheel will do)
    python -m benchmark.engine.gpu_attention_check --out DIR

1. Correctness: `pytest -m gpu tests/engine/test_attention.py` in this process (cases and pass rule there):
   `causal_varlen_attention` through torch's `varlen_attn` (flash varlen) against one SDPA call per
   segment, both judged against fp32 SDPA (packed RL-like lengths, context-parallel segments, GQA 14/2
   d=64 and 28/4 d=128, bf16 and fp16, output and dq/dk/dv), and the tiny GPTModel THD (varlen) vs one
   sequence at a time BSHD (SDPA) in bf16 against fp32. One PASS/FAIL line per test.
2. Timing (informational): forward+backward of one pack of 16 sequences with lengths uniform in
   64..2048 (0.5B heads), varlen vs per-sequence SDPA vs padded BSHD SDPA [16, longest].
Writes gpu_attention_check.json; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmark.op.gpu_check import run_gpu_tests
from benchmark.harness import run_meta, write_json

TESTS = ("tests/engine/test_attention.py",)


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
    # imported here: the tests run first and their conftest must set the poisoning switch before
    # areal_lce loads
    from areal_lce.engine.model.attention import causal_varlen_attention, make_segments

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
    rows, rc = run_gpu_tests(TESTS)
    t = timing()
    print(f"timing: {t['tokens']} tokens in 16 sequences (padded {t['padded_tokens']}): varlen {t['varlen_ms']:.2f} ms, "
          f"per-sequence SDPA {t['sdpa_ms']:.2f} ms, padded BSHD SDPA {t['padded_bshd_ms']:.2f} ms (fwd+bwd)")
    write_json(args.out, "gpu_attention_check.json", {"meta": run_meta(), "tests": list(TESTS), "pytest_exit": rc,
                                                      "cases": rows, "timing": t})
    print(f"gpu_attention_check: {sum(r['ok'] for r in rows)}/{len(rows)} passed")
    return 0 if rc == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
