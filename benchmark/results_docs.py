"""The docs against the result manifests: the figures of the checked tables and every result path cited.

    python -m benchmark.results_docs   # exit 1 naming each doc line whose figure no current manifest holds

Checked:
- benchmark/README.md's table: one row per question of results_index.QUESTIONS, in that order, whose result
  is `results/<the question's current folder>` and whose headline's figures that folder's manifest holds;
- docs/benchmarks.md above its "## Historical runs": every table row's figures (every cell but the first),
  held by the manifest of a current folder its section cites (`results/<folder>`);
- every result path that a doc or a code comment cites, and every result folder it names alone
  (`h100_op_peers`), resolves to a file or folder under results/, by its name or a former one
  (results_index.resolve).

A figure is a decimal number (1.09, 20.5, 3.8e-06), a count of passes (71/71), or a whole number with a unit
(115 ms, 94%, 40k, 8192 tokens, 80 GB, and each number of a run that ends in one: 115 vs 137 ms); not text
in backticks, nor the sides of a shape (4096×896). A manifest holds a figure when its `what` or `note` has a
number that rounds to it at the figure's precision (1.085 holds 1.09 and 1.08; 115.2 holds 115 ms), or for a
count the same n/m.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from benchmark import results_index as ri

REPO = ri.RESULTS.parent.parent
README = "benchmark/README.md"
NARRATION = "docs/benchmarks.md"
HISTORICAL = "## Historical runs"
_NUM = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e[-+]?\d+)?)(/\d+)?(?!\d|\.\d)")
# a unit after the number, or after a run of numbers it leads ("115 vs 137 ms", "126 / 16.3 GiB")
_UNIT = re.compile(r"(?:\s?(?:vs|/|-|–|,|and|or)\s?\d+(?:\.\d+)?)*\s?(?:ms|s|GiB|GB|MiB|k|%|tokens)(?![\w])")
_SHAPE = re.compile(r"\s?[×x]\s?\d")
_ANY = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
# a result path as the benchmark pages and code comments cite it (`results/<folder>`), and as the other docs do
# (only `benchmark/results/<folder>`: docs/results/ holds the docs' own files)
BARE = r"(?<![\w/])(?:\.\./)?(?:benchmark/)?results/([\w.\-]+(?:/[\w.\-]+)*)"
FULL = r"(?<![\w/])(?:\.\./)?benchmark/results/([\w.\-]+(?:/[\w.\-]+)*)"
# a result folder named alone, in prose ("(h100_select_stream, same kernels)"): `<card>[x<n>]_<question>_<what>`
NAME = r"(?<![\w/.\-])((?:archive/)?(?:%s)(?:x\d+)?_[a-z0-9]+_[a-z0-9_]*[a-z0-9])(?![\w])" % "|".join(ri.CARDS)


def figures(text: str) -> list:
    """[(token, value, tolerance)] of the figures in text, as the module docstring defines them."""
    text = re.sub(r"`[^`]*`", " ", text)
    out = []
    for m in _NUM.finditer(text):
        tok, count = m.group(1), m.group(2)
        before, after = text[:m.start()], text[m.end():]
        if re.search(r"[×x]\s?$", before) or _SHAPE.match(after):
            continue
        if count:
            if "." not in tok and "e" not in tok:
                out.append((tok + count, None, None))
            continue
        mant, _, exp = tok.partition("e")
        decimals = len(mant.partition(".")[2])
        if not decimals and not exp and not _UNIT.match(after):
            continue
        out.append((tok, float(tok), 0.5 * 10 ** (int(exp or 0) - decimals)))
    return out


def held(figure: tuple, text: str) -> bool:
    """Whether a manifest's text holds the figure (same n/m, or a number within the figure's rounding)."""
    tok, value, tol = figure
    if value is None:
        return re.search(r"(?<!\d)" + re.escape(tok) + r"(?!\d)", text) is not None
    return any(abs(float(y) - value) <= tol * (1 + 1e-9) + 1e-12 for y in _ANY.findall(text))


def _manifest_text(m: dict) -> str:
    return f"{m.get('what', '')} {m.get('note', '')}"


def _current(root: Path) -> dict:
    """{question: folder} of the current runs."""
    return {ri.question(f): f for f in ri.folders(root) if ri.load(root, f).get("status") == "current"}


def _cells(line: str) -> list:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def check_readme(text: str, root: Path = ri.RESULTS) -> list:
    """benchmark/README.md's question table against QUESTIONS and the current manifests."""
    bad, current = [], _current(root)
    rows = [(n, _cells(ln)) for n, ln in enumerate(text.splitlines(), 1)
            if ln.startswith("| ") and not ln.startswith("| question ")]
    if [c[0] for _, c in rows] != list(ri.QUESTIONS.values()):
        bad.append(f"{README}: the table's questions are not results_index.QUESTIONS in order: "
                   f"{[c[0] for _, c in rows]}")
    for (n, cells), q in zip(rows, ri.QUESTIONS):
        folder = current.get(q)
        if folder is None or len(cells) < 5 or cells[3] != f"`results/{folder}`":
            bad.append(f"{README}:{n}: the result of question {q!r} must be `results/{folder}` (its one current "
                       f"folder), got {cells[3] if len(cells) > 3 else None!r}")
            continue
        mtext = _manifest_text(ri.load(root, folder))
        bad += [f"{README}:{n}: figure {f[0]} is not in {folder}/manifest.json" for f in figures(cells[4])
                if not held(f, mtext)]
    return bad


