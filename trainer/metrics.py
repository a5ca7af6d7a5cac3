"""Where training reports to: `metrics.jsonl` in the output directory, plus any callbacks.

Callbacks are how the pipeline binds training to MLflow and Prefect without the trainer importing either.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from data.errors import DataError
from data.manifest import write_jsonl_atomic

log = logging.getLogger("grpoflow.train")


class TrainerCallback(Protocol):
    """Missing methods are fine: the trainer calls only what a callback defines."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...
    def on_train_end(self, summary: dict) -> None: ...


SUMMARY = "summary.json"  # rank 0's TrainResult.summary() in the run directory, written when training ends


class MetricsFile:
    """Appends one JSON object per step; on resume, drops lines past the checkpoint so no step repeats.

    A last line without its newline is a write the run did not finish (a crash, a full disk): it is dropped
    with a warning. Any other line that is not a JSON object with a `step` is a DataError naming the line.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        write_jsonl_atomic(self.path, [line for line, row in self._rows(warn=True) if row["step"] <= step])

    def append(self, step: int, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rows_after(self, seen: int) -> tuple[list[dict], int]:
        """The complete rows past the first `seen`, and how many rows the file holds now. A file cut back
        below `seen` (a resumed run drops the steps past its checkpoint, then writes them again) is read on
        from where it was cut."""
        rows = self.read()
        seen = min(seen, len(rows))
        return rows[seen:], len(rows)

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [row for _, row in self._rows(warn=False)]

    def _rows(self, warn: bool) -> list[tuple[str, dict]]:
        """(line, parsed row) for each complete line; a torn last line is left out."""
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        out = []
        for lineno, raw in enumerate(lines, 1):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if lineno == len(lines) and not raw.endswith("\n"):
                    if warn:
                        log.warning(
                            "%s:%d: dropping a partial last line (a write the run did not finish)",
                            self.path,
                            lineno,
                        )
                    break
                raise DataError(
                    f"{self.path}:{lineno}: not valid JSON ({e.msg}); the file was edited or "
                    "corrupted: fix or remove that line to resume"
                ) from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise DataError(
                    f"{self.path}:{lineno}: expected a JSON object with an integer 'step', got "
                    f"{line[:80]!r}; fix or remove that line to resume"
                )
            out.append((line, row))
        return out


@dataclass
class TrainResult:
    steps: int
    heldout_before: dict
    heldout_after: dict
    checkpoint: str
    metrics_path: str
    seconds_per_step: float
    resumed_from: int
    trainer_ranks: int = 1

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "heldout_accuracy_before": self.heldout_before.get("accuracy"),
            "heldout_accuracy_after": self.heldout_after.get("accuracy"),
            "heldout_before": self.heldout_before,
            "heldout_after": self.heldout_after,
            "seconds_per_step": self.seconds_per_step,
            "checkpoint": self.checkpoint,
            "metrics": self.metrics_path,
            "resumed_from_step": self.resumed_from,
            "trainer_ranks": self.trainer_ranks,
        }
