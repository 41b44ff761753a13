"""Multi-rank cases of tests/export/test_export.py (gloo, CPU), and the helpers both share.

    python -m torch.distributed.run --nproc_per_node=2 tests/export/export_worker.py QWEN2_DIR QWEN3_DIR OUT_DIR

Imports the Hugging Face checkpoint QWEN2_DIR at TP=2 (with sequence parallelism) and at PP=2 and exports
each into OUT_DIR/tp2 and OUT_DIR/pp2; imports QWEN3_DIR at TP=2 with sequence parallelism, runs one
train_step and saves the gradients of its norm weights (replicated over TP) in OUT_DIR/norm_grads.pt.
Rank 0 writes OUT_DIR/worker.json ({"done": true} or {"error": traceback}).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

warnings.filterwarnings("ignore")

from areal_lce.engine.config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402
from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from areal_lce.export import export_hf  # noqa: E402

VOCAB = 300  # megatron pads it to 384 (and at TP=2 too): the export must cut the embedding and LM head back


def make_checkpoint(path, family: str, tied: bool, seed: int = 0, vocab: int = VOCAB) -> None:
    """A tiny random transformers model (random norm weights and q/k/v biases, so no layout hides behind
    ones and zeros) saved as safetensors. Qwen3's head_dim (24) is not hidden/heads (16)."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=tied,
              max_position_embeddings=256)
    cls = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config"}[family]
    cfg = getattr(transformers, cls)(**kw, **({"head_dim": 24} if family == "qwen3" else {}))
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)


def batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[0, 2] = VOCAB - 1  # the last true row, next to the padding rows
    return ids, labels


def _nll(stats, mb):
    return -stats.logprobs.sum() / (mb.labels != -100).sum().clamp(min=1), {}


def norm_grads(hf_dir, parallel: ParallelConfig) -> dict:
    """Gradients of every norm weight (q/k norms included) after one train_step on `batch()` at lr 0."""
    cfg = EngineConfig(model=ModelConfig(hf_checkpoint_dir=str(hf_dir), max_seq_len=64), parallel=parallel,
                       optim=OptimConfig(lr=0.0, clip_grad=0.0), lce=LCEConfig(backend="torch"))
    engine = MegatronEngine(cfg)
    engine.train_step([MicroBatch(*batch())], _nll)
    return {n: g for n, g in engine.grads().items() if "layernorm" in n}


def main() -> None:
    qwen2, qwen3, out = sys.argv[1:4]
    result = {}
    try:
        for name, parallel in (("tp2", ParallelConfig(tensor_parallel=2, sequence_parallel=True)),
                               ("pp2", ParallelConfig(pipeline_parallel=2))):
            cfg = EngineConfig(model=ModelConfig(hf_checkpoint_dir=qwen2, max_seq_len=64), parallel=parallel,
                               lce=LCEConfig(backend="torch"))
            export_hf(MegatronEngine(cfg, trainable=False), os.path.join(out, name))
        grads = norm_grads(qwen3, ParallelConfig(tensor_parallel=2, sequence_parallel=True))
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(grads, os.path.join(out, "norm_grads.pt"))
        result["done"] = True
    except Exception:  # reported to pytest through the result file
        result["error"] = traceback.format_exc()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "worker.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
