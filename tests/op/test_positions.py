"""Position sweeps of the invariance contract (docs/op.md, "Consistency"): an element's bits must not follow
where it falls in a tensor. A CPU's elementwise loop computes whole vector chunks with one implementation
of a function and the remainder with another, so with a library exp2 / log the element at position p of a
[segments, rows] tensor rounds one way when p lies in a vector chunk and another way in the tail, and which
one it is follows the row count and the segment count. These sweeps vary both across several vector steps
(16 fp32 lanes on AVX-512, 8 on AVX2) and compare each prefix of the rows, computed alone, with the same
rows of the full call: the int64 fixed-point fold and every output, bitwise.

They exercise the positions themselves, so they mean the same on any CPU: with torch.exp2 / torch.log in
exact.py they fail under AVX-512 and AVX2 alike (about 6% of fp32 inputs round differently between SLEEF's
vector exp2 and the scalar one). test_positions_interpreter.py runs the Triton kernels' sweep under two
OpenBLAS kernels.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_lce.op import exact
from areal_lce import linear_logprobs_entropy as lce
from areal_lce.op.materialised import logprobs_entropy_from_logits
from helpers.cpu import cpu_flags

ROWS = 40  # prefixes 1..40: past two AVX-512 and five AVX2 vector steps of fp32
SEGMENTS = range(1, 10)  # segment counts 1..9: the fold's [G, N] tensor takes every size mod the vector width
H = 16
IGNORE = -100


def _partials(g_count: int, n: int, seed: int):
    """Segment partials [3, G, N] as a backend leaves them (rmax, s in [1, 128], a <= 0), a global max per row
    and a per-row 1/T: the shifts (rmax - mx)·inv_t·log2(e) spread over [-30, 0]."""
    g = torch.Generator().manual_seed(seed)
    rmax = torch.randn(g_count, n, generator=g) * 6
    mx = rmax.amax(0)
    s = 1 + torch.rand(g_count, n, generator=g) * 127
    a = -torch.rand(g_count, n, generator=g) * 40
    inv_t = 0.5 + torch.rand(n, generator=g)
    return torch.stack([rmax, s, a]), mx, inv_t


@pytest.mark.parametrize("g_count", SEGMENTS)
def test_fold_and_finish_do_not_follow_the_row_count(g_count):
    seg, mx, inv_t = _partials(g_count, ROWS, seed=g_count)
    zy = mx * inv_t - 3.0
    q_full = exact.fold_segments(seg, mx, inv_t)
    f_full = exact.finish(q_full, zy, mx, mx - 9, inv_t)
    bad = []
    for n in range(1, ROWS + 1):
        q = exact.fold_segments(seg[:, :, :n].contiguous(), mx[:n].clone(), inv_t[:n].clone())
        if not torch.equal(q, q_full[:, :n]):
            bad.append(f"fold n={n}: {int((q != q_full[:, :n]).sum())} int64 terms")
            continue
        f = exact.finish(q, zy[:n].clone(), mx[:n].clone(), mx[:n] - 9, inv_t[:n].clone())
        for name in ("lp", "ent", "lse"):
            if not torch.equal(getattr(f, name), getattr(f_full, name)[:n]):
                bad.append(f"finish n={n}: {name}")
    assert not bad, f"G={g_count}: " + "; ".join(bad[:8])


@pytest.mark.parametrize("g_count", [1, 2, 3, 5, 9])
def test_segment_stats_do_not_follow_rows_or_width(g_count):
    """Each row's segment partials alone equal its partials in the full block and in a wider block."""
    g = torch.Generator().manual_seed(10 + g_count)
    width = g_count * exact.SEG
    r = torch.randn(ROWS, width + exact.SEG, generator=g) * 4
    inv_t = 0.5 + torch.rand(ROWS, generator=g)
    valid = width - 37  # the last segment partly padding
    full = exact.segment_stats_torch(r[:, :width].contiguous(), inv_t, valid, True)
    wide = exact.segment_stats_torch(r, inv_t, valid, True)[:, :g_count]
    assert torch.equal(wide, full)
    for n in range(1, ROWS + 1, 3):
        part = exact.segment_stats_torch(r[:n, :width].contiguous(), inv_t[:n].clone(), valid, True)
        assert torch.equal(part, full[:, :, :n]), n


def _op_inputs(v: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, H, generator=g)
    weight = torch.randn(v, H, generator=g) * 0.8
    weight[v // 2] = hidden[0] * 0.9  # one peaked row
    labels = torch.randint(0, v, (ROWS,), generator=g)
    labels[[4, 17]] = IGNORE
    labels[5] = v - 1
    return hidden.bfloat16(), weight.bfloat16(), labels


FIELDS = ("logprobs", "entropy", "lse", "max_logit", "min_logit")


# the op-level sweeps: prefixes on both sides of the 8- and 16-lane steps (a whole sweep of 1..40 costs
# 4 s a segment count on 2 cores and adds no position the fold sweep above does not already take)
PREFIXES = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33)


