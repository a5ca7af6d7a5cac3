"""Comparing a candidate with a baseline through MLflow: find (or make) each side's evaluation, compare, log.

A side is a registered version (`models:/name@alias`, `models:/name/3`), a checkpoint directory, or a finished
evaluation (its work dir, or the `report.json` in it). Both sides are checked (the version exists, the path is
there) before either is evaluated, and an error names the side. Evaluations are reused: a registered
version's evaluation runs (the one its `eval_mlflow_run_id` tag names first, then any other run tagged with
its name and version) are checked for one made with the recipe's `eval` settings (`evaluation.made_with`)
whose work dir is on this machine. Only when there is none is EvalScope run, and the result recorded with
`record_evaluation` (the run also gets an `eval_work_dir` tag, so the next comparison finds it directly). A
recipe with `eval.benchmarks: []` evaluates on its held-out split instead (`evaluation.heldout`: per problem,
compared as the benchmark `heldout`), reused when made on the same data with the same `train.eval_heldout`
and token budgets.

The comparison is one MLflow run (`compare`) with per-benchmark metrics `<benchmark>.<metric>.{diff,ci_low,
ci_high,baseline,candidate,n}`, the markdown table, the PNG and the rows as artifacts, and tags naming both
sides. Differences are candidate minus baseline. `tasks.regression` runs these steps in order, as Prefect
tasks in the `regression-eval` flow and as plain calls in `grpoflow compare` and `gate`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from data.errors import DataError, MissingPathError, ServiceUnavailable
from data.manifest import sha256_json, write_json_atomic
from evaluation import made_with, settings_hash
from evaluation.compare import (
    GateResult,
    Row,
    compare,
    evaluation_differences,
    load_samples,
    markdown_table,
    only_one_side,
    read_report_json,
)
from evaluation.heldout import HELDOUT, SETTING_KEYS, heldout_settings, made_with_heldout
from evaluation.plots import plot_comparison
from tasks import tracking
from tasks.evaluation import (
    ModelRef,
    evaluate_heldout,
    is_registered_ref,
    lookup_version,
    record_evaluation,
    resolve_model,
)
from trainer.recipe import EvalConfig, Recipe

log = logging.getLogger("grpoflow.comparison")

CHAMPION = "champion"
WORK_DIR_TAG = "eval_work_dir"
BOOTSTRAP = {"n_resamples": 10000, "seed": 0, "confidence": 0.95}


class ComparisonError(RuntimeError):
    """A side of the comparison cannot be found or evaluated; names the reference and what is missing."""


@dataclass
class Side:
    """One side of a comparison: what was asked for, and the finished evaluation that stands for it."""

    ref: str
    work_dir: str
    benchmarks: list[str] | None = None  # the benchmarks to compare; None: all the evaluation has
    model_name: str | None = None
    model_version: str | None = None
    eval_run_id: str | None = None
    reused: bool = True  # False when this comparison ran the evaluation

    @property
    def label(self) -> str:
        if self.model_name:
            return f"{self.model_name} v{self.model_version}"
        return Path(self.work_dir).name

    def to_dict(self) -> dict:
        return asdict(self)


def open_store(recipe: Recipe, services: dict) -> tuple[MlflowClient, str]:
    """The MLflow client and the recipe's experiment; raises `TrackingError` when the store is unusable."""
    try:
        client = tracking.client_for(services["tracking_uri"], services.get("registry_uri"))
    except ServiceUnavailable:  # names the server already
        raise
    # a sqlite store fails here already (e.g. its folder cannot be made)
    except Exception as e:  # noqa: BLE001
        raise tracking.TrackingError(
            f"MLflow at {services['tracking_uri']!r} is unreachable: {type(e).__name__}: {e}"
        ) from e
    return client, tracking.ensure_experiment(
        client, recipe.registry.experiment, services.get("artifact_root")
    )


