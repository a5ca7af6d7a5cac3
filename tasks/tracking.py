"""MLflow tracking for the pipeline: one run per flow run, a nested run per stage, ids passed explicitly.

Everything goes through `MlflowClient` with explicit run ids: MLflow's fluent "active run" is thread-local,
and Prefect runs tasks in worker threads. Flows and tasks pass the tracking URI masked (Prefect stores their
parameters); `client_for` connects with the credentials of the environment variable that holds the real URI.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param

from data.dir_lock import exclusive
from data.reachability import require_reachable
from data.redact import has_credentials, mask_uri, redact

log = logging.getLogger("grpoflow.tracking")


class TrackingError(RuntimeError):
    """The MLflow store cannot be reached or refused a write; names the tracking URI."""


# Where a masked URI's credentials are found: the variables the services are configured from.
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


# MLflow's own defaults retry an unreachable server for about 250 s (7 retries, backoff factor 2, 120 s per
# request); ours bound one call to about a minute and a half. A value the user set is kept.
HTTP_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
PROBE_TIMEOUT_S = 10.0  # the reachability check before the first call (never longer than the request timeout)
_reachable: set[str] = set()
# MLflow makes an sqlite store's schema on its first use; two processes making it at once crash in its
# migration. The first opening in a process waits up to this long for another process making it.
STORE_CREATION_WAIT_S = 300.0
_opened: set[str] = set()  # store URIs this process opened


def client_for(tracking_uri: str, registry_uri: str | None = None) -> MlflowClient:
    """A client for the store at `tracking_uri`, which may be given masked (see `with_credentials`).

    The store's server (or database host) is checked first with a short timeout, once per process: an
    unreachable one raises `ServiceUnavailable` naming it, instead of MLflow retrying for minutes.
    """
    tracking_uri = with_credentials(tracking_uri)
    registry_uri = with_credentials(registry_uri or tracking_uri)
    bound_http_waits()
    check_reachable(tracking_uri, "MLflow tracking store", "MLFLOW_TRACKING_URI")
    check_reachable(registry_uri, "MLflow model registry", "MLFLOW_REGISTRY_URI")
    return _open_client(tracking_uri, registry_uri)


def _open_client(tracking_uri: str, registry_uri: str) -> MlflowClient:
    """The client, its sqlite stores opened one process at a time (a lock file beside each database) the
    first time this process opens them: the first opening makes the schema (MlflowClient makes the tracking
    store, the first registry call the registry's), and concurrent ones would race in its migration."""
    fresh = sorted(
        {
            path
            for uri in (tracking_uri, registry_uri)
            if uri not in _opened
            and urlsplit(uri).scheme == "sqlite"
            and (path := local_store(uri)) is not None
        }
    )
    locked = set()
    with contextlib.ExitStack() as held:
        for path in fresh:
            try:
                held.enter_context(
                    exclusive(
                        path.parent,
                        "the MLflow store's folder",
                        name=f".{path.name}.open.lock",
                        wait_s=STORE_CREATION_WAIT_S,
                    )
                )
            except (
                OSError
            ):  # a folder that cannot be made: MLflow's own error names the store when it is used
                continue
            locked.add(path)
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
        if local_store(registry_uri) in locked:
            client.search_registered_models(max_results=1)
    _opened.update(u for u in (tracking_uri, registry_uri) if local_store(u) not in set(fresh) - locked)
    return client


def local_store(uri: str) -> Path | None:
    """The file (sqlite) or folder (file store) of a store on this machine; None for a server or a
    database."""
    parts = urlsplit(uri)
    if parts.scheme == "sqlite":
        path = unquote(uri.removeprefix("sqlite:///"))
        return None if not path or path.startswith(":memory:") else Path(path).resolve()
    if parts.scheme == "file" or (not parts.scheme and uri):
        return Path(unquote(parts.path) if parts.scheme else uri).resolve()
    return None


def bound_http_waits() -> None:
    """Bound MLflow's HTTP retries and timeouts (`HTTP_BOUNDS`) unless the user set them; logs the bounds."""
    for variable, value in HTTP_BOUNDS.items():
        if variable not in os.environ:
            os.environ[variable] = value
            log.debug("%s=%s (grpoflow's bound; set it to change)", variable, value)


def check_reachable(
    uri: str, what: str = "MLflow tracking store", variable: str = "MLFLOW_TRACKING_URI"
) -> None:
    """Raise `ServiceUnavailable` unless the server or database host of `uri` answers (sqlite/file: no
    check)."""
    if uri in _reachable:
        return
    timeout = min(PROBE_TIMEOUT_S, float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or PROBE_TIMEOUT_S))
    require_reachable(uri, what, timeout, hint=variable)
    _reachable.add(uri)


