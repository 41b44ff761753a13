"""`gather_from_context_parallel` checks that the context-parallel ranks gather one layout.

Two gloo ranks (this file is the worker): a layout both ranks agree on gathers back the full tensor and
is checked once (a second call of the same layout runs no check collective); equal local sizes with
different cu_seqlens (which used to gather silently into a wrong order) and different local sizes (a
gloo abort before) raise ValueError on both ranks, naming what differs; the accelerator route (deferred:
no host read of the votes) poisons the call's output with NaN and `check_deferred()` raises.
"""
import os
import types

import pytest
import torch

from areal_lce.op import checks
from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank group)


def test_record_disagreement_is_raised_once_by_check_deferred():
    agree = torch.tensor([[3, 7], [-3, -7]])  # [max, -min] of two items over a group: equal everywhere
    differ = torch.tensor([[3, 9], [-3, -7]])
    assert not checks.record_disagreement(agree, "layouts differ")
    checks.check_deferred()  # nothing recorded
    assert checks.record_disagreement(differ, "layouts differ")
    with pytest.raises(ValueError, match=r"layouts differ \(1 call\(s\) on cpu since the last check\)"):
        checks.check_deferred()
    checks.check_deferred()  # the record was reset


def test_one_cp_group_value(fake_group):
    """`CPGroup.of` is the one conversion of the spellings of "which context-parallel group" (None, a process
    group, megatron's pg_collection, a CPGroup); the split takes any of them and keeps the same tokens.
    (A namespace with `cp` stands for megatron's ProcessGroupCollection, whose import takes seconds.)"""
    from areal_lce.megatron.context_parallel import CPGroup, split_for_context_parallel

    none = CPGroup.none()
    assert not none.active and (none.group, none.size, none.rank) == (None, 1, 0)
    assert CPGroup.of(None) == none and CPGroup.of(types.SimpleNamespace(cp=None)) == none  # collection, no cp
    cp = CPGroup.of(fake_group)
    assert (cp.group, cp.size, cp.rank, cp.active) == (fake_group, 2, 0, True)
    pgc = types.SimpleNamespace(cp=fake_group, tp=None)
    assert CPGroup.of(pgc) == cp and CPGroup.of(cp) is cp
    with pytest.raises(TypeError, match="the context-parallel group must be a torch.distributed ProcessGroup"):
        CPGroup.of(2)
    x, cu = torch.arange(16).view(1, 16), torch.tensor([0, 8, 16])
    # rank 0 of 2: chunks 0 and 3 (of 4, two tokens each) of every packed sequence
    assert split_for_context_parallel(x, fake_group, cu).tolist() == [[0, 1, 6, 7, 8, 9, 14, 15]]
    for spelling in (cp, pgc):
        assert torch.equal(split_for_context_parallel(x, spelling, cu), split_for_context_parallel(x, fake_group, cu))
    assert split_for_context_parallel(x, none, cu) is x
    assert fake_group.calls == []  # splitting needs no collective


@pytest.mark.distributed
def test_gather_checks_the_layout_on_two_ranks():
    from helpers.launch import torchrun

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torchrun(os.path.abspath(__file__), timeout=240)


def _expect_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        missing = [n for n in needles if n not in str(e)]
        if missing:
            raise AssertionError(f"error does not name {missing}: {e}") from e
        return
    raise AssertionError(f"no ValueError (expected one naming {needles})")


def _worker():
    import torch.distributed as dist

    from areal_lce.op import comms
    from areal_lce.megatron import context_parallel as CP

    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    votes = []
    real_votes = comms.agreement_votes

    def counting_votes(key, g):
        votes.append(1)
        return real_votes(key, g)

    comms.agreement_votes = counting_votes

    # an agreed packed layout: the full tensor back, the check once per layout
    cu = torch.tensor([0, 8, 20, 44])
    full = torch.arange(44 * 3, dtype=torch.float32).reshape(1, 44, 3)
    local = CP.split_for_context_parallel(full, group, cu)
    for _ in range(3):
        assert torch.equal(CP.gather_from_context_parallel(local, group, cu), full)
    assert len(votes) == 1, votes
    bshd = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(CP.gather_from_context_parallel(CP.split_for_context_parallel(bshd, group), group), bshd)
    assert len(votes) == 2, votes  # a new layout: checked once more

    # equal local sizes, different cu_seqlens (lengths 8 + 8 on rank 0, 4 + 12 on rank 1)
    mine = torch.tensor([0, 8, 16] if rank == 0 else [0, 4, 16])
    x = torch.ones(1, 8, 3)
    _expect_error(lambda: CP.gather_from_context_parallel(x, group, mine),
                  "packed sequence lengths (cu_seqlens)", "differ(s) across the context-parallel group")
    # different local sizes
    y = torch.ones(2, 4 if rank == 0 else 6, 3)
    _expect_error(lambda: CP.gather_from_context_parallel(y, group),
                  "local.shape[1] (tokens on this rank)", f"rank {rank} of 2")

    # the accelerator route: the votes are not read; the output is NaN and check_deferred raises
    CP._reads_votes_now = lambda device: False
    mine = torch.tensor([0, 12, 16] if rank == 0 else [0, 4, 16])
    out = CP.gather_from_context_parallel(x, group, mine)
    assert out.shape == (1, 16, 3) and torch.isnan(out).all()
    _expect_error(checks.check_deferred, "gathered different layouts", "1 call(s)")
    same = CP.gather_from_context_parallel(local, group, cu)  # an agreed layout, already checked: no NaN
    assert torch.equal(same, full)
    checks.check_deferred()

    dist.barrier()  # both ranks done before either tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