def check_sides(baseline: str, candidate: str, client: MlflowClient) -> None:
    """Refuse, naming the side, a reference that cannot stand for one (an unknown version, a missing path),
    before either side is evaluated: one side's evaluation can take long, and its error would hide the
    other's."""
    for role, ref in (("baseline", baseline), ("candidate", candidate)):
        try:
            if is_registered_ref(ref):
                _version_of(ref, client)
            else:
                _local_side(ref)
        except tracking.TrackingError as e:
            raise tracking.TrackingError(f"{role} {e}") from e
        except MissingPathError as e:
            raise MissingPathError(f"{role} {e}") from e


def evaluated_side(
    ref: str, client: MlflowClient, experiment_id: str, recipe: Recipe, services: dict
) -> Side:
    """The finished evaluation standing for `ref`: reused when one with the recipe's settings exists, else
    run."""
    settings = recipe.eval
    heldout = None if settings.benchmarks else heldout_settings(recipe)
    benchmarks = list(settings.benchmarks) or [HELDOUT]
    if is_registered_ref(ref):
        name, version = _version_of(ref, client)
        found = find_evaluation(client, name, version, settings, experiment_id, heldout)
        if found:
            log.info("%s: reusing the evaluation in %s (MLflow run %s)", ref, *found)
            return Side(ref, str(found[0]), benchmarks, name, version, found[1])
        work_dir = _fresh_work_dir(settings, f"{name}-v{version}", heldout)
    else:
        path, kind = _local_side(ref)
        if kind == "evaluation":
            return Side(ref, str(path))
        # one work dir per checkpoint path and settings: two runs' `checkpoint-150` must not share one
        work_dir = _fresh_work_dir(settings, f"{path.name}-{settings_hash(settings, path)}", heldout)
        if _usable(work_dir, settings, heldout):  # evaluated before, by an earlier comparison
            return Side(ref, str(work_dir), benchmarks)
    model = resolve_model(ref, client, Path(services["state_dir"]) / "models-cache")
    run_id = _evaluate(model, work_dir, client, experiment_id, recipe, heldout)
    return Side(ref, str(work_dir), benchmarks, model.model_name, model.model_version, run_id, reused=False)


def _local_side(ref: str) -> tuple[Path, str]:
    """(resolved path, "evaluation" or "checkpoint") of a side given as a path; MissingPathError otherwise."""
    path = Path(ref).expanduser()
    if path.is_file() and path.name == "report.json":
        path = path.parent
    if (path / "report.json").is_file():
        return path.resolve(), "evaluation"
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve(), "checkpoint"
    raise MissingPathError(
        f"{ref!r}: expected models:/name@alias, models:/name/<version>, a checkpoint "
        "directory, or a finished evaluation (a work dir with report.json, or the file)"
    )


def find_evaluation(
    client: MlflowClient,
    name: str,
    version: str,
    settings: EvalConfig,
    experiment_id: str,
    heldout: dict | None = None,
) -> tuple[Path, str] | None:
    """(work dir, eval run id) of an evaluation of this version made with `settings` (with `heldout`, the
    held-out evaluation those settings name, see `evaluation.heldout`), found on this machine."""
    try:
        tagged = client.get_model_version(name, version).tags.get("eval_mlflow_run_id")
        runs = client.search_runs(
            [experiment_id],
            f"tags.model_name = '{name}' and tags.model_version = "
            f"'{version}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=100,
        )
    except Exception as e:  # noqa: BLE001 - the store answered once already; any failure now is the store's
        raise tracking.TrackingError(
            f"models:/{name}/{version}: reading its evaluations from MLflow at "
            f"{tracking.shown(client)!r} failed ({type(e).__name__}: {e})"
        ) from e
    if tagged:  # the version's latest evaluation goes first; it may live in another experiment, or be deleted
        try:
            runs.insert(0, client.get_run(tagged))
        except MlflowException as e:
            log.warning(
                "models:/%s/%s: its eval_mlflow_run_id %s cannot be read (%s)", name, version, tagged, e
            )
    for run in runs:
        for work_dir in _work_dir_candidates(run, name, version):
            if _usable(work_dir, settings, heldout):
                return work_dir, run.info.run_id
    return None


