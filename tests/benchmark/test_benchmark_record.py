"""The benchmark record reads as one: each question (a row of benchmark/README.md) has exactly one current
result folder, every other run is archived and leads by `superseded_by` to a current one, every manifest
states device, versions, commit and date, no experiment script sits beside a current run, the figures of the
checked tables (benchmark/README.md's headlines, docs/benchmarks.md's current tables) are in the manifests
of the current runs they cite, and every result path a doc or code comment cites resolves.
"""
import json

import pytest

from benchmark import results_docs as rd
from benchmark import results_index as ri
from helpers.paths import REPO

RESULTS = REPO / "benchmark" / "results"


def _manifest(**kw):
    m = dict(command="python -m benchmark.op.bench_lce --out x", commit="7ac9e0e", device="NVIDIA H100 80GB HBM3",
             versions={"torch": "2.11.0"}, date="2026-11-22", status="current",
             what="fwd+bwd 1.085 / 0.993, 115.2 ms, 20.46 GiB, gpu_check 71/71, 94% ignored")
    m.update(kw)
    return {k: v for k, v in m.items() if v is not None}


def _put(root, folder, m, files=()):
    (root / folder).mkdir(parents=True)
    (root / folder / "manifest.json").write_text(json.dumps(m))
    for f in files:
        (root / folder / f).write_text("print(1)\n")


def test_the_committed_record_has_one_current_run_per_question():
    assert ri.problems(RESULTS) == []
    current = {}
    for f in ri.folders(RESULTS):
        m = ri.load(RESULTS, f)
        assert m["status"] == ("historical" if f.startswith("archive/") else "current"), f
        if m["status"] == "current":
            current.setdefault(ri.question(f), []).append(f)
        else:
            assert m.get("superseded_by"), f
    assert {q: len(fs) for q, fs in current.items()} == {q: 1 for q in ri.QUESTIONS}


def test_a_second_current_folder_of_a_question_fails(tmp_path):
    _put(tmp_path, "h100_op_peers", _manifest())
    _put(tmp_path, "archive/h100_op_old", _manifest(status="historical", superseded_by="h100_op_peers"))
    assert ri.problems(tmp_path) == []
    _put(tmp_path, "h200_op_again", _manifest())
    found = "\n".join(ri.problems(tmp_path))
    assert "question 'op' has 2 current folders (h100_op_peers, h200_op_again)" in found, found


def test_a_question_left_without_a_current_run_or_a_chain_ending_elsewhere_fails(tmp_path):
    _put(tmp_path, "h100_select_now", _manifest())
    _put(tmp_path, "archive/h100_op_a", _manifest(status="historical", superseded_by="archive/h100_op_b"))
    _put(tmp_path, "archive/h100_op_b", _manifest(status="historical", superseded_by="archive/h100_op_a"))
    found = "\n".join(ri.problems(tmp_path))
    assert "question 'op' has 0 current folders (none)" in found, found
    assert "archive/h100_op_a/manifest.json: superseded_by leads archive/h100_op_a -> archive/h100_op_b" in found


@pytest.mark.parametrize("key", ["device", "versions", "commit", "date"])
def test_a_manifest_without_device_versions_commit_or_date_fails(tmp_path, key):
    _put(tmp_path, "h100_op_peers", _manifest(**{key: None}))
    assert f"h100_op_peers/manifest.json: missing '{key}'" in "\n".join(ri.problems(tmp_path))


def test_an_experiment_script_beside_a_current_run_fails(tmp_path):
    _put(tmp_path, "h100_profile_step", _manifest(command="python3 benchmark/results/h100_profile_step/prof.py"),
         files=["prof.py"])
    _put(tmp_path, "archive/h100_profile_trial", _manifest(status="historical", superseded_by="h100_profile_step"),
         files=["trial.py"])  # a trial's script lives with its archived result
    assert ri.problems(tmp_path) == []
    (tmp_path / "h100_profile_step" / "sweep.py").write_text("print(2)\n")
    found = "\n".join(ri.problems(tmp_path))
    assert "h100_profile_step/sweep.py: a script beside a current run that its command does not run" in found, found


