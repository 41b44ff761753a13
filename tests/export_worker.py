"""Multi-rank HF export for tests/test_export.py (gloo, CPU).

    python -m torch.distributed.run --nproc_per_node=2 tests/export_worker.py HF_DIR OUT_DIR

Imports the Hugging Face checkpoint HF_DIR at TP=2 (with sequence parallelism) and at PP=2, and exports each
into OUT_DIR/tp2 and OUT_DIR/pp2; rank 0 writes OUT_DIR/worker.json ({"done": true} or {"error": ...}).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_lce.megatron.config import EngineConfig, LCEConfig, ModelConfig, ParallelConfig  # noqa: E402
from areal_lce.megatron.engine import MegatronEngine  # noqa: E402


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    result = {}
    try:
        for name, parallel in (("tp2", ParallelConfig(tensor_parallel=2, sequence_parallel=True)),
                               ("pp2", ParallelConfig(pipeline_parallel=2))):
            cfg = EngineConfig(model=ModelConfig(hf_checkpoint_dir=hf_dir, max_seq_len=64), parallel=parallel,
                               lce=LCEConfig(backend="torch"))
            MegatronEngine(cfg, trainable=False).export_hf(os.path.join(out, name))
        result["done"] = True
    except Exception:  # reported to pytest through the result file
        result["error"] = traceback.format_exc()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "worker.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
