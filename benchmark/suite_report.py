"""The manifest of one run of the test suite on a device (benchmark/run_suite.sh), from pytest's JUnit XML.

    python3 -m benchmark.suite_report --junit OUT/suite_gpu.xml OUT/suite_rest.xml --out OUT \
        --command "bash benchmark/run_suite.sh" [--interrupted rest]

Writes OUT/manifest.json in benchmark/results_index.py's format (its `what` line carries the counts), ready
to copy into benchmark/results/<device>_check_<what>/, and OUT/suite_summary.json: per phase (one XML
each) the passed / skipped / failed / error counts, the seconds, the failing test ids and whether the phase
was stopped at its time limit. A phase whose XML is missing (pytest stopped before it wrote one) is listed
as without results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path


def phase_counts(path: Path) -> dict:
    """Counts of one JUnit XML: every <testcase> once, as passed, skipped, failed or error."""
    counts = {"passed": 0, "skipped": 0, "failed": 0, "error": 0, "seconds": 0.0, "failing": []}
    if not path.is_file():
        counts["missing"] = True
        return counts
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts["seconds"] = round(sum(float(s.get("time", 0.0)) for s in suites), 1)
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failing"].append(name)
        elif case.find("error") is not None:
            counts["error"] += 1
            counts["failing"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split("\n")
        names = [n.strip() for n in out if n.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:
        return f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return f"{names[0]} x{len(names)}" if len(names) > 1 else names[0]


def commit() -> str:
    sha = os.environ.get("GIT_SHA", "")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            sha = ""
    return sha or "0000000"


def build(junit: list, names: list, interrupted: set, command: str) -> tuple:
    """(manifest, summary) of the phases' XML files."""
    phases = {name: phase_counts(Path(p)) for name, p in zip(names, junit)}
    for name, c in phases.items():
        c["interrupted"] = name in interrupted
    total = {k: sum(c[k] for c in phases.values()) for k in ("passed", "skipped", "failed", "error")}
    cut = [n for n, c in phases.items() if c["interrupted"]]
    lost = [n for n, c in phases.items() if c.get("missing")]
    versions = {"torch": _version("torch"), "triton": _version("triton"), "python": platform.python_version(),
                "megatron_core": _version("megatron-core")}
    versions = {k: v for k, v in versions.items() if v}
    what = (f"The test suite on the device: {total['passed']} passed, {total['skipped']} skipped, "
            f"{total['failed']} failed, {total['error']} errors"
            + "".join(f"; {n}: {c['passed']} passed, {c['skipped']} skipped, {c['failed'] + c['error']} failed "
                      f"in {c['seconds']:.0f} s" for n, c in phases.items())
            + (f"; stopped at the time limit: {', '.join(cut)}" if cut else "")
            + (f"; no results (pytest wrote no XML, see its log): {', '.join(lost)}" if lost else ""))
    manifest = {"command": command, "commit": commit(), "device": device_name(), "versions": versions,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "status": "current",
                "what": what}
    if cut or lost:
        manifest["note"] = "incomplete: the counts are of the tests that finished (suite_summary.json per phase)"
    summary = {"total": total, "phases": phases, "complete": not cut and not lost}
    return manifest, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--junit", nargs="+", required=True, help="one JUnit XML per phase")
    ap.add_argument("--names", nargs="+", help="the phases' names (default: the XML files' stems)")
    ap.add_argument("--interrupted", nargs="*", default=[], help="phases stopped at their time limit")
    ap.add_argument("--command", required=True, help="what was run, from the repository root")
    ap.add_argument("--out", required=True, help="folder for manifest.json and suite_summary.json")
    a = ap.parse_args(argv)
    names = a.names or [Path(p).stem for p in a.junit]
    if len(names) != len(a.junit):
        ap.error(f"--names has {len(names)} entries for {len(a.junit)} --junit files")
    manifest, summary = build(a.junit, names, set(a.interrupted), a.command)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    (out / "suite_summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(manifest["what"])
    for name in (f for c in summary["phases"].values() for f in c["failing"]):
        print("FAILED", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