def test_figures_are_decimals_counts_and_numbers_with_units():
    text = ("4096×896×151936 | 8192 (4×2048) | **1.10** / 1.12 | 115 ms, 20.5 GiB | 71/71 | `1.5` | 94% | 3.8e-6 "
            "| TP=2")
    assert [f[0] for f in rd.figures(text)] == ["1.10", "1.12", "115", "20.5", "71/71", "94", "3.8e-6"]
    held = "ratios 1.096 / 1.115; 115.2 ms, 20.46 GiB; gpu_check 71/71; 94% ignored; |dlogp| 3.8e-06"
    assert all(rd.held(f, held) for f in rd.figures(text))
    assert not rd.held(rd.figures("1.13")[0], held) and not rd.held(rd.figures("116 ms")[0], held)
    assert not rd.held(rd.figures("7/71")[0], held) and not rd.held(rd.figures("3.9e-6")[0], held)


def test_the_committed_docs_hold_only_current_figures_and_resolving_paths():
    assert rd.problems() == []


def test_a_readme_headline_figure_or_result_that_is_not_current_fails():
    text = (REPO / rd.README).read_text(encoding="utf-8")
    assert rd.check_readme(text) == []
    changed = text.replace("115 vs 137 ms", "114 vs 137 ms")
    assert rd.check_readme(changed) == [f"{rd.README}:{_line(text, '115 vs 137 ms')}: figure 114 is not in "
                                        "h100_train_megatron_own/manifest.json"]
    two = text.replace("`results/h100_train_megatron_own`", "`results/h100_train_megatron_own`, `results/x`")
    assert "the result of question 'train' must be `results/h100_train_megatron_own`" in "\n".join(rd.check_readme(two))


def test_a_narration_table_figure_no_current_manifest_holds_fails():
    text = (REPO / rd.NARRATION).read_text(encoding="utf-8")
    assert rd.check_narration(text) == []
    row = "| 1× H100, 0.5B-shaped | 8192 (4×2048) | **115 ms, 20.5 GiB** |"
    assert row in text
    bad = rd.check_narration(text.replace(row, row.replace("20.5 GiB", "20.8 GiB")))
    assert bad == [f"{rd.NARRATION}:{_line(text, row)}: figure 20.8 is in no manifest of the current folders its "
                   f"section cites ({_cited(bad)})"], bad
    # a table whose section cites only an archived run: its figures are in no current manifest
    archived = ("## A section\n\n`results/archive/h200x2_invariant_tp2/`\n\n"
                "| what | cost |\n|---|---|\n| TP=2 | 1.001 |\n")
    assert rd.check_narration(archived + "\n" + text)[0].endswith("figure 1.001 is in no manifest of the current "
                                                                  "folders its section cites (none)")
    # prose and the historical sections are not checked tables
    later = text.replace(rd.HISTORICAL, rd.HISTORICAL + "\n\n| a | b |\n|---|---|\n| x | 9.99 |")
    assert rd.check_narration(later) == []


def test_a_cited_result_path_that_does_not_resolve_fails():
    text = "see benchmark/results/h100_op_peers/combined/ and benchmark/results/archive/h100_op_run3_tma_sweep\n" \
           "and results/h100_train_model_graphs/run2 (a former name)\n"
    assert rd.check_cited("x.md", text, rd.BARE) == []
    assert rd.check_cited("x.md", text + "benchmark/results/h100_op_gone/a.json\n", rd.BARE) == \
        ["x.md:3: cites benchmark/results/h100_op_gone/a.json, which does not exist"]
    assert rd.check_cited("x.md", "(h100_select_stream, same kernels; archive/h100_select_picks)", rd.FULL) == []
    assert rd.check_cited("x.md", "a later run (h100_select_gone, same kernels)", rd.FULL) == \
        ["x.md:1: cites benchmark/results/h100_select_gone, which does not exist"]
    cited = dict(rd.citing())
    for doc in ("README.md", "docs/op.md", "benchmark/README.md", "torchrun/README.md", "areal_lce/engine/graphs.py",
                "benchmark/op/lce_run.py"):
        assert doc in cited, doc


def _line(text, s):
    return next(n for n, ln in enumerate(text.splitlines(), 1) if s in ln)


def _cited(bad):
    return bad[0].rsplit("(", 1)[1].rstrip(")") if bad else ""
