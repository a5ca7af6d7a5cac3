"""The comparison as a picture: baseline and candidate bars per benchmark, the difference's CI as error bars."""

from __future__ import annotations

from pathlib import Path

from evaluation.compare import Row
from evaluation.plots import _pyplot


def plot_comparison(rows: list[Row], out_path: str | Path, baseline: str = "baseline",
                    candidate: str = "candidate") -> Path:
    """One panel per metric. The candidate bar carries the difference's confidence interval, drawn around
    the candidate's score: where the candidate could plausibly lie, seen against the baseline bar."""
    if not rows:
        raise ValueError("nothing to plot: no comparison rows")
    metrics = list(dict.fromkeys(r.metric for r in rows))
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(max(5.0, 3.2 * len(metrics) + 2), 3.8), dpi=100,
                             squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        panel = [r for r in rows if r.metric == metric]
        xs = range(len(panel))
        width = 0.38
        ax.bar([x - width / 2 for x in xs], [r.a for r in panel], width, label=f"baseline: {baseline}", color="#9e9e9e")
        yerr = [[max(0.0, r.diff - r.ci_low) for r in panel], [max(0.0, r.ci_high - r.diff) for r in panel]]
        ax.bar([x + width / 2 for x in xs], [r.b for r in panel], width, yerr=yerr, capsize=4,
               label=f"candidate: {candidate} (CI of diff)", color="#1f77b4")
        ax.set_xticks(list(xs), [f"{r.benchmark}\n(n={r.n})" for r in panel], fontsize=8)
        ax.set_title(metric)
        if all(r.gated for r in panel):  # correctness: a fraction of problems solved
            ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")  # a reader never sees half a PNG
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out_path)
    return out_path
