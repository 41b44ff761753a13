"""megatron-core's own loss path (use_fused_linear_ce=false, SFT loss) against the fused route.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/engine/own_loss_worker.py OUT.json

`parity(tp, sp, pack, fusions)` builds engines that share parameters and differ in
`use_fused_linear_ce` (and `model.cross_entropy_loss_fusion` on the flag-off ones), runs one `train_step`
of the SFT loss on prompt-masked micro-batches through each, and returns the losses, the largest
gradient difference relative to each tensor's largest entry, and how often megatron's
`compute_language_model_loss` and its CE functions ran. The vocabulary (512) is not padded at TP <= 4, so megatron's softmax and areal_lce's
run over the same columns. Used in-process by tests/engine/test_own_loss.py (TP=1) and under torchrun (TP=2).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

VOCAB = 512  # the tiny preset's; a multiple of make_vocab_size_divisible_by x TP: no padded columns


@contextlib.contextmanager
def megatron_ce_spy():
    """Counts of megatron's compute_language_model_loss, vocab_parallel_cross_entropy and
    fused_vocab_parallel_cross_entropy calls while the block runs (the real functions still run)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module import language_module as lm

    counts = {"compute_language_model_loss": 0, "vocab_parallel_cross_entropy": 0,
              "fused_vocab_parallel_cross_entropy": 0}
    real = {"compute_language_model_loss": lm.LanguageModule.compute_language_model_loss,
            "vocab_parallel_cross_entropy": tensor_parallel.vocab_parallel_cross_entropy,
            "fused_vocab_parallel_cross_entropy": lm.fused_vocab_parallel_cross_entropy}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return real[name](*args, **kwargs)
        return call

    lm.LanguageModule.compute_language_model_loss = counting("compute_language_model_loss")
    tensor_parallel.vocab_parallel_cross_entropy = counting("vocab_parallel_cross_entropy")
    lm.fused_vocab_parallel_cross_entropy = counting("fused_vocab_parallel_cross_entropy")
    try:
        yield counts
    finally:
        lm.LanguageModule.compute_language_model_loss = real["compute_language_model_loss"]
        tensor_parallel.vocab_parallel_cross_entropy = real["vocab_parallel_cross_entropy"]
        lm.fused_vocab_parallel_cross_entropy = real["fused_vocab_parallel_cross_entropy"]


def sft_microbatches(seed: int = 0, n: int = 2, b: int = 3, s: int = 14):
    """Right-padded rows with a prompt (no target), a response (targets) and padding, random ids."""
    from areal_lce.engine.microbatch import MicroBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (b, s), generator=g)
        labels = torch.full((b, s), -100, dtype=torch.long)
        for r in range(b):
            prompt, length = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(8, s + 1, (1,), generator=g))
            ids[r, length:] = 0
            labels[r, prompt:length - 1] = ids[r, prompt + 1:length]
        out.append(MicroBatch(ids, labels))
    return out


def parity(tp: int = 1, sp: bool = False, pack: bool = True, fusions=(False,), **parallel) -> dict:
    """One train_step of the SFT loss on the fused route and on megatron's own loss path with each
    `model.cross_entropy_loss_fusion` of `fusions`, all engines on the fused engine's parameters.
    `parallel`: further ParallelConfig fields (context_parallel=2, pipeline_parallel=2)."""
    from areal_lce.megatron.compat import cpu_shims
    from areal_lce.engine.engine import MegatronEngine
    from areal_lce.train.losses import SFTLoss
    from areal_lce.train.rl import _copy_parameters
    from helpers.engines import tiny_engine

    def build(fused: bool, fusion: bool = False) -> MegatronEngine:
        # lr = 0: the step leaves the parameters alone; fp32 on CPU
        return tiny_engine(VOCAB, model=dict(max_seq_len=32, cross_entropy_loss_fusion=fusion),
                           parallel=dict(tensor_parallel=tp, sequence_parallel=sp, **parallel),
                           optim=dict(lr=0.0, clip_grad=0.0), use_fused_linear_ce=fused, pack_sequences=pack, seed=11)

    mbs = sft_microbatches()
    targets = sum(mb.target_tokens() for mb in mbs)

    def step(eng: MegatronEngine) -> dict:
        loss_fn = SFTLoss(targets)
        with megatron_ce_spy() as counts:
            loss = eng.train_step(mbs, loss_fn)["loss"]
        return {"loss": loss, "calls": dict(counts), "record_keys": sorted(loss_fn.records[0]) if loss_fn.records else None,
                "uses": eng.uses_megatron_loss(loss_fn), "grads": eng.grads()}

    fused = build(True)
    ref = step(fused)
    out = {"microbatches": len(mbs), "fused": {k: v for k, v in ref.items() if k != "grads"}}
    for fusion in fusions:
        eng = build(False, fusion)
        _copy_parameters(fused, eng)
        got = step(eng)
        with cpu_shims():
            got["grad_rel"] = max(((ref["grads"][k] - g).abs().max() / ref["grads"][k].abs().max().clamp_min(1e-30))
                                  .item() for k, g in got.pop("grads").items())
        out[f"megatron_fusion{int(fusion)}"] = got
    return out


def main() -> None:
    # packed THD under SP (megatron's most involved layout); BSHD rows and loss fusion: the in-process case
    results = {"tp2-sp-packed": parity(tp=2, sp=True, pack=True)}
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
