"""Where raw records come from: local files, a directory of them, a Hugging Face hub dataset, or the
generator.

`open_source(spec, ...)` decides what `spec` names and returns a `Source` whose `records()` yields `Record`s,
each with its location for error messages:

- `path/to/file.jsonl:17` for JSON lines (`.jsonl`, or `.json` holding one object per line; a `.json` file
  that starts with `[` is read as one JSON array and located as `file.json row 17`),
- `path/to/file.parquet row 17`, `path/to/file.csv row 17` (row 1 is the first data row, after a CSV header),
- `hub:openai/gsm8k[train] row 17`, `synthetic:addition row 17`.
Every number counts from 1.

Text files (JSON, CSV) are UTF-8, with or without a byte-order mark, or UTF-16 / UTF-32 with one; CRLF line
ends are read like LF. A CSV row with more cells than its header has columns is a bad record.

How a spec is read, in this order:
1. `synthetic`, `synthetic:addition`, `synthetic:countdown`: `data.synthetic.generate(rows, seed, kind)`.
2. `hub:<id>`: a hub dataset, whatever is on disk.
3. An existing path, or one that looks like a path (starts with `/`, `.` or `~`, has a data-file suffix, or
   has more than one `/`): a local file or directory; if it does not exist, "source not found", never a hub
   lookup.
4. Anything else (`name` or `owner/name`) is a hub dataset id, loaded with `datasets.load_dataset(id, config,
   split=split)`.

A directory is read non-recursively (a hub snapshot keeps configs in subdirectories, and mixing `main/` with
`socratic/` would duplicate every problem). If some of its files are named for a split (`train.jsonl`,
`test.parquet`, `train-00000-of-00002.parquet`), only the files of the requested split are read; otherwise all
data files are read, in name order. `split` is ignored for a single file: naming the file chose the split.

The hub is probed with a plain TCP connection before `load_dataset`: unreachable, `huggingface_hub` retries
five times with backoff (about 25 s here) before it gives up, and we want one clear error at once.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from data.errors import DataError, short_repr
from data.manifest import MANIFEST, sha256_file
from data.reachability import probe_tcp
from data.text import SURROGATE_PROBLEM, unpaired_surrogate

# Read by huggingface_hub when it is first imported; only defaults, a user's own setting wins.
os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
SYNTHETIC = "synthetic"
# Names a directory's files are recognised by as splits, so that `--split` can pick one of them.
SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "heldout", "eval")


@dataclass(frozen=True)
class Record:
    """One raw record. `data` is None when the record could not be parsed; `error` says why."""

    where: str
    data: dict | None
    base_dir: Path | None = None  # relative paths inside the record (images) resolve against this
    error: str | None = None
    reason: str | None = None  # drop-count key when `data` is None


@dataclass
class Source:
    """A resolved source: what to record in the manifest and how to read its records."""

    kind: str  # "file" | "directory" | "hub" | "synthetic"
    spec: str
    read: Callable[[], Iterator[Record]]
    files: list[Path] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def records(self) -> Iterator[Record]:
        return self.read()

    def describe(self) -> dict:
        """The manifest's `source` entry: the spec, and a sha256 for each local file read."""
        out = {"kind": self.kind, "spec": self.spec, **self.info}
        if self.files:
            out["files"] = [{"path": str(p.resolve()), "sha256": sha256_file(p)} for p in self.files]
        return out


def open_source(
    spec: str,
    *,
    split: str = "train",
    hub_config: str | None = None,
    seed: int = 0,
    synthetic_rows: int = 2000,
) -> Source:
    spec = str(spec)
    if spec == SYNTHETIC or spec.startswith(SYNTHETIC + ":"):
        return _synthetic(spec, synthetic_rows, seed)
    if spec.startswith("hub:"):
        return _hub(spec.removeprefix("hub:"), hub_config, split)
    path = Path(spec).expanduser()
    if path.exists():
        return _directory(spec, path, split) if path.is_dir() else _file(spec, path)
    if _looks_like_path(spec):
        raise DataError(f"source not found: {spec}")
    return _hub(spec, hub_config, split)


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", ".", "~"))
        or Path(spec).suffix.lower() in SUFFIXES
        or spec.count("/") > 1
        or "\\" in spec
    )


# --- local files ---


def _file(spec: str, path: Path) -> Source:
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(
            f"{spec}: unsupported file type '{path.suffix}'; expected one of {', '.join(SUFFIXES)}"
        )
    return Source("file", spec, lambda: read_file(path), files=[path], info={"path": str(path.resolve())})


def _directory(spec: str, path: Path, split: str) -> Source:
    files = split_files(path, split)
    return Source(
        "directory",
        spec,
        lambda: (r for f in files for r in read_file(f)),
        files=files,
        info={"path": str(path.resolve()), "split": split},
    )


