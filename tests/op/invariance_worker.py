"""Worker of test_invariance.py::test_tensor_parallel_degrees_are_bitwise_equal (4 gloo ranks).

Every rank computes the TP=1 outputs itself (the weight padded to 128 rows), then the same tokens at TP=2
(groups {0,1}, {2,3}) and TP=4, with megatron's padding (vocab to a multiple of 128·tp) and garbage in
the padding rows, sequence parallelism off and on, on the torch backend and on the Triton kernels (under
the interpreter; selected ids gathered, and in bf16 also picked from the forward's tiles), bf16 and fp32; it records every output that is not bitwise equal. Rank 0 writes the
JSON result. It also checks that the online-softmax merge (invariant=False) does differ across degrees.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from areal_lce import VocabParallel, linear_logprobs_entropy

V, H, N = 1100, 48, 40
FIELDS = ("logprobs", "entropy", "max_logit", "min_logit", "lse", "sum_logit", "sumsq_logit", "selected_logprobs",
          "topk_ids", "topk_logprobs")
TOP_K = 6


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


def selected(y):
    """[N, 5] ids: the label, segment / shard edges, a repeat, an ignore entry."""
    sel = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(8))
    sel[:, 0] = y.clamp_min(0)
    sel[:, 1] = torch.tensor([0, 127, 128, 639, 640, V - 1] * 7)[:N]
    sel[:, 2] = sel[:, 1]
    sel[::3, 3] = -100
    return sel


def run(backend, dtype, tp, group, rank, sp, invariant=True):
    h, y = inputs(dtype)
    w = weight_for(tp, dtype)
    kw = dict(backend=backend, vocab_size=V, return_stats=True, return_logit_sums=True, invariant=invariant,
              selected_ids=selected(y), top_k=TOP_K)
    if tp == 1:
        return linear_logprobs_entropy(h, w, y, **kw)
    shard = padded(tp) // tp
    w_r = w[rank * shard:(rank + 1) * shard]
    if sp:
        rows = N // tp
        vp = VocabParallel(group, d_hidden="reduce_scatter")
        return linear_logprobs_entropy(h[rank * rows:(rank + 1) * rows], w_r, y, vocab_parallel=vp, **kw)
    return linear_logprobs_entropy(h, w_r, y, vocab_parallel=VocabParallel(group), **kw)


def _grads(tp, group, rank, sp):
    h, y = inputs(torch.float32)
    w = weight_for(tp, torch.float32)
    rows = N // tp if sp else N
    hh = (h[rank * rows:(rank + 1) * rows] if sp else h).clone().requires_grad_()
    shard = padded(tp) // tp
    ww = (w[rank * shard:(rank + 1) * shard] if tp > 1 else w).clone().requires_grad_()
    vp = None if tp == 1 else VocabParallel(group, d_hidden="reduce_scatter" if sp else "all_reduce")
    o = linear_logprobs_entropy(hh, ww, y, backend="torch", vocab_size=V, return_stats=True, vocab_parallel=vp,
                                selected_ids=selected(y), top_k=TOP_K, temperature=0.8)
    g = torch.Generator().manual_seed(3)
    loss = (o.logprobs.sum() + 0.3 * o.entropy.sum() - 0.2 * o.lse.sum()
            + (o.selected_logprobs * torch.randn(o.selected_logprobs.shape, generator=g)).sum()
            + (o.topk_logprobs * torch.randn(o.topk_logprobs.shape, generator=g)).sum())
    loss.backward()
    return hh.grad, ww.grad


def _grad_error(rank, group, sp):
    dh1, dw1 = _grads(1, None, 0, False)
    dh2, dw2 = _grads(2, group, rank, sp)
    rows, shard = (N // 2 if sp else N), padded(2) // 2
    dh1 = dh1[rank * rows:(rank + 1) * rows] if sp else dh1
    dw1 = torch.cat([dw1[:V], torch.zeros(padded(2) - V, H)])[rank * shard:(rank + 1) * shard]
    return max(float((dh2 - dh1).abs().max() / dh1.abs().max()), float((dw2 - dw1).abs().max() / dw1.abs().max()))


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    everyone = dist.group.WORLD
    mismatches, checked = [], 0
    from areal_lce.op.backends.triton import select_launch
    default = select_launch.PICK_KH_PER_ID
    for route, dtypes in (("torch", (torch.bfloat16, torch.float32)), ("triton", (torch.bfloat16, torch.float32)),
                            ("triton:picks", (torch.bfloat16,))):
        # "triton:picks": the selected ids taken from the forward's tiles (a shard's own segments), the rest
        # listed; "triton" gathers them all at these sizes (select_launch.takes_picks)
        select_launch.PICK_KH_PER_ID = 0.0 if route == "triton:picks" else default
        backend = route.split(":")[0]
        for dtype in dtypes:
            ref = run(backend, dtype, 1, None, 0, False)
            for tp, group, r in ((2, pair, rank % 2), (4, everyone, rank)):
                for sp in (False, True):
                    got = run(backend, dtype, tp, group, r, sp)
                    checked += 1
                    for f in FIELDS:
                        a, b = getattr(got, f), getattr(ref, f)
                        if not torch.equal(a, b):
                            mismatches.append(f"rank {rank} {route} {dtype} tp={tp} sp={sp} {f}: "
                                              f"{int((a != b).sum())} differ, max {float((a - b).abs().max()):.3g}")
    # gradients of a loss mixing logprobs, entropy, lse, selected and top-k logprobs: TP=2 (SP off / on) against
    # TP=1 to fp32 rounding (deterministic, not bitwise: the vocab-partial d_hidden is summed over ranks)
    grad_err = max(_grad_error(rank % 2, pair, sp) for sp in (False, True))
    # the online-softmax merge is not TP-invariant on these inputs (the check can fail)
    ref = run("torch", torch.float32, 1, None, 0, False, invariant=False)
    got = run("torch", torch.float32, 4, everyone, rank, False, invariant=False)
    differs = any(not torch.equal(getattr(got, f), getattr(ref, f)) for f in ("logprobs", "entropy", "lse"))
    results = [None] * world
    dist.all_gather_object(results, dict(mismatches=mismatches, checked=checked, differs=differs,
                                         grad_err=grad_err))
    if rank == 0:
        merged = dict(mismatches=sum((r["mismatches"] for r in results), []),
                      grad_rel_err=max(r["grad_err"] for r in results),
                      checked=sum(r["checked"] for r in results),
                      online_merge_differs=any(r["differs"] for r in results))
        with open(out, "w") as f:
            json.dump(merged, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
