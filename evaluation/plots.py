"""PNG plots people would rather look at than read: training curves, a comparison of two models as bars, and
held-out images with a model's answers before and after training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evaluation.compare import Row

CURVES = {
    "reward": ("reward", "rewards/accuracy/mean", "rewards/counting/mean"),
    "completion_length": ("completions/mean_length", "completions/max_length"),
}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or servers
    import matplotlib.pyplot as plt

    return plt


def plot_training_curves(metrics_path: str | Path, out_dir: str | Path, window: int = 10) -> list[Path]:
    """Reward and completion-length curves from a trainer's metrics.jsonl (raw + moving average)."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    written = []
    for name, keys in CURVES.items():
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            steps, values = zip(*pts, strict=True)
            (line,) = ax.plot(steps, values, alpha=0.3, linewidth=1)
            smooth = [
                sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))
            ]
            ax.plot(steps, smooth, color=line.get_color(), linewidth=2, label=f"{key} (mean of {window})")
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{name}.png"))
    return written


def plot_comparison(
    rows: list[Row], out_path: str | Path, baseline: str = "baseline", candidate: str = "candidate"
) -> Path:
    """One panel per metric. The candidate bar carries the difference's confidence interval, drawn around
    the candidate's score: where the candidate could plausibly lie, seen against the baseline bar."""
    if not rows:
        raise ValueError("nothing to plot: no comparison rows")
    metrics = list(dict.fromkeys(r.metric for r in rows))
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(max(5.0, 3.2 * len(metrics) + 2), 3.8), dpi=100, squeeze=False
    )
    for ax, metric in zip(axes[0], metrics, strict=True):
        panel = [r for r in rows if r.metric == metric]
        xs = range(len(panel))
        width = 0.38
        ax.bar(
            [x - width / 2 for x in xs],
            [r.a for r in panel],
            width,
            label=f"baseline: {baseline}",
            color="#9e9e9e",
        )
        yerr = [[max(0.0, r.diff - r.ci_low) for r in panel], [max(0.0, r.ci_high - r.diff) for r in panel]]
        ax.bar(
            [x + width / 2 for x in xs],
            [r.b for r in panel],
            width,
            yerr=yerr,
            capsize=4,
            label=f"candidate: {candidate} (CI of diff)",
            color="#1f77b4",
        )
        ax.set_xticks(list(xs), [f"{r.benchmark}\n(n={r.n})" for r in panel], fontsize=8)
        ax.set_title(metric)
        if all(r.gated for r in panel):  # correctness: a fraction of problems solved
            ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out_path)


def plot_answers(images: list[str], titles: list[str], out_path: str | Path, columns: int = 4) -> Path:
    """A grid of images (prepared references: paths, URLs, `data:` URIs), each under its title (e.g. the gold
    count and a model's answers before and after training)."""
    from data.images import load_image

    if not images or len(images) != len(titles):
        raise ValueError(f"plot_answers: {len(images)} images for {len(titles)} titles")
    plt = pyplot()
    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.9 * rows), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, ref, title in zip(axes.flat, images, titles, strict=False):
        ax.imshow(load_image(ref))
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return _save(fig, Path(out_path))


def plot_before_after(images: list[str], before: list[dict], after: list[dict], out_path: str | Path) -> Path:
    """`plot_answers` titled with each image's gold answer and the answers before and after training, marked
    right or wrong; `before`, `after`: greedy samples (`id`, `answer`, `completion`, `correct`, as
    `trainer.heldout.evaluate_greedy` returns them) of the images, in their order."""
    if [s["id"] for s in before] != [s["id"] for s in after]:
        raise ValueError("plot_before_after: the samples before and after training are not of the same rows")
    titles = [
        f"gold {a['answer']}\nbefore {_answer(b)}  after {_answer(a)}"
        for b, a in zip(before, after, strict=True)
    ]
    return plot_answers(images, titles, out_path)


def _answer(sample: dict) -> str:
    """The sample's final answer, shortened for a title, marked right or wrong."""
    from data.answers import extract_answer

    return f"{(extract_answer(sample['completion']) or '-')[:8]} {'✓' if sample['correct'] else '✗'}"


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")  # a reader never sees half a PNG
    fig.savefig(tmp, format="png")
    pyplot().close(fig)
    tmp.replace(path)
    return path
