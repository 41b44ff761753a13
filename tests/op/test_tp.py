"""Tensor-parallel tests.

* A fake TP group of size 2 in one process (torch.distributed's collectives replaced by recorders):
  the op must issue exactly the collectives its docstring promises, each on the given group and of the
  promised size — forward one MAX and one packed SUM of O(N) elements (plus the API's 2-integer
  shard-size agreement check; the logit sums ride in the same SUM), backward one all-reduce of d_hidden
  (VocabParallel d_hidden="all_reduce"), none with d_hidden="caller", one reduce-scatter under sequence
  parallel ("reduce_scatter", whose forward all-gathers hidden once). The removed keywords tp_group /
  sequence_parallel / reduce_d_hidden raise a TypeError naming VocabParallel.
* The real thing: `torchrun/run_lce_tp2.py --quick --bad-input` on 2 gloo ranks (CPU), which compares
  every sharded result with the unsharded fp64 oracle and checks the clear errors on bad input.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from helpers.kernel_device import interpreter_on
from helpers.paths import REPO
from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank TP group)

from areal_lce import VocabParallel, linear_logprobs_entropy, logprobs_entropy_from_logits

IGNORE = -100


N, H, V_SHARD = 12, 8, 10


def _inputs(sp: bool, n_ignored: int = 2):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N // 2 if sp else N, H, generator=g).requires_grad_()
    weight = torch.randn(V_SHARD, H, generator=g).requires_grad_()
    labels = torch.randint(0, 2 * V_SHARD, (N,), generator=g)
    labels[:n_ignored] = IGNORE
    return hidden, weight, labels


def _split(calls, kind, op=None):
    return [c for c in calls if c["kind"] == kind and (op is None or c["op"] == op)]


def _assert_forward(calls, n_valid: int) -> int:
    """Exactly one fp32 MAX of [max, -min] (2·n) then one fp32 SUM of packed [s, a, z_label] (3·n), plus
    at most one int64 MAX of 2 integers (the API's shard-size agreement check): nothing that grows with
    V or H. n is every row, ignored ones included: they are partitioned on the device, not counted on the
    host, so the sizes are the same on every step. Returns the number of all-reduces."""
    reduces = _split(calls, "all_reduce")
    ints = [c for c in reduces if c["dtype"] == torch.int64]
    floats = [c for c in reduces if c["dtype"] != torch.int64]
    assert [(c["op"], c["numel"]) for c in ints] in ([], [(dist.ReduceOp.MAX, 2)]), calls
    assert [(c["op"], c["dtype"], c["numel"]) for c in floats] == \
        [(dist.ReduceOp.MAX, torch.float32, 2 * n_valid), (dist.ReduceOp.SUM, torch.float32, 3 * n_valid)], calls
    return len(reduces)


@pytest.mark.parametrize("d_hidden", ["all_reduce", "caller"])
def test_fake_group_collectives_non_sp(fake_group, d_hidden):
    hidden, weight, labels = _inputs(sp=False)
    out = linear_logprobs_entropy(hidden, weight, labels, backend="torch",
                                  vocab_parallel=VocabParallel(fake_group, d_hidden))
    fwd = list(fake_group.calls)
    n_reduces = _assert_forward(fwd, n_valid=N)
    assert len(fwd) == n_reduces, fwd  # no all-gather, no reduce-scatter without SP
    fake_group.calls.clear()
    (out.logprobs.sum() + out.entropy.sum()).backward()
    bwd = fake_group.calls
    if d_hidden == "all_reduce":
        # one SUM of d_hidden over the group, in fp32, over every row of this rank's [N, H]
        assert [(c["kind"], c["op"], c["shape"], c["dtype"]) for c in bwd] == \
            [("all_reduce", dist.ReduceOp.SUM, (N, H), torch.float32)], bwd
    else:
        assert bwd == [], bwd  # the caller's mapping reduces it: the op must not
    assert hidden.grad is not None and weight.grad is not None


def test_fake_group_collectives_sequence_parallel(fake_group):
    hidden, weight, labels = _inputs(sp=True)
    out = linear_logprobs_entropy(hidden, weight, labels, backend="torch", temperature=0.8,
                                  vocab_parallel=VocabParallel(fake_group, "reduce_scatter"))
    fwd = list(fake_group.calls)
    gathers = _split(fwd, "all_gather")
    assert [(c["shape"], c["out_shape"]) for c in gathers] == [((N // 2, H), (N, H))], fwd
    n_reduces = _assert_forward(fwd, n_valid=N)
    assert len(fwd) == n_reduces + 1, fwd  # + the all-gather; no reduce-scatter in forward
    fake_group.calls.clear()
    (out.logprobs.sum() - 0.5 * out.entropy.sum()).backward()
    bwd = fake_group.calls
    # one reduce-scatter of the full-sequence fp32 d_hidden to this rank's rows; no all-reduce on top
    assert [(c["kind"], c["shape"], c["out_shape"], c["dtype"]) for c in bwd] == \
        [("reduce_scatter", (N, H), (N // 2, H), torch.float32)], bwd
    assert bwd[0]["op"] == dist.ReduceOp.SUM
    assert hidden.grad.shape == (N // 2, H)


def test_vocab_parallel_bad_input(fake_group):
    hidden, weight, labels = _inputs(sp=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_groups'"):  # a typo stays a TypeError
        linear_logprobs_entropy(hidden, weight, labels, tp_groups=fake_group)
    with pytest.raises(ValueError, match="d_hidden"):
        VocabParallel(fake_group, "sum")
    with pytest.raises(TypeError, match="VocabParallel.group"):
        VocabParallel(2)
    with pytest.raises(TypeError, match="vocab_parallel"):
        linear_logprobs_entropy(hidden, weight, labels, vocab_parallel=fake_group)


def test_fake_group_logit_sums_ride_the_packed_sum(fake_group):
    """return_logit_sums adds two rows (Σr, Σr²) to the forward's one packed SUM: 5·n instead of 3·n
    elements, no extra collective (this rank's shard sums are exactly what the SUM receives)."""
    hidden, weight, labels = _inputs(sp=False)
    out = linear_logprobs_entropy(hidden, weight, labels, backend="torch", vocab_parallel=VocabParallel(fake_group),
                                  return_logit_sums=True)
    n = N  # every row: ignored ones are partitioned on the device, not dropped (see _assert_forward)
    floats = [c for c in _split(fake_group.calls, "all_reduce") if c["dtype"] != torch.int64]
    assert [(c["op"], c["numel"]) for c in floats] == [(dist.ReduceOp.MAX, 2 * n), (dist.ReduceOp.SUM, 5 * n)]
    raw = hidden.detach().double() @ weight.detach().double().t()  # this rank's shard (the fake SUM is identity)
    keep = labels != IGNORE
    assert torch.allclose(out.sum_logit[keep].double(), raw.sum(1)[keep], rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.sumsq_logit[keep].double(), (raw * raw).sum(1)[keep], rtol=1e-5, atol=1e-5)


def test_fake_group_collectives_materialised(fake_group):
    _, _, labels = _inputs(sp=False)
    logits = torch.randn(N, V_SHARD, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = logprobs_entropy_from_logits(logits, labels, vocab_parallel=VocabParallel(fake_group))
    fwd = list(fake_group.calls)
    # MAX of [max, -min] (no grad); one SUM of the packed exp-sum, Σ e·(z−m) and label logit
    assert [(c["op"], c["numel"]) for c in fwd] == [(dist.ReduceOp.MAX, 2 * N), (dist.ReduceOp.SUM, 3 * N)], fwd
    fake_group.calls.clear()
    (out.logprobs.sum() + out.entropy.sum()).backward()
    # backward needs no collective: d_logits follows from the replicated per-row lse and entropy
    assert fake_group.calls == []


def test_materialised_route_takes_the_ops_vocab_parallel(fake_group):
    """logprobs_entropy_from_logits takes the VocabParallel value the fused op takes (whatever its d_hidden:
    only the group matters for logits): the same collectives and bits with either d_hidden."""
    _, _, labels = _inputs(sp=False)
    logits = torch.randn(N, V_SHARD, generator=torch.Generator().manual_seed(1))
    runs = []
    for kw in (dict(vocab_parallel=VocabParallel(fake_group, "caller")), dict(vocab_parallel=VocabParallel(fake_group))):
        x = logits.clone().requires_grad_()
        out = logprobs_entropy_from_logits(x, labels, temperature=0.9, **kw)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        runs.append(([(c["op"], c["numel"]) for c in fake_group.calls], out, x.grad))
        fake_group.calls.clear()
    (calls_a, out_a, g_a), (calls_b, out_b, g_b) = runs
    assert calls_a == calls_b and len(calls_a) == 2
    assert torch.equal(out_a.logprobs, out_b.logprobs) and torch.equal(out_a.entropy, out_b.entropy)
    assert torch.equal(g_a, g_b)
    with pytest.raises(TypeError, match="vocab_parallel must be an areal_lce.VocabParallel"):
        logprobs_entropy_from_logits(logits, labels, vocab_parallel=fake_group)


def test_no_group_no_collectives(fake_group):
    hidden, weight, labels = _inputs(sp=False)
    labels = labels.clamp(max=V_SHARD - 1)  # without a group, weight is the whole vocabulary
    out = linear_logprobs_entropy(hidden, weight, labels, backend="torch")
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert fake_group.calls == []


@pytest.mark.distributed
def test_torchrun_tp2_gloo():
    """2 gloo ranks on CPU: every case of the script against the fp64 oracle, then the bad-input errors."""
    # CPU ranks: the Triton backends only through the interpreter (helpers/kernel_device.py; the ranks inherit it)
    backends = "reference,torch" + (",triton,triton_ascend" if interpreter_on() else "")
    from helpers.launch import torchrun

    proc = torchrun(REPO / "torchrun" / "run_lce_tp2.py", "--quick", "--bad-input", "--device", "cpu",
                    "--backends", backends, timeout=300, cwd=REPO, env={"PYTHONWARNINGS": "ignore::FutureWarning"})
    rows = [line for line in proc.stdout.splitlines() if line.rstrip().endswith(("PASS", "FAIL"))]
    assert rows and all(r.rstrip().endswith("PASS") for r in rows), proc.stdout
    for b in backends.split(",") + ["materialised"]:
        assert any(f" {b} " in r for r in rows), f"no case ran on backend {b}:\n{proc.stdout}"
    assert "PASS: " in proc.stdout and "runs within tolerance (tp=2)" in proc.stdout, proc.stdout
    assert "PASS bad-input: all clear errors" in proc.stdout, proc.stdout
    assert "FAIL" not in proc.stdout, proc.stdout


def test_bench_tp_summarize(tmp_path, capsys, monkeypatch):
    """The TP scaling summary: ratios against the TP=1 run of the same shape and the printed targets."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmark.op.bench_tp import summarize

    def run(tp, rows):
        meta = {"device": "fake-gpu"}
        res = [dict(shape="8x4x16", n=8, h=4, v=16, tp=tp, sp=sp, dtype="bf16", backend="triton", step_ms=ms,
                    step_p20_ms=ms, step_p80_ms=ms, floor_ms=1.0, comm_total_ms=0.5, comm_in_op_ms=None,
                    peak_mem_gib=None) for sp, ms in rows]
        (tmp_path / f"bench_tp_tp{tp}.json").write_text(json.dumps({"meta": meta, "results": res}))

    run(1, [(False, 100.0)])
    run(2, [(False, 50.0), (True, 60.0)])
    run(4, [(False, 25.0)])
    assert summarize(str(tmp_path)) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[1:3]): line for line in out.splitlines() if line.startswith("8x4x16")}
    assert " 0.500 " in rows[("off", "2")] and "ok <=0.55" in rows[("off", "2")]
    assert " 0.600 " in rows[("on", "2")] and "MISS <=0.55" in rows[("on", "2")]
    assert " 0.250 " in rows[("off", "4")] and "ok <=0.30" in rows[("off", "4")]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["meets_target"] for r in summary["rows"] if r["tp"] > 1] == [True, True, False]
