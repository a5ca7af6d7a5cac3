"""Benchmark: the embedded vision demo learns to count (configs/tiny-vl-counting-cpu.yaml), end to end.

What it runs, in one process: the counting bootstrap (a tiny Qwen2-VL-architecture model warmed up on
synthetic CLEVR-like images until its greedy held-out counting accuracy is in the recipe's band), the prepared
synthetic counting data (2000 training images, 200 held-out images from their own stream), then GRPO with the
recipe's format + counting rewards. It prints held-out greedy counting accuracy before and after, the training
time, and the sampled counting reward per 50 steps; it writes the reward curve and a before/after grid of
held-out images with their answers to `.state/bench/vision/`.

The aim: held-out counting accuracy up by at least 10 points in at most 10 minutes of training on a
2-core machine. This is a figure, not a timed test: it is asserted only that training ran its steps and that
the accuracies are fractions; the README reports what was measured.

Run: `make bench` (with the other benchmarks), or alone:
`.venv/bin/python -m pytest -m bench tests/benchmarks/test_bench_vision.py -s`.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT

RECIPE = REPO_ROOT / "configs" / "tiny-vl-counting-cpu.yaml"
OUT = REPO_ROOT / ".state" / "bench" / "vision"


def run_vision_demo(out: Path) -> dict:
    from evaluation.plots import plot_training_curves
    from tasks.stages import heldout_answers_plot
    from trainer.grpo import prepare_inputs
    from trainer.grpo import train_recipe as train
    from trainer.recipe import load_recipe

    shutil.rmtree(out / "run", ignore_errors=True)  # a fresh run, not a resumed one
    recipe = load_recipe(RECIPE, [f"train.output_dir={out / 'run'}", f"data.out={out / 'data'}"])
    prepare_inputs(recipe)  # the data and the warmed-up base model (cached), outside the training time
    started = time.perf_counter()
    result = train(recipe, progress=False)
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in Path(result["metrics"]).read_text().splitlines()]
    per_50 = [
        round(statistics.fmean(r["rewards/counting/mean"] for r in rows[i : i + 50]), 3)
        for i in range(0, len(rows), 50)
    ]
    plots = plot_training_curves(result["metrics"], out / "plots")
    grid = heldout_answers_plot(result, str(out / "data"), out / "plots" / "answers.png")
    summary = {
        "before": result["heldout_accuracy_before"],
        "after": result["heldout_accuracy_after"],
        "steps": result["steps"],
        "training_s": round(seconds, 1),
        "counting_reward_per_50_steps": per_50,
        "plots": [str(p) for p in [*plots, grid]],
    }
    print(
        f"\nvision demo ({recipe.name}): held-out counting accuracy {summary['before']:.3f} -> "
        f"{summary['after']:.3f} ({100 * (summary['after'] - summary['before']):+.1f} points) in "
        f"{summary['steps']} steps, {seconds / 60:.1f} min of training (aim: +10 points in <= 10 min)"
    )
    print(f"sampled counting reward, mean per 50 steps: {per_50}")
    print("plots:", *summary["plots"], sep="\n  ")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@pytest.mark.bench
def test_bench_vision_demo_learns_to_count():
    OUT.mkdir(parents=True, exist_ok=True)
    summary = run_vision_demo(OUT)
    assert summary["steps"] > 0 and 0 <= summary["before"] <= 1 and 0 <= summary["after"] <= 1
    assert all(Path(p).is_file() for p in summary["plots"])
