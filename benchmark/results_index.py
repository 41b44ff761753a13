"""benchmark/results/README.md, generated from the manifest.json of every result folder.

    python -m benchmark.results_index           # check the manifests, rewrite README.md
    python -m benchmark.results_index --check   # exit 1 when a manifest is missing or invalid, or README.md is stale

Every folder in benchmark/results/ and benchmark/results/archive/ holds a manifest.json with
    command        what was run, from the repository root
    commit         the code that ran (short git sha)
    device         the machine, in words
    versions       {package: version}: torch, triton, python, and megatron_core or the peers where used
    date           YYYY-MM-DD of the run
    status         current: the latest run of its question and the code as it stands (one per question);
                   historical: a later run replaces it, it measured older code, or it was a trial not kept
    what           one line: what it measured, with its figures
    superseded_by  (historical runs) the folder, relative to results/, that replaced it: a later run of the
                   question or, for a trial or probe, the question's current run; following it from any
                   historical run ends at a current one
    note           (optional) anything a reader of the numbers must know: what the run was for, targets met
                   or missed, why a figure moved
    formerly       (optional) the folder's earlier names, relative to results/: `resolve` maps them
                   (and any path under them) to the folder, so notes and comments that cite them still work
Current runs live at the top level, one per question of QUESTIONS; historical ones live in archive/. A current
folder holds what came back from the device and no experiment script beyond the one its command runs; the
scripts of trials and probes stay with their archived results.

Folder names follow one scheme, `<device>_<question>_<what>`: the device (h100, h200x2: card and count),
the question the run answers (one of QUESTIONS, the rows of benchmark/README.md) and a few words on what
was run, all lower case with underscores (`h100_op_peers`, `h200x2_cp_megatron_own`).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STATUSES = ("current", "historical")
REQUIRED = ("command", "commit", "device", "versions", "date", "status", "what")
OPTIONAL = ("superseded_by", "note", "formerly")
# The questions, one row each of benchmark/README.md's table, in its order: {key: question}. The key is the
# `<question>` of a folder's name; each question has exactly one current folder (its latest run on the code as
# it stands), every other run of it is historical and lives in archive/.
QUESTIONS = {
    "op": "The op against its peers (fwd, fwd+bwd, memory, accuracy)",
    "trees": "The public op against an earlier tree's (the cost of a refactor), paired rounds",
    "invariant": "Invariant logprobs: bitwise checks and cost",
    "select": "Selected ids and top-k (distillation)",
    "softcap": "Soft-capping against Liger",
    "ignored": "Ignored rows (RL prompts)",
    "materialised": "The materialised route (lean) against megatron-core's CE + entropy",
    "tp": "Tensor parallel over NCCL: checks, TP=1 vs TP=2 bitwise",
    "train": "Engine step against megatron-core's own loss, one GPU",
    "trainpaired": "Engine step against megatron-core's own loss with and without its CE fusion, paired rounds, one GPU",
    "defaults": "The engine's LM-head defaults by measurement: logits cache, megatron-core's CE fusion, RL passes",
    "head": "The LM head alone against megatron-core's output GEMM + CE at a 7B TP=2 rank's shapes",
    "traintp2": "Engine step against megatron-core's own loss at TP=2+SP (0.5B and 7B)",
    "largest": "The largest micro-batch each route trains, one GPU",
    "largesttp2": "The largest 7B micro-batch at TP=2+SP",
    "graphs": "CUDA graphs of the engine's model calls",
    "packing": "Packed (THD) vs padded micro-batches",
    "rollout": "Rollouts: KV cache and graphed decode",
    "cp": "Context parallelism: a 32k sequence at CP=2",
    "longest": "The longest sequence each route trains at CP=2",
    "check": "GPU correctness sweep (op, capture, graphs, attention)",
    "suite": "The whole test suite on a GPU machine",
    "profile": "Where an engine step's time goes",
}
# files that are programs, not results: in a current folder only the one its manifest's `command` runs
SCRIPTS = (".py", ".sh", ".diff")
# the cards of the runs so far; a run on another card adds it here
CARDS = ("h100", "h200", "h800", "h20", "a100", "b200", "gb200", "mi300x", "ascend910b")
DEVICE = re.compile(r"(?P<card>[a-z0-9]+?)(?:x(?P<count>[2-9]|[1-9][0-9]+))?")
WHAT = re.compile(r"[a-z0-9]+(?:_[a-z0-9]+)*")


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
    elif status == "current" and archived:
        bad.append(f"{where}: a current run does not belong in results/archive/")
    elif status == "historical" and not archived:
        bad.append(f"{where}: a historical run belongs in results/archive/")
    elif status == "historical" and not m.get("superseded_by"):
        bad.append(f"{where}: a historical run names 'superseded_by' (the run that replaced it)")
    sup = m.get("superseded_by")
    if isinstance(sup, str) and sup:
        if status != "historical":
            bad.append(f"{where}: 'superseded_by' with status {status!r}")
        if not (root / sup / "manifest.json").is_file():
            bad.append(f"{where}: superseded_by {sup!r} is not a result folder with a manifest")
    old = m.get("formerly", [])
    if not (isinstance(old, list) and all(isinstance(o, str) and re.fullmatch(r"(archive/)?[\w.\-]+", o) for o in old)):
        bad.append(f"{where}: 'formerly' must be a list of folder names relative to results/")
    return bad


def check_name(folder: str) -> list:
    """Problems of a folder's name against the `<device>_<question>_<what>` scheme."""
    name = folder.removeprefix("archive/")
    parts = name.split("_", 2)
    if len(parts) < 3 or not WHAT.fullmatch(parts[2]):
        return [f"{folder}/: name does not follow <device>_<question>_<what> (lower case, e.g. h100_op_peers)"]
    device, question = parts[0], parts[1]
    hit = DEVICE.fullmatch(device)
    if hit is None or hit["card"] not in CARDS:
        return [f"{folder}/: device {device!r} is not a card of {CARDS} with an optional x<count> (h200x2); "
                "a new card goes into results_index.CARDS"]
    if question not in QUESTIONS:
        return [f"{folder}/: question {question!r} is not one of {tuple(QUESTIONS)}"]
    return []


