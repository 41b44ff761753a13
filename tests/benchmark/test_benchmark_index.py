"""benchmark/results/: every result folder has a valid manifest.json and a name of the one scheme, README.md
is the index generated from them (`python -m benchmark.results_index --check`), every former folder name
still finds its folder, and the docs' first-measurements table is what `bench_lce --merge` prints from the
committed result files. The record's shape (one current run per question) and the docs' figures and paths:
test_benchmark_record.py.
"""
import json
import re

import pytest

from benchmark import results_index as ri
from helpers.paths import REPO

RESULTS = REPO / "benchmark" / "results"

# Folder names that notes, commit messages and code comments cited before the one naming scheme: each must
# keep resolving to its folder.
FORMER = """combined cp_h200x2 h100_attention_packing_rollout h100_bench_lce_peers h100_bench_lce_rawmax
h100_bench_lce_warm_rounds h100_check_kernel h100_chunk_budget h100_compact_choice h100_engine_pinned
h100_graph_decode h100_invariant h100_logprob_budget h100_model_graphs h100_packing h100_persistent_bwd
h100_rope_fusion h100_select h100_sft_largest_grpo_lean h100_sft_megatron_own h100_softcap
h200x2_cp2_megatron_own h200x2_decode_tp2_cp2_long h200x2_tp2_7b_largest h200x2_tp2_cp2
h200x2_tp2_select_materialised h200x2_tp2_sft_megatron_own h200x4_tp run10_large_rep2000 run3_tma_sweep
run8_final_small_qwen7b run9_final_large train train_sampler archive/h100_alternating_pairs
archive/h100_backward_overlap_trials archive/h100_engine_syncfree archive/h100_gpu_check_bench_lce_syncfree
archive/h100_kernel_trials archive/run11_gpu_check_chunks archive/run12_tma_store_sweep
archive/run2_correctness_sweep archive/run4_bench_small_qwen7b archive/run5_areal_small_qwen7b
archive/run5_bench_large archive/run5_chunk_gemms archive/run6_bench_small_qwen7b
archive/run7_label_split_tpp h100_op_run8_final_small_qwen7b h100_select_softcap_stream
h200x2_tp_select_materialised h200x2_train_tp2_megatron_own h100_train_largest_grpo_lean h200x2_train_tp2_7b_largest
h100_train_model_graphs h200x2_cp_long_decode_tp2 h200_check_after_split h100_softcap_liger_tiles""".split()


def test_every_result_folder_has_a_valid_manifest_and_name():
    names = ri.folders(RESULTS)
    assert "h100_op_peers" in names and any(n.startswith("archive/") for n in names)
    assert ri.problems(RESULTS) == []
    for name in names:
        m = ri.load(RESULTS, name)
        assert set(ri.REQUIRED) <= set(m) and m["status"] in ri.STATUSES, name
        assert (m["status"] == "current") <= (not name.startswith("archive/")), name
        assert ri.check_name(name) == [], name


def test_readme_is_the_generated_index():
    assert ri.main(["--check"]) == 0, "benchmark/results/README.md is stale: run python -m benchmark.results_index"
    text = (RESULTS / "README.md").read_text(encoding="utf-8")
    for name in ri.folders(RESULTS):
        assert f"[{name}]({name}/)" in text
    for old in FORMER:
        assert f"| {old} | [" in text, old


def test_every_former_name_resolves():
    old = ri.aliases(RESULTS)
    for name in FORMER:
        assert name in old and len(old[name]) == 1, name
        assert (RESULTS / old[name][0] / "manifest.json").is_file(), name
        assert not (RESULTS / name).exists(), name  # the old folder is gone: the name moved
    assert ri.resolve("run8_final_small_qwen7b/bench_lce.json").is_file()
    assert ri.resolve("h100_op_run8_final_small_qwen7b/bench_lce.json") == \
        RESULTS / "archive" / "h100_op_run8_final_small_qwen7b" / "bench_lce.json"
    assert ri.resolve("archive/h100_alternating_pairs/probe_ab.log") == \
        RESULTS / "archive" / "h100_op_alternating_pairs" / "probe_ab.log"
    assert ri.resolve("h100_op_peers/gpu_check") == RESULTS / "h100_op_peers" / "gpu_check"  # current names pass


def _manifest(**kw):
    m = dict(command="python -m benchmark.op.bench_lce", commit="7ac9e0e", device="NVIDIA H100 80GB HBM3",
             versions={"torch": "2.11.0"}, date="2026-11-22", status="current", what="one line")
    m.update(kw)
    return {k: v for k, v in m.items() if v is not None}


