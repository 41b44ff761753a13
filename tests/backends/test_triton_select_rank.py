"""The Triton top-k's segment ranking and candidate truncation (CPU interpreter) against torch's int64 top-k
of select.sort_key keys: the same segment sets, ties to the lower segment (flat rows, ties at the threshold,
per-token temperature), and the truncated candidates holding the row's top-k."""
from __future__ import annotations

import pytest
import torch
import triton

from areal_lce import select
from areal_lce.backends.triton import select_launch

pytestmark = pytest.mark.slow  # the Triton interpreter (on a GPU host: the kernels, same assertions)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(seg_max, it, kk):
    G, n = seg_max.shape
    z = seg_max.t() * (it[:, None] if torch.is_tensor(it) else it)
    keys = select.sort_key(z, torch.arange(G)[None, :].expand(n, G))
    return select.key_id(keys.topk(kk, dim=1).values)


@pytest.mark.parametrize("kk, temp", [(3, "scalar"), (13, "per_token"), (20, "scalar")])  # 20: torch's top-k
def test_rank_segments_takes_the_oracles_set(kk, temp):
    g = torch.Generator().manual_seed(kk)
    G, n = 37, 21
    seg = torch.randn(G, n, generator=g).round(decimals=1)  # many ties
    seg[:, 0] = 0.5  # a flat row: segments 0..kk-1
    seg[:, 1] = -0.0  # -0.0 ties +0.0
    seg[5, 1] = 0.0
    seg[[3, 9, 30], 2] = 4.0  # a tie at the threshold for kk = 2 .. 3
    seg[7, 3] = float("inf")
    it = torch.linspace(0.5, 2.0, n) if temp == "per_token" else 1 / 0.7
    got = select_launch.rank_segments(seg.to(DEV), it.to(DEV) if torch.is_tensor(it) else it, kk).cpu()
    want = _reference(seg, it, kk)
    assert got.shape == (n, kk)
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert torch.equal(got[0], torch.arange(kk))


def test_candidate_width_keeps_the_top_k(k=5):
    """candidate_keys' kept keys per segment (candidate_width(k) of 128) hold the row's top-k keys."""
    g = torch.Generator().manual_seed(k)
    n, h, v = 9, 24, 700
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    weight[300:305] = weight[260]  # ties inside the segment
    from areal_lce.types import LCEParams
    params = LCEParams(vocab_size=v, shard_valid=v)
    segs = torch.tensor([[2]] * n)  # one segment: the interpreter's bitonic top-k is slow
    hidden, weight, segs = hidden.to(DEV), weight.to(DEV), segs.to(DEV)
    w = triton.next_power_of_2(k)  # what candidate_width(k) keeps on a GPU for k <= KEEP_MAX
    keys = select_launch.candidate_keys(hidden, weight, 0, segs, 1.0, params, 0, k, keep=w)
    assert keys.shape == (n, w)
    assert select_launch.candidate_width(k) == (w if k <= select_launch.KEEP_MAX and DEV == "cuda" else 128)
    full = select_launch.candidate_keys(hidden, weight, 0, segs, 1.0, params, 0, k, keep=128)
    assert full.shape == (n, 128)
    assert torch.equal(keys, full.topk(w, dim=1).values)  # the segment's w best, descending
