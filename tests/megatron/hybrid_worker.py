"""TP=2 cases of tests/megatron/test_hybrid.py on a HybridModel of megatron's local modules (gloo, CPU), one launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/megatron/hybrid_worker.py OUT.json

Each case runs hybrid_builder.check_routes (token_stats, fused and materialised, against the model's own
materialised log_softmax within fp32 bounds) on every rank; the worst value over the ranks is reported.
Rank 0 writes {case: {metric: value}} to OUT.json (an exception is reported as {"error": text}).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

warnings.filterwarnings("ignore")

from helpers import gpt_builder as G  # noqa: E402
import hybrid_builder as HB  # noqa: E402

from areal_lce.op import comms  # noqa: E402


def worst_over_ranks(result: dict) -> dict:
    values = torch.tensor([float(result[k]) for k in sorted(result)], dtype=torch.float64)
    comms.all_reduce_max_(values, None)  # the worst value over the TP ranks (metrics only)
    return dict(zip(sorted(result), values.tolist()))


def bshd_case(sp: bool, tied: bool) -> dict:
    model = HB.build_hybrid(tp=2, sp=sp, tied=tied)
    ids, labels, _ = G.batch(1)
    t = torch.rand(labels.shape[0], 1, generator=torch.Generator().manual_seed(11)) + 0.5  # per sequence
    return worst_over_ranks(HB.check_routes(model, ids, labels, t))


def thd_case(sp: bool) -> dict:
    """Packed sequences of batch(1) (T padded to a multiple of TP), per-token temperatures."""
    from areal_lce.megatron import pack_rows

    model = HB.build_hybrid(tp=2, sp=sp)
    ids, labels, _ = G.batch(1)
    rows = pack_rows(ids, labels, pad_to_multiple=2)
    t = torch.rand(1, rows.input_ids.shape[1], generator=torch.Generator().manual_seed(3)) + 0.5
    return worst_over_ranks(HB.check_routes(model, rows.input_ids, rows.labels, t, position_ids=rows.position_ids,
                                            packed_seq_params=rows.packed_seq_params()))


# why each case: TP without SP (the head's all-reduce of d_hidden), TP+SP (its all-gather / reduce-scatter)
# with the tied weight sharded over TP, THD packing under SP (T padded to a multiple of TP)
CASES = {"bshd-sp0-untied": (bshd_case, (False, False)), "bshd-sp1-tied": (bshd_case, (True, True)),
         "thd-sp1": (thd_case, (True,))}


def _run(fn, args) -> dict:
    try:
        return fn(*args)
    except Exception:  # reported to pytest, which fails the case with this text
        return {"error": traceback.format_exc()[-3000:]}


def main(out_path: str) -> None:
    results = {name: _run(fn, args) for name, (fn, args) in CASES.items()}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():  # megatron-core on a CPU-only host (the SP backward's buffers too)
        main(sys.argv[1])
