"""The samples `evaluation.thinking` measures, read from an EvalScope work dir or from a JSONL of outputs.

Two inputs, one `Sample` shape (benchmark, subset, id, gold answers, the assistant message):

- A finished `run_evalscope` work dir (it has `report.json`): `load_result` names each benchmark's
  review files, `evalscope/reviews/<model_id>/<benchmark>_<subset>.jsonl`. A review line holds the same
  assistant message as the matching prediction line (`messages[-1]`, with any reasoning EvalScope
  separated from the text as a `{"type": "reasoning"}` content block) plus the gold answers (`target`,
  a list) and EvalScope's own per-sample score, so the prediction files are not read.
- A JSONL file of `{"id", "output", "answer"}` rows (`output`: the model's whole text; `answer`: the
  gold answer, a string or number, or a list of them), optionally with `reasoning_content` when the
  server returned the reasoning separately. The benchmark is the file's stem, the subset "default".

Bad input raises `FileNotFoundError` (no such path) or `DataError` naming the file, line and field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from data.errors import DataError, MissingPathError
from evaluation.evalscope_reports import problem_id, review_score
from evaluation.evalscope_runner import REPORT, load_result


@dataclass
class Sample:
    """One model output to measure."""

    benchmark: str
    subset: str
    id: object
    golds: list[str]  # gold answers; the output is correct if it matches any
    message: dict  # the assistant message: `content`, maybe `reasoning_content`
    evalscope_score: float | None = None  # EvalScope's own verdict, when the sample came from a work dir
    problem: str | None = None  # the problem it answers (`problem_id`), shared by its repeated samples


def read_samples(path: str | os.PathLike) -> list[Sample]:
    """The samples of an EvalScope work dir (a directory) or of a JSONL file (anything else)."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"no such EvalScope work dir or JSONL file: {path}")
    return list(_work_dir_samples(path) if path.is_dir() else _jsonl_samples(path))


def default_out(path: str | os.PathLike) -> Path:
    """Where the per-sample rows go by default: `<work_dir>/thinking/samples.jsonl`, or
    `<stem>.thinking.jsonl` next to a JSONL input."""
    path = Path(path)
    return (
        path / "thinking" / "samples.jsonl"
        if path.is_dir()
        else path.with_name(f"{path.stem}.thinking.jsonl")
    )


def _work_dir_samples(work_dir: Path) -> Iterator[Sample]:
    if not (work_dir / REPORT).is_file():
        raise MissingPathError(
            f"{work_dir} is a directory without {REPORT}: not a finished grpoflow EvalScope "
            "work dir (pass the work dir of `grpoflow eval`, or a JSONL file)"
        )
    for bench, paths in load_result(work_dir).review_paths.items():
        for path in paths:
            subset = path.stem[len(bench) + 1 :]  # `<benchmark>_<subset>.jsonl`; subset names may hold `_`
            for where, review in _jsonl_lines(path):
                message = _field(review, "messages", list, where)
                if not message or not isinstance(message[-1], Mapping):
                    raise DataError(f"{where}: field 'messages': expected a non-empty list of messages")
                try:
                    problem = problem_id(review, subset)
                except KeyError:
                    raise DataError(
                        f"{where}: no problem id (sample_score.group_id or sample_id, or index)"
                    ) from None
                yield Sample(
                    bench,
                    subset,
                    _field(review, "index", object, where),
                    _golds(_field(review, "target", object, where), where, "target"),
                    dict(message[-1]),
                    review_score(review),
                    problem,
                )


def _jsonl_samples(path: Path) -> Iterator[Sample]:
    for where, row in _jsonl_lines(path):
        message = {"content": _field(row, "output", str, where)}
        if row.get("reasoning_content") is not None:
            message["reasoning_content"] = _field(row, "reasoning_content", str, where)
        yield Sample(
            path.stem,
            "default",
            _field(row, "id", object, where),
            _golds(_field(row, "answer", object, where), where, "answer"),
            message,
        )


def _jsonl_lines(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _field(row: dict, name: str, kind: type, where: str):
    if row.get(name) is None:
        raise DataError(f"{where}: missing field '{name}'")
    if not isinstance(row[name], kind):
        raise DataError(f"{where}: field '{name}': expected {kind.__name__}, got {type(row[name]).__name__}")
    return row[name]


def _golds(value: object, where: str, name: str) -> list[str]:
    values = value if isinstance(value, list) else [value]
    golds = [str(v).strip() for v in values if isinstance(v, (str, int, float)) and str(v).strip()]
    if not golds or len(golds) != len(values):
        raise DataError(
            f"{where}: field '{name}': expected a non-empty answer (string or number, or a list of "
            f"them), got {value!r}"
        )
    return golds
