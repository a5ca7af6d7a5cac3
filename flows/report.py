"""The summary a person reads at the end of `grpoflow run` (URIs shown with their credentials masked)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from data.redact import mask_uri, redact


def print_run_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"grpoflow run: {summary['recipe']}", show_header=False)
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    if before is not None and after is not None:
        table.add_row(
            "held-out accuracy (greedy)", f"base {before:.3f} -> trained {after:.3f} ({after - before:+.3f})"
        )
    for bench, score in summary["scores"].items():
        if bench != "heldout_accuracy":
            table.add_row(f"EvalScope {bench}", f"{score:.3f}")
    table.add_row("registered", f"{summary['model_uri']} (alias candidate)")
    table.add_row("cached stages", ", ".join(summary["cached_stages"]) or "none")
    table.add_row("checkpoint", summary["checkpoint"])
    table.add_row("MLflow", mask_uri(summary["tracking_uri"]))
    table.add_row("Prefect", mask_uri(summary["state"]["prefect"]))
    for i, cmd in enumerate(summary["ui"]):
        table.add_row("open the UIs" if i == 0 else "", f"[bold]{redact(cmd)}[/bold]")
    console.print(table)
