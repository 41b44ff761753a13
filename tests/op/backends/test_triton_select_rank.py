"""The Triton top-k's segment ranking and its thresholded candidate selection (CPU interpreter) against torch's
int64 top-k of select.sort_key keys: the same segment sets and threshold, ties to the lower segment (flat rows,
ties at the threshold, per-token temperature), and the k best candidates equal to the oracle's top-k."""
from __future__ import annotations

import pytest
import torch
import triton

from areal_lce.op import exact, select
from areal_lce.op.backends.triton import select_launch
from helpers.kernel_device import kernel_device, needs_kernels

pytestmark = [pytest.mark.slow, needs_kernels]  # the interpreter (on a GPU host: the kernels, same assertions)
DEV = kernel_device() or torch.device("cpu")


def _reference(seg_max, it, kk):
    G, n = seg_max.shape
    z = seg_max.t() * (it[:, None] if torch.is_tensor(it) else it)
    keys = select.sort_key(z, torch.arange(G)[None, :].expand(n, G))
    return select.key_id(keys.topk(kk, dim=1).values)


@pytest.mark.parametrize("kk, temp, G", [(3, "scalar", 37), (13, "per_token", 37), (20, "scalar", 37),
                                         (20, "per_token", 4100),  # 4100 segments: many chunks of a row
                                         (5, "unit_bf16", 37), (16, "unit_bf16", 300)])  # bisection over blocks
def test_rank_segments_takes_the_oracles_set(kk, temp, G):
    g = torch.Generator().manual_seed(kk)
    n = 21
    seg = torch.randn(G, n, generator=g).round(decimals=1)  # many ties
    seg[:, 0] = 0.5  # a flat row: segments 0..kk-1
    seg[:, 1] = -0.0  # -0.0 ties +0.0
    seg[5, 1] = 0.0
    seg[[3, 9, 30], 2] = 4.0  # a tie at the threshold for kk = 2 .. 3
    seg[7, 3] = float("inf")
    seg[:, 4] = torch.randn(G, generator=g)  # distinct values: the bisection stops once exactly kk reach it
    seg[:, 5] = torch.linspace(-3.0, 2.0, G)  # ... and a row of evenly spaced ones
    seg[:, 6] = torch.linspace(-1e-3, 1e-3, G)  # both signs about 0
    it = torch.linspace(0.5, 2.0, n) if temp == "per_token" else 1 / 0.7
    if temp == "unit_bf16":  # the values' patterns share their 16 low zero bits (bf16 logits at temperature 1)
        seg, it = seg.to(torch.bfloat16).float(), 1.0
        seg[:3, 7] = torch.tensor([1 + 2.0 ** -23, -1 - 2.0 ** -23, 1.0])  # ... except in row 7: no common zero bit
    got, thr, _ = select_launch.rank_segments(seg.t().to(DEV), it.to(DEV) if torch.is_tensor(it) else it, kk)
    got, thr = got.cpu(), thr.cpu()
    want = _reference(seg, it, kk)
    assert got.shape == (n, kk)
    z = seg.t() * (it[:, None] if torch.is_tensor(it) else it)
    assert torch.equal(thr, z.topk(kk, dim=1).values[:, -1])  # the kk-th largest tempered maximum
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert torch.equal(got[0], torch.arange(kk))


def test_candidate_topk_is_the_oracles_top_k():
    """candidate_topk over every segment of a row (threshold -inf) and over its k best segments with their
    threshold (rank_segments): the k best keys, descending, equal to torch's top-k of all the row's keys
    (ties across segments and at the threshold, a flat row whose every column is a candidate, a row with
    fewer columns than k: padded)."""
    from areal_lce.op.types import LCEParams
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 7, 24, 600, 4  # 5 segments, the last one 88 columns wide
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    weight[140:150] = weight[5]  # ties across segments
    hidden[1] = 0.0  # a flat row: all 600 logits tie, the top-k is ids 0..3
    hidden[2] = weight[300] * 4  # a peaked row
    params = LCEParams(vocab_size=v, shard_valid=v)
    args = [t.to(DEV) for t in (hidden, weight)]
    rows, segs = torch.arange(n).repeat_interleave(5), torch.arange(5).repeat(n)
    r = select_launch.segment_logits(*args, rows.to(DEV), segs.to(DEV), params).cpu().view(n, 5, 128)
    z = r.reshape(n, 640)[:, :v]  # the forward's bits
    want = select.sort_key(z, torch.arange(v)[None, :].expand(n, v)).topk(k, dim=1).values
    every = torch.arange(5)[None, :].expand(n, 5).contiguous().to(DEV)
    none = torch.full((n,), float("-inf"), device=DEV)
    assert torch.equal(select_launch.candidate_topk(*args, 0, every, none, 1.0, params, 0, k).cpu(), want)
    segs, thr, _ = select_launch.rank_segments(r.amax(-1).to(DEV), 1.0, k)
    assert torch.equal(select_launch.candidate_topk(*args, 0, segs, thr, 1.0, params, 0, k).cpu(), want)
    few = select_launch.candidate_topk(*args, 2, every[:3, 4:], none, 1.0, LCEParams(vocab_size=v, shard_valid=516),
                                       0, 8).cpu()  # rows 2..4, segment 4 holds 4 real columns of 516
    assert torch.equal(few[:, :4], select.sort_key(z[2:5, 512:516], torch.arange(512, 516)[None, :].expand(3, 4))
                       .topk(4, dim=1).values)
    assert torch.equal(few[:, 4:], torch.full((3, 4), exact.PAD_KEY))
    assert exact.PAD_KEY == int(select.sort_key(torch.tensor([float("-inf")]), torch.tensor([2 ** 31 - 1])))


