"""Every collective of areal_lce (tensor- and context-parallel) lives here.

Plain helpers are called from inside the op's forward and backward (function.py, the real
implementations of library.py's custom ops, which autograd and torch.compile do not look into); the op
carries its group by name (`group_name`, `resolve_group`). The small autograd Functions at the bottom
serve the materialised route (`materialised.py`), whose softmax statistics are differentiated by
autograd; each name says what it does in forward and in backward.

Gradient convention (Megatron's): after the LM head, every rank of the TP group computes the same
replicated loss from the same global per-token values, so the gradient of a replicated value is
already complete on each rank and needs no reduction; only partial sums over vocab shards are reduced.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist



def _flat_collective(new: str, old: str):
    """torch >= 2.13 names the flat-tensor collectives *_single (the old names warn); same semantics.
    Looked up at call time so a patched torch.distributed (tests' fake groups) is honoured."""
    return getattr(dist, new, None) or getattr(dist, old)

_CHECKED = set()  # (group, value, what) already found equal: the check runs once per group and size


class CollectiveError(RuntimeError):
    """A collective of areal_lce failed (typically timed out because another rank stalled or died)."""


@contextlib.contextmanager
def _named(what: str, group):
    """Re-raise a failed collective naming it, its group size and this rank (torch's gloo timeout says only
    'Timed out waiting Nms for recv operation')."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"{what} over a {group_size(group) if group is not None else dist.get_world_size()}-rank group failed "
            f"on global rank {rank}: {e} -- another rank stalled or died, or the process group's timeout "
            "(engine.parallel.timeout_s in the train jobs) expired") from e


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_name(group) -> str:
    """The name torch.distributed registered `group` under (ProcessGroup.group_name): how the op's options
    carry it across the custom op, as torch's functional collectives take a group."""
    name = getattr(group, "group_name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"VocabParallel.group must be a torch.distributed ProcessGroup with a group_name, "
                        f"got {group!r}")
    return name


def resolve_group(name: str):
    """The process group registered under `name` (torch.distributed's own resolver, looked up at call time)."""
    return dist.distributed_c10d._resolve_process_group(name)


def group_backend(group) -> Optional[str]:
    """The collective backend of `group` ("nccl", "gloo", ...), None without a group."""
    return None if group is None else str(dist.get_backend(group))


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce_(t: torch.Tensor, op, group) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    with _named(f"all-reduce {str(op).rsplit('.', 1)[-1]} of {tuple(t.shape)}", group):
        if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
            # host-side values (job metrics) over an NCCL group: NCCL reduces device tensors only
            dev = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(dev, op=op, group=group)
            return t.copy_(dev)
        dist.all_reduce(t, op=op, group=group)
    return t


def all_reduce_max_(t: torch.Tensor, group) -> torch.Tensor:
    """In place MAX over the group (per-token max logit of each vocab shard -> global max)."""
    return _all_reduce_(t, dist.ReduceOp.MAX, group)


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    """In place SUM over the group (partial sums over vocab shards -> full-vocabulary sums)."""
    return _all_reduce_(t, dist.ReduceOp.SUM, group)


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate each rank's [n, ...] rows in rank order: sequence shards -> full sequence."""
    world = group_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    with _named(f"all-gather of {tuple(t.shape)} rows", group):
        _flat_collective("all_gather_single", "all_gather_into_tensor")(out, t, group=group)
    return out


def reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    """SUM over ranks, each rank keeping its [N/tp, ...] block of rows (full-seq grads -> its shard)."""
    world = group_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    out = torch.empty((t.shape[0] // world,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    with _named(f"reduce-scatter of {tuple(t.shape)} rows", group):
        _flat_collective("reduce_scatter_single", "reduce_scatter_tensor")(out, t, op=dist.ReduceOp.SUM, group=group)
    return out


def check_same_across_group(value: int, group, what: str) -> None:
    """Raise on every rank if an integer (e.g. the vocab shard size) differs across the group."""
    if group_size(group) == 1 or (id(group), value, what) in _CHECKED:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    with _named(f"all-reduce MAX checking {what}", group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != value or -int(t[1]) != value:
        raise ValueError(f"{what} differs across the tensor-parallel group (this rank: {value}, "
                         f"max {int(t[0])}, min {-int(t[1])}); Megatron shards must be equal")
    _CHECKED.add((id(group), value, what))


def checked_group_size(group, what: str) -> int:
    """`group_size`, with an error naming the option when `group` is not a process group (e.g. an int)."""
    if group is None:
        return 1
    if isinstance(group, (bool, int, float, str, bytes)):
        raise TypeError(f"{what} must be a torch.distributed ProcessGroup or None, got {group!r}")
    try:
        return dist.get_world_size(group)
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a torch.distributed ProcessGroup or None, got {group!r} ({e})") from e


def agreement_votes(key: torch.Tensor, group) -> torch.Tensor:
    """[max, -min] of an int64 scalar over the group, left on device (the caller syncs once): the ranks
    agree iff votes[0] == -votes[1]."""
    t = torch.stack([key, -key]).to(torch.int64)
    return _all_reduce_(t, dist.ReduceOp.MAX, group)  # MAX of [key, -key]: the group's max and -min


def raise_disagreement(values: dict, group, otherwise: str, hint: str) -> None:
    """Collective, on the failure path only (every rank saw the votes disagree): one MAX of [v, -v] over
    the named integers, then a ValueError on every rank naming those that differ (else `otherwise`)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    v = torch.tensor(list(values.values()), dtype=torch.int64, device=device)
    t = torch.cat([v, -v])
    with _named("all-reduce MAX explaining a disagreement", group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # per-value max and -min over the group
    k = len(values)
    differ = [f"{name} differs across the tensor-parallel group (this rank: {val}, min {-int(t[k + i])}, "
              f"max {int(t[i])})" for i, (name, val) in enumerate(values.items()) if int(t[i]) != -int(t[k + i])]
    raise ValueError(f"{'; '.join(differ) or otherwise} [rank {group_rank(group)} of {group_size(group)}]: {hint}")


def check_not_replicated(t: torch.Tensor, group, what: str, message: str) -> None:
    """Raise `message` on every rank if `t` is identical (and not all zero) on every rank of the group: a
    full, unsharded tensor handed in where each rank's shard belongs. One MAX of 4 float64, once per
    (group, shape)."""
    key = (id(group), tuple(t.shape), what)
    if group_size(group) == 1 or key in _CHECKED:
        return
    d = t.detach().double()
    fp = torch.stack([d.sum(), d.square().sum()])
    both = torch.cat([fp, -fp])
    _all_reduce_(both, dist.ReduceOp.MAX, group)  # MAX of [fp, -fp]: equal everywhere iff max == min
    if torch.equal(both[:2], -both[2:]) and float(fp[1]) != 0.0:
        raise ValueError(message)
    _CHECKED.add(key)


class AllReduceSumReplicatedGrad(torch.autograd.Function):
    """forward: SUM of vocab-shard partials over the group; backward: identity.

    The summed value feeds a loss that every rank computes identically, so its gradient is the same
    on all ranks and is exactly the gradient of each rank's partial: no collective in backward.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        return all_reduce_sum_(t.clone(), group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def all_reduce_sum_replicated_grad(t: torch.Tensor, group: Optional[object]) -> torch.Tensor:
    return t if group_size(group) == 1 else AllReduceSumReplicatedGrad.apply(t, group)


class AllReduceSumPartialGrad(torch.autograd.Function):
    """forward: SUM of vocab-shard partials over the group; backward: SUM of the gradient over the group.

    For a sum that every rank then feeds into its own shard-local terms (the exp-sum behind lse, which
    each rank's log-probs of its vocab columns use): each rank's gradient holds only its shard's part,
    so the parts are summed.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum_(t.clone(), group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # SUM: per-shard partial gradients of the replicated sum -> its full gradient on every rank
        return all_reduce_sum_(g.contiguous().clone(), ctx.group), None


def all_reduce_sum_partial_grad(t: torch.Tensor, group: Optional[object]) -> torch.Tensor:
    return t if group_size(group) == 1 else AllReduceSumPartialGrad.apply(t, group)


class AllGatherRowsReplicatedGrad(torch.autograd.Function):
    """forward: all-gather of each rank's [n, ...] rows in rank order; backward: this rank's block of rows.

    For a gathered tensor that every rank feeds into the same (replicated) loss, e.g. per-token outputs
    gathered over the context-parallel group: the gradient is the same full tensor on every rank, so
    each rank's rows get exactly their own block of it (a reduce-scatter would multiply it by the size).
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.rows = group_rank(group), t.shape[0]
        return all_gather_rows(t, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.narrow(0, ctx.rank * ctx.rows, ctx.rows), None


def all_gather_rows_replicated_grad(t: torch.Tensor, group: Optional[object]) -> torch.Tensor:
    return t if group_size(group) == 1 else AllGatherRowsReplicatedGrad.apply(t, group)

