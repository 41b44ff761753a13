"""Engine under context parallelism x tensor parallelism: per-step losses against the CP=1 run.

    torchrun --nproc_per_node=4 torchrun/run_engine_cp.py --tp 2 [--sp] [--out FILE.json]

World = tp x cp x dp. Runs 3 training steps of the tiny preset with CP=2 (x TP) and again with CP=1
(the two CP ranks become data-parallel replicas fed the same micro-batches), fused and materialised,
packed (THD) and padded (BSHD), and prints / writes the largest relative per-step loss difference
(fp32, gloo on CPU or NCCL on GPU). CI runs CP=2 at TP=1 (tests/megatron/test_megatron_capture.py); this script
covers the 4-rank CP=2 x TP=2 layout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402

VOCAB = 500


def batch(seed: int, b: int = 2, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[1, s // 2:] = -100
    return ids, labels


def loss_fn(stats, mb):
    n = (mb.labels != -100).sum().clamp(min=1)
    return -(stats.logprobs.sum() + 0.1 * stats.entropy.sum()) / n, {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = {}
    for fused in (True, False):
        for pack in (True, False):
            losses = {}
            for cp in (2, 1):
                cfg = EngineConfig(model=ModelConfig(preset="tiny", max_seq_len=64),
                                   parallel=ParallelConfig(tensor_parallel=args.tp, sequence_parallel=args.sp,
                                                           context_parallel=cp),
                                   optim=OptimConfig(lr=3e-3), use_fused_linear_ce=fused, lce=LCEConfig(backend="torch"),
                                   pack_sequences=pack)
                e = MegatronEngine(cfg, vocab_size=VOCAB)
                losses[cp] = [e.train_step([MicroBatch(i, l) for i, l in
                                            (batch(10 + k), batch(20 + k, b=3, s=11))], loss_fn)["loss"]
                              for k in range(3)]
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses[2], losses[1]))
            out[f"fused{int(fused)}_pack{int(pack)}"] = {"max_rel_loss": rel, "cp2": losses[2], "cp1": losses[1]}
    if torch.distributed.get_rank() == 0:
        worst = max(v["max_rel_loss"] for v in out.values())
        print(json.dumps(out, indent=1))
        print(f"{'PASS' if worst <= 1e-5 else 'FAIL'}: CP=2 x TP={args.tp} (sp={args.sp}) vs CP=1, worst per-step "
              f"loss rel diff {worst:.2e} (limit 1e-5)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": torch.distributed.get_world_size(), "tp": args.tp, "sp": args.sp,
                           "torch": torch.__version__, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
