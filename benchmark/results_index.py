"""benchmark/results/README.md, generated from the manifest.json of every result folder.

    python -m benchmark.results_index           # check the manifests, rewrite README.md
    python -m benchmark.results_index --check   # exit 1 when a manifest is missing or invalid, or README.md is stale

Every folder in benchmark/results/ and benchmark/results/archive/ holds a manifest.json with
    command        what was run, from the repository root
    commit         the code that ran (short git sha)
    device         the machine, in words
    versions       {package: version}: torch, triton, python, and megatron_core or the peers where used
    date           YYYY-MM-DD of the run
    status         cited: docs/ or a code comment quotes its numbers as they stand;
                   superseded: a later run replaces it, or it is older than the code it measures;
                   trial: a sweep or an experiment that was not kept
    what           one line: what it measured
    superseded_by  (optional) the folder, relative to results/, that replaces it
    note           (optional) anything a reader of the numbers must know
A superseded run names superseded_by or says why in a note. Trials live in archive/, cited runs do not;
superseded runs move there once no doc quotes them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STATUSES = ("cited", "superseded", "trial")
REQUIRED = ("command", "commit", "device", "versions", "date", "status", "what")
OPTIONAL = ("superseded_by", "note")


def folders(root: Path) -> list:
    """Result folders relative to root: the top-level ones, then those under archive/."""
    top = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "archive")
    arch = root / "archive"
    old = sorted(f"archive/{p.name}" for p in arch.iterdir() if p.is_dir()) if arch.is_dir() else []
    return top + old


def load(root: Path, folder: str) -> dict:
    with open(root / folder / "manifest.json", encoding="utf-8") as f:
        return json.load(f)


def check_manifest(root: Path, folder: str, m) -> list:
    """Problems of one folder's manifest, each naming the folder and the key."""
    where = f"{folder}/manifest.json"
    if not isinstance(m, dict):
        return [f"{where}: not a JSON object"]
    bad = [f"{where}: missing '{k}'" for k in REQUIRED if k not in m]
    bad += [f"{where}: unknown key '{k}' (allowed: {', '.join(REQUIRED + OPTIONAL)})"
            for k in m if k not in REQUIRED + OPTIONAL]
    for k in ("command", "commit", "device", "what", "superseded_by", "note"):
        if k in m and not (isinstance(m[k], str) and m[k].strip() and "\n" not in m[k]):
            bad.append(f"{where}: '{k}' must be a non-empty one-line string")
    if isinstance(m.get("commit"), str) and not re.fullmatch(r"[0-9a-f]{7,40}", m["commit"]):
        bad.append(f"{where}: 'commit' must be a git sha, got {m['commit']!r}")
    if "versions" in m and not (isinstance(m["versions"], dict) and m["versions"]
                                and all(isinstance(v, str) and v for v in m["versions"].values())):
        bad.append(f"{where}: 'versions' must map package names to version strings")
    if "date" in m and not (isinstance(m["date"], str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["date"])):
        bad.append(f"{where}: 'date' must be YYYY-MM-DD, got {m['date']!r}")
    status = m.get("status")
    archived = folder.startswith("archive/")
    if "status" in m and status not in STATUSES:
        bad.append(f"{where}: 'status' must be one of {STATUSES}, got {status!r}")
    elif status == "trial" and not archived:
        bad.append(f"{where}: a trial belongs in results/archive/")
    elif status == "cited" and archived:
        bad.append(f"{where}: a cited run does not belong in results/archive/")
    elif status == "superseded" and not (m.get("superseded_by") or m.get("note")):
        bad.append(f"{where}: a superseded run names 'superseded_by' or says why in 'note'")
    sup = m.get("superseded_by")
    if isinstance(sup, str) and sup:
        if status != "superseded":
            bad.append(f"{where}: 'superseded_by' with status {status!r}")
        if not (root / sup / "manifest.json").is_file():
            bad.append(f"{where}: superseded_by {sup!r} is not a result folder with a manifest")
    return bad


def problems(root: Path = RESULTS) -> list:
    out = []
    for folder in folders(root):
        if not (root / folder / "manifest.json").is_file():
            out.append(f"{folder}/: no manifest.json")
            continue
        try:
            m = load(root, folder)
        except (OSError, ValueError) as e:
            out.append(f"{folder}/manifest.json: unreadable: {e}")
            continue
        out += check_manifest(root, folder, m)
    return out


def _natural(name: str) -> list:
    """run2 before run10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def render(root: Path = RESULTS) -> str:
    ms = {f: load(root, f) for f in sorted(folders(root), key=lambda f: (f.startswith("archive/"), _natural(f)))}
    lines = [
        "# Benchmark results",
        "",
        "<!-- generated by `python -m benchmark.results_index` from each folder's manifest.json: edit the",
        "     manifests, then rerun it (`--check` fails while this file is stale) -->",
        "",
        "One folder per device run, each with the files that came back and a `manifest.json` (command,",
        "commit, device, versions, date, status, what). Status: **cited**, docs/ or a code comment quotes",
        "its numbers as they stand; **superseded**, a later run replaces it or it is older than the code",
        "it measures; **trial**, a sweep or an experiment that was not kept. Trials and superseded runs",
        "that no doc quotes are in `archive/`. `docs/benchmarks.md` presents the cited numbers and",
        "`benchmark/notes.md` tells what each run was for. The manifest format: `benchmark/results_index.py`.",
    ]
    for title, group in (("Runs", [f for f in ms if not f.startswith("archive/")]),
                         ("Archive", [f for f in ms if f.startswith("archive/")])):
        group = sorted(group, key=lambda f: (STATUSES.index(ms[f]["status"]), ms[f]["date"], _natural(f)))
        lines += ["", f"## {title}", "", "| folder | status | date | commit | device | what |",
                  "|---|---|---|---|---|---|"]
        for f in group:
            m = ms[f]
            status = m["status"] + (f" by [{m['superseded_by']}]({m['superseded_by']}/)" if m.get("superseded_by")
                                    else "")
            lines.append(f"| [{f}]({f}/) | {status} | {m['date']} | {m['commit']} | {_cell(m['device'])} | "
                         f"{_cell(m['what'])} |")
    lines += ["", "## Commands, versions and notes"]
    for f in ms:
        m = ms[f]
        lines += ["", f"### {f}", "", f"- command: `{m['command']}`",
                  "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
        if m.get("note"):
            lines.append(f"- note: {m['note']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a manifest is invalid or README.md is stale")
    ap.add_argument("--root", type=Path, default=RESULTS, help="the results folder (default: %(default)s)")
    args = ap.parse_args(argv)
    bad = problems(args.root)
    for p in bad:
        print(f"results_index: {p}", file=sys.stderr)
    if bad:
        return 1
    readme = args.root / "README.md"
    text = render(args.root)
    if args.check:
        if not readme.is_file() or readme.read_text(encoding="utf-8") != text:
            print(f"results_index: {readme} is stale: run python -m benchmark.results_index", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text, encoding="utf-8")
    print(f"results_index: wrote {readme} ({len(folders(args.root))} folders)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
