"""KV-cache decode at TP = N: tokens with the decode steps replayed from CUDA graphs against the same
steps run eagerly (and against full recompute on CPU), and on a GPU the ms per decode step of each.

    torchrun --nproc_per_node=2 torchrun/run_decode_tp.py --tp 2 [--preset qwen2.5-0.5b --seqs 64
                                                           --new-tokens 256] [--out FILE.json]

Every rank builds the same engine (tensor parallel over all ranks), generates from the same prompts with one
torch.Generator seed three ways: KV cache with engine.decode_cuda_graphs on, KV cache with it off, and (CPU
only, small) full recompute. The sampled tokens must be equal: greedy and sampled (temperature 1) alike,
since every rank samples the same logits (decode.py). On NCCL the graphed run captures the TP collectives
(decode.graphs_usable); on gloo both KV runs are eager and the check is the TP decode path itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402
from areal_lce.engine.generation import decode  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seqs", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = EngineConfig(model=ModelConfig(preset=args.preset, max_seq_len=args.prompt_len + args.new_tokens + 8),
                       parallel=ParallelConfig(tensor_parallel=args.tp), optim=OptimConfig(lr=0.0),
                       lce=LCEConfig(backend="auto"), kv_cache=True)
    engine = MegatronEngine(cfg, trainable=False)
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,),
                                                                 generator=g)),), generator=g).tolist()
               for _ in range(args.seqs)]
    usable = decode.graphs_usable(engine.generation_model())
    res = {"tp": args.tp, "graphs_usable": usable, "device": str(engine.dist.device),
           "backend": str(engine.dist.backend), "seqs": args.seqs, "new_tokens": args.new_tokens}
    runs = {}
    for temp in (0.0, 1.0):
        toks = {}
        for name, graphs, kv in (("graphs", True, True), ("eager", False, True), ("recompute", False, False)):
            if name == "recompute" and torch.cuda.is_available():
                continue
            engine.cfg.decode_cuda_graphs = graphs
            engine.cfg.kv_cache = kv
            times = []
            for rep in range(2 if torch.cuda.is_available() else 1):  # the first run warms up / captures
                _sync()
                t0 = time.perf_counter()
                out = engine.generate(prompts, args.new_tokens, temperature=temp,
                                      generator=torch.Generator().manual_seed(1))
                _sync()
                times.append(time.perf_counter() - t0)
            toks[name] = out
            runs[f"{name}_t{temp}_ms_per_step"] = 1000 * times[-1] / args.new_tokens
        ref = toks["eager"]
        res[f"equal_t{temp}"] = {k: v == ref for k, v in toks.items()}
    res.update(runs)
    ok = all(all(v.values()) for k, v in res.items() if k.startswith("equal_"))
    res["ok"] = ok
    if engine.dist.rank == 0:
        print(json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
