"""benchmark/engine/bench_train.py's paired rounds (--rounds, --isolate): a route's time is its median over
the rounds, a ratio the median of the rounds' own ratios (each round runs every route once, in turn)."""
import pytest

from benchmark.engine.bench_train import merge_rounds, paired_ratio


def _sft(route, step_s, peak):
    return {"route": route, "step_s": step_s, "peak_mem_gib": peak, "peak_reserved_gib": peak + 1,
            "tokens_per_s": 1000 / step_s, "loss": [1.0]}


def test_a_routes_time_is_its_median_over_rounds_and_its_peak_the_largest():
    out = merge_rounds([_sft("fused", s, p) for s, p in ((0.30, 5.0), (0.20, 7.0), (0.25, 6.0))])
    assert out["step_s"] == 0.25 and out["step_s_rounds"] == [0.30, 0.20, 0.25]
    assert out["peak_mem_gib"] == 7.0 and out["peak_reserved_gib"] == 8.0
    assert out["tokens_per_s"] == pytest.approx(1000 / 0.25)


def test_a_ratio_is_the_median_of_the_rounds_ratios_not_of_the_medians():
    # round 2 is slow for both routes (a noisy host): its ratio still pairs the two routes of that round
    a = merge_rounds([_sft("fused", s, 1.0) for s in (0.10, 0.50, 0.12)])
    b = merge_rounds([_sft("megatron", s, 1.0) for s in (0.20, 0.55, 0.10)])
    assert paired_ratio(a, b) == pytest.approx(0.50 / 0.55)  # the rounds' ratios 0.5, 0.909, 1.2
    assert a["step_s"] / b["step_s"] == pytest.approx(0.12 / 0.20)  # what unpaired medians would say


def test_grpo_phases_merge_per_phase_and_an_out_of_memory_round_marks_the_route():
    runs = [{"route": "fused", "phase_s": {"update": u, "rollout": r}, "step_s": u + r, "peak_mem_gib": 1.0,
             "peak_reserved_gib": 2.0} for u, r in ((0.3, 1.0), (0.1, 3.0), (0.2, 2.0))]
    out = merge_rounds(runs)
    assert out["phase_s"] == {"update": 0.2, "rollout": 2.0} and out["step_s"] == pytest.approx(2.2)
    assert merge_rounds([_sft("megatron", 0.2, 1.0), {"route": "megatron", "oom": True}]) == \
        {"route": "megatron", "oom": True}
