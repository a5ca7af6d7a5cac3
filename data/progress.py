"""Progress bars that are shown in a terminal and stay quiet in CI or when stderr is not a terminal.

`progress_enabled` is the one rule every layer asks (the trainer's bars, EvalScope's echoed output, the
thinking metrics); it lives in the bottom layer so that all of them can.
"""

from __future__ import annotations

import os
import sys


def progress_enabled(enabled: bool | None = None) -> bool:
    if enabled is not None:
        return enabled
    return sys.stderr.isatty() and not os.environ.get("CI")


def quiet_transformers_progress() -> None:
    """Turn off transformers' own bars ("Loading weights", "Writing model shards"): one per load and per
    checkpoint would bury the run's own progress, which is what a user should see."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class Progress:
    """A rich progress bar with live fields (`bar.update(1, reward="0.42")`), or nothing at all."""

    def __init__(self, total: int, description: str, enabled: bool | None = None, completed: int = 0):
        self.enabled = progress_enabled(enabled)
        self.total, self.description, self.completed = total, description, completed
        self._progress = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self.description, total=self.total, completed=self.completed, info=""
            )
        return self

    def update(self, advance: int = 1, **fields) -> None:
        if self._progress is not None:
            info = "  ".join(f"{k}={v}" for k, v in fields.items())
            self._progress.update(self._task, advance=advance, info=info)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False
