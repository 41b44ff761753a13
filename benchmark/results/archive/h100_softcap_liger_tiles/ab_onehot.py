"""A/B of one tree (run alternately per tree): forward / fwd+bwd at 4096x896 and 8192x4096, default options and extras."""
import json, sys, torch
from areal_lce import linear_logprobs_entropy as lce
from benchmark.op.bench_invariant import inputs, timed
from benchmark.op.bench_select import _sel
tag = sys.argv[1]
SHAPES = {"small": (4096, 896, 151936), "qwen7b": (8192, 4096, 151936)}
res = {"tag": tag}
for name, (n, h, v) in SHAPES.items():
    hid, w, y = inputs(n, h, v)
    s64 = _sel(y, v, 64)
    reps = 21 if name == "small" else 7
    with torch.no_grad():
        for k, kw in (("fwd", {}), ("fwd_cap", {"softcap": 30.0}), ("fwd_sel8", {"selected_ids": s64[:, :8].contiguous()}),
                      ("fwd_sel64", {"selected_ids": s64}), ("fwd_top8", {"top_k": 8}), ("fwd_top64", {"top_k": 64})):
            res[f"{name}_{k}"] = timed(lambda: lce(hid, w, y, vocab_size=v, **kw), reps)
    hg, wg = hid.detach().requires_grad_(), w.detach().requires_grad_()
    for k, kw in (("fb", {}), ("fb_cap", {"softcap": 30.0})):
        def fb():
            out = lce(hg, wg, y, vocab_size=v, **kw)
            out.logprobs.sum().backward()
            hg.grad = wg.grad = None
        res[f"{name}_{k}"] = timed(fb, 7 if name == "small" else 3)
    with torch.no_grad():
        o = lce(hid, w, y, vocab_size=v, top_k=8, selected_ids=s64)
        res[f"{name}_digest"] = [float(o.logprobs.double().sum()), float(o.entropy.double().sum()),
                                 float(o.selected_logprobs.double().sum()), int(o.topk_ids.sum())]
    del hid, w, y, hg, wg
    torch.cuda.empty_cache()
print(json.dumps(res), flush=True)
