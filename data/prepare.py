"""The prepare stage: a task and a source in, a prepared dataset directory with its manifest out.

    out/
      train.jsonl      one prepared row per line, in the chat schema of `data.schema`
      heldout.jsonl    the same, for the held-out rows (empty when heldout=0)
      manifest.json    content sha256 (with the bytes of every image the rows name), row counts, source
                       (+ a sha256 per local file), task, seed, split, drops by reason with a few examples,
                       code version, created_at

Decisions a user can rely on:
- Without `skip_invalid`, the first bad record stops the run with its location, field and expectation; with
  it, bad records are dropped and counted by reason. Nothing is written either way until every row is good,
  and the directory appears only complete (`atomic_dir`): a failed run leaves no directory, or the old one
  untouched.
- `out` may be new, empty, or a previous prepared-dataset directory (which is replaced whole); anything else
  (a directory with other files, `.`, a project with `.git`, a file) is refused before any work, untouched.
- `load_prepared` checks each split's file against the sha256 in the manifest: edited data is an error
  naming the file, never read as if it were what the manifest describes.
- Exact duplicate prompts (same question, same images) are always dropped and counted as "duplicate prompt":
  a copy on each side of the split would make the held-out score a training score.
- Ids are `<task>-<n>`, n the record's 0-based position in the source (so ids do not move with the seed or
  when bad records are skipped), or `<task>-<its own id>` when the record has a `unique_id` or `id`.
- `heldout`: 0 for none, a number in (0, 1) for a fraction (at least one row), a whole number >= 1 for a
  count. The rows are split by a `random.Random(seed)` shuffle; each file keeps source order. Sources that
  assign the split themselves (the synthetic addition pools) keep their assignment and `heldout` is not used;
  the manifest's `split_by` says which happened.
- `limit` keeps the first `limit` usable rows, before the split.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from data.adapters import Adapter, Example, get_adapter
from data.errors import DataError, FieldError
from data.images import images_digest
from data.manifest import (
    MANIFEST,
    atomic_dir,
    check_replaceable,
    code_version,
    read_manifest,
    sha256_dir,
    sha256_file,
)
from data.schema import check_tools, make_row, resolve_system_prompt, resolve_tools
from data.sources import Source, open_source

__all__ = ["DataError", "prepare", "load_prepared", "SPLITS"]

SPLITS = ("train", "heldout")
KIND = "prepared-dataset"
_EXAMPLES_PER_REASON = 3


def prepare(
    task: str,
    source: str,
    out: str | Path,
    *,
    seed: int = 0,
    heldout: float | int = 0.1,
    skip_invalid: bool = False,
    limit: int | None = None,
    split: str = "train",
    hub_config: str | None = None,
    synthetic_rows: int = 2000,
    system_prompt: str | None = None,
    tools: list[str] | None = None,
) -> dict:
    """Prepare `source` for `task` into the directory `out`; see the module docstring for the layout.

    `system_prompt` is a preset of `data.schema.SYSTEM_PROMPTS` (default `r1`) or literal text. `tools`: the
    tools every row offers unless it names its own (`data.schema.resolve_tools`: built-in names or JSON files
    of schemas), as its `tools` column.
    """
    adapter = get_adapter(task)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit must be a whole number >= 1 (or None for all rows), got {limit!r}")
    _check_heldout(heldout)
    src = open_source(
        str(source), split=split, hub_config=hub_config, seed=seed, synthetic_rows=synthetic_rows
    )
    final = Path(out).resolve()
    _refuse_overwriting_source(final, src)
    check_replaceable(final, KIND)  # before any work: an unrelated --out is refused, untouched

    drops = _Drops(task, skip_invalid)
    offered = resolve_tools(tools or [])
    rows, presplit = _collect(task, adapter, src, drops, limit, resolve_system_prompt(system_prompt), offered)
    if not rows:
        raise DataError(
            f"source '{source}': no usable rows for task '{task}' (dropped: {dict(drops.counts)})"
        )
    if presplit:
        (train, held), split_by = _keep_source_split(rows, presplit, source), "source"
    else:
        (train, held), split_by = split_rows(rows, heldout, seed), "seeded shuffle"

    with atomic_dir(final, kind=KIND) as tmp:
        for name, part in (("train", train), ("heldout", held)):
            _write_jsonl(tmp / f"{name}.jsonl", part)
        digest = sha256_dir(tmp)
        images = images_digest(ref for row in rows for ref in row.get("images", ()))
        if images:  # the rows point at the images: their bytes are part of what this data is
            digest = hashlib.sha256(f"{digest}\nimages {images['sha256']}".encode()).hexdigest()
        manifest = {
            "kind": KIND,
            "sha256": digest,
            "files": {f"{name}.jsonl": sha256_file(tmp / f"{name}.jsonl") for name in SPLITS},
            "rows": {"train": len(train), "heldout": len(held)},
            "task": task,
            "adapter": f"{adapter.__module__}.{adapter.__name__}",
            "source": src.describe(),
            "seed": seed,
            "system_prompt": resolve_system_prompt(system_prompt),
            "heldout": heldout,
            "split_by": split_by,
            "split": split,
            "limit": limit,
            "skip_invalid": skip_invalid,
            "tools": list(tools or []),
            "dropped": dict(drops.counts),
            "dropped_examples": drops.examples,
            "code_version": code_version(),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if images:
            manifest["images"] = images
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    return {
        "out": str(final),
        "rows": manifest["rows"],
        "manifest": str(final / MANIFEST),
        "dropped": manifest["dropped"],
        "sha256": digest,
    }


def load_prepared(directory: str | Path, split: str = "train") -> list[dict]:
    """The rows of one split of a prepared directory, checked against its manifest."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError as e:
        raise DataError(str(e)) from None
    if manifest.get("kind") != KIND:
        raise DataError(f"{directory}: its {MANIFEST} has kind {manifest.get('kind')!r}, expected '{KIND}'")
    if split not in manifest.get("rows", {}):
        raise DataError(f"{directory}: no split '{split}'; it has {', '.join(manifest.get('rows', {}))}")
    path = directory / f"{split}.jsonl"
    expected = manifest.get("files", {}).get(path.name)
    if expected and path.is_file() and sha256_file(path) != expected:
        raise DataError(
            f"{path}: its sha256 differs from the one in {directory / MANIFEST}: the file was "
            f"changed after it was prepared; prepare the data again (grpoflow prep) or restore it"
        )
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if len(rows) != manifest["rows"][split]:
        raise DataError(
            f"{path}: {len(rows)} rows, but {MANIFEST} says {manifest['rows'][split]}: "
            f"the directory was changed after it was prepared"
        )
    return rows


