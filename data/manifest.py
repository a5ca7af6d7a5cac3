"""Manifests, content hashes and atomic output directories: the lineage record every stage writes.

Each stage writes its output into a temporary sibling directory and renames it into place only when the
output is complete, with a `manifest.json` describing what is inside and what made it. Nothing half-written
is ever visible under the final name.

Two guarantees rest on the manifest:
- `atomic_dir` replaces only what grpoflow made: a missing path, an empty directory, or a directory whose
  `manifest.json` is ours (of the expected kind). Anything else (a project directory, the current directory,
  a directory with other files, a plain file) is refused with `OutputDirError`, before anything is written.
- `verify_output` checks a directory's files against the sha256 its manifest recorded, naming the file that
  differs (`IntegrityError`): a checkpoint or dataset edited or corrupted after it was written is never used
  as if it were the one its manifest describes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from data.errors import DataError, MissingPathError

MANIFEST = "manifest.json"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class OutputDirError(DataError):
    """An output path that is not a previous grpoflow output of the same kind: it is left untouched."""


class IntegrityError(DataError):
    """A grpoflow output whose files no longer match the sha256 its manifest recorded."""


def file_hashes(path: str | os.PathLike, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """sha256 of every file under `path`, keyed by its relative posix name, in sorted order."""
    root = Path(path)
    out = {}
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if rel not in exclude:
            out[rel] = sha256_file(p)
    return out


def combined_sha256(hashes: dict[str, str]) -> str:
    """The directory hash of `sha256_dir` from per-file hashes (so a directory is read once for both)."""
    h = hashlib.sha256()
    for rel in sorted(hashes):
        h.update(rel.encode() + b"\0" + hashes[rel].encode() + b"\n")
    return h.hexdigest()


def sha256_dir(path: str | os.PathLike, exclude: tuple[str, ...] = (MANIFEST,)) -> str:
    """Hash of a directory's content: relative file names and bytes, in sorted order."""
    return combined_sha256(file_hashes(path, exclude))


def sha256_json(obj) -> str:
    """Stable hash of a JSON-serialisable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def code_version() -> str:
    """The git commit of this code (with `+dirty` when the tree has changes), else the package version."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return "grpoflow-" + version("grpoflow")
        except PackageNotFoundError:
            return "unknown"


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary sibling and rename it over `path`: a reader sees the old file or the new
    one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows) -> None:
    """One JSON object per line; a row that is already a string is written as it is."""
    write_text_atomic(
        path, "".join((r if isinstance(r, str) else json.dumps(r, default=str)) + "\n" for r in rows)
    )


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise MissingPathError(f"no {MANIFEST} in {directory}: not a complete grpoflow output")
    return json.loads(path.read_text())


def verify_output(directory: str | os.PathLike, kind: str | None = None) -> dict:
    """The manifest of `directory`, after checking every file against the sha256 the manifest recorded.

    Raises IntegrityError naming the first file that is missing, added or changed (or the directory, for a
    manifest without per-file hashes), FileNotFoundError when there is no manifest. A manifest without a
    `sha256` has nothing to check against and is returned as it is.
    """
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except ValueError as e:
        raise IntegrityError(f"{directory / MANIFEST}: not valid JSON ({e})") from None
    if kind is not None and manifest.get("kind") != kind:
        raise IntegrityError(f"{directory / MANIFEST}: kind {manifest.get('kind')!r}, expected {kind!r}")
    expected = manifest.get("sha256")
    if not expected:
        return manifest
    actual = file_hashes(directory)
    listed = manifest.get("files")
    if isinstance(listed, dict):
        for name in sorted(set(listed) | set(actual)):
            if name not in actual:
                raise IntegrityError(f"{directory / name}: missing; {MANIFEST} lists it")
            if name not in listed:
                raise IntegrityError(
                    f"{directory / name}: not in {MANIFEST}; the directory was changed after it was written"
                )
            if actual[name] != listed[name]:
                raise IntegrityError(
                    f"{directory / name}: its sha256 differs from the one in {MANIFEST} "
                    "(edited, truncated or corrupted after it was written)"
                )
    if combined_sha256(actual) != expected:
        raise IntegrityError(
            f"{directory}: its content differs from the sha256 in {MANIFEST} (edited, "
            "truncated or corrupted after it was written)"
        )
    return manifest


def check_replaceable(final: str | os.PathLike, kind: str | None = None) -> None:
    """Raise OutputDirError unless `final` may be replaced by a new output of `kind`; touches nothing.

    Replaceable: a path that does not exist, an empty directory, or a directory whose `manifest.json` was
    written by grpoflow (a JSON object with a `kind`; equal to `kind` when one is given). Never the current
    directory or one that contains it, nor a directory holding `.git`.
    """
    final = Path(final).resolve()
    if not final.exists():
        return
    if not final.is_dir():
        raise OutputDirError(
            f"output {final} exists and is not a directory; refusing to replace it "
            "(choose another output directory)"
        )
    cwd = Path.cwd().resolve()
    if final == cwd or final in cwd.parents:
        raise OutputDirError(
            f"output directory {final} is the current directory or contains it; refusing to "
            "replace it (choose a new or previous output directory)"
        )
    if not any(final.iterdir()):
        return
    if (final / ".git").exists():
        raise OutputDirError(
            f"output directory {final} holds a .git repository; refusing to replace it "
            "(choose a new or previous output directory)"
        )
    manifest = final / MANIFEST
    try:
        found = json.loads(manifest.read_text()) if manifest.is_file() else None
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict) or not isinstance(found.get("kind"), str):
        raise OutputDirError(
            f"output directory {final} is not empty and is not a grpoflow output (no "
            f"grpoflow {MANIFEST}); refusing to replace it (choose a new or previous output "
            "directory)"
        )
    if kind is not None and found["kind"] != kind:
        raise OutputDirError(
            f"output directory {final} holds a grpoflow {found['kind']!r}, not a {kind!r}; "
            "refusing to replace it (choose another output directory)"
        )


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = True, kind: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; rename it to `final` only if the block succeeds.

    On any exception the temporary directory is removed and `final` is left as it was. An existing `final`
    is replaced only when `check_replaceable(final, kind)` allows it (checked before the block runs, and
    again before the rename); otherwise OutputDirError, and nothing is touched.
    """
    final = Path(final).resolve()
    check_replaceable(final, kind)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        yield tmp
        check_replaceable(final, kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{final} exists")
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
