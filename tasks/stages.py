"""The pipeline's Prefect tasks: thin, retried, cached calls into data/, trainer/ and evaluation/.

Caching is keyed on the task's source code and its inputs (recipe sections and upstream outputs), never on
MLflow run ids: a rerun with the same recipe is served from cache, and a changed recipe reruns exactly the
stages downstream of the change. Results are persisted under PREFECT_HOME so the cache outlives the process.
Each task logs to its own nested MLflow run (ids passed explicitly) and leaves a Prefect markdown artifact
with the manifests it read and wrote: the lineage chain. Recipe sections arrive as plain data (Prefect's
parameters) and are read only once typed again (`tasks.recipe_sections`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.runtime import flow_run

from data.manifest import code_version, read_manifest
from tasks import tracking
from tasks.recipe_sections import typed_recipe, typed_section
from tasks.registry import register_checkpoint

# Run ids and URIs say where to log, not what to compute: they stay out of the cache key.
CACHE = (TASK_SOURCE + INPUTS) - "ctx"
RETRY = {"retries": 2, "retry_delay_seconds": [5, 20]}
log = logging.getLogger("grpoflow.stages")


def _ctx_client(ctx: dict):
    return tracking.client_for(ctx["tracking_uri"], ctx.get("registry_uri"))


def _artifact_key(stage: str) -> str:
    return f"grpoflow-{stage}"


@task(name="prepare-data", cache_policy=CACHE, persist_result=True, **RETRY)
def prepare_data(data_cfg: dict, ctx: dict) -> dict:
    from data.prepare import prepare

    result = prepare(**typed_section("data", data_cfg).prepare_kwargs())
    manifest = read_manifest(result["out"])
    client = _ctx_client(ctx)
    run_id = tracking.start_run(client, ctx["experiment_id"], "prepare", ctx["parent_run_id"])
    tracking.log_params(client, run_id, {"data": data_cfg})
    tracking.log_metrics(
        client, run_id, {"rows_train": result["rows"]["train"], "rows_heldout": result["rows"]["heldout"]}
    )
    tracking.log_dataset(client, run_id, manifest, result["out"])
    client.log_artifact(run_id, result["manifest"])
    client.set_terminated(run_id)
    create_markdown_artifact(
        key=_artifact_key("prepare"),
        description="prepared dataset",
        markdown=(
            f"# Prepared data\n\n| | |\n|---|---|\n| out | `{result['out']}` |\n"
            f"| sha256 | `{manifest['sha256']}` |\n"
            f"| rows | {result['rows']} |\n| dropped | {result['dropped'] or 'none'} |\n"
            f"| source | `{manifest['source']}` |\n"
            f"| MLflow run | `{run_id}` |\n"
        ),
    )
    return {**result, "mlflow_run_id": run_id, "task": manifest.get("task")}


@task(name="make-base-model", cache_policy=CACHE, persist_result=True, **RETRY)
def make_base_model(model_cfg: dict, bootstrap_cfg: dict, system_prompt: str) -> dict:
    """The base model: a hub id / path as given, or the embedded default's tiny model (made once)."""
    from trainer.bootstrap import resolve_base_model

    return resolve_base_model(
        typed_section("model", model_cfg),
        typed_section("bootstrap", bootstrap_cfg),
        system_prompt,
        progress=False,
    )


@task(name="train-policy", cache_policy=CACHE, persist_result=True, retries=2, retry_delay_seconds=[5, 20])
def train_policy(recipe_dict: dict, base: dict, prepared: dict, ctx: dict) -> dict:
    """GRPO training; a retry resumes from the last checkpoint in the same output_dir (no lost steps). The run
    directory is held while training (`trainer.checkpoint.claim_run_dir`): another run on it is refused."""
    from trainer.checkpoint import claim_run_dir
    from trainer.grpo import GRPOTrainer
    from trainer.launch import RENDEZVOUS_ENV, in_processes_of_their_own, run_ranks

    recipe = typed_recipe(recipe_dict)
    client = _ctx_client(ctx)
    with claim_run_dir(recipe.train.output_dir):  # before the stage's MLflow run: a refused run opens none
        run_id = _stage_run(client, ctx, "train", recipe.train.output_dir)
        tracking.log_params(
            client,
            run_id,
            {
                "train": recipe_dict["train"],
                "rollout": recipe_dict["rollout"],
                "rewards": recipe_dict["rewards"],
                "base_model": base["path"],
            },
        )
        tracking.log_dataset(client, run_id, read_manifest(prepared["out"]), prepared["out"])
        callback = tracking.MlflowTrainingCallback(client, run_id)
        if in_processes_of_their_own(recipe):  # several trainer ranks (or nodes): started as `grpoflow train`
            result = run_ranks(recipe, callback.on_step, os.environ.get(RENDEZVOUS_ENV))
            callback.on_checkpoint(result["steps"], Path(result["checkpoint"]))
            callback.on_train_end(result)
        else:
            trainer = GRPOTrainer(recipe, base["path"], prepared["out"], callbacks=[callback], progress=False)
            result = trainer.train().summary()
        client.log_param(run_id, "trainer_ranks", result["trainer_ranks"])
    checkpoint = Path(result["checkpoint"])
    from evaluation.plots import plot_training_curves

    plots = plot_training_curves(result["metrics"], checkpoint.parent / "plots")
    if recipe.model.modality == "vision":  # a few held-out images with the answers before and after training
        answers = heldout_answers_plot(
            result, prepared["out"], checkpoint.parent / "plots" / "heldout_answers.png"
        )
        plots += [answers] if answers else []
    for p in plots:
        client.log_artifact(run_id, str(p), "plots")
    client.log_artifact(run_id, result["metrics"])
    client.set_terminated(run_id)
    manifest = read_manifest(checkpoint)
    create_markdown_artifact(
        key=_artifact_key("train"),
        description="GRPO training",
        markdown=(
            f"# GRPO training\n\n| | |\n|---|---|\n| checkpoint | `{checkpoint}` |\n"
            f"| checkpoint sha256 | `{manifest['sha256']}` |\n"
            f"| data sha256 | `{manifest.get('data_sha256')}` |\n| base model | `{base['path']}` |\n"
            f"| steps | {result['steps']} |\n"
            f"| held-out accuracy | {_accuracy(result['heldout_accuracy_before'])} → "
            f"{_accuracy(result['heldout_accuracy_after'])} |\n"
            f"| trainer ranks | {result['trainer_ranks']} |\n"
            f"| s/step | {result['seconds_per_step']:.3f} |\n| MLflow run | `{run_id}` |\n\n"
            + "".join(f"![{p.stem}]({p.as_uri()})\n" for p in plots)
        ),
    )
    return {
        **result,
        "mlflow_run_id": run_id,
        "checkpoint_sha256": manifest["sha256"],
        "plots": [str(p) for p in plots],
    }


