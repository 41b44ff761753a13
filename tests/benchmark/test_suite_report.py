"""benchmark/suite_report.py, the manifest of a device run of the test suite (benchmark/run_suite.sh): the
counts of pytest's JUnit XML per phase, failing ids, a phase stopped at its limit or without XML, and a
manifest that benchmark/results_index.py accepts."""
import json

from benchmark import results_index as ri
from benchmark import suite_report

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="1" tests="5" time="12.5"><testcase classname="tests.op.test_a" name="test_ok" time="1"/>
<testcase classname="tests.op.test_a" name="test_ok2[x]" time="1"/>
<testcase classname="tests.op.test_a" name="test_skip" time="0"><skipped message="needs a CUDA device"/></testcase>
<testcase classname="tests.op.test_b" name="test_bad" time="1"><failure message="assert 0"/></testcase>
<testcase classname="tests.op.test_b" name="test_err" time="1"><error message="fixture"/></testcase>
</testsuite></testsuites>"""


def test_counts_failing_ids_and_a_valid_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_SHA", "abc1234")
    (tmp_path / "gpu.xml").write_text(XML)
    out = tmp_path / "out"
    assert suite_report.main(["--junit", str(tmp_path / "gpu.xml"), str(tmp_path / "rest.xml"), "--names", "gpu",
                              "rest", "--interrupted", "gpu", "--command", "bash benchmark/run_suite.sh",
                              "--out", str(out)]) == 0
    summary = json.loads((out / "suite_summary.json").read_text())
    gpu, rest = summary["phases"]["gpu"], summary["phases"]["rest"]
    assert (gpu["passed"], gpu["skipped"], gpu["failed"], gpu["error"], gpu["seconds"]) == (2, 1, 1, 1, 12.5)
    assert gpu["failing"] == ["tests/op/test_b.py::test_bad", "tests/op/test_b.py::test_err"]
    assert gpu["interrupted"] and rest["missing"] and not summary["complete"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert ri.check_manifest(tmp_path, "out", manifest) == []
    assert manifest["commit"] == "abc1234" and "2 passed, 1 skipped, 1 failed, 1 errors" in manifest["what"]
    assert "stopped at the time limit: gpu" in manifest["what"] and "no results" in manifest["what"]