def test_check_names_each_problem(tmp_path, capsys):
    def put(folder, m):
        (tmp_path / folder).mkdir(parents=True)
        if m is not None:
            (tmp_path / folder / "manifest.json").write_text(json.dumps(m))

    put("h100_op_good", _manifest(formerly=["run1_good"]))
    put("h100_op_no_manifest", None)
    put("h100_op_bad_status", _manifest(status="cited"))
    put("archive/h100_op_current_inside", _manifest())
    put("archive/h100_op_dangling", _manifest(status="historical", superseded_by="nowhere"))
    put("archive/h100_op_unexplained", _manifest(status="historical", note="a trial"))
    put("h100_op_old_on_top", _manifest(status="historical", superseded_by="h100_op_good"))
    put("h100_op_missing_key", _manifest(commit=None, colour="blue", date="22.11.2026"))
    put("run5_old_scheme", _manifest())
    put("h100_op", _manifest())
    put("h100_kernels_sweep", _manifest())
    put("h100_op_claims_too", _manifest(formerly=["run1_good", "h100_op_good"]))
    put("h100_op_bad_formerly", _manifest(formerly="run0"))
    put("archive/h100_op_old", _manifest(status="historical", superseded_by="h100_op_good"))
    found = "\n".join(ri.problems(tmp_path))
    for expected in ("h100_op_no_manifest/: no manifest.json",
                     "h100_op_bad_status/manifest.json: 'status' must be one of",
                     "archive/h100_op_current_inside/manifest.json: a current run does not belong",
                     "archive/h100_op_dangling/manifest.json: superseded_by 'nowhere'",
                     "archive/h100_op_unexplained/manifest.json: a historical run names 'superseded_by'",
                     "h100_op_old_on_top/manifest.json: a historical run belongs in results/archive/",
                     "h100_op_missing_key/manifest.json: missing 'commit'", "unknown key 'colour'",
                     "'date' must be YYYY-MM-DD", "run5_old_scheme/: device 'run5' is not a card", "h100_op/: name does not follow <device>_<question>_<what>",
                     "h100_kernels_sweep/: question 'kernels' is not one of",
                     "former name 'run1_good' claimed by 2 folders",
                     "former name 'h100_op_good' of h100_op_claims_too is also a folder's current name",
                     "h100_op_bad_formerly/manifest.json: 'formerly' must be a list"):
        assert expected in found, found
    assert "h100_op_good/" not in found and "archive/h100_op_old" not in found
    assert ri.main(["--check", "--root", str(tmp_path)]) == 1  # invalid manifests: README not written
    assert not (tmp_path / "README.md").exists()

    for bad in ("h100_op_no_manifest", "h100_op_bad_status", "archive/h100_op_current_inside",
                "archive/h100_op_dangling", "archive/h100_op_unexplained", "h100_op_old_on_top", "h100_op_missing_key",
                "run5_old_scheme", "h100_op", "h100_kernels_sweep",
                "h100_op_claims_too", "h100_op_bad_formerly"):
        (tmp_path / bad / "manifest.json").unlink(missing_ok=True)
        (tmp_path / bad).rmdir()
    assert ri.main(["--check", "--root", str(tmp_path)]) == 1  # valid, but no README.md yet
    assert ri.main(["--root", str(tmp_path)]) == 0
    assert ri.main(["--check", "--root", str(tmp_path)]) == 0
    assert "| run1_good | [h100_op_good](h100_op_good/) |" in (tmp_path / "README.md").read_text()
    assert ri.resolve("run1_good/x.json", tmp_path) == tmp_path / "h100_op_good" / "x.json"
    (tmp_path / "h100_op_good" / "manifest.json").write_text(json.dumps(_manifest(what="another line")))
    assert ri.main(["--check", "--root", str(tmp_path)]) == 1  # a manifest changed: README stale
    assert "is stale" in capsys.readouterr().err


def test_docs_table_is_the_merge_of_the_committed_runs(tmp_path, capsys):
    """docs/benchmarks.md's first-measurements table: `bench_lce --merge` of run8 and run9, from the result files."""
    from benchmark.op import bench_lce

    files = [RESULTS / "archive" / "h100_op_run8_final_small_qwen7b" / "bench_lce.json",
             RESULTS / "archive" / "h100_op_run9_final_large" / "bench_lce.json"]
    assert bench_lce.main(["--merge", ",".join(map(str, files)), "--out", str(tmp_path)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if re.match(r"\| \d+×", ln)]
    docs = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert len(rows) == 4 * 8 + 4
    for row in rows:
        assert row in docs, row
    assert (tmp_path / "bench_lce.csv").read_text() == \
        (RESULTS / "archive" / "h100_op_run8_run9_combined" / "bench_lce.csv").read_text()
