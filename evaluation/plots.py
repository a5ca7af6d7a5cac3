"""PNG plots people would rather look at than read: training curves now, comparison bars later."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = {
    "reward": ("reward", "rewards/accuracy/mean"),
    "completion_length": ("completions/mean_length", "completions/max_length"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or servers
    import matplotlib.pyplot as plt
    return plt


def plot_training_curves(metrics_path: str | Path, out_dir: str | Path, window: int = 10) -> list[Path]:
    """Reward and completion-length curves from a trainer's metrics.jsonl (raw + moving average)."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []
    for name, keys in CURVES.items():
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            steps, values = zip(*pts, strict=True)
            line, = ax.plot(steps, values, alpha=0.3, linewidth=1)
            smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                      for i in range(len(values))]
            ax.plot(steps, smooth, color=line.get_color(), linewidth=2, label=f"{key} (mean of {window})")
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
