"""Comparing two finished evaluations problem by problem, and the regression gate built on that comparison.

Direction: every difference is candidate minus baseline, so a positive `diff` is an improvement. Scores are
paired: both sides are reduced to the problems both scored (keyed by a stable id, see `load_samples`), and the
confidence interval of the mean difference comes from a paired bootstrap over those problems.

Per-sample correctness comes from EvalScope's review files (`report.json` lists them under `review_paths`),
and for a held-out evaluation (`evaluation.heldout`: a recipe with `eval.benchmarks: []`) from its samples
file, compared as the benchmark `heldout`. Two evaluations are compared on the benchmarks both have; one that
only one side has is named in the table and left out. If the evaluation also
has a thinking-efficiency file (`<work_dir>/thinking/samples.jsonl`: one JSON object per sample with
`benchmark`, `subset`, an `id` and numeric metric fields, as `evaluation.thinking` writes it), each numeric
field is compared the same way over the problems where both sides have a value; those rows are reported but
never gated, since "better" depends on the metric.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data.errors import MissingPathError
from evaluation.eval_settings import setting_differences
from evaluation.evalscope_reports import problem_id, review_score
from evaluation.heldout import HELDOUT, SETTING_KEYS, heldout_samples

log = logging.getLogger("grpoflow.compare")

DEFAULT_MAX_DROP = (
    0.02  # the gate's allowed drop in a benchmark's score (absolute, e.g. 2 points of accuracy)
)
SCORE = "accuracy"  # the metric name of the correctness rows (EvalScope's primary metric for math benchmarks)
THINKING_SAMPLES = Path("thinking") / "samples.jsonl"
# Fields of a thinking sample that identify it; the first one present is its id. Never compared as metrics.
_ID_FIELDS = ("problem_id", "sample_key", "id", "question_id", "sample_id", "index")
# evalscope_score repeats the correctness row; first_correct_paragraph is a position, not an amount.
_NOT_METRICS = frozenset(_ID_FIELDS) | {
    "benchmark",
    "subset",
    "generation_index",
    "repeat",
    "model",
    "evalscope_score",
    "first_correct_paragraph",
}

# benchmark -> metric -> problem id -> value (the mean over a problem's generations)
Samples = dict[str, dict[str, dict[str, float]]]


@dataclass(frozen=True)
class Row:
    """One benchmark x metric: baseline (a) and candidate (b) means over the problems both scored."""

    benchmark: str
    metric: str
    a: float  # baseline mean
    b: float  # candidate mean
    diff: float  # b - a: candidate minus baseline
    ci_low: float  # bootstrap confidence interval of diff
    ci_high: float
    n: int  # problems in common
    dropped: int  # problems only one side scored, left out of the comparison
    gated: bool  # a correctness row, which the gate checks

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GateResult:
    passed: bool
    max_drop: float
    failing: list[Row]  # gated rows whose whole confidence interval lies below -max_drop
    checked: list[Row]  # every gated row

    def markdown(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        head = (
            f"**Gate {verdict}**: {len(self.failing)} of {len(self.checked)} benchmarks dropped by more than "
            f"{self.max_drop:g} (upper CI bound of candidate - baseline below {-self.max_drop:g})\n"
        )
        return head + ("\n" + markdown_table(self.failing) if self.failing else "")


def read_report_json(work_dir: str | os.PathLike) -> dict:
    """The `report.json` of a finished evaluation, checked for what a comparison reads: a JSON object with
    EvalScope's `review_paths` (benchmark -> review files) or a held-out evaluation's `heldout` section.
    MissingPathError when there is none, ValueError naming the file and what was expected otherwise."""
    path = Path(work_dir) / "report.json"
    if not path.is_file():
        raise MissingPathError(f"no report.json in {work_dir}: not a finished evaluation")
    expected = (
        "expected the JSON object an evaluation writes, with 'review_paths' (EvalScope's review files "
        "per benchmark) or 'heldout' (a held-out evaluation)"
    )
    text = path.read_text()
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; {expected}")
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); {expected}") from e
    if not isinstance(report, dict) or not ({"review_paths", HELDOUT} & report.keys()):
        if isinstance(report, dict):
            got = f"an object with keys {sorted(report)}" if report else "an empty object {}"
        else:
            got = f"a JSON {type(report).__name__}"
        raise ValueError(f"{path}: {expected}; got {got}")
    reviews = report.get("review_paths", {})
    if not isinstance(reviews, dict) or not all(
        isinstance(ps, list) and all(isinstance(p, str) for p in ps) for ps in reviews.values()
    ):
        raise ValueError(
            f"{path}: 'review_paths' must map each benchmark to a list of review file paths, "
            f"got {reviews!r:.200}"
        )
    held = report.get(HELDOUT)
    if held is not None and not (isinstance(held, dict) and isinstance(held.get("samples"), str)):
        raise ValueError(f"{path}: 'heldout' must be an object naming its 'samples' file, got {held!r:.200}")
    return report


def load_samples(work_dir: str | os.PathLike) -> Samples:
    """Per-problem scores of a finished evaluation: correctness from EvalScope's reviews (and from the
    held-out samples of a held-out evaluation, as benchmark `heldout`), plus thinking metrics.

    A problem's id is MATH-500's `question_id` when the sample has one, else `<subset>/<group_id>` (EvalScope
    numbers problems within each subset; its `sample_id` numbers generations); a held-out problem's is its row
    id. Repeated generations of a problem are averaged.
    """
    work_dir = Path(work_dir)
    report = read_report_json(work_dir)
    samples: Samples = {}
    for bench, paths in report.get("review_paths", {}).items():
        values: dict[str, list[float]] = {}
        for rel in paths:
            path = work_dir / rel
            subset = Path(rel).stem.removeprefix(f"{bench}_")
            for lineno, rec in _jsonl(path):
                try:
                    key = problem_id(rec, subset)
                    value = review_score(rec)
                    if value is None:
                        raise KeyError(
                            f"no accuracy among the sample's scores {rec['sample_score']['score']['value']}"
                        )
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(
                        f"{path}:{lineno}: not an EvalScope review ({type(e).__name__}: {e}); "
                        "expected sample_score.score.value and sample_id or index"
                    ) from e
                values.setdefault(key, []).append(value)
        if not values:
            raise ValueError(f"{work_dir}: no reviewed samples for benchmark {bench!r} in {paths}")
        samples[bench] = {SCORE: {k: sum(v) / len(v) for k, v in values.items()}}
    if HELDOUT in report:
        held = heldout_samples(work_dir, report)
        if not held:
            raise ValueError(f"{work_dir / report[HELDOUT]['samples']}: no held-out samples")
        samples[HELDOUT] = {SCORE: held}
    thinking = work_dir / THINKING_SAMPLES
    if thinking.is_file():
        for bench, metrics in _thinking_samples(thinking).items():  # never overrides EvalScope's correctness
            samples.setdefault(bench, {}).update({m: v for m, v in metrics.items() if m != SCORE})
    return samples


def paired_bootstrap(
    a: list[float], b: list[float], n_resamples: int = 10000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float, float]:
    """(mean of b - a, lower, upper): percentile bootstrap over paired problems (a[i] and b[i] are one
    problem)."""
    if len(a) != len(b):
        raise ValueError(
            f"paired bootstrap needs one baseline and one candidate value per problem, "
            f"got {len(a)} and {len(b)}"
        )
    if not a:
        raise ValueError("paired bootstrap needs at least one problem")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be positive, got {n_resamples}")
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    rng = np.random.default_rng(seed)
    # Resample in chunks of about a million indices: memory stays flat for large benchmarks.
    chunk = max(1, 1_000_000 // len(d))
    means = np.concatenate(
        [
            d[rng.integers(0, len(d), size=(min(chunk, n_resamples - i), len(d)))].mean(axis=1)
            for i in range(0, n_resamples, chunk)
        ]
    )
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(d.mean()), float(lo), float(hi)


def compare(
    a_samples: Samples, b_samples: Samples, n_resamples: int = 10000, seed: int = 0, confidence: float = 0.95
) -> list[Row]:
    """One row per benchmark x metric: baseline `a_samples` against candidate `b_samples`.

    The benchmarks both sides scored are compared (`only_one_side` names the others, which the caller shows);
    none in common is a ValueError naming what each side has. Thinking metrics are compared where both sides
    have them.
    """
    a_benches, b_benches = _scored(a_samples), _scored(b_samples)
    if not a_benches & b_benches:
        raise ValueError(
            f"the evaluations have no benchmark in common (different benchmarks: baseline "
            f"{sorted(a_benches)}, candidate {sorted(b_benches)}); evaluate both with the same "
            "benchmarks, or both on the held-out split (eval.benchmarks: [])"
        )
    baseline_only, candidate_only = only_one_side(a_samples, b_samples)
    if baseline_only or candidate_only:
        log.warning(
            "benchmarks only one side scored are not compared: baseline only %s, candidate only %s",
            baseline_only,
            candidate_only,
        )
    a_benches &= b_benches
    rows = []
    for bench in sorted(a_benches):
        metrics = [SCORE] + sorted(m for m in a_samples[bench] if m != SCORE and m in b_samples[bench])
        for metric in metrics:
            a_map, b_map = a_samples[bench][metric], b_samples[bench][metric]
            common = sorted(a_map.keys() & b_map.keys())
            dropped = len(a_map.keys() ^ b_map.keys())
            if not common and metric != SCORE:  # e.g. a metric defined on correct answers, and none in common
                log.warning(
                    "%s %s: no problem in common with a value on both sides; not compared", bench, metric
                )
                continue
            if not common:
                raise ValueError(
                    f"{bench} {metric}: no problem in common between baseline ({len(a_map)} problems) "
                    f"and candidate ({len(b_map)}); were they evaluated on the same data?"
                )
            if dropped:
                log.warning(
                    "%s %s: %d problems scored by one side only were dropped; comparing the %d in common",
                    bench,
                    metric,
                    dropped,
                    len(common),
                )
            a, b = [a_map[k] for k in common], [b_map[k] for k in common]
            diff, lo, hi = paired_bootstrap(a, b, n_resamples, seed, confidence)
            rows.append(
                Row(
                    bench,
                    metric,
                    sum(a) / len(a),
                    sum(b) / len(b),
                    diff,
                    lo,
                    hi,
                    len(common),
                    dropped,
                    gated=metric == SCORE,
                )
            )
    return rows


def only_one_side(a_samples: Samples, b_samples: Samples) -> tuple[list[str], list[str]]:
    """(benchmarks only the baseline scored, benchmarks only the candidate scored): what `compare` leaves
    out."""
    a, b = _scored(a_samples), _scored(b_samples)
    return sorted(a - b), sorted(b - a)


def _scored(samples: Samples) -> set[str]:
    return {b for b, m in samples.items() if SCORE in m}


def check_max_drop(max_drop: float) -> None:
    """A gate's allowed drop must be a finite number >= 0: NaN compares false with everything and would
    pass any regression, infinity would too."""
    if (
        isinstance(max_drop, bool)
        or not isinstance(max_drop, (int, float))
        or not (math.isfinite(max_drop) and max_drop >= 0)
    ):
        raise ValueError(f"max_drop must be a finite number >= 0, got {max_drop!r}")


def gate(rows: list[Row], max_drop: float = DEFAULT_MAX_DROP) -> GateResult:
    """Fail a benchmark only when it dropped by more than `max_drop` with confidence: its CI's upper bound
    of candidate - baseline is below -max_drop. Thinking-metric rows are not gated."""
    check_max_drop(max_drop)
    checked = [r for r in rows if r.gated]
    if not checked:
        raise ValueError("nothing to gate: the comparison has no benchmark scores")
    failing = [r for r in checked if r.ci_high < -max_drop]
    return GateResult(not failing, max_drop, failing, checked)


def markdown_table(
    rows: list[Row], confidence: float = 0.95, left_out: tuple[list[str], list[str]] = ((), ())
) -> str:
    """The rows as a markdown table; `left_out`: `only_one_side`'s benchmarks, named below it."""
    lines = [
        f"| benchmark | metric | baseline | candidate | diff (cand - base) | {confidence:.0%} CI | n |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.benchmark} | {r.metric} | {_fmt(r.a)} | {_fmt(r.b)} | {_fmt(r.diff, '+')} | "
            f"[{_fmt(r.ci_low, '+')}, {_fmt(r.ci_high, '+')}] | {r.n} |"
        )
    dropped = [f"{r.benchmark} {r.metric}: {r.dropped}" for r in rows if r.dropped]
    if dropped:
        lines.append(f"\nProblems scored by one side only, left out: {'; '.join(dropped)}.")
    sides = [
        f"{side} only: {', '.join(benches)}"
        for side, benches in zip(("baseline", "candidate"), left_out, strict=True)
        if benches
    ]
    if sides:
        lines.append(f"\nBenchmarks scored by one side only, not compared: {'; '.join(sides)}.")
    return "\n".join(lines) + "\n"


