"""Four gloo ranks: a checkpoint saved at one parallel layout, loaded at others.

    torchrun --nproc_per_node=4 tests/engine/checkpoint_worker.py OUT_DIR

1. TP=2 (DP=2): two training steps, save, two more steps (the reference), then a load of the checkpoint at
   the same layout and the same two steps again (must equal the reference bit for bit).
2. TP=1 (DP=4) and 3. TP=2 + PP=2 (DP=1): a fresh engine (another seed) loads the checkpoint, then runs the
   same two steps on the same global batches.
After each load the gathered parameters and AdamW moments (every tensor of the sharded state put together
from its shards) are compared with those gathered before the save; rank 0 writes OUT_DIR/result.json:
{layout: {"max_diff": ..., "keys": n, "losses": [...]}, "reference": [...], "same_layout": [...]}.
The model: the tiny preset with 2 layers, tied embeddings (under PP=2 the last stage holds the LM head as a
copy of the first stage's embedding) and the byte tokenizer's 259 tokens, whose padded vocabulary is 384
rows at TP=1 and 512 at TP=2 (only the true rows are compared).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, GLOBAL_BATCH = 259, 16, 4


def engine(tp: int, pp: int, seed: int):
    from areal_lce.engine.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
    from areal_lce.engine.engine import MegatronEngine

    model = ModelConfig(preset="tiny", max_seq_len=32, num_layers=2, tie_word_embeddings=True)
    cfg = EngineConfig(model=model,
                       optim=OptimConfig(lr=1e-2, warmup_steps=0),
                       parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, timeout_s=300), seed=seed)
    return MegatronEngine(cfg, vocab_size=VOCAB)


def steps(e, first: int, n: int) -> list:
    """Train steps `first`..`first+n-1` on the global batch of each step (this rank's data-parallel share,
    in micro-batches of two sequences at most); the losses."""
    from areal_lce.engine import MicroBatch

    dp, rank = e.dist.dp_size, e.dist.dp_rank
    losses = []
    for step in range(first, first + n):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        mine = ids.chunk(dp)[rank]
        mbs = [MicroBatch(m, m) for m in mine.split(2)]
        k = len(mbs)
        losses.append(e.train_step(mbs, lambda stats, mb: (-stats.logprobs.mean() / k, {}))["loss"])
    return losses


def gathered(e) -> dict:
    """{sharded key: full tensor} of the engine's model and optimizer tensors, every shard written by its main
    replica and summed over the world (x + 0 is exact: bitwise the saved values)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    from areal_lce.engine import sharded
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():
        model = sharded.model_sharded_state(e.gpt)
        full = {"model": model, "optimizer": sharded.optimizer_sharded_state(e.optimizer, False, model, False)}
        tensors, _plain = sharded.split_plain(full, validate=False)
    mine = {}  # a key may have several shards here (the layers of a stage: one stacked tensor)
    for t in nested_values(tensors):
        if isinstance(t, ShardedTensor):
            mine.setdefault(t.key, []).append(t)
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, {k: tuple(ts[0].global_shape) for k, ts in mine.items()})
    keys = sorted({k: s for d in shapes for k, s in d.items()}.items())
    out = {}
    for key, shape in keys:
        buf, cover = torch.zeros(shape, dtype=torch.float32), torch.zeros(shape, dtype=torch.float32)
        for t in mine.get(key, []):
            if is_main_replica(t.replica_id):
                local = (1,) * t.prepend_axis_num + tuple(t.data.shape)
                where = tuple(slice(o, o + n) for o, n in zip(t.global_offset, local))
                buf[where] = t.data.detach().reshape(local)
                cover[where] += 1
        dist.all_reduce(buf)
        dist.all_reduce(cover)
        assert bool((cover == 1).all()), f"{key}: not every element written by exactly one main replica"
        out[key] = buf[:VOCAB] if "word_embeddings" in key or "output_layer" in key else buf
    return out


def max_diff(a: dict, b: dict) -> tuple:
    """(the largest absolute difference of two gathered states, the key where it is)."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    worst = max(a, key=lambda k: float((a[k] - b[k]).abs().max()))
    return float((a[worst] - b[worst]).abs().max()), worst


def main() -> None:
    out = sys.argv[1]
    ckpt = os.path.join(out, "engine")
    result = {}
    e = engine(2, 1, seed=1)
    steps(e, 0, 2)
    e.save(ckpt)
    saved = gathered(e)
    result["reference"] = steps(e, 2, 2)
    e.load(ckpt)
    result["same_layout"] = steps(e, 2, 2)
    del e
    for name, tp, pp in (("tp1", 1, 1), ("tp2_pp2", 2, 2)):
        e = engine(tp, pp, seed=99)
        e.load(ckpt)
        g = gathered(e)
        diff, worst = max_diff(saved, g)
        result[name] = {"max_diff": diff, "worst": worst, "keys": len(g), "step_count": e.step_count,
                        "losses": steps(e, 2, 2)}
        del e
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