def _usable(work_dir: Path, settings: EvalConfig, heldout: dict | None) -> bool:
    """Whether `work_dir` holds a finished evaluation made with these settings; an unreadable report.json is
    not one (it is named in a warning, and a new evaluation is made elsewhere)."""
    if not (work_dir / "report.json").is_file():
        return False
    try:
        report = read_report_json(work_dir)
    except ValueError as e:
        log.warning("not reusing %s: %s", work_dir, e)
        return False
    return made_with_heldout(report, heldout) if heldout is not None else made_with(report, settings)


def compare_sides(baseline: Side, candidate: Side) -> tuple[list[Row], tuple[list[str], list[str]]]:
    """Rows of candidate minus baseline over the benchmarks both sides were asked for and both have, and the
    benchmarks only one side has (`only_one_side`), which are left out."""
    for key, (a, b) in evaluation_differences(baseline.work_dir, candidate.work_dir).items():
        log.warning("the two evaluations differ in %s: %r (baseline) vs %r (candidate)", key, a, b)
    samples = []
    for side in (baseline, candidate):
        loaded = load_samples(side.work_dir)
        samples.append({b: s for b, s in loaded.items() if side.benchmarks is None or b in side.benchmarks})
    return compare(*samples, **BOOTSTRAP), only_one_side(*samples)


def log_comparison(
    client: MlflowClient,
    experiment_id: str,
    baseline: Side,
    candidate: Side,
    rows: list[Row],
    out_root: str | Path,
    verdict: GateResult | None = None,
    left_out: tuple[list[str], list[str]] = ([], []),
) -> dict:
    """The comparison as an MLflow run, its table and plot written under `out_root/<run id>/` and logged;
    `left_out`: the benchmarks only the baseline, and only the candidate, has."""
    tags = {
        "baseline": baseline.ref,
        "candidate": candidate.ref,
        "baseline_work_dir": baseline.work_dir,
        "candidate_work_dir": candidate.work_dir,
    }
    for role, side in (("baseline", baseline), ("candidate", candidate)):
        if side.model_name:
            tags.update({f"{role}_model_name": side.model_name, f"{role}_model_version": side.model_version})
        if side.eval_run_id:
            tags[f"{role}_eval_mlflow_run_id"] = side.eval_run_id
    if verdict is not None:
        tags["gate"] = "PASS" if verdict.passed else "FAIL"
    run_id = tracking.start_run(client, experiment_id, "compare", tags=tags)
    out = Path(out_root).resolve() / run_id
    table = markdown_table(rows, BOOTSTRAP["confidence"], left_out)
    text = f"# {candidate.label} (candidate) vs {baseline.label} (baseline)\n\n{table}"
    if verdict is not None:
        text += "\n" + verdict.markdown()
    markdown = out / "comparison.md"
    out.mkdir(parents=True, exist_ok=True)
    tmp = markdown.with_name(".comparison.md.tmp")
    tmp.write_text(text)
    tmp.replace(markdown)
    plot = plot_comparison(rows, out / "comparison.png", baseline.label, candidate.label)
    write_json_atomic(
        out / "comparison.json",
        {
            "baseline": baseline.to_dict(),
            "candidate": candidate.to_dict(),
            "rows": [r.to_dict() for r in rows],
            "bootstrap": BOOTSTRAP,
            "left_out": _left_out_dict(left_out),
        },
    )
    tracking.log_params(
        client, run_id, {"bootstrap": BOOTSTRAP, **({"max_drop": verdict.max_drop} if verdict else {})}
    )
    metrics = {}
    for r in rows:
        prefix = f"{r.benchmark}.{r.metric}"
        metrics.update(
            {
                f"{prefix}.diff": r.diff,
                f"{prefix}.ci_low": r.ci_low,
                f"{prefix}.ci_high": r.ci_high,
                f"{prefix}.baseline": r.a,
                f"{prefix}.candidate": r.b,
                f"{prefix}.n": r.n,
            }
        )
    if verdict is not None:
        metrics["gate.passed"] = float(verdict.passed)
    tracking.log_metrics(client, run_id, metrics)
    client.log_artifacts(run_id, str(out), "comparison")
    client.set_terminated(run_id)
    return {
        "mlflow_run_id": run_id,
        "plot": str(plot),
        "markdown": str(markdown),
        "table": table,
        "left_out": _left_out_dict(left_out),
    }


