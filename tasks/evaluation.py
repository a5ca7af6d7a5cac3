"""Evaluating a model reference and recording the scores in MLflow, for the pipeline and `grpoflow eval`.

A reference is a checkpoint directory, a registered version (`models:/name@alias`, `models:/name/3`), or
an OpenAI-compatible endpoint URL. Registered versions are downloaded once into the state folder.
`evaluate_reference` is all of `grpoflow eval` but its flags and its printing.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import secrets
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow import MlflowClient

from data.errors import MissingPathError, UsageError
from data.manifest import MANIFEST, read_manifest
from data.redact import mask_uri, redact
from tasks import tracking
from tasks.preflight import check_eval_settings
from tasks.registry import MODEL_DIR, model_id_of
from trainer.model_loading import verify_if_ours
from trainer.typed_config import to_dict

if TYPE_CHECKING:
    from tasks.services import Services
    from trainer.recipe import EvalConfig, Recipe

log = logging.getLogger("grpoflow.evaluation")
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


@dataclass
class ModelRef:
    text: str  # the reference as shown and stored (an endpoint's credentials masked)
    local_path: str | None = None  # a checkpoint on disk
    api_url: str | None = None  # an OpenAI-compatible endpoint, with its credentials: only for connecting
    model_name: str | None = None  # registered name and version, when the reference is one
    model_version: str | None = None


def is_registered_ref(ref: str) -> bool:
    return bool(_MODELS_URI.match(ref))


def lookup_version(ref: str, client: MlflowClient):
    """(name, ModelVersion) of a `models:/name@alias` or `models:/name/N` reference; nothing downloaded."""
    m = _MODELS_URI.match(ref)
    if m is None:
        raise ValueError(f"{ref!r} is not a models:/name@alias or models:/name/version reference")
    try:
        mv = (
            client.get_model_version_by_alias(m["name"], m["alias"])
            if m["alias"]
            else client.get_model_version(m["name"], m["version"])
        )
    except Exception as e:  # noqa: BLE001 - unknown name/alias/version or unreachable store
        raise tracking.TrackingError(
            redact(f"{ref}: not found in MLflow at {tracking.shown(client)!r} ({type(e).__name__}: {e})")
        ) from e
    return m["name"], mv


def download_version(client: MlflowClient, name: str, mv, cache_dir: Path) -> Path:
    """The checkpoint folder of registered version `mv`, downloaded once into `cache_dir/<name>/v<N>`: the
    `model/` folder of its MLflow model, or (versions registered before they were MLflow models) the folder
    its source names."""
    target = cache_dir / name / f"v{mv.version}"
    if not target.is_dir():
        import mlflow

        source = mv.source
        if source.startswith("models:/m-"):  # a logged model: its artifacts, through the tracking server
            source = client.get_logged_model(source.removeprefix("models:/")).artifact_location
        staging = target.parent / f".v{mv.version}"
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted download left
        target.parent.mkdir(parents=True, exist_ok=True)
        downloaded = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(staging), tracking_uri=client.tracking_uri
            )
        )
        downloaded.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
    return target / MODEL_DIR if (target / "MLmodel").is_file() else target


def resolve_model(ref: str, client: MlflowClient | None, cache_dir: Path) -> ModelRef:
    if ref.startswith(("http://", "https://")):
        return ModelRef(mask_uri(ref), api_url=ref)
    if is_registered_ref(ref):
        if client is None:
            raise ValueError(f"{ref}: a registered model needs an MLflow tracking URI")
        name, mv = lookup_version(ref, client)
        target = download_version(client, name, mv, cache_dir)
        manifest = read_manifest(target)
        expected = mv.tags.get("checkpoint_sha256")
        if expected and manifest.get("checkpoint_sha256", manifest.get("sha256")) != expected:
            raise RuntimeError(
                f"{ref}: downloaded checkpoint at {target} does not match its registered sha256"
            )
        verify_if_ours(str(target))  # EvalScope loads it in its own process: check it here
        return ModelRef(ref, local_path=str(target), model_name=name, model_version=str(mv.version))
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise MissingPathError(
            f"model {mask_uri(ref)!r}: not a checkpoint directory, a models:/ URI or an http(s) URL"
        )
    verify_if_ours(str(path))
    return ModelRef(ref, local_path=str(path.resolve()))


def record_evaluation(
    client: MlflowClient,
    experiment_id: str,
    ref: ModelRef,
    scores: dict,
    settings: EvalConfig,
    report: Path | None,
    parent_run_id: str | None = None,
) -> str:
    """One MLflow run with the scores and the recipe's eval `settings`. For a registered version the scores
    are also linked to its MLflow model (the metrics MLflow's model comparison shows) and set as
    `eval.<benchmark>` tags on the version (lineage, as before). A local model's scores include the
    thinking-efficiency aggregates of the work dir next to `report` (`thinking_scores`)."""
    tags = {"model": mask_uri(ref.text)}
    model_id = None
    if ref.model_name:
        tags.update(model_name=ref.model_name, model_version=ref.model_version)
        model_id = model_id_of(client.get_model_version(ref.model_name, ref.model_version))
    thinking = thinking_scores(report.parent, ref.local_path) if report is not None and ref.local_path else {}
    run_id = tracking.start_run(client, experiment_id, "evaluate", parent_run_id, tags=tags)
    tracking.log_params(client, run_id, {"eval": to_dict(settings)})
    tracking.log_metrics(client, run_id, {**scores, **thinking}, model_id=model_id)
    if report is not None and report.is_file():
        client.log_artifact(run_id, str(report))
    client.set_terminated(run_id)
    if ref.model_name:
        for bench, value in scores.items():
            if value is not None:  # None: not measured (train.eval_heldout 0 and no benchmarks)
                tag = f"eval.{bench}"
                client.set_model_version_tag(ref.model_name, ref.model_version, tag, f"{value:.4f}")
        client.set_model_version_tag(ref.model_name, ref.model_version, "eval_mlflow_run_id", run_id)
    return run_id


def thinking_scores(work_dir: Path, tokenizer: str) -> dict[str, float]:
    """The thinking-efficiency aggregates of an EvalScope work dir (`evaluation.thinking.analyze`, tokens
    counted by `tokenizer`) as `thinking/<metric>` numbers (`thinking/overthinking/samples`, ...); none for a
    work dir without per-sample outputs, and none of the aggregates that no sample defines (e.g. first-correct
    tokens when nothing was right)."""
    from evaluation.thinking import analyze

    try:
        summary = analyze(work_dir, tokenizer, progress=False).summary
    except MissingPathError as e:
        log.warning("no thinking-efficiency metrics for %s: %s", work_dir, e)
        return {}
    flat = {}
    for key, value in summary.items():
        if isinstance(value, dict) and key != "per_benchmark":
            flat.update({f"thinking/{key}/{k}": v for k, v in value.items()})
        else:
            flat[f"thinking/{key}"] = value
    return {k: float(v) for k, v in flat.items() if isinstance(v, (int, float))}


def _score_heldout(
    model_path,
    model_cfg,
    rows: list[dict],
    *,
    max_tokens: int,
    max_prompt_length: int,
    samples: bool = False,
    env: dict | None = None,
) -> dict:
    """`trainer.heldout.evaluate_greedy` (the one held-out scorer) on a checkpoint loaded from disk: for a
    model whose training's own held-out answers (`trainer.heldout.write_samples`) are not at hand. `env`: the
    recipe's `rollout.env` (as a dict), whose environment the problems are solved in."""
    from trainer.heldout import evaluate_greedy
    from trainer.model_loading import load_model
    from trainer.multiturn.rollout import in_environment
    from trainer.recipe import EnvConfig
    from trainer.rewards import accuracy_reward, format_reward
    from trainer.rollout.hf_engine import HFEngine

    model, tokenizer = load_model(str(model_path), model_cfg)
    env_cfg = None if env is None else EnvConfig(**env)
    return evaluate_greedy(
        in_environment(HFEngine(model.eval(), tokenizer), tokenizer, env_cfg),
        tokenizer,
        rows,
        accuracy_reward,
        format_reward,
        max_tokens=max_tokens,
        max_prompt_length=max_prompt_length,
        return_samples=samples,
    )


def heldout_accuracy(model_path: str, data_dir: str | Path, recipe) -> float | None:
    """In-domain greedy accuracy of a local checkpoint on the recipe's prepared held-out rows."""
    from data.prepare import load_prepared

    if not (Path(data_dir) / MANIFEST).is_file():
        return None
    rows = load_prepared(data_dir, "heldout")[: recipe.train.eval_heldout]
    if not rows:
        return None
    return _score_heldout(
        model_path,
        recipe.model,
        rows,
        max_tokens=recipe.train.max_completion_length,
        max_prompt_length=recipe.train.max_prompt_length,
        env=None if recipe.rollout.env is None else dataclasses.asdict(recipe.rollout.env),
    )["accuracy"]


def evaluate_heldout(model_path: str | Path, model_cfg, settings: dict, work_dir: str | Path) -> dict:
    """Score the checkpoint at `model_path` (loaded with the recipe's `model` section, `model_cfg`) on the
    held-out rows `settings` name (`evaluation.heldout.heldout_settings`) into `work_dir`, problem by problem;
    returns the report written there."""
    from data.prepare import load_prepared
    from evaluation.heldout import write_heldout_evaluation

    data_dir = Path(settings["data_dir"])
    if not (data_dir / MANIFEST).is_file():
        raise FileNotFoundError(
            f"no prepared data at {data_dir} (data.out): the held-out evaluation "
            "(eval.benchmarks: []) scores its held-out split; prepare it with `grpoflow prep`"
        )
    rows = load_prepared(data_dir, "heldout")[: settings["limit"]]
    if not rows:
        raise ValueError(
            f"{data_dir}: no held-out rows to evaluate (data.heldout 0, or train.eval_heldout 0); "
            "eval.benchmarks: [] needs a held-out split"
        )
    result = _score_heldout(
        model_path,
        model_cfg,
        rows,
        max_tokens=settings["max_tokens"],
        max_prompt_length=settings["max_prompt_length"],
        samples=True,
        env=settings.get("env"),
    )
    return write_heldout_evaluation(work_dir, model_path, settings, result)


def evaluate_reference(
    model: str,
    recipe: Recipe,
    services: Services,
    *,
    source: str,
    serve: bool = False,
    served_model_name: str | None = None,
    api_key_env: str | None = None,
    concurrency: int = 8,
    serve_engine: str = "auto",
    work_dir: str | None = None,
) -> dict:
    """`grpoflow eval`: evaluate `model` (a reference, see `resolve_model`) with the recipe's eval settings,
    through a local endpoint when `serve`, and record it in MLflow; returns the command's summary.

    `source` names the recipe in errors; `concurrency`: requests in flight against an endpoint; `work_dir`:
    where the evaluation goes (default `default_work_dir`). A work dir holding an evaluation made with other
    settings is refused (`UsageError` naming `--work-dir`)."""
    from evaluation import evaluate

    endpoint = model if model.startswith(("http://", "https://")) else None
    if (
        not recipe.eval.benchmarks
    ):  # [] means "the held-out split is the evaluation", which needs a training run
        raise UsageError(
            f"{source}: eval.benchmarks: needs at least 1 entry to evaluate a model, got [] (an empty "
            "list is for `grpoflow run`, where the held-out split scored after training is the "
            "evaluation)"
        )
    check_eval_settings(
        recipe,
        source,
        endpoint,
        api_key_env=None if serve else api_key_env,
        eval_batch_size=concurrency if endpoint else 1,
    )
    client = tracking.client_for(services.tracking_uri, services.registry_uri)
    ref = resolve_model(model, client, services.state_dir / "models-cache")
    name = (
        ref.model_name and f"{ref.model_name}-v{ref.model_version}" or Path(ref.local_path or "endpoint").name
    )
    target = (
        Path(work_dir).expanduser().resolve()
        if work_dir
        else default_work_dir(recipe.eval.out, ref, name, serve, served_model_name)
    )
    with _served(ref, model, name, serve, served_model_name, concurrency, serve_engine) as served:
        api_url = served.url if served else ref.api_url
        evaluated = served.model_name if served else ref.local_path or served_model_name or "default"
        try:
            result = evaluate(
                evaluated,
                recipe.eval,
                work_dir=target,
                api_url=api_url,
                api_key_env=None if served else api_key_env,
                eval_batch_size=concurrency if api_url else 1,
            )
        except FileExistsError as e:  # a finished evaluation with other settings: never mixed, never replaced
            raise UsageError(f"{e}: pass --work-dir DIR to evaluate into another directory") from e
    scores = dict(result.scores)
    if ref.local_path and (acc := heldout_accuracy(ref.local_path, recipe.data.out, recipe)) is not None:
        scores["heldout_accuracy"] = acc
    experiment = tracking.ensure_experiment(client, recipe.registry.experiment, services.artifact_root)
    run_id = record_evaluation(client, experiment, ref, scores, recipe.eval, result.report_json)
    return {
        "model": ref.text,
        "model_name": ref.model_name,
        "model_version": ref.model_version,
        "scores": scores,
        "num_samples": result.num_samples,
        "report": str(result.report_json),
        "work_dir": str(result.work_dir),
        "mlflow_run_id": run_id,
        "tracking_uri": services.flow_parameters()["tracking_uri"],
        "served_by": served.engine if served else None,
    }


def default_work_dir(out: str, ref: ModelRef, name: str, serve: bool, served_model_name: str | None) -> Path:
    """Where `grpoflow eval` evaluates by default, under the recipe's `eval.out`: a checkpoint or a registered
    version in a folder of its name (rerun with the same settings, it returns the finished evaluation), served
    for the evaluation in `<name>-served`. An endpoint gets a folder of its own each time
    (`endpoint-<served model>-<UTC time>-<random>`): what a URL serves can change between two runs, so a
    finished evaluation of it stands for nothing but itself."""
    root = Path(out).resolve()
    if serve:
        return root / f"{name}-served"
    if ref.api_url is None:
        return root / name
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", served_model_name or "default").strip("_") or "model"
    return root / f"endpoint-{model}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"


def _served(
    ref: ModelRef,
    model: str,
    name: str,
    serve: bool,
    served_model_name: str | None,
    concurrency: int,
    engine: str = "auto",
):
    """`eval --serve`: a context serving the local checkpoint on loopback (None without --serve)."""
    if concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {concurrency}")
    if not serve:
        return nullcontext(None)
    if not ref.local_path:
        raise UsageError(
            f"--serve needs a checkpoint directory or a models:/ reference, not the endpoint {model}"
        )
    from evaluation.serving import served_model

    # vLLM's server starts in minutes on a CPU (three processes, each importing vLLM), seconds for
    # transformers
    return served_model(
        ref.local_path,
        served_model_name=served_model_name or name,
        max_batch_size=concurrency,
        engine=engine,
        startup_timeout_s=600 if engine == "vllm" else 120,
    )
