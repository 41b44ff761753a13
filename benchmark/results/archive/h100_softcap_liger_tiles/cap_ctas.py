"""num_ctas=2 (thread-block clusters) on the forward tile at 4096x896: bits and time vs the default (softcap / base / top-8)."""
import os, sys, torch
from areal_lce import linear_logprobs_entropy
from areal_lce.backends.triton import configs, launch, segment_launch
from areal_lce.backends.triton.configs import TileConfig as T
from benchmark.op.bench_invariant import SHAPES, inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cap_tiles import bit_checks, time_forward  # noqa: E402

CTAS = {"n": 1}
orig = launch._launch_opts


def opts(cfg):
    o = orig(cfg)
    if CTAS["n"] > 1:
        o["num_ctas"] = CTAS["n"]
    return o


launch._launch_opts = opts
segment_launch._launch_opts = opts
V = {"d": (None, 1), "d_c2": (None, 2), "128x128w4_c2": (T(128, 128, 64, 16, 4, 3), 2),
     "128x128w4s4_c2": (T(128, 128, 64, 16, 4, 4), 2), "128x128w8_c2": (T(128, 128, 64, 16, 8, 3), 2),
     "256x128w8_c2": (T(256, 128, 64, 16, 8, 3), 2)}
n, h, v = SHAPES["small"]
hid, w, y = inputs(n, h, v)


def fwd(kw, key):
    cfg, c = V[key]
    CTAS["n"] = c
    try:
        with configs.tuning(fwd=cfg), torch.no_grad():
            return linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
    finally:
        CTAS["n"] = 1


ok = bit_checks(fwd, list(V)[1:])
variants = [("base", {}, "d"), ("cap_d", {"softcap": 30.0}, "d"), ("top8_d", {"top_k": 8}, "d")]
for key in ok:
    variants += [(f"base_{key}", {}, key), (f"cap_{key}", {"softcap": 30.0}, key), (f"top8_{key}", {"top_k": 8}, key)]
time_forward(fwd, variants, 5)
