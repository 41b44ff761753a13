"""Worker of test_positions.py's Triton-interpreter sweep: run in a fresh process so that OPENBLAS_CORETYPE
(numpy's GEMM kernel, which the interpreter's tl.dot calls) and TRITON_INTERPRET take effect before numpy and
triton load. Prints one JSON line: the OpenBLAS core in use, the cases checked and every mismatch."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_lce.op import exact  # noqa: E402
from areal_lce import linear_logprobs_entropy as lce  # noqa: E402

H = 16
FIELDS = ("logprobs", "entropy", "lse", "max_logit", "min_logit")
# segment counts 1..9 with two row-count patterns across the interpreter's row block (16 rows here)
CASES = [(g, ((1, 2, 7, 16, 17, 24), (3, 9, 15, 18, 33, 40))[g % 2]) for g in range(1, 10)]


def core() -> str:
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')} coretype={os.environ.get('OPENBLAS_CORETYPE', 'auto')}"
    except Exception as e:  # numpy without the dict mode: say so rather than guess
        return f"unknown ({type(e).__name__}) coretype={os.environ.get('OPENBLAS_CORETYPE', 'auto')}"


def main() -> None:
    bad, checked = [], 0
    for g_count, rows in CASES:
        v = g_count * exact.SEG - 5
        gen = torch.Generator().manual_seed(40 + g_count)
        n_max = max(rows)
        hidden = torch.randn(n_max, H, generator=gen).bfloat16()
        weight = (torch.randn(v, H, generator=gen) * 0.8).bfloat16()
        labels = torch.randint(0, v, (n_max,), generator=gen)
        labels[min(4, n_max - 1)] = -100

        def call(n):
            return lce(hidden[:n].clone(), weight, labels[:n].clone(), backend="triton", vocab_size=v,
                       temperature=0.7, return_stats=True, invariant=True)
        full = call(n_max)
        for n in rows[:-1]:
            part = call(n)
            checked += 1
            for f in FIELDS:
                if not torch.equal(getattr(part, f), getattr(full, f)[:n]):
                    bad.append(f"V={v} n={n} {f}")
    print(json.dumps({"core": core(), "checked": checked, "mismatches": bad}))


if __name__ == "__main__":
    sys.exit(main())
