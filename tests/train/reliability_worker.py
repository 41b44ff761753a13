"""2-rank gloo cases of tests/train/test_reliability.py, all in ONE torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/train/reliability_worker.py OUT.json TMPDIR

Cases, in this order (the last one breaks the process group on purpose):
  padding_shard    the op (torch and reference backends) and the materialised route when rank 1's vocab
                   shard is all padding (vocab_size <= V_shard): values and gradients vs the unsharded fp64
                   reference, for a logprob-only loss and a logprob + entropy loss
  full_weight      the unsharded weight passed with tp_group is refused; an all-zero (e.g. zero-initialised)
                   shard is not mistaken for it
  label_mismatch   ranks passing different ignore patterns / labels get a ValueError on every rank (no
                   gloo abort), and the group stays usable
  sft_padding      the SFT job at TP=2, engine.model.make_vocab_size_divisible_by=512, builtin 259-id
                   tokenizer (padded vocabulary 1024: rank 1's LM-head shard is all padding), fused vs
                   materialised route: per-step losses
  stall            process group re-created by init_distributed with engine.parallel.timeout_s=6; rank 1
                   stalls (sleeps), rank 0's world barrier and the op's TP all-reduce (run concurrently)
                   must each fail after ~6 s with an error naming the collective and the rank
Rank 0 writes {case: {rank: result}} to OUT.json; pytest asserts.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from helpers.paths import REPO
from areal_lce import VocabParallel, linear_logprobs_entropy, logprobs_entropy_from_logits  # noqa: E402

N, H, V_SHARD, VOCAB = 12, 16, 32, 20  # rank 1 holds global ids [32, 64): padding only
STALL_TIMEOUT_S = 6.0  # short, yet room for Megatron's ~30 group creations on a loaded 2-core machine
STALL_SLEEP_S = 12.0  # > the timeout rank 0 waits through, with margin


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    full_w = torch.randn(2 * V_SHARD, H, generator=g, dtype=torch.float64)
    full_w[:3] = hidden[:3] * 2.0  # peaked rows: a few tokens whose best logit is far above the rest
    labels = torch.randint(0, VOCAB, (N,), generator=g)
    labels[0], labels[5] = VOCAB - 1, -100  # a label at the vocabulary's edge, an ignored row
    return hidden, full_w, labels


def _loss(lp, ent, labels, with_entropy: bool):
    mask = (labels != -100).double()
    return -(lp * mask).sum() - (0.1 * (ent * mask).sum() if with_entropy else 0.0)


def _grads(route: str, hidden, weight, labels, group, with_entropy: bool):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    if route == "materialised":
        out = logprobs_entropy_from_logits(h @ w.t(), labels, vocab_size=VOCAB, vocab_parallel=VocabParallel(group))
    else:
        out = linear_logprobs_entropy(h, w, labels, vocab_size=VOCAB, vocab_parallel=VocabParallel(group),
                                      backend=route)
    _loss(out.logprobs.double(), out.entropy.double(), labels, with_entropy).backward()
    dh = h.grad.clone()
    if route == "materialised" and group is not None:
        dist.all_reduce(dh, group=group)  # the materialised route leaves d_hidden vocab-partial
    return out, dh, w.grad


def padding_shard() -> dict:
    rank = dist.get_rank()
    hidden, full_w, labels = _inputs()
    shard = full_w[rank * V_SHARD:(rank + 1) * V_SHARD]
    res = {}
    for with_entropy in (False, True):
        ref, dh_ref, dw_ref = _grads("reference", hidden, full_w, labels, None, with_entropy)
        for route in ("torch", "reference", "materialised"):
            out, dh, dw = _grads(route, hidden.float(), shard.float(), labels, dist.group.WORLD, with_entropy)
            key = f"{route}-{'lp_ent' if with_entropy else 'lp'}"
            res[key] = {
                "d_logprobs": float((out.logprobs.double() - ref.logprobs).abs().max()),
                "d_entropy": float((out.entropy.double() - ref.entropy).abs().max()),
                "d_hidden_grad": float((dh.double() - dh_ref).abs().max()),
                "d_weight_grad": float((dw.double() - dw_ref[rank * V_SHARD:(rank + 1) * V_SHARD]).abs().max()),
                "scale": float(dh_ref.abs().max()),
            }
    return res


def _error_of(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def full_weight() -> dict:
    hidden, full_w, labels = _inputs()
    h, w = hidden.float(), full_w[:2 * VOCAB].float()
    refused = _error_of(lambda: linear_logprobs_entropy(h, w, labels, vocab_size=2 * VOCAB,
                                                        vocab_parallel=VocabParallel(dist.group.WORLD),
                                                        backend="torch"))
    zeros = torch.zeros(V_SHARD, H)
    zero_ok = _error_of(lambda: linear_logprobs_entropy(h, zeros, labels, vocab_size=VOCAB + 1,
                                                        vocab_parallel=VocabParallel(dist.group.WORLD),
                                                        backend="torch"))
    return {"refused": refused, "zero_shard_error": zero_ok}


def label_mismatch() -> dict:
    rank = dist.get_rank()
    hidden, full_w, labels = _inputs()
    shard = full_w[rank * V_SHARD:(rank + 1) * V_SHARD].float()
    call = lambda y: linear_logprobs_entropy(hidden.float(), shard, y, vocab_size=VOCAB,  # noqa: E731
                                             vocab_parallel=VocabParallel(dist.group.WORLD), backend="torch")
    more_ignored = labels.clone()
    if rank == 1:
        more_ignored[7] = -100  # rank 1 ignores one more row: the compacted row counts would differ
    other_label = labels.clone()
    if rank == 1:
        other_label[7] = (int(labels[7]) + 1) % VOCAB  # same ignore pattern, one label differs
    out = {"ignore_pattern": _error_of(lambda: call(more_ignored)),
           "label_value": _error_of(lambda: call(other_label))}
    ok = call(labels)  # the group is still in step after the refused calls
    out["after_ok"] = float(torch.isfinite(ok.logprobs).all())
    return out


def sft_padding(tmp: str) -> dict:
    from areal_lce.train import sft
    from areal_lce.train.config import load_config

    losses = {}
    for fused in (True, False):
        cfg = load_config(str(REPO / "configs" / "sft_tiny.yaml"), [
            "engine.parallel.tensor_parallel=2", "engine.model.make_vocab_size_divisible_by=512",
            f"engine.use_fused_linear_ce={str(fused).lower()}", "trainer.steps=3", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2", "engine.optim.warmup_steps=1", "trainer.progress=false",
            "trainer.sample_prompts=0", "trainer.plot=false", "trainer.save_final=false",
            f"trainer.output_dir={os.path.join(tmp, f'sft_fused{int(fused)}')}"])
        losses[str(fused)] = [r["loss"] for r in sft.run(cfg)["records"]]
    return {"losses": losses}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed(fn) -> dict:
    t0 = time.perf_counter()
    try:
        fn()
        error = ""
    except Exception as e:  # noqa: BLE001 -- what a stalled peer makes this rank raise is the result
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "elapsed_s": time.perf_counter() - t0}


def stall() -> dict:
    import threading

    from megatron.core import parallel_state as mpu

    from areal_lce.engine.config import ParallelConfig
    from areal_lce.engine.parallel import barrier_world, init_distributed

    # Re-create the process group through the engine's own start-up, with the short timeout, on a fresh
    # rendezvous store (the torchrun agent's store still holds the destroyed groups' addresses).
    port = [_free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]), TORCHELASTIC_USE_AGENT_STORE="False")
    init_distributed(ParallelConfig(tensor_parallel=2, timeout_s=STALL_TIMEOUT_S))
    barrier_world()  # both ranks are here
    if dist.get_rank() == 1:
        time.sleep(STALL_SLEEP_S)  # the stalled rank: never joins the collectives below
        return {}
    hidden, full_w, labels = _inputs()
    out = {}
    # Both at once (separate process groups): the world group's barrier (init_process_group's timeout) in
    # a thread, the op's all-reduce over Megatron's TP group (initialize_model_parallel's timeout) here.
    barrier = threading.Thread(target=lambda: out.update(world_barrier=_timed(barrier_world)))
    barrier.start()
    tp_group = mpu.get_tensor_model_parallel_group()
    out["op_tp_all_reduce"] = _timed(lambda: linear_logprobs_entropy(
        hidden.float(), full_w[:V_SHARD].float(), labels, vocab_parallel=VocabParallel(tp_group), backend="torch"))
    barrier.join()
    return out


def main() -> None:
    out_path, tmp = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {"padding_shard": padding_shard, "full_weight": full_weight, "label_mismatch": label_mismatch,
             "sft_padding": lambda: sft_padding(tmp)}
    mine = {}
    for name, fn in cases.items():
        try:
            mine[name] = fn()
        except Exception:  # report, keep going: pytest shows which case failed and why
            mine[name] = {"error": traceback.format_exc()}
    if not dist.is_initialized():  # a job's destroy_distributed may have torn the group down
        dist.init_process_group("gloo")
    both = [None, None]
    dist.all_gather_object(both, mine)
    results = {name: {str(r): both[r][name] for r in range(2)} for name in cases}
    try:
        results["stall"] = {str(rank): stall()}
    except Exception:
        results["stall"] = {str(rank): {"error": traceback.format_exc()}}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # the stalled group cannot be torn down cleanly; rank 1 exits after its sleep


if __name__ == "__main__":
    main()