def _accuracy(value: float | None) -> str:
    return "not measured (train.eval_heldout 0)" if value is None else f"{value:.3f}"


def heldout_answers_plot(trained: dict, data_dir: str, out: Path, n: int = 8) -> Path | None:
    """The first `n` held-out images, each titled with its gold answer and the answers training scored before
    and after it (`trained`: the trainer's summary, whose held-out scores name their samples); nothing is
    generated again. None, with a warning, when either side's samples are not there (a run resumed from a
    checkpoint written before training kept them)."""
    from data.prepare import load_prepared
    from evaluation.plots import plot_before_after
    from trainer.heldout import read_samples

    before, after = (read_samples(trained.get(k) or {}) for k in ("heldout_before", "heldout_after"))
    if before is None or after is None:
        log.warning(
            "no held-out answers plot: the run kept no held-out samples %s training",
            "before" if before is None else "after",
        )
        return None
    images = {r["id"]: r["images"][0] for r in load_prepared(data_dir, "heldout")}
    return plot_before_after([images[s["id"]] for s in after[:n]], before[:n], after[:n], out)


def _stage_run(client, ctx: dict, stage: str, output_dir: str) -> str:
    """The stage's MLflow run; a retried attempt continues the run its first attempt opened."""
    marker = Path(output_dir) / f".mlflow-{stage}-{ctx['parent_run_id']}"
    if marker.is_file():
        return marker.read_text().strip()
    run_id = tracking.start_run(client, ctx["experiment_id"], stage, ctx["parent_run_id"])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(run_id)
    return run_id


@task(name="register-checkpoint", cache_policy=CACHE, persist_result=True, **RETRY)
def register_model(
    trained: dict, prepared: dict, base: dict, recipe_sha256: str, model_name: str, ctx: dict
) -> dict:
    client = _ctx_client(ctx)
    try:
        run_id = tracking.start_run(client, ctx["experiment_id"], "register", ctx["parent_run_id"])
        tags = {
            "dataset_sha256": read_manifest(prepared["out"])["sha256"],
            "recipe_sha256": recipe_sha256,
            "git_commit": code_version(),
            "prefect_flow_run_id": flow_run.get_id() or "",
            "base_model": base["path"],
            "steps_trained": trained["steps"],
            "train_mlflow_run_id": trained["mlflow_run_id"],
            "heldout_accuracy": trained["heldout_accuracy_after"],
        }
        version, created = register_checkpoint(
            client,
            model_name,
            ctx["experiment_id"],
            run_id,
            trained["checkpoint"],
            trained["checkpoint_sha256"],
            tags,
        )
        client.set_terminated(run_id)
    except Exception as e:
        raise tracking.TrackingError(
            f"registering {trained['checkpoint']} as '{model_name}' in MLflow at "
            f"{ctx.get('registry_uri') or ctx['tracking_uri']!r} failed ({type(e).__name__}: {e}); "
            "the checkpoint on disk is untouched"
        ) from e
    create_markdown_artifact(
        key=_artifact_key("register"),
        description="registered model version",
        markdown=(
            f"# Registered\n\n`models:/{model_name}/{version}` (alias `candidate`)"
            f"{'' if created else ' — already registered'}\n\n"
            + "\n".join(f"- {k}: `{v}`" for k, v in tags.items())
        ),
    )
    return {
        "model_name": model_name,
        "model_version": version,
        "created": created,
        "tags": tags,
        "uri": f"models:/{model_name}/{version}",
        "mlflow_run_id": run_id,
    }


