"""Where training reports to: `metrics.jsonl` in the output directory, plus any callbacks.

Callbacks are how the pipeline binds training to MLflow and Prefect without the trainer importing either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol


class TrainerCallback(Protocol):
    """Missing methods are fine: the trainer calls only what a callback defines."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...
    def on_train_end(self, summary: dict) -> None: ...


class MetricsFile:
    """Appends one JSON object per step; on resume, drops lines past the checkpoint so no step repeats."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def append(self, step: int, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
