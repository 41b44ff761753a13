"""Durable file writes for checkpoints: write a temporary name, fsync it, rename it over the final name,
fsync the directory. A process killed at any point leaves either the old file or the complete new one
(plus, at worst, a stray `*.tmp`), and a file that a later marker declares complete has reached the disk
before the marker is written.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union

PathLike = Union[str, os.PathLike]


def fsync_dir(path: PathLike) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk. Best effort: some file systems
    (and Windows) cannot open or fsync a directory."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: PathLike, write: Callable) -> Path:
    """Call `write(f)` on a binary file opened at a temporary name next to `path`, fsync it, then rename it
    to `path` and fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def write_text(path: PathLike, text: str) -> Path:
    """`path` holds `text` (UTF-8), durably."""
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def torch_save(obj, path: PathLike) -> Path:
    """torch.save(obj) to `path`, durably."""
    import torch

    return write_atomic(path, lambda f: torch.save(obj, f))