def split_rows(rows: list[dict], heldout: float | int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, heldout): a seeded choice of held-out rows; both keep the order of `rows`."""
    n = len(rows)
    if heldout == 0:
        count = 0
    elif heldout < 1:
        count = max(1, round(n * heldout))
    else:
        count = int(heldout)
    if count >= n:
        raise DataError(
            f"heldout={heldout!r} takes {count} of the {n} usable rows and leaves none to train on"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return ([r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held])


def _keep_source_split(rows: list[dict], presplit: list[str | None], source: str) -> tuple[list, list]:
    if None in presplit:
        raise DataError(
            f"source '{source}': some records name their split and some do not; expected all or none"
        )
    train = [r for r, s in zip(rows, presplit, strict=True) if s == "train"]
    if not train:
        raise DataError(
            f"source '{source}': every record is assigned to the held-out split; none is left to train on"
        )
    return train, [r for r, s in zip(rows, presplit, strict=True) if s == "heldout"]


def _check_heldout(heldout: object) -> None:
    ok = (
        isinstance(heldout, (int, float))
        and not isinstance(heldout, bool)
        and (0 <= heldout < 1 or float(heldout).is_integer() and heldout >= 1)
    )
    if not ok:
        raise DataError(
            f"heldout must be 0, a fraction in (0, 1) or a whole number of rows >= 1, got {heldout!r}"
        )


def _refuse_overwriting_source(final: Path, src: Source) -> None:
    # atomic_dir replaces `final` wholesale: pointing it at the source's own directory would delete the data.
    for f in src.files:
        f = f.resolve()
        if final == f or final in f.parents:
            raise DataError(
                f"output directory {final} would replace the source file {f}; choose another --out"
            )


class _Drops:
    """Raise on a bad record, or count it by reason when bad records are to be skipped."""

    def __init__(self, task: str, skip_invalid: bool):
        self.task, self.skip_invalid = task, skip_invalid
        self.counts: Counter = Counter()
        self.examples: list[dict] = []

    def bad(self, where: str, reason: str, detail: str) -> None:
        if not self.skip_invalid:
            raise DataError(
                f"{where}: {detail} (task '{self.task}'; pass skip_invalid=True, or --skip-invalid, "
                f"to drop such rows)"
            )
        self.drop(where, reason, detail)

    def drop(self, where: str, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        if self.counts[reason] <= _EXAMPLES_PER_REASON:
            self.examples.append({"where": where, "reason": reason, "detail": detail})


def _collect(
    task: str,
    adapter: Adapter,
    src: Source,
    drops: _Drops,
    limit: int | None,
    system_prompt: str,
    tools: list[dict],
) -> tuple[list[dict], list[str | None]]:
    """The usable rows, and the split each names for itself (an empty list when none does)."""
    rows: list[dict] = []
    splits: list[str | None] = []
    prompts: dict[tuple, str] = {}  # prompt key -> where it was first seen
    ids: dict[str, str] = {}
    for index, record in enumerate(src.records()):
        if limit is not None and len(rows) >= limit:
            break
        if record.data is None:
            drops.bad(record.where, record.reason or "unreadable", record.error or "unreadable record")
            continue
        try:
            example: Example = adapter(record.data, record.base_dir)
            if record.data.get("tools") is not None:  # any task's rows may offer tools
                example.columns["tools"] = check_tools(record.data["tools"])
            elif tools:
                example.columns["tools"] = tools
        except FieldError as e:
            drops.bad(record.where, e.reason, str(e))
            continue
        key = (example.question, tuple(example.columns.get("images", ())))
        if key in prompts:
            drops.drop(record.where, "duplicate prompt", f"same prompt as {prompts[key]}")
            continue
        row_id = f"{task}-{example.source_id}" if example.source_id else f"{task}-{index:05d}"
        if row_id in ids:
            drops.bad(record.where, "duplicate id", f"id '{row_id}' is already used by {ids[row_id]}")
            continue
        prompts[key], ids[row_id] = record.where, record.where
        rows.append(
            make_row(row_id, example.question, example.answer, task, system_prompt, **example.columns)
        )
        splits.append(example.split)
    return rows, (splits if any(s is not None for s in splits) else [])


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
