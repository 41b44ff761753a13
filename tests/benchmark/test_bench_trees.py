"""benchmark/op/bench_trees.py: a tree's time over another's is the median of the rounds' ratios of
GEMM-normalised times (each round's two children time their own cuBLAS GEMM), and its arguments are checked
before any child runs."""
import pytest

from benchmark.op.bench_trees import compare, main


def _child(gemm, fwd, fwd_bwd, peak=1.0):
    return {"small": {"gemm": gemm, "fwd": fwd, "fwd_bwd": fwd_bwd, "peak_gib": peak}}


def test_a_ratio_divides_each_childs_time_by_its_own_gemm_and_pairs_the_round():
    rounds = [
        # round 1: the base child ran at a lower clock (its GEMM 10% slower): normalised, the trees tie
        {"this": _child(1.0, 2.0, 8.0), "base": _child(1.1, 2.2, 8.8, peak=1.5)},
        # round 2: this tree 2% slower at the same clock
        {"this": _child(1.0, 2.0, 8.16), "base": _child(1.0, 2.0, 8.0)},
        # round 3: a slow host for both (the clocks equal): the ratio of the round still pairs them
        {"this": _child(1.0, 3.0, 12.0), "base": _child(1.0, 3.0, 12.0)},
    ]
    row = compare(rounds, ["small"])["small"]
    assert row["fwd_bwd"]["ratio_rounds"] == pytest.approx([1.0, 1.02, 1.0])
    assert row["fwd_bwd"]["ratio"] == pytest.approx(1.0)  # the median of the rounds' ratios
    assert row["fwd_bwd"]["this"] == 8.16 and row["fwd_bwd"]["base"] == 8.8  # the medians of the raw times
    assert row["fwd"]["ratio"] == pytest.approx(1.0)
    assert row["peak_gib"] == {"this": 1.0, "base": 1.5}  # the largest over the rounds


def test_arguments_are_checked_before_a_child_runs(tmp_path):
    with pytest.raises(SystemExit, match="--shapes: unknown"):
        main(["--shapes", "small,huge", "--base", str(tmp_path)])
    with pytest.raises(SystemExit, match="--base must be a tree holding areal_lce/"):
        main(["--base", str(tmp_path)])  # no areal_lce/ there
