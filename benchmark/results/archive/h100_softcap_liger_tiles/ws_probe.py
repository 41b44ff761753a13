"""Triton's automatic warp specialisation (tl.range(warp_specialize=True)) on the forward's tile loop, sm_90."""
import json, os, statistics, sys, torch
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import SHAPES, inputs, timed
tag = os.environ.get("AREAL_WS", "0")
res = {"ws": tag}
for name in sys.argv[1].split(","):
    n, h, v = SHAPES[name]
    hid, w, y = inputs(n, h, v)
    with torch.no_grad():
        for key, kw in (("base", {}), ("cap", {"softcap": 30.0}), ("top8", {"top_k": 8})):
            try:
                o = linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
                res[f"{name}_{key}_digest"] = [float(o.logprobs.double().sum()), float(o.entropy.double().sum())] + \
                    ([int(o.topk_ids.sum()), float(o.topk_logprobs.double().sum())] if key == "top8" else [])
                res[f"{name}_{key}_ms"] = statistics.median(
                    [timed(lambda: linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw), 15) for _ in range(3)])
            except Exception as e:
                res[f"{name}_{key}_error"] = f"{type(e).__name__}: {str(e)[-300:]}"
print(json.dumps(res), flush=True)