def question(folder: str) -> str:
    """The question a folder's name says it answers (`h100_op_peers` -> `op`)."""
    return folder.removeprefix("archive/").split("_", 2)[1]


def check_record(root: Path, ms: dict) -> list:
    """Problems of the record as a whole, from {folder: manifest} of the valid manifests: one current folder per
    question, every superseded_by chain ending at a current run, no stray scripts beside a current run."""
    bad = []
    current = {}
    for f, m in ms.items():
        if m.get("status") == "current":
            current.setdefault(question(f), []).append(f)
    asked = {question(f) for f in ms}
    for q in QUESTIONS:
        runs = current.get(q, [])
        if len(runs) > 1 or (q in asked and not runs):
            bad.append(f"question {q!r} has {len(runs)} current folders ({', '.join(runs) or 'none'}): "
                       "exactly one answers it, every other run of it is historical in archive/")
    for f, m in ms.items():
        seen, at = [f], m
        while at.get("status") == "historical" and at.get("superseded_by") in ms and at["superseded_by"] not in seen:
            seen.append(at["superseded_by"])
            at = ms[at["superseded_by"]]
        if m.get("status") == "historical" and at.get("status") != "current":
            bad.append(f"{f}/manifest.json: superseded_by leads {' -> '.join(seen)} and not to a current run")
    for f in current.values():
        for folder in f:
            cmd = ms[folder].get("command", "")
            for p in sorted((root / folder).rglob("*")):
                if p.suffix in SCRIPTS and p.is_file() and p.name not in cmd:
                    bad.append(f"{folder}/{p.relative_to(root / folder)}: a script beside a current run that its "
                               "command does not run (trials and probes go to archive/ with their results)")
    return bad


def aliases(root: Path = RESULTS) -> dict:
    """{former name: [folders that claim it]}, relative to root, from every manifest's `formerly`."""
    out = {}
    for folder in folders(root):
        try:
            old = load(root, folder).get("formerly", [])
        except (OSError, ValueError):
            continue  # problems() reports the manifest
        for o in old if isinstance(old, list) else []:
            out.setdefault(o, []).append(folder)
    return out