def check_narration(text: str, root: Path = ri.RESULTS) -> list:
    """docs/benchmarks.md's tables above its historical runs against the current folders each section cites."""
    bad, former = [], ri.aliases(root)
    head = text.split("\n" + HISTORICAL, 1)[0].splitlines()
    starts = [i for i, ln in enumerate(head) if ln.startswith("## ")] + [len(head)]
    for a, b in zip(starts, starts[1:]):
        section = "\n".join(head[a:b])
        cited = []
        for p in re.findall(BARE, section):
            path = ri.resolve(p, root, former)
            rel = path.relative_to(root).parts if path.is_relative_to(root) else ()
            folder = "/".join(rel[:2] if rel[:1] == ("archive",) else rel[:1])
            if folder and (root / folder / "manifest.json").is_file() and \
                    ri.load(root, folder).get("status") == "current" and folder not in cited:
                cited.append(folder)
        mtexts = {f: _manifest_text(ri.load(root, f)) for f in cited}
        header = True
        for n in range(a, b):
            ln = head[n]
            if not ln.startswith("|"):
                header = True
                continue
            if header or re.fullmatch(r"\|[-|: ]+\|", ln.strip()):
                header = False
                continue
            for f in figures(" | ".join(_cells(ln)[1:])):
                if not any(held(f, t) for t in mtexts.values()):
                    bad.append(f"{NARRATION}:{n + 1}: figure {f[0]} is in no manifest of the current folders its "
                               f"section cites ({', '.join(cited) or 'none'})")
    return bad


def citing() -> list:
    """[(file, pattern)]: every doc and code file that may cite a result path, with the form it cites."""
    pages = [README, NARRATION, "torchrun/README.md"]
    out = [(p, BARE) for p in pages if (REPO / p).is_file()]
    out += [(str(p.relative_to(REPO)), FULL) for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
            if str(p.relative_to(REPO)) not in pages]
    for pkg in ("areal_lce", "benchmark", "torchrun"):
        out += [(str(p.relative_to(REPO)), BARE) for p in sorted((REPO / pkg).rglob("*.py"))
                if "results" not in p.relative_to(REPO).parts[:2]]
    return out


def check_cited(doc: str, text: str, pattern: str, root: Path = ri.RESULTS, former: dict | None = None) -> list:
    """The result paths and folder names that text (the file doc) cites and that resolve to nothing under root."""
    former = ri.aliases(root) if former is None else former
    return [f"{doc}:{n}: cites benchmark/results/{p}, which does not exist"
            for n, ln in enumerate(text.splitlines(), 1) for p in re.findall(pattern, ln) + re.findall(NAME, ln)
            if not ri.resolve(p.rstrip("."), root, former).exists()]


def check_paths(root: Path = ri.RESULTS) -> list:
    """Every result path that a doc or a code comment cites, resolved by its name or a former one."""
    former = ri.aliases(root)
    return [bad for doc, pattern in citing()
            for bad in check_cited(doc, (REPO / doc).read_text(encoding="utf-8"), pattern, root, former)]


def problems(root: Path = ri.RESULTS) -> list:
    return (check_readme((REPO / README).read_text(encoding="utf-8"), root)
            + check_narration((REPO / NARRATION).read_text(encoding="utf-8"), root) + check_paths(root))


def main() -> int:
    bad = problems()
    for p in bad:
        print(f"results_docs: {p}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