def _prefix_mismatches(call, hidden, labels):
    full = call(hidden, labels)
    bad = []
    for n in PREFIXES:
        part = call(hidden[:n].clone(), labels[:n].clone())
        for f in FIELDS:
            if not torch.equal(getattr(part, f), getattr(full, f)[:n]):
                bad.append(f"n={n} {f}")
    return bad


@pytest.mark.parametrize("g_count", SEGMENTS)
def test_torch_backend_outputs_do_not_follow_the_row_count(g_count):
    v = g_count * exact.SEG - 5
    hidden, weight, labels = _op_inputs(v, seed=20 + g_count)

    def call(h, y):
        return lce(h, weight, y, backend="torch", vocab_size=v, temperature=0.7, return_stats=True, invariant=True)
    bad = _prefix_mismatches(call, hidden, labels)
    assert not bad, f"V={v}: " + "; ".join(bad[:8])


@pytest.mark.parametrize("g_count", SEGMENTS)
def test_materialised_invariant_outputs_do_not_follow_the_row_count(g_count):
    v = g_count * exact.SEG - 5
    hidden, weight, labels = _op_inputs(v, seed=30 + g_count)
    logits = hidden.float() @ weight.float().t()

    def call(h, y):
        return logprobs_entropy_from_logits(logits[: h.shape[0]].clone(), y, temperature=0.7, invariant=True)
    bad = _prefix_mismatches(call, hidden, labels)
    assert not bad, f"V={v}: " + "; ".join(bad[:8])


def test_portable_exp2_and_log():
    """exact.exp2 / exact.log: the same bits for every prefix and stride of the input (torch.exp2 fails this on
    any x86 vector path), within 0.51 ulp of fp64's exp2 and a few fp64 ulp of log, and the edge values."""
    g = torch.Generator().manual_seed(3)
    x = -torch.rand(4099, generator=g) * 40
    y = exact.exp2(x)
    for n in list(range(1, 70)) + [1000, 4098]:
        assert torch.equal(exact.exp2(x[:n].clone()), y[:n]), n
    assert torch.equal(exact.exp2(x[1::3]), y[1::3])
    ref = torch.exp2(x.double())
    ulp = (torch.nextafter(ref.float(), torch.tensor(math.inf)).double() - ref.float().double())
    assert float(((y.double() - ref).abs() / ulp).max()) <= 0.51
    edge = exact.exp2(torch.tensor([0.0, -1.0, -0.5, -126.5, -math.inf, math.nan]))
    assert edge[:2].tolist() == [1.0, 0.5] and edge[3:5].tolist() == [0.0, 0.0] and edge[5].isnan()
    s = 1 + torch.rand(3001, generator=g, dtype=torch.float64) * 2.0 ** 45
    ls = exact.log(s)
    for n in range(1, 40):
        assert torch.equal(exact.log(s[:n].clone()), ls[:n]), n
    rel = ((ls - torch.log(s)).abs() / torch.log(s).clamp_min(1e-300))
    assert float(rel.max()) <= 8 * 2.0 ** -53
    assert exact.log(torch.tensor([1.0], dtype=torch.float64)).item() == 0.0
    e = torch.arange(-60, 61)
    assert torch.equal(exact.pow2(e), torch.tensor([2.0 ** int(i) for i in e], dtype=torch.float64))


def _openblas_cores() -> tuple:
    """Two OpenBLAS kernels this CPU can run: SkylakeX and Haswell on AVX-512 machines (numpy picks the first
    on its own there), Haswell and Sandybridge on AVX2 ones, else the generic Prescott and Core2."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return ("SkylakeX", "Haswell")
    if "avx2" in flags:
        return ("Haswell", "Sandybridge")
    return ("Prescott", "Core2")


@pytest.mark.slow
@pytest.mark.parametrize("core", _openblas_cores())
def test_triton_interpreter_outputs_do_not_follow_the_row_count(core):
    """The Triton kernels (interpreter) over segment counts 1..9 and row prefixes on both sides of the row
    block, under two OpenBLAS kernels for the interpreter's tl.dot: each prefix's bits equal the full call's."""
    env = dict(os.environ, OPENBLAS_CORETYPE=core, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("positions_interpreter_worker.py"))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res["core"])
    assert res["checked"] == 45 and not res["mismatches"], res