def split_files(directory: Path, split: str) -> list[Path]:
    """The data files of `directory` to read for `split` (see the module docstring)."""
    files = sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and p.suffix.lower() in SUFFIXES and not p.name.startswith(".") and p.name != MANIFEST
    )
    if not files:
        subdirs = sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
        hint = f"; it has subdirectories {', '.join(subdirs)}: pass one of them" if subdirs else ""
        raise DataError(f"{directory}: no data files ({', '.join(SUFFIXES)}) directly inside{hint}")
    by_split = {name: [p for p in files if _split_of(p) == name] for name in SPLIT_NAMES}
    if not any(by_split.values()):
        return files
    if by_split.get(split):
        return by_split[split]
    found = sorted({_split_of(p) for p in files} - {None})
    raise DataError(
        f"{directory}: no files for split '{split}' (found splits: {', '.join(found)}); "
        f"pass --split with one of them, or name a file as the source"
    )


def _split_of(path: Path) -> str | None:
    stem = path.name[: -len(path.suffix)].lower()
    for name in SPLIT_NAMES:
        if stem == name or stem.startswith((name + "-", name + "_", name + ".")):
            return name
    return None


def read_file(path: Path) -> Iterator[Record]:
    """Records of one local data file, in file order."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".csv":
        return _read_csv(path)
    return _read_json(path)


# Byte-order marks and the encodings they name, longest first: UTF-32-LE's begins with UTF-16-LE's. The
# codecs named drop the mark. PowerShell 5 writes UTF-16 with a mark (`> rows.jsonl`), Excel and Notepad
# write UTF-8 with one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_BOM = "\ufeff"
# csv's default field limit (128 KiB) would refuse a long worked solution that JSON lines read; this is the
# largest the csv module takes on every platform (a C long).
_CSV_FIELD_CHARACTERS = 2**31 - 1


def _encoding(path: Path) -> str:
    """The text encoding of a file: the one its byte-order mark names, else UTF-8."""
    with open(path, "rb") as f:
        head = f.read(4)
    return next((name for bom, name in _BOMS if head.startswith(bom)), "utf-8")


def _read_json(path: Path) -> Iterator[Record]:
    base = path.resolve().parent
    encoding = _encoding(path)
    if path.suffix.lower() == ".json" and _is_array(path, encoding):
        try:
            items = json.loads(path.read_bytes().decode(encoding).removeprefix(_BOM))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        except UnicodeDecodeError:
            raise DataError(_undecodable(path, encoding)) from None
        except (ValueError, RecursionError) as e:
            raise DataError(f"{path}: not readable JSON ({_unreadable(e)})") from None
        for i, item in enumerate(items, 1):
            yield _as_record(f"{path} row {i}", item, base)
        return
    for lineno, text in _lines(path, encoding):
        where = f"{path}:{lineno}"
        if isinstance(text, UnicodeDecodeError):
            yield Record(where, None, base, f"not UTF-8 text ({text.reason})", "invalid JSON")
            continue
        # `cat a.jsonl b.jsonl` of files saved with a mark puts one at the start of a later line
        text = text.removeprefix(_BOM)
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            yield Record(where, None, base, f"not valid JSON ({e.msg} at column {e.colno})", "invalid JSON")
            continue
        except (ValueError, RecursionError) as e:
            yield Record(where, None, base, f"not readable JSON ({_unreadable(e)})", "invalid JSON")
            continue
        yield _as_record(where, item, base)


def _is_array(path: Path, encoding: str) -> bool:
    """Whether a `.json` file holds one JSON array (else it is read as JSON lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).decode(encoding, errors="ignore")  # a character cut at the end is no matter
    return head.removeprefix(_BOM).lstrip().startswith("[")


def _lines(path: Path, encoding: str) -> Iterator[tuple[int, str | UnicodeDecodeError]]:
    """(line number, text) of each line; in UTF-8 a line that does not decode is that line's error, so that
    one bad line is one bad record."""
    if encoding in ("utf-8", "utf-8-sig"):
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    yield lineno, line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, e
        return
    # UTF-16/32: a newline is not one byte, so the file is decoded as a whole stream; lines end only at
    # "\n" (JSON text holds no raw "\r" or U+2028 that could end one)
    try:
        with open(path, encoding=encoding, newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except UnicodeDecodeError:
        raise DataError(_undecodable(path, encoding)) from None


def _unreadable(e: Exception) -> str:
    if isinstance(e, RecursionError):
        return "nested deeper than the JSON reader goes"
    # an integer of more digits than Python converts: "Exceeds the limit (4300 digits) for integer string
    # conversion: value has 5000 digits; use sys.set_int_max_str_digits() ..." up to its first colon
    return str(e).split(":")[0][:120]


def _as_record(where: str, item: object, base: Path | None) -> Record:
    if not isinstance(item, dict):
        got = type(item).__name__
        return Record(where, None, base, f"expected a JSON object, got {got}", "not an object")
    if (field_name := unpaired_surrogate(item)) is not None:
        return Record(where, None, base, f"field '{field_name}': {SURROGATE_PROBLEM}", "invalid text")
    return Record(where, item, base)


def _read_csv(path: Path) -> Iterator[Record]:
    base = path.resolve().parent
    encoding = _encoding(path)
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_CHARACTERS))
    # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first column's name
    with open(path, encoding="utf-8-sig" if encoding == "utf-8" else encoding, newline="") as f:
        rows = csv.DictReader(f)
        i = 0
        try:
            for i, row in enumerate(rows, 1):
                where = f"{path} row {i}"
                if None in row:  # cells past the header's columns: DictReader would set them aside unseen
                    cells = len(rows.fieldnames) + len(row[None])
                    yield Record(
                        where,
                        None,
                        base,
                        f"{cells} cells, but the header names {len(rows.fieldnames)} columns",
                        "extra cells",
                    )
                    continue
                yield Record(where, dict(row), base)
        except UnicodeDecodeError:  # the rest of the file cannot be read: no row-level recovery
            raise DataError(_undecodable(path, encoding)) from None
        except csv.Error as e:
            raise DataError(f"{path} row {i + 1}: not valid CSV ({e})") from None


