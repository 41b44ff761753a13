"""Run outputs on rank 0: metrics.jsonl, a tqdm progress bar, metric lines and a PNG of the curves."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .. import durable

LOG_KEYS = ("step", "loss", "entropy", "max_logit", "min_logit", "grad_norm", "lr", "tokens_per_s", "peak_mem_gib")
PLOT_KEYS = ("loss", "entropy", "max_logit", "min_logit", "grad_norm", "lr", "tokens_per_s", "peak_mem_gib")


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl. A torn last line (a process killed while writing it) is skipped
    with a warning; an unreadable line before it is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    records = []
    for k, (lineno, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k < len(lines) - 1:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({e})") from e
            warnings.warn(f"{path}:{lineno}: skipping a torn last line (a run killed while writing it): "
                          f"{line[:80]!r}", RuntimeWarning, stacklevel=2)
    return records


def strict_json(record: dict) -> str:
    """The record as strict JSON (RFC 8259: no NaN / Infinity): a value that is not a finite number is
    written as null (a metric not computed that step)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()},
                      allow_nan=False)


class MetricsLog:
    """Append-only `metrics.jsonl` (one strict JSON object per step, null for a value not computed). Inactive
    off rank 0.

    On a resumed run, lines past the resumed step (written by the killed run after its last
    checkpoint) are dropped first, so the file reads as one uninterrupted run: the kept lines go to a
    new file that replaces the old one atomically (never truncated in place).
    """

    def __init__(self, path, enabled: bool = True, resume_step: int = 0):
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        # a new file renamed over the old one: a kill at any moment leaves the old lines or the kept ones
        text = "".join(strict_json(r) + "\n" for r in kept)
        durable.write_atomic(self.path, lambda f: f.write(text.encode("utf-8")))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(strict_json(record) + "\n")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class ProgressBar:
    """tqdm on rank 0 when enabled; metric lines go through `write` so they don't break the bar."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, is_main: bool = True, desc: str = "train"):
        self.is_main = is_main
        if is_main and enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)
        else:
            self._bar = _NoBar()

    def update(self, postfix: Optional[dict] = None) -> None:
        if not self.is_main:
            return
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def write(self, text: str) -> None:
        if self.is_main:
            self._bar.write(text)

    def close(self) -> None:
        if self.is_main:
            self._bar.close()


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def format_record(record: dict, keys: Sequence[str] = LOG_KEYS) -> str:
    """The metrics line of a record: `key=value` for each of `keys` that it holds."""
    return "  ".join(f"{k}={_fmt(record[k])}" for k in keys if record.get(k) is not None)


def plot_metrics(records: Iterable[dict], png_path, keys: Sequence[str] = PLOT_KEYS, title: str = "") -> Optional[Path]:
    """One panel per metric against step; returns the path written, or None without records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records)]
    if not records or not keys:
        return None
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
