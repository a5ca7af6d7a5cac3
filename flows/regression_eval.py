"""The regression gate as a Prefect flow, for CI triggers and deployments: evaluate both sides, compare, gate.

The steps are `tasks.regression.run_comparison`'s, run here as Prefect tasks; `grpoflow gate` runs the same
steps without Prefect, so a gate answers without a Prefect server. Called from code, the flow returns the
gate's verdict (the dict `grpoflow gate --json` prints, without its exit code) instead of failing on a
regression, so a caller decides what a failed gate means; a deployment sets `fail_on_regression`, so that
the run's state says it. Infrastructure errors (MLflow unreachable, an unknown model: both sides are checked
before either is evaluated, the error naming the side) fail the flow.
Call `services.configure()` before importing this module: Prefect reads its settings at import time.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed

from evaluation.compare import DEFAULT_MAX_DROP
from tasks.comparison import CHAMPION
from tasks.regression import run_comparison
from tasks.services import recipe_and_services

REGRESSION = "Regression"  # the name of a Failed state that a failed gate ends in (fail_on_regression)


@flow(name="regression-eval", log_prints=True)
def regression_eval(
    candidate: str,
    baseline: str,
    max_drop: float = DEFAULT_MAX_DROP,
    promote: bool = False,
    recipe: dict | None = None,
    services: dict | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    fail_on_regression: bool = False,
):
    """Gate `candidate` against `baseline`; with `promote`, a passing candidate becomes the `champion`.

    A deployment (infra/prefect.yaml's `regression-eval/gate`) passes `config` (a recipe path relative to
    the working directory) and `overrides` instead of `recipe` and `services`, and sets `fail_on_regression`:
    a regression then ends the flow run Failed, named `Regression`, its message saying which benchmark
    dropped by how much, so that `prefect deployment run ... --watch` exits non-zero; a broken check fails
    with its error.
    """
    if recipe is None:
        typed, found = recipe_and_services(config, overrides or ())
        recipe, services = typed.to_dict(), found.flow_parameters()
    result = run_comparison(baseline, candidate, recipe, services, max_drop, CHAMPION if promote else None)
    verdict = result["gate"]
    create_markdown_artifact(
        key="grpoflow-regression-gate",
        description=f"{candidate} vs {baseline}",
        markdown=f"{result['table']}\n{verdict['report']}\n\n![comparison]({Path(result['plot']).as_uri()})"
        f"\n\nMLflow run `{result['mlflow_run_id']}`\n",
    )
    if fail_on_regression and not result["passed"]:
        drops = "; ".join(f"{r['benchmark']} {r['diff']:+.4f}" for r in verdict["failing"])
        return Failed(
            name=REGRESSION,
            data=result,
            message=f"regression: {candidate} is worse than {baseline} beyond max_drop "
            f"{max_drop:g} ({drops})",
        )
    return result
