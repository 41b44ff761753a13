"""selected_ids, top_k, softcap and the differentiable lse / sum_logit of the fused op, against the float64
materialised oracle: values, top-k ids (ties to the lower id), and the gradients to hidden and weight of one
loss mixing logprobs, entropy, selected and top-k logprobs, lse and the logit sum. Tolerances are fp32
rounding bounds of the same computation (tests/helpers/bounds.py), evaluated on the test's own tensors."""
from __future__ import annotations

import pytest
import torch

import areal_lce
from areal_lce import linear_logprobs_entropy as lce

from helpers.bounds import U32, gamma, op_bounds
from helpers.kernel_device import needs_interpreter, on_kernel_device

IGNORE = -100
H, V, V_PAD = 40, 300, 384  # the vocabulary Megatron would pad to 384; rows past 300 are garbage
# the triton rows compare CPU tensors with the CPU oracle: the interpreter's case (on a GPU: benchmark.op.gpu_check)
INTERPRETED = [pytest.mark.slow, needs_interpreter]
BACKENDS = ["torch", "reference", pytest.param("triton", marks=INTERPRETED)]


def _inputs(n=37, k_sel=6, dtype=torch.float32, seed=0, flat=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(V_PAD, H, generator=g) * (0.02 if flat else 0.4)
    weight[[5, 128, 299]] = hidden[:3] * 0.7  # peaked rows at segment edges and the last real id
    labels = torch.randint(0, V, (n,), generator=g)
    labels[:4] = torch.tensor([0, 127, 128, V - 1])
    labels[[6, 13, 20]] = IGNORE
    sel = torch.randint(0, V, (n, k_sel), generator=g)
    sel[:, 0] = labels.clamp_min(0)  # the label itself
    sel[1, 1:4] = torch.tensor([127, 128, 128])  # shard / segment edges, a repeat
    sel[2, 2] = IGNORE
    return hidden.to(dtype), weight.to(dtype), labels, sel


def _oracle(hidden, weight, inv_t, softcap=None):
    h, w = hidden.double(), weight[:V].double()
    r = h @ w.t()
    if softcap:
        r = torch.tanh(r / softcap) * softcap
    t = inv_t.double()[:, None] if torch.is_tensor(inv_t) else inv_t
    z = r * t
    return r, z, torch.log_softmax(z, -1)


def _logit_bound(hidden, weight, inv_t):
    """|δz| per (row, id) of one fp32 evaluation: the GEMM's γ_(H+1) (softcap's tanh is 1-Lipschitz)."""
    t = inv_t.double()[:, None] if torch.is_tensor(inv_t) else inv_t
    return gamma(H + 1) * t * (hidden.double().abs() @ weight[:V].double().abs().t())


def _inv_t(kind, n):
    if kind == "scalar":
        return 1 / 0.7, 0.7
    temp = torch.linspace(0.5, 1.5, n)
    return 1 / temp, temp


def _route(backend, monkeypatch):
    """"triton": selected ids gathered after the forward; "triton:picks": taken from the forward's tiles where
    it can (select_launch.takes_picks), the rest by pair_logits."""
    if backend.startswith("triton"):
        from areal_lce.op.backends.triton import select_launch
        monkeypatch.setattr(select_launch, "PICK_KH_PER_ID", 0.0 if backend == "triton:picks" else float("inf"))
    return backend.split(":")[0]


@pytest.mark.parametrize("backend", BACKENDS + [pytest.param("triton:picks", marks=INTERPRETED)])
@pytest.mark.parametrize("temp_kind", ["scalar", "per_token"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_values_and_gradients_match_the_float64_oracle(backend, temp_kind, softcap, monkeypatch):
    backend = _route(backend, monkeypatch)
    if softcap and not areal_lce.op.backends.get_backend(backend).supports_softcap:
        with pytest.raises(ValueError, match="softcap is not implemented"):
            lce(*_inputs()[:3], vocab_size=V, backend=backend, softcap=softcap)
        return
    hidden, weight, labels, sel = _inputs()
    n = hidden.shape[0]
    inv_t, temperature = _inv_t(temp_kind, n)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    k = 7
    out = lce(h, w, labels, temperature=temperature, vocab_size=V, backend=backend, selected_ids=sel, top_k=k,
              softcap=softcap, return_stats=True, return_logit_sums=True)
    r, z, logp = _oracle(hidden, weight, inv_t, softcap)
    valid = labels != IGNORE
    # bounds: each logprob is a logit minus lse; the label's bound from op_bounds gives |δlse| (+ its own |δz|)
    bz = _logit_bound(hidden, weight, inv_t)
    ob = op_bounds(hidden, weight[:V], labels, inv_t if torch.is_tensor(inv_t) else inv_t, vocab_size=V)
    lab = labels.clamp_min(0)
    dlse = torch.where(valid, ob.logprobs - bz.gather(1, lab[:, None]).squeeze(1), 0.0)[:, None]

    def bound_at(ids):
        ids = ids.clamp(0, V - 1)
        return bz.gather(1, ids) + dlse + 2 * U32 * logp.gather(1, ids).abs() + 1e-30

    # selected
    sv = (sel != IGNORE) & valid[:, None]
    want = torch.where(sv, logp.gather(1, sel.clamp(0, V - 1)), 0.0)
    err = (out.selected_logprobs.double() - want).abs()
    assert out.selected_logprobs.shape == sel.shape and out.selected_logprobs.dtype == torch.float32
    assert (err <= torch.where(sv, bound_at(sel), 0.0)).all(), float(err.max())
    assert torch.all(out.selected_logprobs[~sv] == 0)
    # the label column of `sel` is the row's logprob, to rounding
    assert ((out.selected_logprobs[:, 0] - out.logprobs).abs().double()
            <= 2 * bound_at(lab[:, None]).squeeze(1)).all()
    # top-k: descending, ties to the lower id, every id outside the k no larger than the k-th (to rounding)
    ids, tlp = out.topk_ids, out.topk_logprobs
    assert ids.dtype == torch.int64 and ids.shape == (n, k)
    assert torch.all(ids[~valid] == IGNORE) and torch.all(tlp[~valid] == 0)
    iv, tv = ids[valid], tlp[valid]
    assert torch.all((iv >= 0) & (iv < V))
    assert torch.all(tv[:, :-1] >= tv[:, 1:])
    same = tv[:, :-1] == tv[:, 1:]
    assert torch.all(iv[:, :-1][same] < iv[:, 1:][same])
    lv, bv = logp[valid], bound_at(ids.clamp_min(0))[valid]
    assert ((tv.double() - lv.gather(1, iv)).abs() <= bv).all()
    outside = torch.ones_like(lv, dtype=torch.bool).scatter_(1, iv, False)
    kth = lv.gather(1, iv[:, -1:])
    slack = bv[:, -1:] + bound_at(torch.arange(V).expand(n, V))[valid]
    assert torch.all(~outside | (lv <= kth + slack)), "a larger logit was left out of the top-k"
    # softcap: the stats are of the capped logits
    if softcap:
        assert torch.all(out.max_logit[valid].abs() <= softcap)

    # gradients of one loss mixing everything differentiable, against autograd through the oracle
    g = torch.Generator().manual_seed(5)
    c_lp, c_ent, c_lse = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g)
    c_sel, c_top = torch.randn(sel.shape, generator=g), torch.randn(n, k, generator=g)
    c_sum = torch.randn(n, generator=g) * 0.01
    loss = ((out.logprobs * c_lp).sum() + (out.entropy * c_ent).sum() + (out.lse * c_lse).sum()
            + (out.selected_logprobs * c_sel).sum() + (out.topk_logprobs * c_top).sum())
    if softcap is None:
        loss = loss + (out.sum_logit * c_sum).sum()
    loss.backward()
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    r6, z6, lp6 = _oracle(h64, w64, inv_t, softcap)
    lse6 = torch.logsumexp(z6, -1)
    ent6 = -(lp6.exp() * lp6).sum(-1)
    vm = valid.double()
    loss6 = ((lp6.gather(1, lab[:, None]).squeeze(1) * c_lp * vm).sum() + (ent6 * c_ent * vm).sum()
             + (lse6 * c_lse * vm).sum() + (torch.where(sv, lp6.gather(1, sel.clamp(0, V - 1)), 0.0) * c_sel).sum()
             + (torch.where(valid[:, None], lp6.gather(1, ids.clamp_min(0)), 0.0) * c_top).sum())
    if softcap is None:
        loss6 = loss6 + (r6.sum(-1) * c_sum * vm).sum()
    loss6.backward()
    # bound: the backend's dense pass runs with g_lp' = g_lp - g_lse + Σ g_sel + Σ g_top (op_bounds), the
    # sparse columns add c·W_j / c·h_n with fp32 products and sums (γ_(J+2) on Σ |c| |W|, |c| |h|)
    eff = torch.where(valid, c_lp - c_lse + (c_sel * sv).sum(1) + c_top.sum(1), 0.0)
    dense = op_bounds(hidden, weight[:V], labels, inv_t, g_lp=eff.abs() + c_lp.abs(), g_ent=c_ent, vocab_size=V)
    t = inv_t.double() if torch.is_tensor(inv_t) else torch.full((n,), inv_t, dtype=torch.float64)
    coef = (c_lse.abs() + (c_sel * sv).abs().sum(1) + c_top.abs().sum(1)).double() * 2 * t * vm
    J = sel.shape[1] + k + 1
    wmax = weight[:V].double().abs().max(0).values
    dh_b = dense.d_hidden + gamma(J + 4) * coef[:, None] * wmax[None, :] + 1e-6 * c_sum.abs().double()[:, None]
    dw_b = torch.cat([dense.d_weight, torch.zeros(V_PAD - V, H, dtype=torch.float64)]) \
        + gamma(n * J + 4) * (coef[:, None] * hidden.double().abs()).sum(0)[None, :] \
        + gamma(n + 2) * (c_sum.abs().double()[:, None] * hidden.double().abs()).sum(0)[None, :]
    assert ((h.grad.double() - h64.grad).abs() <= dh_b).all(), float((h.grad.double() - h64.grad).abs().max())
    gw = torch.cat([w64.grad[:V], torch.zeros(V_PAD - V, H, dtype=torch.float64)])
    assert ((w.grad.double() - gw).abs() <= dw_b).all(), float((w.grad.double() - gw).abs().max())
    assert torch.all(w.grad[V:] == 0)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_topk_ties_go_to_the_lower_id_and_flat_rows(backend):
    hidden, weight, labels, _ = _inputs(flat=True)
    weight[200] = weight[3]  # exact ties: ids 3 and 200, 130 and 131 give bitwise equal logits
    weight[131] = weight[130]
    weight[3] *= 0  # a zero row: a tie with id 200 too, at 0
    weight[200] *= 0
    hidden[5] = 0  # a flat row: every logit 0, the top-k are ids 0..k-1
    out = lce(hidden, weight, labels, vocab_size=V, backend=backend, top_k=9)
    assert torch.equal(out.topk_ids[5], torch.arange(9))
    for row in range(hidden.shape[0]):
        ids = out.topk_ids[row].tolist()
        if labels[row] == IGNORE:
            continue
        for a, b in ((3, 200), (130, 131)):
            if b in ids:
                assert a in ids and ids.index(a) < ids.index(b), (row, ids)


def test_selected_and_topk_are_batch_invariant():
    """A row's selected / top-k outputs are bitwise the same alone, in a batch and permuted (invariant mode)."""
    hidden, weight, labels, sel = _inputs(n=45, dtype=torch.bfloat16)
    full = lce(hidden, weight, labels, vocab_size=V, selected_ids=sel, top_k=6, backend="torch")
    perm = torch.randperm(45, generator=torch.Generator().manual_seed(2))
    p = lce(hidden[perm], weight, labels[perm], vocab_size=V, selected_ids=sel[perm], top_k=6, backend="torch")
    one = lce(hidden[9:10], weight, labels[9:10], vocab_size=V, selected_ids=sel[9:10], top_k=6, backend="torch")
    for f in ("selected_logprobs", "topk_ids", "topk_logprobs", "logprobs"):
        assert torch.equal(getattr(p, f), getattr(full, f)[perm]), f
        assert torch.equal(getattr(one, f)[0], getattr(full, f)[9]), f


def test_z_loss_and_label_smoothing_are_one_line():
    """lse² and the mean tempered logprob (sum_logit / (T·V) - lse) through autograd, against the oracle."""
    hidden, weight, labels, _ = _inputs()
    h = hidden.clone().requires_grad_()
    out = lce(h, weight, labels, vocab_size=V, temperature=0.7, return_stats=True, return_logit_sums=True,
              backend="torch")
    valid = labels != IGNORE
    loss = (out.lse[valid] ** 2).sum() - (out.sum_logit / (0.7 * V) - out.lse)[valid].sum()
    loss.backward()
    h64 = hidden.double().requires_grad_()
    r = h64 @ weight[:V].double().t()
    lse = torch.logsumexp(r / 0.7, -1)
    ((lse[valid] ** 2).sum() - (r.sum(-1) / (0.7 * V) - lse)[valid].sum()).backward()
    b = op_bounds(hidden, weight[:V], labels, 1 / 0.7, g_lp=2 * lse.abs().float() + 1, vocab_size=V).d_hidden
    assert ((h.grad.double() - h64.grad).abs() <= b + 1e-5).all(), float((h.grad.double() - h64.grad).abs().max())


@pytest.mark.parametrize("kw, match", [
    (dict(selected_ids=torch.zeros(37, 3)), "integer tensor"),
    (dict(selected_ids=torch.zeros(36, 3, dtype=torch.int64)), "shaped like labels"),
    (dict(selected_ids=torch.full((37, 2), V, dtype=torch.int64)), "outside"),
    (dict(top_k=V + 1), "exceeds vocab_size"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=0.5), "top_k"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
])
def test_bad_options_raise_naming_them(kw, match):
    hidden, weight, labels, _ = _inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        lce(hidden, weight, labels, vocab_size=V, backend="torch", **kw)


def test_deferred_check_marks_bad_selected_ids_nan():
    hidden, weight, labels, sel = _inputs()
    sel[4, 1] = V + 3
    out = lce(hidden, weight, labels, vocab_size=V, backend="torch", selected_ids=sel, check_labels="deferred")
    assert torch.isnan(out.selected_logprobs[4, 1]) and not torch.isnan(out.selected_logprobs[4, 0])
    areal_lce.op.checks._reset(areal_lce.op.checks._record_of(hidden.device))


@pytest.mark.slow  # the Triton interpreter (on a GPU: the kernels)
def test_softcapped_outputs_are_batch_invariant_on_triton():
    """Soft-capped outputs on the Triton kernels: a row's results are bitwise the same alone as in a batch
    (the cap is elementwise, inside the invariant segment kernels); selected / top-k included."""
    hidden, weight, labels, sel = on_kernel_device(*_inputs(n=45, dtype=torch.bfloat16))
    kw = dict(vocab_size=V, top_k=6, backend="triton", softcap=3.0, return_stats=True)
    full = lce(hidden, weight, labels, selected_ids=sel, **kw)
    fields = ("logprobs", "entropy", "lse", "max_logit", "min_logit", "selected_logprobs", "topk_ids",
              "topk_logprobs")
    for row in (9, 44):  # a row inside the first block, the last row of the batch
        one = lce(hidden[row:row + 1], weight, labels[row:row + 1], selected_ids=sel[row:row + 1], **kw)
        for f in fields:
            assert torch.equal(getattr(one, f)[0], getattr(full, f)[row]), (row, f)
    assert full.max_logit.abs().max() <= 3.0  # capped


@pytest.mark.slow
@pytest.mark.parametrize("route", ["triton", "triton:picks"])
def test_triton_topk_with_compacted_rows_is_the_same(route, monkeypatch):
    """Triton, invariant mode: with compact_ignored the forward sees the rows partitioned (ignored rows last)
    and the top-k reads its per-row planes back in caller order: ids, logprobs and selected logprobs bitwise
    as without (more segments than k, so the ranking and the forward's maxima matter; selected ids gathered,
    or picked from the forward's tiles in partition order)."""
    g = torch.Generator().manual_seed(4)
    n, h, v = 41, 16, 1100
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = torch.randn(v, h, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[0, 6, 13, 20]] = IGNORE
    sel = torch.randint(0, v, (n, 5), generator=g)
    sel[1, 1:] = sel[1, 0] // 128 * 128 + torch.arange(4)  # ids sharing a segment (one picked, the rest listed)
    sel[2, 3] = sel[2, 0]  # a repeat
    hidden, weight, labels, sel = on_kernel_device(hidden, weight, labels, sel)  # the interpreter, or the kernels
    dev = hidden.device
    kw = dict(vocab_size=v, selected_ids=sel, top_k=4, backend=_route(route, monkeypatch),
              temperature=torch.linspace(0.6, 1.4, n, device=dev))
    a = lce(hidden, weight, labels, compact_ignored=True, **kw)
    b = lce(hidden, weight, labels, compact_ignored=False, **kw)
    for f in ("topk_ids", "topk_logprobs", "selected_logprobs", "logprobs"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
