"""Worker of test_compile.py::test_tp2_nccl_cuda_graph_replay_matches_eager (2 ranks, one GPU each, NCCL).

Each rank captures the op's forward + backward at TP=2 (the op's defaults on CUDA: the Triton backend, the
deferred label check, bf16) once with torch.cuda.graph, for the vocab-parallel modes "all_reduce" and
"reduce_scatter" (sequence parallel), then replays it on new hidden, weight, labels (another ignore
pattern) and temperatures copied into the captured inputs, and compares each replay with an eager call
on the same values. The collectives (label agreement votes, the statistics' MAX and SUM, the all-gather
of hidden and the reduce-scatter or all-reduce of d_hidden) are captured with the op. Rank 0 writes the
JSON result.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from areal_lce import VocabParallel, check_deferred, linear_logprobs_entropy

N, H, V_SHARD, VOCAB = 512, 256, 8192, 16000  # a padded vocabulary (2 · 8192 rows)


def inputs(seed: int, rank: int, sp: bool):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * V_SHARD, H, generator=g) * (4.0 / H ** 0.5)).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (N,), generator=g)
    y[400 + 30 * seed:] = -100
    y[torch.randint(0, 400, (20,), generator=g)] = -100
    temp = 0.5 + torch.rand(N, generator=g)
    g_out = torch.randn(2, N, generator=g)
    h = h[rank * N // 2:(rank + 1) * N // 2] if sp else h
    w = w[rank * V_SHARD:(rank + 1) * V_SHARD]
    return [t.cuda().contiguous() for t in (h, w, y, temp, g_out)]


def step(vp, h, w, y, temp, g_out):
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    o = linear_logprobs_entropy(hh, ww, y, temperature=temp, vocab_size=VOCAB, return_stats=True, vocab_parallel=vp)
    loss = (o.logprobs * g_out[0]).sum() + (o.entropy * g_out[1]).sum()
    dh, dw = torch.autograd.grad(loss, (hh, ww))
    return [o.logprobs, o.entropy, o.max_logit, o.min_logit, o.lse, dh, dw]


def main():
    out = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.new_group([0, 1])
    replays = []
    for d_hidden in ("all_reduce", "reduce_scatter"):
        vp = VocabParallel(group, d_hidden)
        statics = inputs(0, rank, d_hidden == "reduce_scatter")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step(vp, *statics)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(vp, *statics)
        for seed in (1, 2, 0):
            for dst, src in zip(statics, inputs(seed, rank, d_hidden == "reduce_scatter")):
                dst.copy_(src)
            graph.replay()
            eager = step(vp, *statics)
            torch.cuda.synchronize()
            replays.append(dict(rank=rank, d_hidden=d_hidden, seed=seed,
                                bitwise=all(torch.equal(a, b) for a, b in zip(captured, eager)),
                                finite=bool(torch.isfinite(captured[0]).all())))
    check_deferred()  # no bad label was passed: nothing recorded, on any rank
    results = [None] * 2
    dist.all_gather_object(results, replays)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(replays=sum(results, [])), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
