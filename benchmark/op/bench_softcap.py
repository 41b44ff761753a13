"""softcap on a GPU: its values against the fp64 oracle and its cost, with Liger's fused linear CE (the peer
that has soft-capping) in the same run.

    PYTHONPATH=<liger_kernel>:. python -m benchmark.op.bench_softcap --out DIR [--shapes ...] [--rounds 3]

Cost: forward+backward of the default call (loss = Σ logprobs) with softcap=30 against the same call
without it, paired rounds (median of each round's median); Liger's LigerFusedLinearCrossEntropyLoss
(reduction="sum") with and without softcap in the same rounds, and both in ms; stream_*: the same with each round's
three calls issued back to back between one pair of events (the GPU's time, as inside a training step). Target:
<= 1.05.
Accuracy: 256 rows of a 1024x896x151936 bf16 call, logprob and entropy against the fp64 log_softmax of the
capped logits; Liger's loss per row (reduction="none") likewise.
"""
from __future__ import annotations

import statistics

import torch

from areal_lce import linear_logprobs_entropy

from .bench_invariant import SHAPES, inputs, stream_timed, timed
from ..harness import checks_then_costs, log, paired_ratios

CAP = 30.0


def _liger(softcap, reduction="sum"):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100, softcap=softcap, reduction=reduction)


def checks(v=151936, h=896, n=1024):
    hid, w, y = inputs(n, h, v)
    w = w * 20  # logits well past the cap's knee
    out = linear_logprobs_entropy(hid, w, y, vocab_size=v, softcap=CAP)
    rows = torch.arange(256, device="cuda")
    r = hid[rows].double() @ w.double().t()
    logp = torch.log_softmax(torch.tanh(r / CAP) * CAP, -1)
    valid = y[rows] != -100
    want = logp.gather(1, y[rows].clamp_min(0)[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    res = {"logprob_max_abs": float((out.logprobs[rows].double() - want)[valid].abs().max()),
           "entropy_max_abs": float((out.entropy[rows].double() - ent)[valid].abs().max()),
           "max_abs_raw_logit": float(r.abs().max())}
    lg = _liger(CAP, "none")
    if lg is not None:
        nll = lg(w, hid, y)
        res["liger_nll_max_abs"] = float((nll[rows].double() + want)[valid].abs().max())
    return res


def cost(name, n, h, v, rounds):
    hid, w, y = inputs(n, h, v)
    hid.requires_grad_()
    w.requires_grad_()

    def ours(cap):
        def f():
            linear_logprobs_entropy(hid, w, y, vocab_size=v, softcap=cap).logprobs.sum().backward()
            hid.grad = w.grad = None
        return f

    def liger(cap):
        lg = _liger(cap)

        def f():
            lg(w, hid, y).backward()
            hid.grad = w.grad = None
        return f if lg is not None else None

    fns = {"ours": ours(None), "ours_cap": ours(CAP), "liger": liger(None), "liger_cap": liger(CAP)}
    fns = {k: f for k, f in fns.items() if f is not None}
    times = {k: [] for k in fns}
    streams = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(timed(f, 3))
            streams[k].append(stream_timed(f, 3))
    out = {f"{k}_ms": statistics.median(t) for k, t in times.items()}
    out.update({f"stream_{k}_ms": statistics.median(t) for k, t in streams.items()})
    for k in ("ours", "liger"):
        if f"{k}_cap" in times:
            out[f"{k}_softcap_ratio"], out[f"{k}_softcap_ratio_spread"] = paired_ratios(times[f"{k}_cap"], times[k])
            out[f"stream_{k}_softcap_ratio"], out[f"stream_{k}_softcap_ratio_spread"] = paired_ratios(
                streams[f"{k}_cap"], streams[k])
    log(f"{name}: {out}")
    return out


def main():
    checks_then_costs("bench_softcap", SHAPES, checks, cost)


if __name__ == "__main__":
    main()