def test_forward_maxima_columns_spare_the_recompute(monkeypatch):
    """A top-k forward's seg_top (each segment's max column, lowest on ties, second value, the maxima as
    [N, G]) against the recomputed segments, and topk_keys with it (most segments taken from the forward's
    maxima, those whose second value reaches the threshold recomputed; rows whose list overflows redone
    one program per row) bitwise equal to topk_keys recomputing every chosen segment: spread, clustered
    (one segment holds the top-k), flat and tied rows."""
    from areal_lce.op.backends.triton import segment_launch
    from areal_lce.op.backends.triton.launch import TritonBackend
    from areal_lce.op.types import LCEParams
    monkeypatch.setattr(segment_launch, "TOP_KH_PER_ID", 0.0)  # the forward keeps them at any k, H and V
    g = torch.Generator().manual_seed(3)
    n, h, v, k = 8, 32, 1000, 4  # 8 segments, the last 104 columns wide
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    weight[[10, 140, 520, 900]] = hidden[0] * torch.tensor([0.5, 0.6, 0.7, 0.8])[:, None]  # row 0: spread
    weight[260:266] = hidden[1] * 0.5  # row 1: its top-k all in segment 2
    hidden[2] = 0.0  # flat
    weight[[5, 400, 777]] = hidden[3] * 0.4  # row 3: ties across segments at the top
    weight[998] = hidden[4] * 0.6  # row 4: its max in the last, partial segment
    labels = torch.randint(0, v, (n,), generator=g)
    hidden, weight, labels = hidden.to(DEV), weight.to(DEV), labels.to(DEV)
    params = LCEParams(vocab_size=v, shard_valid=v, invariant=True, top_k=k, backend=TritonBackend())
    st = TritonBackend().forward(hidden, weight, labels, None, params, keep_cache=False)
    G = st.seg.shape[1]
    rows, segs = torch.arange(n).repeat_interleave(G), torch.arange(G).repeat(n)
    r = select_launch.segment_logits(hidden, weight, rows.to(DEV), segs.to(DEV), params).view(n, G, 128).cpu()
    top2 = r.topk(2, dim=-1).values
    assert torch.equal(st.seg[0].cpu().t(), top2[..., 0])
    col = (r == top2[..., :1]).float().argmax(-1)  # the lowest column holding the max
    assert torch.equal(st.seg_top[0].cpu().t().long(), col)
    second = torch.where(torch.arange(128) == col[..., None], float("-inf"), r).amax(-1)
    assert torch.equal(st.seg_top[1].cpu().t(), second)
    with_top = select.topk_keys(hidden, weight, st.seg[0], 1.0, params, k, None, st.seg_top)
    assert torch.equal(with_top, select.topk_keys(hidden, weight, st.seg[0], 1.0, params, k))
    monkeypatch.setattr(select_launch, "TOPK_SPILL", 0)  # every row with a segment to recompute overflows
    assert torch.equal(with_top, select.topk_keys(hidden, weight, st.seg[0], 1.0, params, k, None, st.seg_top))
    segs_k, thr, plan = select_launch.rank_segments(st.seg[0].t(), 1.0, k, st.seg_top[:2], 7, lists=True)
    assert torch.equal(st.seg_top[2], st.seg[0].t())  # the maxima again, rows contiguous
    rows_k = torch.arange(n, device=DEV)[:, None]
    recompute = plan.flags.bool()
    assert torch.equal(recompute, st.seg_top[1][segs_k, rows_k] >= thr[:, None])
    want = select.sort_key(st.seg[0][segs_k, rows_k], segs_k * 128 + st.seg_top[0][segs_k, rows_k].long() + 7)
    want = torch.where(recompute, exact.PAD_KEY, want)  # each chosen segment's max key (ids + shard start 7)
    assert torch.equal(plan.cand[:, :k], want) and torch.all(plan.cand[:, k:] == exact.PAD_KEY)
    listed = torch.zeros(G, n, dtype=torch.bool, device=DEV)  # the per-segment row lists: exactly the flagged pairs
    for g in range(G):
        rows_g = plan.seg_list[g, :int(plan.seg_count[g])].long()
        assert rows_g.unique().numel() == rows_g.numel()
        listed[g, rows_g] = True
    want_listed = torch.zeros(G, n, dtype=torch.bool, device=DEV)
    want_listed[segs_k[recompute], rows_k.expand(n, k)[recompute]] = True
    assert torch.equal(listed, want_listed)
    task_seg, first, n_tasks = select_launch._listed_tasks(plan, 2)  # tasks of 2 rows: segment g owns tasks
    blocks = (plan.seg_count + 1) // 2  # first[g] .. first[g] + blocks[g] - 1
    assert int(n_tasks) == int(blocks.sum())
    for g in range(G):
        assert torch.all(task_seg[int(first[g]):int(first[g] + blocks[g])] == g)
    assert bool(recompute[1].any()) and bool(recompute[2].all()) and not bool(recompute[0].any())


