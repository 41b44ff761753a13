"""Worker of test_compile.py::test_tp2_gloo_compiles_fullgraph_equal_to_eager (2 gloo ranks).

Each rank runs a small model (a projection, the op at TP=2, a loss over every output) eagerly and under
`torch.compile(fullgraph=True, backend="aot_eager")`, forward and backward, for the vocab-parallel modes
"all_reduce" (hidden replicated) and "reduce_scatter" (sequence parallel: hidden is this rank's half of
the rows), and for `linear_logprobs_entropy_into_main_grad` (the weight gradient added into main_grad).
It records every result that is not bitwise equal (the same kernels and collectives run on both sides:
the op's real implementation is called by the compiled graph) and the number of graphs each compile
made. The compiled call runs first, so the "tp2" case's once-per-group check (deferred label checks) runs
while torch.compile traces. Rank 0 writes the JSON result.
"""
import json
import sys

import torch
import torch._dynamo.testing
import torch.distributed as dist

from areal_lce import VocabParallel, check_deferred, linear_logprobs_entropy
from areal_lce.op.main_grad import linear_logprobs_entropy_into_main_grad

N, H, V_SHARD, IGNORE = 16, 16, 128, -100


def inputs(rank: int):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(2 * V_SHARD, H, generator=g) * 0.4
    proj = torch.randn(H, H, generator=g) * 0.3
    labels = torch.randint(0, 2 * V_SHARD, (N,), generator=g)
    labels[[1, 6, 7]] = IGNORE
    temp = torch.rand(N, generator=g) + 0.5
    return hidden, weight[rank * V_SHARD:(rank + 1) * V_SHARD].contiguous(), proj, labels, temp


def model(op, vp, check_labels):
    def f(hidden, weight, proj, labels, temperature):
        out = op(torch.tanh(hidden @ proj), weight, labels, temperature=temperature, return_stats=True,
                 backend="torch", vocab_parallel=vp, check_labels=check_labels)
        mask = (labels != IGNORE).float()
        loss = -(out.logprobs * mask).sum() / mask.sum() - 0.01 * (out.entropy * mask).sum() + 1e-3 * out.lse.sum()
        return loss, torch.stack([out.logprobs, out.entropy, out.lse, out.max_logit, out.min_logit])
    return f


def step(fn, hidden, weight, proj, labels, temp, main_grad: bool):
    h, p = hidden.clone().requires_grad_(), proj.clone().requires_grad_()
    w = torch.nn.Parameter(weight.clone())
    if main_grad:
        w.main_grad = torch.full(weight.shape, 0.25)  # megatron DDP's fp32 buffer, not zero
        w.grad_added_to_main_grad = False
    loss, outs = fn(h, w, p, labels, temp)
    loss.backward()
    res = {"loss": loss.detach(), "outputs": outs.detach(), "d_hidden": h.grad, "d_proj": p.grad}
    if main_grad:
        res.update(main_grad=w.main_grad, flag=torch.tensor(bool(w.grad_added_to_main_grad)),
                   placeholder=torch.tensor(w.grad is not None and w.grad.shape == w.shape))
    else:
        res["d_weight"] = w.grad
    return res


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    hidden, weight, proj, labels, temp = inputs(rank)
    mismatches, graphs = [], {}
    # "tp2" first, with the accelerators' default "deferred" label check: its once-per-group shard-size check (a
    # collective read on the host) runs while the first compiled call traces
    cases = (("tp2", "all_reduce", linear_logprobs_entropy, False, "deferred"),
             ("sp", "reduce_scatter", linear_logprobs_entropy, False, True),
             ("tp2_main_grad", "all_reduce", linear_logprobs_entropy_into_main_grad, True, True))
    for case, d_hidden, op, main_grad, check_labels in cases:
        h = hidden[rank * N // 2:(rank + 1) * N // 2] if d_hidden == "reduce_scatter" else hidden
        f = model(op, VocabParallel(group, d_hidden), check_labels)
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(f, fullgraph=True, backend=counter)
        got = step(compiled, h, weight, proj, labels, temp, main_grad)
        eager = step(f, h, weight, proj, labels, temp, main_grad)
        mismatches += [f"rank {rank} {case} {name}" for name, a in got.items() if not torch.equal(a, eager[name])]
        graphs[case] = dict(frames=counter.frame_count,
                            op_in_graph="areal_lce.lce_forward" in "\n".join(gm.code for gm in counter.graphs))
    check_deferred()  # the labels are good and the same on both ranks: nothing recorded
    results = [None] * 2
    dist.all_gather_object(results, dict(mismatches=mismatches, graphs=graphs))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(mismatches=sum((r["mismatches"] for r in results), []),
                           graphs=[r["graphs"] for r in results]), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