def with_credentials(uri: str) -> str:
    """The real URI behind `uri` when `uri` is one of `CREDENTIAL_VARIABLES` masked; else `uri` itself."""
    for variable in CREDENTIAL_VARIABLES:
        real = os.environ.get(variable)
        if real and real != uri and has_credentials(real) and mask_uri(real) == uri:
            return real
    return uri


def shown(client: MlflowClient) -> str:
    """The client's tracking URI as messages may show it."""
    return mask_uri(client.tracking_uri)


def ensure_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    try:
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = f"{Path(artifact_root).as_uri()}/{name}" if artifact_root else None
        return client.create_experiment(name, artifact_location=location)
    except Exception as e:  # noqa: BLE001 - any failure here means the store is unusable
        raise TrackingError(
            redact(
                f"MLflow at {shown(client)!r} is unreachable or refused the experiment "
                f"{name!r}: {type(e).__name__}: {e}"
            )
        ) from e


def start_run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    parent_run_id: str | None = None,
    tags: dict | None = None,
) -> str:
    tags = {k: str(v) for k, v in (tags or {}).items()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def log_params(client: MlflowClient, run_id: str, params: dict) -> None:
    items = [Param(k, v[:6000]) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])


def log_metrics(
    client: MlflowClient, run_id: str, metrics: dict, step: int = 0, model_id: str | None = None
) -> None:
    """Numeric `metrics` (NaN skipped) at `step`, named as given ('@' is the one character MLflow refuses that
    our names use: `pass@k` is logged as `pass_at_k`); with `model_id`, also linked to that logged model."""
    now = int(time.time() * 1000)
    items = [
        Metric(k.replace("@", "_at_"), float(v), now, step, model_id=model_id)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and v == v
    ]
    for i in range(0, len(items), 500):
        client.log_batch(run_id, metrics=items[i : i + 500])


def log_dataset(
    client: MlflowClient, run_id: str, manifest: dict, path: str, context: str = "training"
) -> None:
    """The prepared dataset as an MLflow dataset input, its digest the manifest's content sha256."""
    dataset = Dataset(
        name=f"{manifest.get('task', 'dataset')}-prepared",
        digest=manifest["sha256"][:36],
        source_type="local",
        source=json.dumps({"uri": path, "source": manifest.get("source")}),
        schema=json.dumps({"columns": ["id", "prompt", "answer", "task"]}),
        profile=json.dumps({"rows": manifest.get("rows"), "sha256": manifest["sha256"]}),
    )
    client.log_inputs(
        run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])]
    )


class MlflowTrainingCallback:
    """Binds the trainer's callback interface to an MLflow run: per-step metrics, checkpoint events."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client, self.run_id = client, run_id

    def on_step(self, step: int, metrics: dict) -> None:
        log_metrics(self.client, self.run_id, metrics, step)  # TRL's names, as metrics.jsonl spells them

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.client.set_tag(self.run_id, "last_checkpoint", str(path))

    def on_train_end(self, summary: dict) -> None:
        log_metrics(
            self.client,
            self.run_id,
            {
                "heldout_accuracy_before": summary["heldout_accuracy_before"],
                "heldout_accuracy_after": summary["heldout_accuracy_after"],
                "seconds_per_step": summary["seconds_per_step"],
            },
        )
