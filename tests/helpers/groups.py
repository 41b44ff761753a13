"""A recording 2-rank tensor-parallel group on one CPU process (the `fake_group` fixture).

This process plays rank 0; every collective the op issues is recorded in `group.calls` (kind, op, shapes,
dtype) and checked to be issued on the group passed to the op. Use: `from helpers.groups import fake_group`
in a test module (a pytest fixture).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


class FakeGroup:
    """Stands for a 2-rank TP group; this process plays rank 0 and records every collective."""

    size, rank = 2, 0
    group_name = "fake_tp2"  # the op's options carry a group by name (resolved by the patched resolver below)

    def __init__(self):
        self.calls: list[dict] = []


@pytest.fixture
def fake_group(monkeypatch):
    g = FakeGroup()

    def check(group):
        if group is not g:
            raise AssertionError(f"collective issued on {group!r}, not on the group passed to the op")

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        g.calls.append(dict(kind="all_reduce", op=op, group=group, numel=t.numel(), shape=tuple(t.shape),
                            dtype=t.dtype))
        check(group)  # identity result: the other rank contributes nothing (SUM) / the same (MAX)

    def all_gather(out, inp, group=None, async_op=False):
        g.calls.append(dict(kind="all_gather", group=group, numel=inp.numel(), shape=tuple(inp.shape),
                            out_shape=tuple(out.shape), dtype=inp.dtype))
        check(group)
        out.copy_(torch.cat([inp] * g.size))

    def reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        g.calls.append(dict(kind="reduce_scatter", op=op, group=group, numel=inp.numel(), shape=tuple(inp.shape),
                            out_shape=tuple(out.shape), dtype=inp.dtype))
        check(group)
        out.copy_(inp[: out.shape[0]])

    def world_size(group=None):
        check(group)
        return g.size

    def rank(group=None):
        check(group)
        return g.rank

    def backend(group=None):
        check(group)
        return "gloo"

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    for name in ("all_gather_into_tensor", "all_gather_single"):
        monkeypatch.setattr(dist, name, all_gather, raising=False)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, reduce_scatter, raising=False)
    def resolve(name):
        if name != g.group_name:
            raise AssertionError(f"the op resolved the group name {name!r}, not {g.group_name!r}")
        return g

    monkeypatch.setattr(dist.distributed_c10d, "_resolve_process_group", resolve)
    monkeypatch.setattr(dist, "get_world_size", world_size)
    monkeypatch.setattr(dist, "get_rank", rank)
    monkeypatch.setattr(dist, "get_backend", backend)
    # no default group either, even when an earlier in-process test left one initialised: otherwise
    # torch.compile's structured logging asks dist.get_rank() of it, which the recorder above refuses
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    return g
