"""Worker of test_invariance.py::test_tensor_parallel_degrees_are_bitwise_equal (4 gloo ranks).

Every rank computes the TP=1 outputs itself (the weight padded to 128 rows), then the same tokens at TP=2
(groups {0,1}, {2,3}) and TP=4, with megatron's padding (vocab to a multiple of 128·tp) and garbage in
the padding rows, sequence parallelism off and on, on the torch backend and on the Triton kernels (under
the interpreter), bf16 and fp32; it records every output that is not bitwise equal. Rank 0 writes the
JSON result. It also checks that the online-softmax merge (invariant=False) does differ across degrees.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from areal_lce import VocabParallel, linear_logprobs_entropy

V, H, N = 1100, 48, 40
FIELDS = ("logprobs", "entropy", "max_logit", "min_logit", "lse", "sum_logit", "sumsq_logit")


def padded(tp: int) -> int:
    step = 128 * tp
    return -(-V // step) * step


def weight_for(tp: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g) * 0.3
    h = torch.randn(N, H, generator=g)
    w[[3, 640, 1099]] = h[:3] * 0.6
    junk = torch.randn(padded(tp) - V, H, generator=torch.Generator().manual_seed(100 + tp)) * 30
    return torch.cat([w, junk]).to(dtype)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    torch.randn(V, H, generator=g)
    h = torch.randn(N, H, generator=g).to(dtype)
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(7))
    y[:8] = torch.tensor([0, 127, 128, 383, 384, 639, 640, V - 1])  # segment and shard edges
    y[[9, 13]] = -100
    return h, y


def run(backend, dtype, tp, group, rank, sp, invariant=True):
    h, y = inputs(dtype)
    w = weight_for(tp, dtype)
    kw = dict(backend=backend, vocab_size=V, return_stats=True, return_logit_sums=True, invariant=invariant)
    if tp == 1:
        return linear_logprobs_entropy(h, w, y, **kw)
    shard = padded(tp) // tp
    w_r = w[rank * shard:(rank + 1) * shard]
    if sp:
        rows = N // tp
        vp = VocabParallel(group, d_hidden="reduce_scatter")
        return linear_logprobs_entropy(h[rank * rows:(rank + 1) * rows], w_r, y, vocab_parallel=vp, **kw)
    return linear_logprobs_entropy(h, w_r, y, vocab_parallel=VocabParallel(group), **kw)


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    everyone = dist.group.WORLD
    mismatches, checked = [], 0
    for backend in ("torch", "triton"):
        for dtype in (torch.bfloat16, torch.float32):
            ref = run(backend, dtype, 1, None, 0, False)
            for tp, group, r in ((2, pair, rank % 2), (4, everyone, rank)):
                for sp in (False, True):
                    got = run(backend, dtype, tp, group, r, sp)
                    checked += 1
                    for f in FIELDS:
                        a, b = getattr(got, f), getattr(ref, f)
                        if not torch.equal(a, b):
                            mismatches.append(f"rank {rank} {backend} {dtype} tp={tp} sp={sp} {f}: "
                                              f"{int((a != b).sum())} differ, max {float((a - b).abs().max()):.3g}")
    # the online-softmax merge is not TP-invariant on these inputs (the check can fail)
    ref = run("torch", torch.float32, 1, None, 0, False, invariant=False)
    got = run("torch", torch.float32, 4, everyone, rank, False, invariant=False)
    differs = any(not torch.equal(getattr(got, f), getattr(ref, f)) for f in ("logprobs", "entropy", "lse"))
    results = [None] * world
    dist.all_gather_object(results, dict(mismatches=mismatches, checked=checked, differs=differs))
    if rank == 0:
        merged = dict(mismatches=sum((r["mismatches"] for r in results), []),
                      checked=sum(r["checked"] for r in results),
                      online_merge_differs=any(r["differs"] for r in results))
        with open(out, "w") as f:
            json.dump(merged, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