def test_topk_routes_give_the_same_bits(monkeypatch):
    """The two routes of a top-k forward (segment_launch.keeps_top): the forward keeping each segment's max column
    and second value (most chosen segments not recomputed), or not (every chosen segment listed and recomputed):
    bitwise equal top-k ids, logprobs and gradients, over spread, clustered, flat and tied rows, an ignored row,
    a last segment cut short and k above a row's segment count. The rule itself: k, H and V only."""
    from areal_lce import linear_logprobs_entropy
    from areal_lce.op.backends.triton import segment_launch
    from areal_lce.op.types import LCEParams
    g = torch.Generator().manual_seed(5)
    n, h, v = 10, 32, 1000
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    weight[[10, 140, 520, 900]] = hidden[0] * torch.tensor([0.5, 0.6, 0.7, 0.8])[:, None]  # spread
    weight[260:266] = hidden[1] * 0.5  # its top-k in one segment
    hidden[2] = 0.0  # flat
    weight[[5, 400, 777]] = hidden[3] * 0.4  # ties across segments
    weight[998] = hidden[4] * 0.6  # the max in the last, partial segment
    labels = torch.randint(0, v, (n,), generator=g)
    labels[6] = -100
    temperature = torch.linspace(0.5, 1.5, n)  # per token
    params = LCEParams(vocab_size=151936, shard_valid=151936)
    assert not segment_launch.keeps_top(8, 896, params) and segment_launch.keeps_top(64, 4096, params)
    assert not segment_launch.keeps_top(0, 4096, params)
    assert segment_launch.keeps_top(8, 4096, LCEParams(vocab_size=151936, shard_valid=151936 // 8))  # a TP=8 shard
    seen, outs = [], {}
    forward_segments = segment_launch.forward_segments

    def spy(*args, **kw):
        st = forward_segments(*args, **kw)
        seen.append(st.seg_top[0] is not None)
        return st
    monkeypatch.setattr(segment_launch, "forward_segments", spy)
    for route, per_id in (("keep", 0.0), ("recompute", float("inf"))):
        monkeypatch.setattr(segment_launch, "TOP_KH_PER_ID", per_id)
        for k in (3, 9):  # 9 > the 8 segments: every column a candidate
            hh = hidden.clone().to(DEV).requires_grad_()
            ww = weight.clone().to(DEV).requires_grad_()
            o = linear_logprobs_entropy(hh, ww, labels.to(DEV), vocab_size=v, top_k=k, backend="triton",
                                        temperature=temperature.to(DEV))
            (o.logprobs.sum() + (o.topk_logprobs * torch.arange(1.0, k + 1, device=DEV)).sum()).backward()
            outs[route, k] = (o.topk_ids, o.topk_logprobs, hh.grad, ww.grad)
    assert seen == [True, True, False, False]
    for k in (3, 9):
        for a, b in zip(outs["keep", k], outs["recompute", k]):
            assert torch.equal(a, b)
    assert outs["keep", 3][0][1].tolist() == [260, 261, 262]  # the clustered row: 260..265 tie, lowest first


def test_rank_segments_lists_every_chosen_segment_without_the_forwards_columns():
    """rank_segments(lists=True) without the forward's max columns: every chosen (row, segment) pair flagged,
    keyed as the pad key and listed under its segment, once."""
    g = torch.Generator().manual_seed(4)
    G, n, kk = 40, 9, 6
    seg = torch.randn(G, n, generator=g).round(decimals=1)  # ties
    segs, thr, plan = select_launch.rank_segments(seg.t().to(DEV), 1.0, kk, None, 0, lists=True)
    assert torch.all(plan.flags == 1) and torch.all(plan.cand == exact.PAD_KEY)
    listed = torch.zeros(G, n, dtype=torch.bool)
    for s_ in range(G):
        rows_g = plan.seg_list[s_, :int(plan.seg_count[s_])].long().cpu()
        assert rows_g.unique().numel() == rows_g.numel()
        listed[s_, rows_g] = True
    want = torch.zeros(G, n, dtype=torch.bool)
    want[segs.cpu(), torch.arange(n)[:, None].expand(n, kk)] = True
    assert torch.equal(listed, want) and int(plan.seg_count.sum()) == n * kk
    assert torch.equal(segs.cpu().sort(1).values, _reference(seg, 1.0, kk).sort(1).values)
    with pytest.raises(ValueError, match="lists=True"):
        select_launch.rank_segments(seg.t().to(DEV), 1.0, kk, (plan.flags, plan.flags), 0)