def _undecodable(path: Path, encoding: str) -> str:
    """Where a text file stops being text in `encoding`: its line and byte (the decoder only saw one read
    block)."""
    data = path.read_bytes()
    try:
        data.decode(encoding)
    except UnicodeDecodeError as e:
        line = data[: e.start].decode(encoding, errors="replace").count("\n") + 1
        name = {"utf-8-sig": "UTF-8"}.get(encoding, encoding.upper())
        hint = " (it may be Latin-1 or Windows-1252)" if encoding == "utf-8" else ""
        return (
            f"{path}:{line}: not {name} text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason}); "
            f"save the file as UTF-8{hint}"
        )
    return f"{path}: not {encoding.upper()} text"


def _read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq  # a dependency of `datasets`; imported late to keep `data` light

    base = path.resolve().parent
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    i = 0
    batches = parquet.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # noqa: BLE001 - a corrupt page: pyarrow raises OSError, ArrowInvalid, ...
            raise DataError(
                f"{path}: unreadable Parquet data after row {i} ({type(e).__name__}: {e}); "
                "the file is damaged or truncated"
            ) from None
        if batch is None:
            return
        for row in batch.to_pylist():
            i += 1
            yield Record(f"{path} row {i}", row, base)


# --- the hub ---


def _hub(dataset_id: str, config: str | None, split: str) -> Source:
    label = f"hub:{dataset_id}[{split}]"
    what = f"hub dataset '{dataset_id}'" + (f" (config '{config}')" if config else "")
    local_hint = "pass a local --source (a .jsonl/.json/.parquet/.csv file or a directory of them)"
    if not _offline() and (unreachable := _probe_hub()):
        raise DataError(
            f"{what}: cannot reach the Hugging Face Hub ({unreachable}), and there is no local "
            f"file or directory named '{dataset_id}'; {local_hint}, or set HF_HUB_OFFLINE=1 to use "
            f"a copy in the local hub cache"
        )
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, config, split=split)
    except Exception as e:  # network, auth, missing config or split: all mean "cannot use this id"
        raise DataError(f"{what}, split '{split}': {type(e).__name__}: {e}; {local_hint}") from None

    def read() -> Iterator[Record]:
        for i, row in enumerate(ds, 1):
            yield Record(f"{label} row {i}", dict(row))

    return Source(
        "hub",
        dataset_id,
        read,
        info={
            "id": dataset_id,
            "config": config,
            "split": split,
            "fingerprint": getattr(ds, "_fingerprint", None),
        },
    )


def _offline() -> bool:
    # What `load_dataset` will do, read where it reads it (fixed when `datasets` is first imported).
    import datasets.config

    return bool(datasets.config.HF_HUB_OFFLINE)


def _probe_hub(timeout: float = 5.0) -> str | None:
    """Why the hub endpoint cannot be reached, or None when it can (or when a proxy hides the answer)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a direct connection says nothing about the proxy route; let huggingface_hub try
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    reason = probe_tcp(url.hostname, port, timeout)
    return f"{endpoint}: {reason}" if reason else None


# --- the generator ---


def _synthetic(spec: str, rows: int, seed: int) -> Source:
    from data import synthetic

    kind = spec.partition(":")[2] or "addition"
    if kind not in synthetic.KINDS:
        raise DataError(
            f"source '{spec}': unknown synthetic kind '{kind}'; "
            f"expected one of {', '.join(SYNTHETIC + ':' + k for k in synthetic.KINDS)}"
        )
    if not 1 <= rows <= synthetic.MAX_ROWS:
        raise DataError(
            f"source '{spec}': synthetic_rows must be between 1 and {synthetic.MAX_ROWS:,}, "
            f"got {short_repr(rows)}"
        )

    def read() -> Iterator[Record]:
        for i, row in enumerate(synthetic.generate(rows, seed, kind), 1):
            yield Record(f"{SYNTHETIC}:{kind} row {i}", row)

    return Source("synthetic", spec, read, info={"generator": kind, "rows": rows, "seed": seed})