@task(name="evaluate-model", cache_policy=CACHE, persist_result=True, **RETRY)
def evaluate_model(registered: dict, trained: dict, eval_cfg: dict, ctx: dict) -> dict:
    from evaluation import evaluate
    from tasks.evaluation import ModelRef, record_evaluation

    settings = typed_section("eval", eval_cfg)
    ref = ModelRef(
        registered["uri"], trained["checkpoint"], None, registered["model_name"], registered["model_version"]
    )
    work_dir = Path(settings.out).resolve() / f"{registered['model_name']}-v{registered['model_version']}"
    if not settings.benchmarks and trained["heldout_accuracy_after"] is not None:
        # the held-out split is the evaluation, problem by problem, so that compare and gate can pair it
        from evaluation.heldout import HELDOUT

        report = _heldout_evaluation(trained, work_dir)
        scores = {"heldout_accuracy": report["scores"][HELDOUT]}
        ref.local_path = None  # no EvalScope samples in it to measure thinking on
        run_id = record_evaluation(
            _ctx_client(ctx),
            ctx["experiment_id"],
            ref,
            scores,
            settings,
            work_dir / "report.json",
            ctx["parent_run_id"],
        )
        return {
            "scores": scores,
            "num_samples": report["num_samples"],
            "work_dir": str(work_dir),
            "report": str(work_dir / "report.json"),
            "mlflow_run_id": run_id,
        }
    if (
        not settings.benchmarks
    ):  # no held-out rows either (train.eval_heldout 0): the aggregate, as training left it
        scores = {"heldout_accuracy": trained["heldout_accuracy_after"]}
        run_id = record_evaluation(
            _ctx_client(ctx), ctx["experiment_id"], ref, scores, settings, None, ctx["parent_run_id"]
        )
        return {
            "scores": scores,
            "num_samples": {},
            "work_dir": None,
            "report": None,
            "mlflow_run_id": run_id,
        }
    result = evaluate(trained["checkpoint"], settings, work_dir=work_dir, progress=False)
    scores = {**result.scores, "heldout_accuracy": trained["heldout_accuracy_after"]}
    report = result.report_json
    run_id = record_evaluation(
        _ctx_client(ctx), ctx["experiment_id"], ref, scores, settings, report, ctx["parent_run_id"]
    )
    create_table_artifact(
        key=_artifact_key("evaluate"),
        description=f"evaluation of {registered['uri']}",
        table=[
            {"benchmark": b, "score": round(v, 4), "samples": result.num_samples.get(b, "")}
            for b, v in scores.items()
        ],
    )
    return {
        "scores": scores,
        "num_samples": result.num_samples,
        "work_dir": str(result.work_dir),
        "report": str(report),
        "mlflow_run_id": run_id,
    }


def _heldout_evaluation(trained: dict, work_dir: Path) -> dict:
    """The trained checkpoint's held-out evaluation written into `work_dir` (`evaluation.heldout`): the
    answers training scored after its last step when they are of the rows and settings the evaluation asks
    for (the same recipe, the same prepared data, the file unchanged), else the checkpoint scored again."""
    from evaluation.heldout import heldout_settings, write_heldout_evaluation
    from tasks.evaluation import evaluate_heldout
    from trainer.heldout import read_samples

    manifest = read_manifest(trained["checkpoint"])
    trained_with = typed_recipe(manifest["recipe"])
    settings = heldout_settings(trained_with)
    after = trained.get("heldout_after") or {}
    samples = read_samples(after)
    if samples is not None and manifest.get("data_sha256") == settings["data_sha256"]:
        return write_heldout_evaluation(
            work_dir, trained["checkpoint"], settings, {**after, "samples": samples}
        )
    log.info(
        "scoring %s on its held-out rows again: training kept no answers of them for these settings",
        trained["checkpoint"],
    )
    return evaluate_heldout(trained["checkpoint"], trained_with.model, settings, work_dir)


# The files a stage's result points to: a cache hit is worth returning only while they are there
OUTPUT_KEYS = ("out", "manifest", "checkpoint", "metrics", "report", "work_dir")


def missing_outputs(result: dict) -> list[str]:
    """The output files or folders `result` names that are gone (a deleted checkpoint, a cleaned eval dir)."""
    paths = [result[k] for k in OUTPUT_KEYS if isinstance(result.get(k), str)]
    if result.get("bootstrapped"):  # a made base model; a hub id is not a path
        paths.append(result["path"])
    return [p for p in paths if not Path(p).exists()]


def lineage_markdown(summary: dict) -> str:
    """The whole chain, one line per stage: what each read and wrote."""
    return "# grpoflow lineage\n\n```json\n" + json.dumps(summary, indent=2, default=str) + "\n```\n"


__all__ = [
    "evaluate_model",
    "heldout_answers_plot",
    "make_base_model",
    "prepare_data",
    "register_model",
    "train_policy",
    "lineage_markdown",
    "missing_outputs",
]
