"""The regression gate as a Prefect flow, for CI triggers and deployments: evaluate both sides, compare, gate.

Each side's evaluation is reused when MLflow already has one with the recipe's settings, and run otherwise
(see `tasks.comparison`). Called from code, the flow returns the gate's verdict instead of failing on a
regression, so a caller decides what a failed gate means; a deployment sets `fail_on_regression`, so that the
run's state says it. Infrastructure errors (MLflow unreachable, an unknown model: both sides are checked
before either is evaluated, the error naming the side) fail the flow. `grpoflow gate`
runs the same steps without Prefect, so a gate answers without a Prefect server.
Call `services.configure()` before importing this module: Prefect reads its settings at import time.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed

from evaluation.compare import DEFAULT_MAX_DROP, gate
from tasks import comparison
from tasks.recipe_sections import typed_recipe
from tasks.services import recipe_and_services

REGRESSION = "Regression"  # the name of a Failed state that a failed gate ends in (fail_on_regression)


@task(name="check-sides")
def check_sides(baseline: str, candidate: str, recipe: dict, services: dict) -> None:
    """Both references exist, checked before either is evaluated (no retries: an unknown version stays unknown)."""
    client, _ = comparison.open_store(typed_recipe(recipe), services)
    comparison.check_sides(baseline, candidate, client)


@task(name="evaluated-side", retries=1, retry_delay_seconds=10)
def evaluated_side(ref: str, recipe: dict, services: dict) -> comparison.Side:
    recipe = typed_recipe(recipe)
    client, experiment_id = comparison.open_store(recipe, services)
    return comparison.evaluated_side(ref, client, experiment_id, recipe, services)


@task(name="compare-and-log")
def compare_and_log(baseline: comparison.Side, candidate: comparison.Side, max_drop: float, recipe: dict,
                    services: dict) -> dict:
    recipe = typed_recipe(recipe)
    client, experiment_id = comparison.open_store(recipe, services)
    rows, left_out = comparison.compare_sides(baseline, candidate)
    verdict = gate(rows, max_drop)
    logged = comparison.log_comparison(client, experiment_id, baseline, candidate, rows,
                                       f"{recipe.eval.out}/comparisons", verdict, left_out)
    return {**logged, "rows": [r.to_dict() for r in rows], "passed": verdict.passed, "max_drop": max_drop,
            "failing": [r.to_dict() for r in verdict.failing], "report": verdict.markdown()}


@task(name="promote-candidate")
def promote_candidate(candidate: comparison.Side, services: dict) -> str:
    from tasks import tracking

    client = tracking.client_for(services["tracking_uri"], services.get("registry_uri"))
    return comparison.promote(client, candidate)


@flow(name="regression-eval", log_prints=True)
def regression_eval(candidate: str, baseline: str, max_drop: float = DEFAULT_MAX_DROP, promote: bool = False,
                    recipe: dict | None = None, services: dict | None = None, config: str | None = None,
                    overrides: list[str] | None = None, fail_on_regression: bool = False):
    """Gate `candidate` against `baseline`; with `promote`, a passing candidate becomes the `champion`.

    A deployment (infra/prefect.yaml's `regression-eval/gate`) passes `config` (a recipe path relative to the
    working directory) and `overrides` instead of `recipe` and `services`, and sets `fail_on_regression`: a
    regression then ends the flow run Failed, named `Regression`, its message saying which benchmark dropped by
    how much, so that `prefect deployment run ... --watch` exits non-zero; a broken check fails with its error.
    """
    if recipe is None:
        typed, found = recipe_and_services(config, overrides or ())
        recipe, services = typed.to_dict(), found.flow_parameters()
    if promote and not comparison.is_registered(candidate):
        raise ValueError(f"promoting needs a registered candidate (models:/...), got {candidate!r}")
    check_sides(baseline, candidate, recipe, services)
    base = evaluated_side(baseline, recipe, services)
    cand = evaluated_side(candidate, recipe, services)
    result = compare_and_log(base, cand, max_drop, recipe, services)
    result.update(baseline=base.to_dict(), candidate=cand.to_dict(), promoted=None)
    if result["passed"] and promote:
        result["promoted"] = promote_candidate(cand, services)
    create_markdown_artifact(key="grpoflow-regression-gate", description=f"{candidate} vs {baseline}",
                             markdown=f"{result['table']}\n{result['report']}\n\n![comparison]"
                                      f"({Path(result['plot']).as_uri()})\n\nMLflow run `{result['mlflow_run_id']}`\n")
    if fail_on_regression and not result["passed"]:
        drops = "; ".join(f"{r['benchmark']} {r['diff']:+.4f}" for r in result["failing"])
        return Failed(name=REGRESSION, data=result,
                      message=f"regression: {candidate} is worse than {baseline} beyond max_drop {max_drop:g} "
                              f"({drops})")
    return result
