"""Reading EvalScope's own output files: per-benchmark report JSON and per-sample prediction/review JSONL.

Scores are taken from EvalScope's report files, never recomputed, so grpoflow's numbers equal EvalScope's
by construction. Layout of one EvalScope run (`no_timestamp=True`) under its output directory:

    reports/<model_id>/<benchmark>.json              the report: metrics, subsets, counts, perf summary
    predictions/<model_id>/<benchmark>_<subset>.jsonl  one generation per line (output, usage, stop reason)
    reviews/<model_id>/<benchmark>_<subset>.jsonl      the same samples scored (target, extracted answer,
                                                       score)
    logs/eval_log.log, configs/task_config.yaml, reports/report.html
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchmarkReport:
    """What one EvalScope report file says about one benchmark."""

    score: float  # the report's primary metric (mean accuracy for the math benchmarks)
    metric: dict  # that metric's identity: name, aggregation, dimensions
    num_generations: int  # scored generations: problems x repeats
    subsets: dict[str, float]  # subset name -> primary metric score (MATH-500: "Level 1".."Level 5")
    subset_sizes: dict[str, int]  # subset name -> scored generations
    pass_at_k: dict[int, float] = field(default_factory=dict)  # k -> pass@k, present when repeats > 1


def report_path(outputs: Path, model_id: str, benchmark: str) -> Path:
    return outputs / "reports" / model_id / f"{benchmark}.json"


def sample_paths(outputs: Path, kind: str, model_id: str, benchmark: str, subsets: list[str]) -> list[Path]:
    """The `predictions` or `reviews` JSONL files of a benchmark, one per subset that has one."""
    paths = [outputs / kind / model_id / f"{benchmark}_{subset}.jsonl" for subset in subsets]
    return [p for p in paths if p.is_file()]


def read_report(path: Path) -> BenchmarkReport:
    """Parse an EvalScope report (schema 2): the primary metric, its subsets, and pass@k if present."""
    data = json.loads(path.read_text())
    primary = data.get("primary_metric_identity")
    if primary is None:
        reason = data.get("primary_metric_unavailable_reason") or "no reason given"
        raise RuntimeError(f"EvalScope report {path} names no primary metric: {reason}")
    metrics = data.get("metrics", [])
    matches = [m for m in metrics if m["identity"] == primary]
    if len(matches) != 1:
        raise RuntimeError(
            f"EvalScope report {path}: expected one metric with identity {primary}, found {len(matches)}"
        )
    main = matches[0]
    subsets = [s for category in main["categories"] for s in category["subsets"] if not s.get("is_aggregate")]
    pass_at_k = {
        int(m["identity"]["dimensions"]["k"]): float(m["score"])
        for m in metrics
        if m["identity"]["name"] == primary["name"] and m["identity"]["aggregation"] == "pass_at_k"
    }
    return BenchmarkReport(
        score=float(main["score"]),
        metric=primary,
        num_generations=int(main["num"]),
        subsets={s["name"]: float(s["score"]) for s in subsets},
        subset_sizes={s["name"]: int(s["num"]) for s in subsets},
        pass_at_k=dict(sorted(pass_at_k.items())),
    )


def review_score(review: dict) -> float | None:
    """A reviewed sample's correctness as EvalScope scored it, or None when the review holds no usable score.

    Adapters name the per-sample score differently (aime24 `acc`, math_500 `accuracy`): take the score the
    review names as its main one, else its only score, else `accuracy` or `acc`.
    """
    score = (review.get("sample_score") or {}).get("score") or {}
    values = score.get("value")
    if not isinstance(values, dict) or not values:
        return None
    name = score.get("main_score_name")
    for key in (
        ([name] if name in values else [])
        + ([next(iter(values))] if len(values) == 1 else [])
        + ["accuracy", "acc"]
    ):
        if key in values and isinstance(values[key], (int, float)):
            return float(values[key])
    return None


def problem_id(review: dict, subset: str) -> str:
    """The problem a reviewed sample answers, the same for its repeated generations and across evaluations:
    MATH-500's `question_id` (its unique_id) when the sample has one, else `<subset>/<group_id>` (EvalScope
    numbers problems within each subset; `sample_id` numbers generations). KeyError if the review has no
    id."""
    score = review["sample_score"]
    # EvalScope keeps a sample's metadata under sample_score
    question = (score.get("sample_metadata") or review.get("sample_metadata") or {}).get("question_id")
    if question is not None:
        return str(question)
    number = next(
        (v for v in (score.get("group_id"), score.get("sample_id"), review.get("index")) if v is not None),
        None,
    )
    if number is None:
        raise KeyError("sample_id")
    return f"{subset}/{number}"


DETAILED_REPORT = (
    "collection_detailed_report.json"  # next to EvalScope's reports/<model>/data_collection.json
)


def read_collection_report(path: str | os.PathLike) -> BenchmarkReport:
    """The scores of a collection run, from the detailed report EvalScope writes next to its `path`.

    EvalScope's report proper (`data_collection.json`) lists one metric per spelling of the per-sample
    score (aime24 says `acc`, math_500 `accuracy`), so it names no primary metric and no whole-collection
    number. Its detailed report does: `score` is the micro average (mean over all samples) of its one
    category-level row (the collection's root), else of its one task-level row; `subsets` are the
    dataset-level micro averages, one per benchmark of the collection.
    """
    detailed = Path(path).with_name(DETAILED_REPORT)
    if not detailed.is_file():
        raise RuntimeError(f"EvalScope wrote no collection report {detailed} next to {path}")
    data = json.loads(detailed.read_text())
    level, rows = next(
        ((lv, data.get(lv, [])) for lv in ("category_level", "task_level") if len(data.get(lv, [])) == 1),
        (None, None),
    )
    if level is None:
        raise RuntimeError(
            f"{detailed}: no single category-level or task-level row holds the whole collection "
            f"({len(data.get('category_level', []))} and {len(data.get('task_level', []))} rows)"
        )
    [overall] = rows
    datasets = data.get("dataset_level", [])
    return BenchmarkReport(
        score=float(overall["micro_avg."]),
        metric={"name": "accuracy", "aggregation": "micro_avg.", "dimensions": {"level": level}},
        num_generations=int(overall["count"]),
        subsets={row["dataset_name"]: float(row["micro_avg."]) for row in datasets},
        subset_sizes={row["dataset_name"]: int(row["count"]) for row in datasets},
    )
