"""Side by side, repeated: how both benchmarks run their sides, meter them and reduce them to verdicts.

A benchmark figure is a ratio measured side by side in one run, repeated enough to be stable (GUIDE.md,
"Tests and benchmarks"). So the sides run in rounds, alternated: A B C in round 1, C B A in round 2, A B C in
round 3, ... Each run is metered for the CPU that other processes took meanwhile (`other%`). A side's figure
is the median over rounds of its per-round figure, and every ratio is computed within a round (its two runs
were minutes apart at most, under the same neighbours) and then medianed over rounds; the per-round values are
kept, printed and plotted, so a reader sees the spread that the median hides.

Knobs shared by both benchmarks: BENCH_STEPS (generated batches per side per round) and BENCH_REPEATS
(rounds).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_OUT = REPO_ROOT / ".state" / "bench"
for _folder in (
    REPO_ROOT,
    Path(__file__).resolve().parent,
):  # run as a script, or under pytest's importlib mode
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: expected a whole number >= {minimum} (unset: {default})")
    return value


def bench_steps(default: int = 10) -> int:
    """Generated batches per side per round; the first is a warm-up, left out of the per-step figures."""
    return env_int("BENCH_STEPS", default, minimum=2)


def bench_repeats(default: int = 3) -> int:
    """Rounds: every side runs once per round, the order reversed every other round."""
    return env_int("BENCH_REPEATS", default)


# ------------------------------------------------------------------------------------------ per step
def mean_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return statistics.fmean(rest) if rest else math.nan


def median_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return statistics.median(rest) if rest else math.nan


# ------------------------------------------------------------------------------------------- the meter
class OtherCPU:
    """Share of the machine's CPU time that OTHER processes used while a side ran (Linux /proc/stat).

    Speed is only comparable side by side if this stays near 0 for every side: on 2 shared cores a concurrent
    job slows 2-thread torch many times over. This process and its children (reaped or alive: rollout workers,
    the math grader worker) count as ours."""

    def __enter__(self):
        self.busy, self.own, self.wall = _busy_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.wall
        others = (_busy_s() - self.busy) - (_own_cpu_s() - self.own)
        self.share = max(0.0, others) / (wall * (os.cpu_count() or 1)) if wall > 0 else math.nan


def _busy_s() -> float:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _live_descendants_cpu_s(os.getpid())


def _live_descendants_cpu_s(root: int) -> float:
    stats = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime+stime
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------- the rounds
def round_order(sides: list[str], round_index: int) -> list[str]:
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def run_rounds(
    sides: dict[str, Callable[[int], dict]], repeats: int, after_each: Callable[[], None] = lambda: None
) -> dict[str, list[dict]]:
    """Every side once per round, alternated; each run metered. A side is `fn(round_index) -> dict`.

    Every run starts with the torch thread count the process started with: an async run sets the trainer to
    one thread and building an in-process vLLM makes `torch.set_num_threads` a no-op for the whole process
    (infra/vllm-cpu-notes.md, section 4); both are undone, as a fresh process would have them."""
    import torch

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for r in range(repeats):
            for position, name in enumerate(round_order(list(sides), r)):
                torch.set_num_threads = set_num_threads
                set_num_threads(threads)
                with OtherCPU() as meter:
                    run = sides[name](r)
                after_each()
                run.update(
                    {"round": r, "position": position, "other_cpu_share": meter.share, "threads": threads}
                )
                runs[name].append(run)
                print(
                    f"  round {r + 1}/{repeats} {name}: {_brief(run)}, other {100 * meter.share:.0f}%",
                    flush=True,
                )
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)
    return runs


def _brief(run: dict) -> str:
    if "error" in run:
        return f"failed ({run['error'][:120]})"
    figures = [
        f"{run[key]:.3f} {unit}"
        for key, unit in (("median_s_per_step", "s/step"), ("wall_s", "s wall"))
        if isinstance(run.get(key), float) and math.isfinite(run[key])
    ]
    return ", ".join(figures) or "done"


def median_over(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return statistics.median(values) if values else math.nan


def max_other(runs: list[dict]) -> float:
    return max((r["other_cpu_share"] for r in runs), default=math.nan)


def round_ratio(
    runs: dict[str, list[dict]],
    num: str,
    den: str,
    key: str = "median_s_per_step",
    den_key: str | None = None,
) -> dict:
    """num/den within each round, then the median over rounds (min and max kept: the spread)."""
    by_round = {r["round"]: r for r in runs[den]}
    rounds = [
        n[key] / by_round[n["round"]][den_key or key]
        for n in runs[num]
        if n["round"] in by_round and n.get(key) and by_round[n["round"]].get(den_key or key)
    ]
    finite = [x for x in rounds if math.isfinite(x)]
    return {
        "median": statistics.median(finite) if finite else math.nan,
        "rounds": rounds,
        "min": min(finite, default=math.nan),
        "max": max(finite, default=math.nan),
    }


def format_ratio(ratio: dict) -> str:
    each = " ".join(f"{x:.2f}" for x in ratio["rounds"])
    return f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}; rounds {each}]"


# --------------------------------------------------------------------------------------------- outputs
def write_json(path: Path, report: dict) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def plot_round_ratios(path: Path, title: str, ratios: dict[str, dict], aims: dict[str, float] = ()) -> str:
    """One column per ratio: a dot per round, a bar at the median, a dashed line at 1 (and at an aim, where
    one is given). Returns the path, or why there is no plot: the numbers are in the JSON either way."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # a plot is a convenience, never a reason to lose the run
        return f"no plot: {type(e).__name__}: {e}"
    names = list(ratios)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(names) + 1), 4.0))
    for i, name in enumerate(names):
        values = ratios[name]["rounds"]
        ax.scatter([i] * len(values), values, color="tab:blue", alpha=0.7, zorder=3)
        ax.hlines(ratios[name]["median"], i - 0.3, i + 0.3, color="tab:red", zorder=4)
        if name in dict(aims):
            ax.hlines(dict(aims)[name], i - 0.4, i + 0.4, color="tab:green", linestyles="dotted", zorder=2)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")  # a ratio and its inverse sit as far from 1
    shown = [
        v for x in ratios.values() for v in [*x["rounds"], x["median"]] if math.isfinite(v) and v > 0
    ] or [1.0]
    lo, hi = min([*shown, 1.0]) / 1.3, max([*shown, 1.0]) * 1.3
    ticks = [t for t in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10, 20, 50) if lo <= t <= hi]
    ax.set_ylim(lo, hi)
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ratio (dots: rounds; red: median; green: aim)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return str(path)
