"""The op's context-parallel contract (function.py's docstring), on 2 simulated CP ranks.

Each simulated rank runs the op on its CP-local tokens only, as a CP rank does: BSHD tokens split by
megatron-core's own `get_batch_on_this_cp_rank` (per-row zigzag: chunks r and 2·cp−1−r of 2·cp), THD
packed sequences split per sequence with the same zigzag. Then, against one run on the full sequence:
  * the CP-local outputs equal the full-sequence outputs at those tokens;
  * each rank's d_hidden equals the full-sequence d_hidden at its tokens (d_hidden stays local);
  * the SUM over CP ranks of the per-rank d_weight equals the full-sequence d_weight — the reduction
    megatron's DDP does over the data-parallel × context-parallel group. Any single rank's d_weight is
    far from it (partial), so the test would see a missing or an extra reduction.
"""
import pytest
import torch
import torch.distributed as dist

import areal_lce

from helpers.bounds import assert_within, op_bounds
from helpers.inputs import available_backends

CP = 2
IGNORE = -100
BACKENDS = [b for b in available_backends() if b != "triton_ascend"]  # same epilogue math as triton, slower


class FakeCPGroup:
    """Stands for one rank of a 2-rank CP group, for megatron's split (which asks torch.distributed)."""

    def __init__(self, rank: int):
        self.rank = rank


def megatron_cp_split(batch: dict, rank: int, monkeypatch) -> dict:
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = FakeCPGroup(rank)
    with monkeypatch.context() as m:
        m.setattr(dist, "get_world_size", lambda g=None: CP if g is group else pytest.fail("wrong group"))
        m.setattr(dist, "get_rank", lambda g=None: group.rank if g is group else pytest.fail("wrong group"))
        return get_batch_on_this_cp_rank(dict(batch, cu_seqlens=None), is_hybrid_cp=False, cp_group=group)


def thd_cp_index(cu_seqlens: list, rank: int) -> torch.Tensor:
    """Token indices of CP rank `rank` in a packed row: per sequence (length a multiple of 2·cp), chunks
    rank and 2·cp−1−rank of its 2·cp equal chunks, sequences in order."""
    idx = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        c = (b - a) // (2 * CP)
        for k in (rank, 2 * CP - 1 - rank):
            idx.append(torch.arange(a + k * c, a + (k + 1) * c))
    return torch.cat(idx)


def _inputs(lead, h=24, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.4
    labels = torch.randint(0, v - 5, lead, generator=g)  # vocab_size = v - 5: padding rows exist
    labels[(torch.rand(lead, generator=g) < 0.2)] = IGNORE
    labels.reshape(-1)[-1] = v - 6  # a label at the true vocabulary's last id
    temp = torch.rand(lead, generator=g) + 0.5  # per-token temperature travels with its token
    g_lp, g_ent = torch.randn(lead, generator=g), torch.randn(lead, generator=g)
    return hidden, weight, labels, temp, g_lp, g_ent


def _run(hidden, weight, labels, temp, g_lp, g_ent, backend):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = areal_lce.linear_logprobs_entropy(h, w, labels, temperature=temp, vocab_size=weight.shape[0] - 5,
                                            backend=backend, return_stats=True, return_logit_sums=True)
    (out.logprobs * g_lp + out.entropy * g_ent).sum().backward()
    return out, h.grad, w.grad


def _check(full, locals_, take, backend, inputs):
    out, dh, dw = full
    dw_sum = torch.zeros_like(dw)
    for r, (o, dh_r, dw_r) in enumerate(locals_):
        for name, a, b in zip(o._fields, o, out):
            if a is None:  # not asked (selected / top-k outputs)
                assert b is None, name
                continue
            torch.testing.assert_close(a, take(b, r), rtol=1e-5, atol=1e-5, msg=lambda m: f"{backend} {name}: {m}")
        # fp32 rounding: the triton path's d_hidden is within ~1e-5 of fp64 at |d_hidden| ~ 5 in either run
        torch.testing.assert_close(dh_r, take(dh, r), rtol=1e-5, atol=1e-5)
        dw_sum += dw_r
        assert (dw_r - dw).abs().max() > 1e-2 * dw.abs().max(), "one CP rank's d_weight must be partial"
    # the ranks' partial sums over their rows are another order of the same fp32 sum: 2 x its rounding bound
    hidden, weight, labels, temp, g_lp, g_ent = inputs
    b = op_bounds(hidden, weight, labels, 1 / temp, g_lp, g_ent, vocab_size=weight.shape[0] - 5)
    assert_within(f"{backend} d_weight summed over the CP ranks", dw_sum, dw, 2 * b.d_weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bshd_cp2_split_by_megatron(backend, monkeypatch):
    lead = (2, 16)  # [b, s]: s divisible by 2·cp
    hidden, weight, labels, temp, g_lp, g_ent = _inputs(lead)
    full = _run(hidden, weight, labels, temp, g_lp, g_ent, backend)
    batch = dict(hidden=hidden, labels=labels, temp=temp, g_lp=g_lp, g_ent=g_ent)
    locals_ = []
    for r in range(CP):
        loc = megatron_cp_split(batch, r, monkeypatch)
        assert loc["hidden"].shape == (2, 16 // CP, hidden.shape[-1])
        locals_.append(_run(loc["hidden"], weight, loc["labels"], loc["temp"], loc["g_lp"], loc["g_ent"], backend))
    take = (lambda t, r: megatron_cp_split({"x": t}, r, monkeypatch)["x"])
    pos = torch.arange(16).expand(2, 16)  # megatron's split is the zigzag: rank 0 keeps chunks 0 and 3 of 4
    assert take(pos, 0)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and take(pos, 1)[1].tolist() == list(range(4, 12))
    _check(full, locals_, take, backend, (hidden, weight, labels, temp, g_lp, g_ent))


@pytest.mark.parametrize("backend", BACKENDS)
def test_thd_cp2_per_sequence_zigzag(backend):
    cu = [0, 8, 20, 44]  # three packed sequences, lengths 8, 12, 24 (multiples of 2·cp)
    hidden, weight, labels, temp, g_lp, g_ent = _inputs((1, cu[-1]), seed=1)
    full = _run(hidden, weight, labels, temp, g_lp, g_ent, backend)
    take = (lambda t, r: t[:, thd_cp_index(cu, r)])
    locals_ = [_run(take(hidden, r), weight, take(labels, r), take(temp, r), take(g_lp, r), take(g_ent, r), backend)
               for r in range(CP)]
    assert thd_cp_index(cu, 1)[:4].tolist() == [2, 3, 4, 5]  # sequence 0 (length 8): chunks 1 and 2 of 4
    _check(full, locals_, take, backend, (hidden, weight, labels, temp, g_lp, g_ent))
