"""RL checks shared by tests/train/test_rl_job.py (in-process, TP=1) and its torchrun launch (TP=2).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/train/rl_worker.py OUT_DIR

route_parity: the GRPO/PPO loss of `rl_loss` on a fixed rollout batch, through two engines that
share parameters and differ only in `use_fused_linear_ce`, gives the same loss, metrics and
gradients (every parameter shard). Under torchrun the worker then runs the RL job itself for a few
steps at tensor_parallel=2 through the CLI entry point.
"""
from __future__ import annotations

import sys

import torch
from helpers.paths import REPO

GRPO_TINY = REPO / "configs" / "grpo_tiny.yaml"
LOSS_AGGS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum")


def fixed_rollout(vocab: int, seed: int = 0, batch: int = 8):
    """Prompts of 3-6 tokens + responses of 2-7 tokens, random ids (same on every rank)."""
    from areal_lce.train.rl import rollout_batch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(batch):
        p = int(torch.randint(3, 7, (1,), generator=g))
        r = int(torch.randint(2, 8, (1,), generator=g))
        prompts.append(torch.randint(0, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(0, vocab, (r,), generator=g).tolist())
    return rollout_batch(prompts, responses, pad_id=0), g


def route_parity(tp: int = 1, temperature: float = 0.7) -> dict:
    """Max relative differences (loss, grads) fused vs materialised for each loss_agg; asserts inside."""
    from areal_lce.engine.config import LCEConfig
    from areal_lce.train.rl import _copy_parameters, minibatch_plan
    from areal_lce.train.rl_config import RLConfig
    from areal_lce.train.rl_losses import PolicyMicroBatch, rl_loss
    from helpers.engines import tiny_engine

    vocab = 259  # the byte tokenizer's vocabulary; Megatron pads it to 384 (x tp)
    engines = {}
    for fused in (True, False):
        # lr = 0: the optimizer step leaves the parameters alone, so every loss mode sees the same model
        engines[fused] = tiny_engine(vocab, model=dict(max_seq_len=32), parallel=dict(tensor_parallel=tp),
                                     optim=dict(lr=0.0, clip_grad=0.0), lce=LCEConfig(), use_fused_linear_ce=fused, seed=7)
    _copy_parameters(engines[True], engines[False])
    batch, g = fixed_rollout(vocab)
    mask = batch.labels != -100
    base = engines[True].token_stats(batch.input_ids, batch.labels, temperature=temperature).logprobs
    # behaviour / reference logprobs off the current policy by ~0.3 nats, so ratios land inside and
    # outside the clip range (both clip sides and the dual clip are exercised)
    old = (base + 0.3 * torch.randn(base.shape, generator=g)) * mask
    ref = (base + 0.3 * torch.randn(base.shape, generator=g)) * mask
    adv = torch.randn(batch.input_ids.shape[0], generator=g)
    full = PolicyMicroBatch(input_ids=batch.input_ids, labels=batch.labels, temperature=temperature,
                            old_logprobs=old, ref_logprobs=ref, advantages=adv)
    (mbs,) = minibatch_plan(full, torch.arange(adv.numel()), 1, 4)  # one minibatch of two microbatches
    report = {}
    for agg in LOSS_AGGS:
        rl = RLConfig(loss_agg=agg, dual_clip=3.0, entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3")
        out, grads = {}, {}
        for fused, eng in engines.items():
            out[fused] = eng.train_step(mbs, lambda stats, mb: rl_loss(stats, mb, rl))
            grads[fused] = eng.grads()
        assert 0.0 < out[True]["clip_frac"] < 1.0, out[True]  # the fixed batch does hit the clip
        assert out[True]["clip_frac"] == out[False]["clip_frac"], (out[True], out[False])
        loss_rel = abs(out[True]["loss"] - out[False]["loss"]) / abs(out[False]["loss"])
        assert loss_rel < 1e-5, (agg, out[True]["loss"], out[False]["loss"])
        for k in ("kl", "entropy", "approx_kl", "max_logit", "min_logit"):
            assert abs(out[True][k] - out[False][k]) <= 1e-5 * (1 + abs(out[False][k])), (agg, k, out)
        worst = 0.0
        for name, gm in grads[False].items():
            gf = grads[True][name]
            scale = gm.abs().max().item()
            err = (gf - gm).abs().max().item()
            assert err <= 1e-5 * scale + 1e-8, f"{agg}: grad of {name} differs: max err {err:.3e}, scale {scale:.3e}"
            worst = max(worst, err / (scale + 1e-12))
        head = [n for n in grads[False] if "output_layer" in n]
        assert head and grads[False][head[0]].abs().max() > 0, "LM-head gradient is zero: the check would be vacuous"
        report[agg] = {"loss": out[True]["loss"], "loss_rel": loss_rel, "grad_rel": worst}
    return report


def main(out_dir: str) -> None:
    from areal_lce.train.__main__ import main as train_main

    import torch.distributed as dist

    report = route_parity(tp=2)
    rank = dist.get_rank()
    print(f"[rank {rank}] route parity tp=2: {report}", flush=True)
    # the job's init_distributed reuses these TP=2 groups (re-creating a torchrun process group hangs)
    rc = train_main([str(GRPO_TINY), "engine.parallel.tensor_parallel=2", "trainer.steps=3",
                     "trainer.save_interval=0", f"trainer.output_dir={out_dir}", "trainer.progress=false"])
    if rank == 0:
        print("RL_WORKER_OK" if rc == 0 else f"RL_WORKER_FAILED rc={rc}", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main(sys.argv[1])