def resolve(path: str, root: Path = RESULTS, former: dict | None = None) -> Path:
    """A path relative to results/ as notes, docs or comments cite it, under a folder's current or former name
    (`run8_final_small_qwen7b/bench_lce.json` -> root/h100_op_run8_final_small_qwen7b/bench_lce.json).
    `former`: `aliases(root)` when resolving many paths (read once)."""
    parts = path.strip("/").split("/")
    n = 2 if parts[0] == "archive" and len(parts) > 1 else 1
    head, rest = "/".join(parts[:n]), parts[n:]
    new = (aliases(root) if former is None else former).get(head)
    return root.joinpath(new[0] if new else head, *rest)


def problems(root: Path = RESULTS) -> list:
    out, valid = [], {}
    names = folders(root)
    for folder in names:
        out += check_name(folder)
        if not (root / folder / "manifest.json").is_file():
            out.append(f"{folder}/: no manifest.json")
            continue
        try:
            m = load(root, folder)
        except (OSError, ValueError) as e:
            out.append(f"{folder}/manifest.json: unreadable: {e}")
            continue
        found = check_manifest(root, folder, m)
        out += found
        if not found:
            valid[folder] = m
    out += check_record(root, valid) if len(valid) == len(names) else []
    for old, new in sorted(aliases(root).items()):
        if len(new) > 1:
            out.append(f"former name {old!r} claimed by {len(new)} folders: {', '.join(new)}")
        if old in names:
            out.append(f"former name {old!r} of {new[0]} is also a folder's current name")
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
        "commit, device, versions, date, status, what, and for a historical run the run that replaced it).",
        "Names follow `<device>_<question>_<what>`. Each question (a row of `benchmark/README.md`) has one",
        "**current** folder at the top level: its latest run on the code as it stands. Every other run is",
        "**historical** and lives in `archive/`: a later run replaced it, it measured older code, or it was a",
        "trial or probe not kept (its note says which); `superseded_by` leads from it to a current run.",
        "A folder's earlier names are in its manifest (`formerly`) and in the table of former names:",
        "`results_index.resolve` finds a folder by either. `docs/benchmarks.md` presents the numbers; what each",
        "run was for is in its manifest's `what` and `note` (below). The manifest format:",
        "`benchmark/results_index.py`.",
        "",
        "## Current: one run per question",
        "",
        "| question | folder | date | commit | device | what |",
        "|---|---|---|---|---|---|",
    ]
    current = {question(f): f for f, m in ms.items() if m["status"] == "current"}
    for q, title in QUESTIONS.items():
        f = current.get(q)
        if f is not None:
            m = ms[f]
            lines.append(f"| {_cell(title)} | [{f}]({f}/) | {m['date']} | {m['commit']} | {_cell(m['device'])} | "
                         f"{_cell(m['what'])} |")
    archived = sorted((f for f in ms if ms[f]["status"] != "current"),
                      key=lambda f: (list(QUESTIONS).index(question(f)) if question(f) in QUESTIONS else len(QUESTIONS),
                                     ms[f]["date"], _natural(f)))
    lines += ["", "## Archive", "", "| folder | superseded by | date | commit | device | what |",
              "|---|---|---|---|---|---|"]
    for f in archived:
        m = ms[f]
        sup = m.get("superseded_by", "")
        lines.append(f"| [{f}]({f}/) | {f'[{sup}]({sup}/)' if sup else ''} | {m['date']} | {m['commit']} | "
                     f"{_cell(m['device'])} | {_cell(m['what'])} |")
    old = aliases(root)
    if old:
        lines += ["", "## Former names", "", "| former name | folder |", "|---|---|"]
        lines += [f"| {o} | [{new[0]}]({new[0]}/) |" for o, new in sorted(old.items(), key=lambda kv: _natural(kv[0]))]
    lines += ["", "## Commands, versions and notes"]
    for f in ms:
        m = ms[f]
        lines += ["", f"### {f}", "", f"- command: `{m['command']}`",
                  "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
        if m.get("formerly"):
            lines.append("- formerly: " + ", ".join(f"`{o}`" for o in m["formerly"]))
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