def _left_out_dict(left_out: tuple[list[str], list[str]]) -> dict:
    return {"baseline_only": list(left_out[0]), "candidate_only": list(left_out[1])}


def promote(client: MlflowClient, candidate: Side, alias: str = CHAMPION) -> str:
    """Point `alias` at the candidate's registered version; returns its models:/ URI."""
    client.set_registered_model_alias(candidate.model_name, alias, candidate.model_version)
    return f"models:/{candidate.model_name}/{candidate.model_version}"


def is_registered(ref: str) -> bool:
    return bool(is_registered_ref(ref))


def _version_of(ref: str, client: MlflowClient) -> tuple[str, str]:
    """(name, version) of a models:/ reference, without downloading the checkpoint."""
    name, mv = lookup_version(ref, client)
    return name, str(mv.version)


def _work_dir_candidates(run, name: str, version: str) -> list[Path]:
    """Where an evaluation run's outputs may be: the tag this module sets, else the pipeline's layout."""
    found = [Path(run.data.tags[WORK_DIR_TAG])] if WORK_DIR_TAG in run.data.tags else []
    out = run.data.params.get("eval.out")
    if out:  # `eval.out` was resolved against the working directory of the process that evaluated
        found += [
            Path(out).resolve() / f"{name}-v{version}",
            Path(__file__).resolve().parents[1] / out / f"{name}-v{version}",
        ]
    return found


def _fresh_work_dir(settings: EvalConfig, name: str, heldout: dict | None = None) -> Path:
    """`<eval.out>/<name>`, or a settings-specific sibling when that one holds an evaluation with other
    settings (or an unreadable report.json)."""
    work_dir = Path(settings.out).resolve() / name
    if (work_dir / "report.json").is_file() and not _usable(work_dir, settings, heldout):
        key = settings_hash(settings)
        if heldout is not None:  # the eval section says nothing of the held-out rows and budgets
            key = sha256_json([key, {k: heldout[k] for k in SETTING_KEYS}])[:8]
        work_dir = work_dir.with_name(f"{name}-{key}")
    return work_dir


def _evaluate(
    model: ModelRef,
    work_dir: Path,
    client: MlflowClient,
    experiment_id: str,
    recipe: Recipe,
    heldout: dict | None,
) -> str:
    from evaluation import evaluate

    settings = recipe.eval
    what = "a held-out evaluation" if heldout is not None else "an evaluation"
    log.info("%s: no %s with these settings yet; running one into %s", model.text, what, work_dir)
    try:
        if heldout is not None:
            report = evaluate_heldout(model.local_path, recipe.model, heldout, work_dir)
            scores, report_json = {"heldout_accuracy": report["scores"][HELDOUT]}, work_dir / "report.json"
            # recorded without its local path: there are no EvalScope samples to measure thinking on
            model = ModelRef(model.text, None, None, model.model_name, model.model_version)
        else:
            result = evaluate(model.local_path, settings, work_dir=work_dir)
            scores, report_json = dict(result.scores), result.report_json
    except (RuntimeError, ValueError, OSError, DataError) as e:
        raise ComparisonError(
            f"{model.text} has no {what} with the requested settings, and running one "
            f"into {work_dir} failed: {e}"
        ) from e
    run_id = record_evaluation(client, experiment_id, model, scores, settings, report_json)
    client.set_tag(run_id, WORK_DIR_TAG, str(work_dir))
    return run_id
