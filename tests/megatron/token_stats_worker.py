"""TP=2 cases of tests/megatron/test_token_stats.py on a user-built GPTModel (gloo, CPU), one launch for all.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/megatron/token_stats_worker.py OUT.json

Every case compares token_stats (fused and fused=False) with megatron's own oracle (gpt_builder.oracle):
per-token values and every parameter's gradient on this rank; the worst error over ranks is reported.
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

from helpers.paths import REPO
from helpers import gpt_builder as G  # noqa: E402

from areal_lce.op import comms  # noqa: E402
from areal_lce.megatron import token_stats  # noqa: E402


def compare(model, ids, labels, temperature, **kw) -> dict:
    """gpt_builder.compare_routes' errors, the worst over the TP ranks."""
    out, _ = G.compare_routes(model, ids, labels, temperature, **kw)
    worst = torch.tensor([out[k] for k in sorted(out)], dtype=torch.float64)
    comms.all_reduce_max_(worst, None)  # worst error over the TP ranks (metrics only)
    return dict(zip(sorted(out), worst.tolist()))


def temperature_of(kind: str, labels):
    if kind == "scalar":
        return 0.7
    g = torch.Generator().manual_seed(11)
    return torch.rand(labels.shape[0], 1, generator=g) + 0.5  # per sequence, broadcast over tokens


def bshd_case(sp: bool, tied: bool, temp: str) -> dict:
    model = G.build_gpt(tp=2, sp=sp, tied=tied)
    ids, labels, _ = G.batch(1)
    return compare(model, ids, labels, temperature_of(temp, labels))


def thd_case(sp: bool, tied: bool, temp: str) -> dict:
    """Packed sequences of batch(1) (T padded to a multiple of TP under SP)."""
    from areal_lce.megatron import pack_rows

    model = G.build_gpt(tp=2, sp=sp, tied=tied)
    ids, labels, _ = G.batch(1)
    rows = pack_rows(ids, labels, pad_to_multiple=2)
    lab = rows.labels
    t = 0.7
    if temp == "per_token":  # laid out like the packed labels [1, T]
        t = torch.rand(1, rows.input_ids.shape[1], generator=torch.Generator().manual_seed(3)) + 0.5
    return compare(model, rows.input_ids, lab, t, position_ids=rows.position_ids,
                   packed_seq_params=rows.packed_seq_params())


def parallel_output_false_case() -> dict:
    model = G.build_gpt(tp=2, sp=False, tied=False)
    model.parallel_output = False
    model.output_layer.gather_output = True
    ids, labels, _ = G.batch(2)
    out = {}
    for fused in (True, False):
        st = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=0.9, fused=fused, backend="torch")
        out["fused" if fused else "mat"] = st
    model.parallel_output = True
    model.output_layer.gather_output = False
    ref = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=0.9, fused=False, backend="torch")
    return {f"{tag}_d_lp": float((st.logprobs - ref.logprobs).abs().max()) for tag, st in out.items()} | \
        {f"{tag}_d_ent": float((st.entropy - ref.entropy).abs().max()) for tag, st in out.items()}


def sp_length_error_case() -> dict:
    model = G.build_gpt(tp=2, sp=True)
    ids, labels, _ = G.batch(1, s=15)
    try:
        token_stats(model, ids, labels, vocab_size=G.VOCAB)
    except ValueError as e:
        return {"message": str(e)}
    return {"message": ""}


def example_case() -> dict:
    """The documented example (torchrun/token_stats_example.py) at TP=2 + SP, BSHD and THD."""
    sys.path.insert(0, str(REPO / "torchrun"))
    import token_stats_example

    return token_stats_example.main(tp=2, sequence_parallel=True)


CASES = {f"bshd-sp{int(sp)}-{'tied' if tied else 'untied'}-{temp}": (bshd_case, (sp, tied, temp))
         for sp in (False, True) for tied in (False, True) for temp in ("scalar", "per_seq")}
CASES.update({f"thd-sp{int(sp)}-{'tied' if tied else 'untied'}-{temp}": (thd_case, (sp, tied, temp))
              for sp in (False, True) for tied, temp in ((False, "scalar"), (True, "per_token"))})
CASES.update({"parallel_output_false": (parallel_output_false_case, ()),
              "sp_length_error": (sp_length_error_case, ()), "example": (example_case, ())})


def main(out_path: str) -> None:
    results = {}
    for name, (fn, args) in CASES.items():
        try:
            results[name] = fn(*args)
        except Exception:  # reported to pytest, which fails the case with this text
            results[name] = {"error": traceback.format_exc()[-3000:]}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():  # megatron-core on a CPU-only host
        main(sys.argv[1])
