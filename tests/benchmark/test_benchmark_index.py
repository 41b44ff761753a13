"""benchmark/results/: every result folder has a valid manifest.json, README.md is the index generated
from them (`python -m benchmark.results_index --check`), the docs point at folders that exist, and the
docs' benchmark table is what `bench_lce --merge` prints from the committed result files.
"""
import json
import re

import pytest

from benchmark import results_index as ri
from helpers.paths import REPO

RESULTS = REPO / "benchmark" / "results"


def test_every_result_folder_has_a_valid_manifest():
    names = ri.folders(RESULTS)
    assert "run8_final_small_qwen7b" in names and any(n.startswith("archive/") for n in names)
    assert ri.problems(RESULTS) == []
    for name in names:
        m = ri.load(RESULTS, name)
        assert set(ri.REQUIRED) <= set(m) and m["status"] in ri.STATUSES, name
        assert (m["status"] == "trial") <= name.startswith("archive/"), name


def test_readme_is_the_generated_index():
    assert ri.main(["--check"]) == 0, "benchmark/results/README.md is stale: run python -m benchmark.results_index"
    text = (RESULTS / "README.md").read_text(encoding="utf-8")
    for name in ri.folders(RESULTS):
        assert f"[{name}]({name}/)" in text


def _manifest(**kw):
    m = dict(command="python -m benchmark.bench_lce", commit="7ac9e0e", device="NVIDIA H100 80GB HBM3",
             versions={"torch": "2.11.0"}, date="2026-11-22", status="cited", what="one line")
    m.update(kw)
    return {k: v for k, v in m.items() if v is not None}


def test_check_names_each_problem(tmp_path, capsys):
    def put(folder, m):
        (tmp_path / folder).mkdir(parents=True)
        if m is not None:
            (tmp_path / folder / "manifest.json").write_text(json.dumps(m))

    put("good", _manifest())
    put("no_manifest", None)
    put("bad_status", _manifest(status="final"))
    put("trial_outside", _manifest(status="trial"))
    put("archive/cited_inside", _manifest())
    put("dangling", _manifest(status="superseded", superseded_by="nowhere"))
    put("unexplained", _manifest(status="superseded"))
    put("missing_key", _manifest(commit=None, colour="blue", date="22.11.2026"))
    put("archive/old", _manifest(status="superseded", superseded_by="good"))
    found = "\n".join(ri.problems(tmp_path))
    for expected in ("no_manifest/: no manifest.json", "bad_status/manifest.json: 'status' must be one of",
                     "trial_outside/manifest.json: a trial belongs in results/archive/",
                     "archive/cited_inside/manifest.json: a cited run does not belong",
                     "dangling/manifest.json: superseded_by 'nowhere'",
                     "unexplained/manifest.json: a superseded run names",
                     "missing_key/manifest.json: missing 'commit'", "unknown key 'colour'", "'date' must be YYYY-MM-DD"):
        assert expected in found, found
    assert "good/" not in found and "archive/old" not in found
    assert ri.main(["--check", "--root", str(tmp_path)]) == 1  # invalid manifests: README not written
    assert not (tmp_path / "README.md").exists()

    for bad in ("no_manifest", "bad_status", "trial_outside", "archive/cited_inside", "dangling", "unexplained",
                "missing_key"):
        (tmp_path / bad / "manifest.json").unlink(missing_ok=True)
        (tmp_path / bad).rmdir()
    assert ri.main(["--check", "--root", str(tmp_path)]) == 1  # valid, but no README.md yet
    assert ri.main(["--root", str(tmp_path)]) == 0
    assert ri.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / "good" / "manifest.json").write_text(json.dumps(_manifest(what="another line")))
    assert ri.main(["--check", "--root", str(tmp_path)]) == 1  # a manifest changed: README stale
    assert "is stale" in capsys.readouterr().err


@pytest.mark.parametrize("doc", ["docs/benchmarks.md", "benchmark/notes.md", "areal_lce/backends/triton/configs.py"])
def test_result_paths_in_docs_exist(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    paths = re.findall(r"(?<![\w/])(?:\.\./)?(?:benchmark/)?results/([\w.\-]+(?:/[\w.\-]+)*)", text)
    assert paths, doc
    for p in paths:
        assert (RESULTS / p.rstrip(".")).exists(), f"{doc} names benchmark/results/{p}, which does not exist"


def test_docs_table_is_the_merge_of_the_committed_runs(tmp_path, capsys):
    """docs/benchmarks.md's main table: `bench_lce --merge` of run8 and run9, printed from the result files."""
    from benchmark import bench_lce

    files = [RESULTS / "run8_final_small_qwen7b" / "bench_lce.json", RESULTS / "run9_final_large" / "bench_lce.json"]
    assert bench_lce.main(["--merge", ",".join(map(str, files)), "--out", str(tmp_path)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if re.match(r"\| \d+×", ln)]
    docs = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert len(rows) == 4 * 8 + 4
    for row in rows:
        assert row in docs, row
    assert (tmp_path / "bench_lce.csv").read_text() == (RESULTS / "combined" / "bench_lce.csv").read_text()
