"""Selected ids taken from the invariant forward's own logit tiles (Triton, CPU interpreter; on a GPU host the
kernels): the pick plan against a plain-Python reference (one pick per row and segment, the lowest slot;
repeated ids share it; a second id in a picked segment is gathered), the picked values bitwise the forward's
(segment_logits recomputes the forward's bits), and at the op level a selected id at a top-k id giving the
top-k logprob bitwise."""
from __future__ import annotations

import pytest
import torch

from areal_lce import linear_logprobs_entropy as lce
from areal_lce.op.backends.triton import select_launch
from areal_lce.op.types import LCEParams
from helpers.kernel_device import kernel_device, needs_kernels

pytestmark = [pytest.mark.slow, needs_kernels]  # the Triton interpreter
DEV = kernel_device() or torch.device("cpu")
IGNORE = -100


@pytest.fixture
def always_pick(monkeypatch):
    """The forward takes selected ids from its tiles whatever K, H and V (select_launch.takes_picks)."""
    monkeypatch.setattr(select_launch, "PICK_KH_PER_ID", 0.0)


def _plan_reference(ids, y, start, valid, G):
    """y: local labels (-1 another shard's, -2 an ignored row)."""
    n, k = ids.shape
    plane = torch.full((G, n), -1, dtype=torch.int64)
    lslot = torch.full((n,), -1, dtype=torch.int64)
    src = torch.full((n, k), -2, dtype=torch.int64)
    for r in range(n):
        lab = int(y[r])
        pick = {}  # segment -> (slot, column)
        for j in range(k):
            c = int(ids[r, j]) - start
            if lab == -2 or int(ids[r, j]) == IGNORE or not 0 <= c < valid:
                continue
            if lab >= 0 and c // 128 == lab // 128:  # the label's segment: only the label itself is taken
                if c == lab and lslot[r] < 0:
                    lslot[r] = j
                src[r, j] = lslot[r] if c == lab else -1
                continue
            if c // 128 not in pick:
                pick[c // 128] = (j, c)
                plane[c // 128, r] = j * 128 + c % 128
            pj, pc = pick[c // 128]
            src[r, j] = pj if pc == c else -1
    return plane, lslot, src


@pytest.mark.parametrize("k", [1, 5, 64, 100])  # 100: slots padded to 128, one row per program
def test_pick_plan_matches_the_reference(k):
    """A shard [256, 856) of the vocabulary (5 segments, the last 88 ids wide): ids of other shards and
    ignore_index entries select nothing here, nor does an ignored row; in the label's segment only the
    label is taken (with the label), ids next to it are computed apart."""
    g = torch.Generator().manual_seed(k)
    n, start, valid = 11, 256, 600
    G = -(-valid // 128)
    ids = start + torch.randint(0, 2 * 128, (n, k), generator=g)  # two segments: many ids share one
    ids[:, k // 2:] = torch.randint(0, 1200, (n, k - k // 2), generator=g)  # other shards too
    ids[0] = start + 3  # one id repeated k times
    ids[1, ::2] = IGNORE
    ids[3, -1] = start + valid - 1  # the shard's last id
    ids[4, 0] = start + valid  # the next shard's first
    y = torch.randint(0, valid, (n,), generator=g, dtype=torch.int32)
    y[0] = 3  # the label is the repeated id
    y[5] = -2  # launch._local_labels' IGNORED: an ignored row
    y[6] = -1  # the label is another shard's
    y[7] = ids[7, -1] - start  # the label selected at the last slot, another id of its segment before it
    ids[7, 0] = ids[7, -1] // 128 * 128 + (ids[7, -1] + 1) % 128
    ids[8, :] = start + y[8]  # every slot selects the label
    params = LCEParams(vocab_size=1200, vocab_start=start, shard_valid=valid)
    plane, lslot, src = select_launch.pick_selected(ids.to(DEV), y.to(DEV), params, G)
    want_plane, want_lslot, want_src = _plan_reference(ids, y, start, valid, G)
    assert torch.equal(plane.cpu().long(), want_plane)
    assert torch.equal(lslot.cpu().long(), want_lslot)
    assert torch.equal(src.cpu(), want_src)
    if k >= 5:  # the cases above occur
        assert (want_src == -1).any() and (want_lslot >= 0).sum() >= 2


def test_route_depends_on_k_h_and_the_vocabulary_only():
    p = LCEParams(vocab_size=151936)
    assert select_launch.takes_picks(64, 4096, p) and select_launch.takes_picks(64, 2048, p)
    assert not select_launch.takes_picks(8, 4096, p) and not select_launch.takes_picks(64, 896, p)
    assert not select_launch.takes_picks(select_launch.PICK_MAX_K + 1, 1 << 20, p)  # the slot must fit the int16


def test_pair_logits_computes_the_listed_pairs():
    g = torch.Generator().manual_seed(2)
    n, h, v, k = 13, 100, 300, 7
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    ids = 50 + torch.randint(0, v, (n, k), generator=g)  # a shard starting at id 50
    need = torch.rand(n, k, generator=g) < 0.3
    out = select_launch.pair_logits(hidden.to(DEV), weight.to(DEV), ids.to(DEV), need.to(DEV), 50).cpu()
    want = (hidden.double()[:, None, :] * weight.double()[ids - 50]).sum(-1)
    assert need.sum() > 20
    torch.testing.assert_close(out[need].double(), want[need], rtol=0, atol=1e-4 * h ** 0.5)
    one = select_launch.pair_logits(hidden[4:5].to(DEV), weight.to(DEV), ids[4:5].to(DEV),
                                     torch.ones(1, k, dtype=torch.bool, device=DEV), 50).cpu()
    assert torch.equal(one[0][need[4]], out[4][need[4]])  # bits: the row and id only


@pytest.mark.parametrize("precision, block_v", [("fp32", 128), ("bf16", 128), ("bf16", 256)])
def test_picked_values_are_the_forwards_bits(precision, block_v, always_pick):
    """ShardStats.sel's picked slots hold bitwise the logits the forward reduced (its segment recompute; with
    bf16 logits the rounded ones), the rest are left to the gather, whose fixed-order dot product rounds
    differently (so the check can tell the two routes apart)."""
    from areal_lce.op.backends.triton.launch import TritonBackend
    g = torch.Generator().manual_seed(1)
    n, h, v, k = 19, 200, 1000, 12  # H = 200: the forward's K steps and the gather's differ
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * 0.2).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g)
    ids = torch.randint(0, v, (n, k), generator=g)
    ids[:, 1] = ids[:, 0]  # a repeat
    ids[:, 2] = ids[:, 0] // 128 * 128 + (ids[:, 0] + 1) % 128  # another id in the same segment
    ids[4, 3:] = IGNORE
    ids[::2, 5] = labels[::2]  # the label selected: taken with the label's own column
    hidden, weight, labels, ids = (t.to(DEV) for t in (hidden, weight, labels, ids))
    params = LCEParams(vocab_size=v, shard_valid=v, invariant=True, backend=TritonBackend(),
                       logits_precision=precision)
    from dataclasses import replace
    from areal_lce.op.backends.triton import configs
    from areal_lce.op.backends.triton.launch import INTERPRET
    # 128: one segment per tile; 256: two, whose taken values are stored together
    fwd = replace(configs.tile("fwd", fp32=False, interpret=INTERPRET, H=h), block_v=block_v)
    with configs.tuning(fwd=fwd):
        st = TritonBackend().forward(hidden, weight, labels, None, params, keep_cache=False, selected=ids)
    raw, src = (t.cpu() for t in st.sel)
    apart = labels.cpu() // 128 != ids.cpu()[:, 0] // 128  # id 0's segment is not the label's
    assert torch.equal(src[:, 1], src[:, 0]) and (src[apart, 0] == 0).all() and (src[apart, 2] == -1).all()
    assert (src[::2, 5] == 5).sum() >= 8  # label slots
    picked = src == torch.arange(k)[None, :]
    rows, slots = picked.nonzero(as_tuple=True)
    c = ids.cpu()[rows, slots]
    r = select_launch.segment_logits(hidden, weight, rows.to(DEV), (c // 128).to(DEV), params).cpu()
    fwd = r[torch.arange(len(c)), c % 128]
    assert torch.equal(raw[rows, slots], fwd)
    gathered = select_launch.gather_logits(hidden, weight, ids.clamp(min=0)).cpu()[rows, slots]
    if precision == "fp32":  # the two routes round differently, so the check above can fail
        assert not torch.equal(gathered, fwd)


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_a_selected_id_at_a_topk_id_gives_its_logprob_bitwise(softcap, always_pick):
    """With one selected id per segment (the top-k's own ids, the later ones in an already chosen segment
    and all but the label in the label's segment ignored) every selected logprob is bitwise the top-k
    logprob of that id: both are the forward's logit."""
    g = torch.Generator().manual_seed(5)
    n, h, v, k = 23, 48, 1100, 6
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = torch.randn(v, h, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[7] = IGNORE
    hidden, weight, labels = (t.to(DEV) for t in (hidden, weight, labels))
    kw = dict(vocab_size=v, backend="triton", temperature=0.8, softcap=softcap)
    top = lce(hidden, weight, labels, top_k=k, **kw)
    ids = top.topk_ids.clone()
    seg = torch.where(ids >= 0, ids // 128, -1)
    dup = (seg[:, :, None] == seg[:, None, :]) & torch.ones(k, k, dtype=torch.bool, device=DEV).tril(-1)
    ids[dup.any(2)] = IGNORE  # a later id in a segment already selected
    ids[(seg == (labels // 128)[:, None]) & (ids != labels[:, None])] = IGNORE  # the label's segment: the label only
    out = lce(hidden, weight, labels, selected_ids=ids, **kw)
    m = ids != IGNORE
    assert m.sum() > n  # most rows keep several ids
    assert torch.equal(out.selected_logprobs[m], top.topk_logprobs[m])