def evaluation_differences(a_dir: str | os.PathLike, b_dir: str | os.PathLike) -> dict[str, tuple]:
    """Generation settings that differ between two evaluations (a comparison across them is apples to pears),
    as `{key: (a's, b's)}`; a held-out evaluation's settings as `heldout.<key>`. ValueError when both hold
    held-out results of different data: their row ids would pair different problems."""
    keys = ("limit", "repeats", "generation_config", "dtype", "seed")
    a, b = (read_report_json(d) for d in (a_dir, b_dir))
    differs = setting_differences(a, {k: b.get(k) for k in keys})
    if isinstance(a.get(HELDOUT), dict) and isinstance(b.get(HELDOUT), dict):
        held = setting_differences(
            {f"{HELDOUT}.{k}": a[HELDOUT].get(k) for k in SETTING_KEYS},
            {f"{HELDOUT}.{k}": b[HELDOUT].get(k) for k in SETTING_KEYS},
        )
        sha = held.pop(f"{HELDOUT}.data_sha256", None)
        if sha:
            raise ValueError(
                f"the held-out results of {a_dir} and {b_dir} were scored on different data (sha256 "
                f"{sha[0]} and {sha[1]}): their problems cannot be paired; evaluate both on one "
                "prepared held-out split (data.out)"
            )
        differs.update(held)
    return differs


def _fmt(x: float, sign: str = "") -> str:
    return f"{x:{sign}.3f}" if abs(x) < 100 else f"{x:{sign}.1f}"


def _jsonl(path: Path):
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e


def _thinking_samples(path: Path) -> Samples:
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for lineno, rec in _jsonl(path):
        id_field = next((f for f in _ID_FIELDS if rec.get(f) is not None), None)
        if "benchmark" not in rec or id_field is None:
            raise ValueError(
                f"{path}:{lineno}: a thinking sample needs 'benchmark' and an id "
                f"(one of {', '.join(_ID_FIELDS)})"
            )
        qualified = (
            id_field != "problem_id" and rec.get("subset") is not None
        )  # a problem_id is whole already
        key = f"{rec['subset']}/{rec[id_field]}" if qualified else str(rec[id_field])
        for name, value in rec.items():
            if name not in _NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(rec["benchmark"], {}).setdefault(name, {}).setdefault(key, []).append(
                    float(value)
                )
    return {
        b: {m: {k: sum(v) / len(v) for k, v in ids.items()} for m, ids in metrics.items()}
        for b, metrics in out.items()
    }
