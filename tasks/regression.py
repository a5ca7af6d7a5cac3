"""The regression gate's steps as Prefect tasks, and the one sequence that runs them.

`run_comparison` is what `grpoflow compare`, `grpoflow gate` and the `regression-eval` flow all run: check
the inputs (a finite `max_drop`, a registered candidate to promote), check both sides (the version exists,
the path is there) before either is evaluated, evaluate each side (or reuse its evaluation, see
`tasks.comparison`), compare and gate, log the comparison run, and on a pass with `promote_to` point that
alias at the candidate and tag the comparison run `promoted`. Inside a flow run each step is a Prefect task
(retried where a retry can help, shown in the UI); outside one the same functions are called directly, so a
command answers without a Prefect server.

The steps take the recipe in its `to_dict()` form and the services as `Services.flow_parameters()` gives
them (what Prefect stores as parameters) and open the MLflow store themselves: a task may run in another
process than the flow that called it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlflow.exceptions import MlflowException
from prefect import task
from prefect.context import FlowRunContext

from data.errors import GrpoflowUserError, UsageError
from evaluation.compare import check_max_drop, gate
from tasks import comparison, tracking
from tasks.comparison import Side
from tasks.recipe_sections import typed_recipe
from trainer.recipe import Recipe


@task(name="check-sides")
def check_sides(baseline: str, candidate: str, recipe: dict, services: dict) -> None:
    """Both references exist (no retries: an unknown version stays unknown)."""
    client, _ = comparison.open_store(typed_recipe(recipe), services)
    comparison.check_sides(baseline, candidate, client)


@task(name="evaluated-side", retries=1, retry_delay_seconds=10)
def evaluated_side(ref: str, recipe: dict, services: dict) -> Side:
    """The finished evaluation standing for `ref`, reused or run."""
    typed = typed_recipe(recipe)
    client, experiment_id = comparison.open_store(typed, services)
    return comparison.evaluated_side(ref, client, experiment_id, typed, services)


@task(name="compare-and-log")
def compare_and_log(
    baseline: Side, candidate: Side, max_drop: float | None, recipe: dict, services: dict
) -> dict:
    """Compare the two evaluations, gate them when `max_drop` is given, and log the comparison run."""
    typed = typed_recipe(recipe)
    client, experiment_id = comparison.open_store(typed, services)
    rows, left_out = comparison.compare_sides(baseline, candidate)
    verdict = gate(rows, max_drop) if max_drop is not None else None
    logged = comparison.log_comparison(
        client,
        experiment_id,
        baseline,
        candidate,
        rows,
        Path(typed.eval.out) / "comparisons",
        verdict,
        left_out,
    )
    return {
        "rows": [r.to_dict() for r in rows],
        **logged,
        "gate": None
        if verdict is None
        else {
            "passed": verdict.passed,
            "max_drop": verdict.max_drop,
            "failing": [r.to_dict() for r in verdict.failing],
            "report": verdict.markdown(),
        },
    }


@task(name="promote-candidate")
def promote_candidate(candidate: Side, alias: str, comparison_run_id: str, services: dict) -> str:
    """Point `alias` at the candidate's version and tag the comparison run that justified it; its URI."""
    client = tracking.client_for(services["tracking_uri"], services.get("registry_uri"))
    promoted = comparison.promote(client, candidate, alias)
    client.set_tag(comparison_run_id, "promoted", f"{alias} -> {promoted}")
    return promoted


def _step(step):
    """`step` as a Prefect task inside a flow run, as the plain function outside one."""
    return step if FlowRunContext.get() is not None else step.fn


def run_comparison(
    baseline: str,
    candidate: str,
    recipe: Recipe | dict,
    services: dict,
    max_drop: float | None = None,
    promote_to: str | None = None,
) -> dict:
    """Compare `candidate` with `baseline` (differences are candidate minus baseline) and, with `max_drop`,
    gate it. `recipe`: the recipe or its `to_dict()` form; `services`: `Services.flow_parameters()`.
    `promote_to`: the alias set on the candidate's version when the gate passes (needs `max_drop` and a
    registered candidate). Inputs are checked before any store is opened or any evaluation runs.

    Returns the comparison (`baseline`, `candidate`, `rows`, `mlflow_run_id`, `plot`, `markdown`, `table`,
    `left_out`), `gate` (None without `max_drop`), `passed` (the gate's verdict, None without one),
    `promoted` (the promoted version's URI or None) and `tracking_uri`.
    """
    if max_drop is not None:
        check_max_drop(max_drop)
    if promote_to and not comparison.is_registered(candidate):
        raise ValueError(
            "promoting needs a registered candidate (models:/name@alias or "
            f"models:/name/<version>), got {candidate!r}"
        )
    recipe = recipe.to_dict() if isinstance(recipe, Recipe) else recipe
    _step(check_sides)(baseline, candidate, recipe, services)
    base = _step(evaluated_side)(baseline, recipe, services)
    cand = _step(evaluated_side)(candidate, recipe, services)
    result = _step(compare_and_log)(base, cand, max_drop, recipe, services)
    passed = None if result["gate"] is None else result["gate"]["passed"]
    promoted = None
    if passed and promote_to:
        promoted = _step(promote_candidate)(cand, promote_to, result["mlflow_run_id"], services)
    return {
        "baseline": base.to_dict(),
        "candidate": cand.to_dict(),
        **result,
        "passed": passed,
        "promoted": promoted,
        "tracking_uri": services["tracking_uri"],
    }


def run_comparison_for_command(
    baseline: str,
    candidate: str,
    recipe: Recipe,
    services: dict,
    max_drop: float | None = None,
    promote_to: str | None = None,
) -> dict:
    """`run_comparison` as `grpoflow compare` and `gate` run it: an error of the inputs or the services
    (MLflow, a reference, a missing evaluation) becomes a `UsageError` (exit 2); for a gate (`max_drop`) every
    error does, since its exit 1 means "regression"."""
    try:
        return run_comparison(baseline, candidate, recipe, services, max_drop, promote_to)
    except GrpoflowUserError:
        raise
    except (tracking.TrackingError, MlflowException, comparison.ComparisonError, ValueError, OSError) as e:
        raise UsageError(str(e)) from e
    except Exception as e:
        if max_drop is None:
            raise
        logging.getLogger("grpoflow").exception("%s failed", "gate")
        raise UsageError(f"{type(e).__name__}: {e}") from e
