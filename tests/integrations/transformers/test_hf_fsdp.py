"""areal_lce.integrations.transformers under FSDP2 and with a vocab-sharded DTensor head: 2 gloo ranks on CPU, this file is the worker
(launched by its own test). Patched and unpatched models must agree on the loss and every gradient."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import areal_lce.integrations.transformers as hf
from helpers.paths import REPO
from hf_models import H, batch, build, expected_from_logits

# --------------------------------------------------------------------------------------------------
# distributed: FSDP2 and a vocab-sharded DTensor head, 2 gloo ranks on CPU (this file is the worker)


@pytest.mark.distributed
def test_fsdp2_and_dtensor_tp_two_ranks(tmp_path):
    """Launch `_dist_worker` on 2 CPU ranks (gloo); it raises on any mismatch, and rank 0 writes the result
    once both ranks have passed every check. The result decides, not the exit status: gloo's teardown can
    abort a rank after the work is done ("terminate called without an active exception")."""
    import os

    from helpers.launch import torchrun

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "result.json"
    result = torchrun(os.path.abspath(__file__), out, timeout=240, cwd=REPO, result=out, check_returncode=False)
    assert result == {"ranks_passed": 2}


def _dist_worker(result_path: str):
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from areal_lce.integrations.transformers.head import _resolve_dtensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def check(value, expected, what, tol=2e-5):
        err = (value.double() - expected.double()).abs().max().item()
        scale = max(expected.abs().max().item(), 1e-30)
        if not err <= tol * scale + 1e-7:
            raise AssertionError(f"rank {rank}: {what}: max abs err {err:.3e} (max |expected| {scale:.3e})")

    # FSDP2: (a) untied, lm_head its own FSDP unit (sharded DTensor outside its forward: its hooks
    # unshard it around the fused call); (b) tied, head and embedding in the root unit. Each rank has
    # its own data; patched and unpatched FSDP models must agree on the loss and every gradient.
    for tied in (False, True):
        base = build("qwen2", tied)
        ids, labels = batch(seed=10 + rank)
        runs = []
        for patched in (False, True):
            m = copy.deepcopy(base)
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            if not tied:
                fully_shard(m.lm_head, mesh=mesh)
            fully_shard(m, mesh=mesh)
            if patched:
                hf.apply(m, backend="torch")
            out = m(input_ids=ids, labels=labels)
            out.loss.backward()
            runs.append((m, out))
        (ref_m, ref), (m, out) = runs
        assert out.logits is None and isinstance(m.lm_head.weight, DTensor)
        check(out.loss, ref.loss, f"fsdp tied={tied} loss")
        for (n, p), (_, q) in zip(ref_m.named_parameters(), m.named_parameters()):
            check(q.grad.full_tensor(), p.grad.full_tensor(), f"fsdp tied={tied} grad {n}")

    # Tensor parallel: lm_head.weight a DTensor Shard(0) over the vocabulary, the rest replicated; same
    # data on every rank. The op's vocab-parallel path must reproduce the single-process model.
    base = build("llama", tied=False)
    ids, labels = batch(seed=20)
    ref_m = copy.deepcopy(base)
    ref = ref_m(input_ids=ids, labels=labels)
    ref.loss.backward()
    m = copy.deepcopy(base)
    m.lm_head.weight = nn.Parameter(distribute_tensor(m.lm_head.weight.detach(), mesh, [Shard(0)]))
    hf.apply(m, backend="torch")
    out = m(input_ids=ids, labels=labels)
    out.loss.backward()
    check(out.loss, ref.loss, "tp loss")
    exp = expected_from_logits(ref.logits, out.shift_labels)
    for k in exp:
        check(getattr(out, k), exp[k], f"tp {k}")
    assert m.lm_head.weight.grad.placements == (Shard(0),)
    check(m.lm_head.weight.grad.full_tensor(), ref_m.lm_head.weight.grad, "tp grad lm_head")
    for (n, p), (_, q) in zip(ref_m.named_parameters(), m.named_parameters()):
        if n != "lm_head.weight":
            check(q.grad, p.grad, f"tp grad {n}")

    # Layouts the op can't take are refused before any collective.
    for tensor, placement, match in [(torch.zeros(7, H), Shard(0), "unevenly"),
                                     (torch.zeros(8, H), Shard(1), "placements")]:
        try:
            _resolve_dtensor(distribute_tensor(tensor, mesh, [placement]), torch.zeros(2, H))
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"no error for placement {placement}")
    dist.barrier()  # both ranks done before either tears gloo down (a peer closing first can abort the other)
    if rank == 0:  # both ranks passed every check above
        with open(result_path, "w") as f:
            json.dump({"ranks_passed": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _dist_worker(sys.argv[1])
