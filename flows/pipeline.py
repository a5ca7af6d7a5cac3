"""The grpoflow pipeline: prepare -> base model -> train -> register -> evaluate, as one Prefect flow.

The flow body reads like the recipe it runs. One MLflow run per flow run holds a nested run per stage;
every task is retried, cached on its code and inputs, and leaves a Prefect artifact with its lineage.
Call `services.configure()` before importing this module (the CLI does): Prefect reads its settings
at import time.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from data.manifest import sha256_json
from tasks import tracking
from tasks.stages import (
    evaluate_model,
    lineage_markdown,
    make_base_model,
    missing_outputs,
    prepare_data,
    register_model,
    train_policy,
)
from trainer.checkpoint import TRAINING_SECTIONS  # the sections that decide what checkpoint comes out


def training_fingerprint(recipe: dict) -> str:
    return sha256_json({k: recipe[k] for k in TRAINING_SECTIONS})


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(
    recipe: dict | None = None,
    services: dict | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Run the recipe. `grpoflow run` passes the loaded `recipe` and its `services`; a deployment
    (infra/prefect.yaml) passes `config`, a recipe path relative to the working directory, with `overrides`
    (`key=value`), and the services are the worker's (PREFECT_API_URL, MLFLOW_TRACKING_URI,
    GRPOFLOW_STATE)."""
    if recipe is None:
        recipe, services = _deployment_inputs(config, overrides)
    recipe = copy.deepcopy(recipe)
    fingerprint = training_fingerprint(recipe)
    # One output directory per training configuration: a retry resumes it, a changed recipe starts fresh.
    recipe["train"]["output_dir"] = f"{recipe['train']['output_dir']}/{fingerprint[:12]}"

    client = tracking.client_for(services["tracking_uri"], services.get("registry_uri"))
    experiment_id = tracking.ensure_experiment(
        client, recipe["registry"]["experiment"], services["artifact_root"]
    )
    parent = tracking.start_run(
        client,
        experiment_id,
        f"pipeline-{recipe['name']}",
        tags={
            "prefect_flow_run_id": flow_run.get_id() or "",
            "recipe": recipe["name"],
            "recipe_sha256": fingerprint,
        },
    )
    tracking.log_params(client, parent, recipe)
    ctx = {
        "tracking_uri": services["tracking_uri"],
        "registry_uri": services.get("registry_uri"),
        "experiment_id": experiment_id,
        "parent_run_id": parent,
    }
    states = {}

    def run(name, task, *args):
        state = task(*args, return_state=True)
        if state.name == "Cached" and (gone := missing_outputs(state.result())):
            # a cache hit would hand on dead paths (a deleted checkpoint): the stage runs again instead
            print(f"{name}: cached result's outputs are gone ({', '.join(gone)}): running the stage again")
            state = task.with_options(refresh_cache=True)(*args, return_state=True)
        states[name] = state
        return state.result()

    training_recipe = {k: recipe[k] for k in TRAINING_SECTIONS}
    try:
        prepared = run("prepare", prepare_data, recipe["data"], ctx)
        base = run(
            "base_model",
            make_base_model,
            recipe["model"],
            recipe["bootstrap"],
            recipe["data"]["system_prompt"],
        )
        trained = run("train", train_policy, training_recipe, base, prepared, ctx)
        registered = run(
            "register",
            register_model,
            trained,
            prepared,
            base,
            fingerprint,
            recipe["registry"]["model_name"],
            ctx,
        )
        evaluated = run("evaluate", evaluate_model, registered, trained, recipe["eval"], ctx)
    except BaseException:
        try:  # the store may be what failed; the stage's own error is the one to report
            client.set_terminated(parent, "FAILED")
        except Exception:  # noqa: BLE001
            pass
        raise

    summary = {
        "recipe": recipe["name"],
        "recipe_sha256": fingerprint,
        "heldout_accuracy_before": trained["heldout_accuracy_before"],
        "heldout_accuracy_after": trained["heldout_accuracy_after"],
        "model_name": registered["model_name"],
        "model_version": registered["model_version"],
        "model_uri": registered["uri"],
        "scores": evaluated["scores"],
        "steps": trained["steps"],
        "checkpoint": trained["checkpoint"],
        "data": prepared["out"],
        "eval_report": evaluated["report"],
        "tracking_uri": services["tracking_uri"],
        "mlflow_run_id": parent,
        "prefect_flow_run_id": str(flow_run.get_id() or ""),
        "cached_stages": [name for name, state in states.items() if state.name == "Cached"],
    }
    tracking.log_metrics(
        client,
        parent,
        {
            "heldout_accuracy_before": summary["heldout_accuracy_before"] or 0.0,
            "heldout_accuracy_after": summary["heldout_accuracy_after"] or 0.0,
            **{f"eval.{k}": v for k, v in evaluated["scores"].items()},
        },
    )
    client.set_tag(parent, "model_uri", registered["uri"])
    client.set_terminated(parent)
    create_markdown_artifact(
        key="grpoflow-lineage", markdown=lineage_markdown(summary), description="the pipeline's lineage chain"
    )
    return summary


def run_pipeline(recipe, services, source: str) -> dict:
    """`grpoflow run`: the pipeline on `recipe` (a `trainer.recipe.Recipe`) with `services`
    (`tasks.services`), holding the state folder from the checks before it to its end. One pipeline per state
    folder: two at once would race on its stores (MLflow's sqlite schema is made by the first to touch it,
    Prefect's home) and register the same checkpoint twice; the second is refused (`DirectoryBusy`, exit 2)
    naming the first."""
    from data.dir_lock import exclusive
    from tasks.preflight import check_before_run

    with exclusive(services.state_dir, "--state-dir"):
        check_before_run(recipe, services, source)
        with _no_retries_after_ctrl_c() if services.prefect_api_url is None else contextlib.nullcontext():
            return grpo_pipeline(recipe.to_dict(), services.flow_parameters())


@contextlib.contextmanager
def _no_retries_after_ctrl_c():
    """After a Ctrl-C, Prefect's client gives up at once instead of retrying.

    A terminal's Ctrl-C reaches the whole process group, Prefect's temporary server included, which stops:
    reporting the flow's crash, and flushing its logs and events on the way out, can only fail, and each
    request would be retried (PREFECT_CLIENT_MAX_RETRIES, 5 by default, 2 to 32 s apart): over two minutes
    before the command exits. SIGINT handled elsewhere (ignored, or a caller's handler) is left alone, and
    so is a pipeline run outside the main thread (which gets no signals)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    from prefect.settings import get_current_settings

    def on_ctrl_c(signum, frame):
        with contextlib.suppress(Exception):  # a Prefect whose settings are frozen retries as before
            get_current_settings().client.max_retries = 0  # the settings this process's Prefect clients read
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _deployment_inputs(config: str | None, overrides: list[str] | None) -> tuple[dict, dict]:
    from tasks.preflight import check_before_run
    from tasks.services import recipe_and_services

    recipe, services = recipe_and_services(config, overrides or ())
    check_before_run(recipe, services, str(config or "<defaults>"))
    return recipe.to_dict(), services.flow_parameters()
