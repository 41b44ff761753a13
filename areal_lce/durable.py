"""Durable, verifiable files for checkpoints.

Writes: a temporary name, fsynced, renamed over the final name, the directory fsynced. A process killed
at any point leaves either the old file or the complete new one (plus, at worst, a stray `*.tmp`), and
a file that a later marker declares complete has reached the disk before the marker is written.
Manifests (below): the sha256 of every file of a directory, written last, checked before reading.
"""
from __future__ import annotations

import hashlib
import json
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


def chmod_default(path: PathLike) -> None:
    """Give `path` the mode open() gives a new file (0o666 less the umask): for a file whose writer made it
    private (safetensors' save_file writes 0o600), so that the files of one output share one mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_text(path: PathLike, text: str) -> Path:
    """`path` holds `text` (UTF-8), durably."""
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def torch_save(obj, path: PathLike) -> Path:
    """torch.save(obj) to `path`, durably."""
    import torch

    return write_atomic(path, lambda f: torch.save(obj, f))


# ------------------------------------------------------------------------------ manifests
# A manifest seals a directory: the sha256 and size of every file in it, written last by the job that
# wrote the files. A reader checks it before deserialising anything, so a file the job did not write (a
# crafted pickle dropped in), a missing one or a flipped byte is refused, naming the file, whatever the
# files' format. A subdirectory sealed by its own manifest (its writer's) counts as that one file; its
# reader checks the rest. A manifest is not a signature: whoever can write the directory can write one.

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "areal_lce.manifest/1"


class IntegrityError(RuntimeError):
    """A sealed directory's files do not match its manifest (or it has none): nothing was read from it."""


def sha256_file(path: PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _listing(root: Path, exclude, sealed, only=None) -> dict:
    """{relative posix path: Path} of the files under `root` that a manifest covers: everything but the
    manifest and `exclude` at the top (with `only`: just the top-level files and directories it names,
    anything else there is not the writer's and is left out), and only the manifest of each subdirectory
    in `sealed`. A link or special file is an error (the job writes none)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        if rel_dir == "." and only is not None:
            dirnames[:] = [d for d in dirnames if d in only]
            filenames = [n for n in filenames if n in only]
        for d in list(dirnames):
            if (here / d).is_symlink():
                raise IntegrityError(f"{here / d}: a link, not a directory the job wrote")
        if rel_dir in sealed:
            dirnames.clear()
            filenames = [n for n in filenames if n == MANIFEST]
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if rel_dir == "." and (name == MANIFEST or name in exclude):
                continue
            p = here / name
            if p.is_symlink() or not p.is_file():
                raise IntegrityError(f"{p}: not a regular file (a link or a special file)")
            found[rel] = p
    return found


def write_manifest(root: PathLike, exclude=(), only=None) -> Path:
    """Seal `root`: hash the files now on disk (call it once every writer is done) into `root/MANIFEST.json`,
    durably. Names in `exclude` (at the top, e.g. a completion marker written after) are not covered; with
    `only`, just the top-level names it lists are (see _listing)."""
    root = Path(root)
    sealed = sorted(p.parent.relative_to(root).as_posix() for p in root.glob(f"*/**/{MANIFEST}")
                    if p.parent != root and (only is None or p.relative_to(root).parts[0] in only))
    sealed = [s for s in sealed if not any(s.startswith(o + "/") for o in sealed)]  # outermost only
    files = {rel: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for rel, p in sorted(_listing(root, exclude, sealed, only).items())}
    body = {"format": MANIFEST_FORMAT, "sealed": sealed, "files": files}
    return write_text(root / MANIFEST, json.dumps(body, indent=1))


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise IntegrityError(f"{root}: no {MANIFEST} (written last by the job that saved it): the directory "
                             "was not completely written by areal_lce, or by an older version; refusing to "
                             "read any file in it")
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSON and UTF-8 errors
        raise IntegrityError(f"{path}: not a readable manifest ({e})") from e
    if not (isinstance(body, dict) and body.get("format") == MANIFEST_FORMAT and _well_formed(body)):
        raise IntegrityError(f"{path}: not a manifest of format {MANIFEST_FORMAT!r}")
    return body


def _well_formed(body: dict) -> bool:
    files, sealed = body.get("files"), body.get("sealed", [])
    return (isinstance(files, dict) and isinstance(sealed, list) and all(isinstance(d, str) for d in sealed)
            and all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
                    for e in files.values()))


def check_manifest(root: PathLike, exclude=(), hash_only: Callable[[str], bool] = None, only=None) -> dict:
    """Refuse (IntegrityError naming the file) unless the files under `root` are exactly its manifest's,
    with their sizes and sha256 (hashing only the files `hash_only(relative path)` picks, by default all;
    sizes and names are checked for every file; with `only`, top-level names outside it are not looked
    at). Returns {relative path: entry} of the manifest."""
    root = Path(root)
    body = _read_manifest(root)
    files, sealed = body["files"], body.get("sealed", [])
    on_disk = _listing(root, exclude, set(sealed), only)
    for rel in sorted(set(files) | set(on_disk)):
        where = root / rel
        if rel not in on_disk:
            raise IntegrityError(f"{where}: listed in {root / MANIFEST} but missing")
        if rel not in files:
            raise IntegrityError(f"{where}: not listed in {root / MANIFEST} (a file the job did not write)")
        entry = files[rel]
        if on_disk[rel].stat().st_size != entry.get("size"):
            raise IntegrityError(f"{where}: {on_disk[rel].stat().st_size} bytes, the manifest says "
                                 f"{entry.get('size')} (truncated or replaced)")
    for rel in sorted(files):
        if (hash_only is None or hash_only(rel)) and sha256_file(on_disk[rel]) != files[rel].get("sha256"):
            raise IntegrityError(f"{root / rel}: sha256 differs from {root / MANIFEST} (damaged or replaced)")
    return files


def sealed_files(root: PathLike, exclude=(), only=None) -> list:
    """Every file of the sealed directory `root` (its manifest, and those of sealed subdirectories, included),
    after checking names and sizes against the manifests (IntegrityError otherwise; nothing is hashed)."""
    root = Path(root)
    body = _read_manifest(root)
    check_manifest(root, exclude, hash_only=lambda rel: False, only=only)
    out = [root / MANIFEST]
    for rel in body["files"]:
        sub = (root / rel).parent
        if rel.endswith(f"/{MANIFEST}") and sub.relative_to(root).as_posix() in body.get("sealed", []):
            out += sealed_files(sub)
        else:
            out.append(root / rel)
    return out


def remove_sealed(root: PathLike, marker: str, only=None) -> list:
    """Delete the files of the sealed directory `root` that its manifests list, and `marker` (removed first,
    so that a half-deleted directory is no longer marked complete); a file the manifests do not cover (a
    user's, outside `only`) and the directories holding it stay. Raises IntegrityError naming the odd file,
    deleting nothing, when a covered file does not match. Returns the directories left (not empty)."""
    root = Path(root)
    files = sealed_files(root, exclude=(marker,), only=only)
    (root / marker).unlink(missing_ok=True)
    fsync_dir(root)
    for f in files:
        f.unlink()
    left = []
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)  # deepest first
        except OSError:  # not empty: it holds a file the job did not write
            left.append(Path(dirpath))
    fsync_dir(root.parent)
    return left
