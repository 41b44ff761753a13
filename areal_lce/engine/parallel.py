"""Distributed start-up for the Megatron engine (process group, Megatron's parallel state, seeds) and
the job-level collectives the engine and the jobs use.

`init_distributed` works the same under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment)
and in a plain single process (a one-rank group on a free local port). Backend: nccl with CUDA,
gloo without. Data parallelism is whatever remains of the world after TP x PP x CP. `DistInfo`
carries this rank's sizes, ranks and process groups, so callers never reach into parallel_state.

Job-level collectives (few, small, on the host; the op's collectives live in areal_lce.op.comms):
`all_ranks_true` (an AND over the job), `barrier_world`, `broadcast_object` and
`object_from_last_stage` (a small value from the last pipeline stage to every stage).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..op import comms

from .config import ParallelConfig


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int  # data-parallel replicas (context-parallel ranks of one replica are not counted)
    cp_rank: int
    cp_size: int
    device: torch.device
    backend: str
    # megatron's process groups of this rank (kept here so that callers never reach into parallel_state)
    tp_group: Any = field(default=None, repr=False)
    pp_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)  # data parallel, context-parallel ranks excluded
    dp_cp_group: Any = field(default=None, repr=False)  # data x context parallel: where megatron's DDP reduces
    cp_group: Any = field(default=None, repr=False)
    mp_group: Any = field(default=None, repr=False)  # tensor x pipeline model parallel

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_OWNS_PROCESS_GROUP = False


def init_process_group(parallel_cfg: ParallelConfig) -> None:
    """torch.distributed's default group (nccl with CUDA, gloo without), unless one exists: the first half
    of `init_distributed`, for checks the ranks must pass before Megatron's groups are built."""
    global _OWNS_PROCESS_GROUP
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        # a stalled or dead rank makes the others raise after timeout_s instead of hanging (torch's default:
        # 10 min for NCCL, 30 min for gloo)
        timeout = timedelta(seconds=parallel_cfg.timeout_s)
        if "RANK" not in os.environ:  # plain single process: a one-rank group on an in-process store (no TCP
            # port, so no race for one; nothing written to os.environ, so a later group in this process is
            # built the same way)
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        _OWNS_PROCESS_GROUP = True


def init_distributed(parallel_cfg: ParallelConfig, seed: int = 1234) -> DistInfo:
    """Initialise torch.distributed and Megatron's parallel_state (each only if not already set up with
    these sizes), then (re)seed torch and Megatron's RNG tracker with `seed`, so every engine built
    right after this call starts from the same parameters for the same seed."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    init_process_group(parallel_cfg)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = dist.get_world_size()
    tp, pp = parallel_cfg.tensor_parallel, parallel_cfg.pipeline_parallel
    cp = parallel_cfg.context_parallel
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by parallel.tensor_parallel={tp} x "
                         f"parallel.pipeline_parallel={pp} x parallel.context_parallel={cp}")
    same = (mpu.model_parallel_is_initialized()
            and mpu.get_tensor_model_parallel_world_size() == tp
            and mpu.get_pipeline_model_parallel_world_size() == pp
            and mpu.get_context_parallel_world_size() == cp)
    if not same:  # idempotent: a second engine (e.g. an RL reference policy) shares the groups
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            create_gloo_process_groups=not cuda,
            distributed_timeout_minutes=parallel_cfg.timeout_s / 60,  # the TP/DP/PP groups' collectives
        )
    # The inference-style tracker keeps per-region seeds without CUDA generator states (CPU-safe).
    # Pipeline stages get distinct seeds (as Megatron-LM does), so their layers are not initialised
    # alike; data-parallel replicas share the seed and therefore the initial parameters.
    stage_seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed, inference_rng_tracker=not cuda,
                                                    force_reset_rng=True)
    torch.manual_seed(stage_seed)
    return DistInfo(
        rank=dist.get_rank(), world_size=world, local_rank=local_rank,
        tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=mpu.get_pipeline_model_parallel_rank(), pp_size=pp,
        dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(), cp_size=cp,
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        backend=backend,
        tp_group=mpu.get_tensor_model_parallel_group(), pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(), dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
        cp_group=mpu.get_context_parallel_group(), mp_group=mpu.get_model_parallel_group(),
    )


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state, and the process group if `init_distributed` created it."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
        _OWNS_PROCESS_GROUP = False


# ------------------------------------------------------------------------------------ job-level collectives


def all_ranks_true(flag: bool) -> bool:
    """True iff `flag` is true on every rank of the job (a collective when the job has several ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([int(not flag)], dtype=torch.int64)
    comms.all_reduce_max_(t, dist.group.WORLD)  # MAX of "false" flags: 0 iff every rank's flag is true
    return not bool(t[0])


def barrier_world() -> None:
    """Wait for every rank of the job (checkpoint files on disk before one rank marks them complete)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with comms._named("barrier", None):  # a timeout raises comms.CollectiveError naming the barrier
            dist.barrier()


def broadcast_object(obj, src: int, group):
    """`obj` (a small picklable value) of global rank `src` on every rank of `group`."""
    if comms.group_size(group) == 1:
        return obj
    box = [obj]
    with comms._named(f"broadcast of an object from rank {src}", group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def object_from_last_stage(obj, info: DistInfo):
    """The last pipeline stage's `obj` (a small picklable value, e.g. metric names) on every stage of
    this rank's pipeline."""
    if info.pp_size == 1:
        return obj
    return broadcast_object(obj, dist.get_global_rank(info.pp_group, info.pp_size - 1), info.pp_group)
