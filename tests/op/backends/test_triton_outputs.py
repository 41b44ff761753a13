"""The Triton backend's one-launch versions of the per-row steps around the selected-id and top-k outputs
(output_launch.py) against select.py's torch code, which they replace on that backend (CPU interpreter; on a
GPU host the kernels): the forward's bitwise, the backward's sparse columns exactly and their coefficients to
the rounding of one row's sum. A shard [256, 856) of a 1000-id vocabulary, odd row counts, ids at the
shard's edges, another shard's ids, ignore_index entries, repeats, ignored rows and ids outside the vocabulary."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from areal_lce.op import exact, select, select_grad
from areal_lce.op.backends.base import head_transform
from areal_lce.op.backends.torch_chunked import TorchChunkedBackend
from areal_lce.op.backends.triton import output_launch, select_launch
from areal_lce.op.backends.triton.launch import TritonBackend
from areal_lce.op.types import LCEParams
from helpers.kernel_device import kernel_device, needs_kernels

pytestmark = [pytest.mark.slow, needs_kernels]  # the Triton interpreter
DEV = kernel_device() or torch.device("cpu")
IGNORE = -100
START, VALID, VOCAB = 256, 600, 1000


def _params(**kw) -> LCEParams:
    base = dict(inv_t=1.0, vocab_size=VOCAB, vocab_start=START, shard_valid=VALID, backend=TritonBackend(), tp_size=1,
                ignore_index=IGNORE, check_labels="deferred")
    return LCEParams(**{**base, **kw})


def _ids(n, k, seed):
    """[n, k] global ids: mostly this shard's (its first and last ids included), some another shard's,
    ignore_index entries, repeats and, with the deferred check, ids outside [0, vocab)."""
    g = torch.Generator().manual_seed(seed)
    ids = START + torch.randint(0, VALID, (n, k), generator=g)
    ids[:, 0] = START
    ids[1::3, -1] = START + VALID - 1
    ids[2::5, k // 2] = START + VALID  # the next shard's first id
    ids[3::4, 0] = 5  # the previous shard's
    ids[::7, -1] = IGNORE
    if k > 2:
        ids[4::6, 1] = ids[4::6, 2]  # a repeat
    ids[5::9, 0] = VOCAB + 3  # outside the vocabulary
    return ids.to(DEV)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randint(0, VOCAB, (n,), generator=g)
    y[::4] = IGNORE
    y[1] = START  # a label at each edge of the shard
    y[2] = START + VALID - 1
    lse = torch.randn(n, generator=g) * 5
    inv_t = torch.rand(n, generator=g) + 0.5
    return y.to(DEV), lse.to(DEV), inv_t.to(DEV)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("n,k", [(37, 5), (9, 64)])
def test_selected_raw_is_the_gather_route_bitwise(n, k, bf16):
    g = torch.Generator().manual_seed(n + k)
    h = (torch.randn(n, 200, generator=g) * 2).to(DEV)
    w = torch.randn(VALID + 8, 200, generator=g).to(DEV)  # 8 padding rows past the shard's valid ones
    p = _params(logits_precision="bf16" if bf16 else "fp32")
    ids = _ids(n, k, n * k)
    loc, own = select.local_columns(ids, p)
    ref = torch.where(own, head_transform(select_launch.gather_logits(h, w, loc), p), 0.0)
    got = output_launch.selected_raw(h, w, ids, p)
    assert torch.equal(got, ref)
    assert (got[~own] == 0).all() and own.any() and (~own).any()


def _selected_reference(r, ids, y, lse, it, p):
    valid = (y != IGNORE)[:, None]
    z = r * (it[:, None] if torch.is_tensor(it) else it)
    out = torch.where(valid & (ids != IGNORE), (z.double() - lse.double()[:, None]).float(), 0.0)
    bad = select.check_selected_ids(ids, p)
    return out.masked_fill(bad, float("nan")) if bad is not None else out


@pytest.mark.parametrize("check", ["deferred", "off"])
@pytest.mark.parametrize("tensor_t", [False, True])
@pytest.mark.parametrize("n,k", [(37, 5), (9, 64), (14, 150)])  # 150: three blocks of slots
def test_selected_logprobs_bitwise(n, k, tensor_t, check):
    y, lse, inv_t = _rows(n, n + k)
    p = _params(check_labels=check, inv_t=None if tensor_t else 0.7)
    ids = _ids(n, k, n * k)
    r = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 30).to(DEV)
    it = inv_t if tensor_t else 0.7
    got = output_launch.selected_logprobs(r, ids, y, lse, it, p)
    ref = _selected_reference(r, ids, y, lse, it, p)
    assert torch.equal(got.isnan(), ref.isnan()) and (got.isnan().any() == (check == "deferred"))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))


@pytest.mark.parametrize("n,k", [(37, 1), (9, 64), (5, 150)])
def test_topk_logprobs_bitwise(n, k):
    """Keys of random values (both signs, -0.0, ±inf) and ids, the pad key (a shard narrower than k)."""
    y, lse, _ = _rows(n, k)
    g = torch.Generator().manual_seed(n * k)
    z = (torch.randn(n, k, generator=g) * 40).to(DEV)
    z[0, 0], z[1, -1], z[2, 0], z[3, -1] = -0.0, float("inf"), float("-inf"), 0.0
    keys = select.sort_key(z, torch.randint(0, 150000, (n, k), generator=g).to(DEV))
    keys[4, -1] = exact.PAD_KEY
    lp, ids = output_launch.topk_logprobs(keys, y, lse, _params())
    valid = (y != IGNORE)[:, None]
    assert torch.equal(lp, torch.where(valid, (select.key_value(keys).double() - lse.double()[:, None]).float(), 0.0))
    assert torch.equal(ids, torch.where(valid, select.key_id(keys), IGNORE))


@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("parts", ["sel", "top", "both"])
@pytest.mark.parametrize("tensor_t", [False, True])
@pytest.mark.parametrize("k1,k2", [(6, 4), (130, 70)])  # 130 and 70: several blocks of slots per row
def test_sparse_columns_match_the_torch_route(parts, tensor_t, lse_grad, k1, k2):
    n = 29
    y, _, inv_t = _rows(n, 7)
    g = torch.Generator().manual_seed(3)
    p = _params(inv_t=None if tensor_t else 0.7)
    it = inv_t if tensor_t else None
    gg = torch.randn(2, n, generator=g).to(DEV)
    g_dstats = torch.randn(1, n, generator=g).to(DEV) if lse_grad else None
    sel = (_ids(n, k1, 1), torch.randn(n, k1, generator=g).to(DEV)) if parts in ("sel", "both") else (None, None)
    top = (_ids(n, k2, 2), torch.randn(n, k2, generator=g).to(DEV)) if parts in ("top", "both") else (None, None)
    fused = select_grad.SparseGrad.of(y, it, p, gg, g_dstats, *sel, *top, torch.float32)
    ref = select_grad.SparseGrad.of(y, it, dataclasses.replace(p, backend=TorchChunkedBackend()), gg, g_dstats, *sel,
                                    *top, torch.float32)
    assert ref._cols is None and fused._cols is not None  # each route taken
    cols, coef = fused.columns(None, None, p)
    ref_cols, ref_coef = ref.columns(None, None, p)
    assert torch.equal(cols, ref_cols)
    assert (cols[y == IGNORE, 1:] >= -1).all() and (coef[y == IGNORE] == 0).all()
    # the label's coefficient and g_lp carry a row's sum of its gradients: summed in another order, so
    # equal to that sum's rounding (K terms: K · 2^-24 of the sum of their magnitudes, 1/T included)
    mags = sum(gc.abs().sum(1) for gc in (sel[1], top[1]) if gc is not None)
    scale = (inv_t if tensor_t else torch.full_like(inv_t, 0.7)).abs() + 1
    tol = (k1 + k2 + 2) * 2.0 ** -24 * (mags + gg[0].abs() + 1) * scale
    assert ((coef[:, 0] - ref_coef[:, 0]).abs() <= tol).all()
    assert ((fused.g[0] - ref.g[0]).abs() <= tol).all()
    assert torch.equal(coef[:, 1:], ref_coef[:, 1:]) and torch.equal(fused.g[1], ref.g[1])
