"""Registering checkpoints in the MLflow model registry as MLflow models, idempotently, with lineage tags.

A version is an MLflow logged model of the transformers flavor (task text-generation), so MLflow's own tools
load and compare it: `mlflow.pyfunc.load_model("models:/name/3")`, `mlflow.transformers.load_model`,
`mlflow models serve`, the experiment's Models tab (with the evaluation metrics logged against the model, see
`tasks.evaluation.record_evaluation`). The model holds what serving needs, the checkpoint's files less its
training state (`trainer.checkpoint.serving_copy`), in the flavor's `model/` folder with our manifest; the
optimizer, scheduler and RNG state stay with the training run's checkpoint.

A version is identified by its checkpoint's content hash (tag `checkpoint_sha256`): registering the same
checkpoint again (a retried task, a rerun flow) returns the existing version and writes nothing, and a logged
model left by an attempt that died before its version was made is reused, not uploaded again.

Also when two processes register the same checkpoint at once, one version comes out:
- a store on this machine (sqlite, a file store): the check and the upload and create that follow are done
  holding a lock file beside it (`registration_lock`), so the second process finds the first's version
  and uploads nothing;
- a tracking server or a database that other machines reach: no lock file reaches them all, so the check
  is repeated after the create. The lowest version with the hash wins; a process whose version is not it
  deletes its version (and the logged model it uploaded) and returns the winner. Both may have uploaded
  meanwhile (the loser's upload is deleted), but the registry keeps one version per checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelStatus
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from data.dir_lock import exclusive
from tasks.tracking import local_store

CHECKPOINT_TAG = "checkpoint_sha256"
MODEL_ID_TAG = "mlflow_model_id"  # on each version: the logged model it is
MODEL_DIR = "model"  # the transformers flavor's folder of model files inside an MLflow model
TASK = "text-generation"
VISION_TASK = "image-text-to-text"  # a python-function model (`_package_vision`)
# How long a registration waits for another one on the same store: packaging and uploading a large model
REGISTRATION_WAIT_S = 1800.0


def find_version(client: MlflowClient, name: str, checkpoint_sha256: str):
    try:
        found = client.search_model_versions(f"name='{name}' and tags.{CHECKPOINT_TAG}='{checkpoint_sha256}'")
    except MlflowException as e:
        if "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
            return None
        raise
    return min(found, key=lambda v: int(v.version)) if found else None


def find_logged_model(client: MlflowClient, experiment_id: str, checkpoint_sha256: str) -> LoggedModel | None:
    """A finished logged model of this checkpoint in the experiment (one an earlier attempt uploaded)."""
    found = client.search_logged_models([experiment_id], f"tags.{CHECKPOINT_TAG} = '{checkpoint_sha256}'")
    ready = [m for m in found if m.status == LoggedModelStatus.READY]
    return min(ready, key=lambda m: m.creation_timestamp) if ready else None


def package_checkpoint(checkpoint: str | Path, dest: Path) -> dict:
    """Write the MLflow model of `checkpoint` into `dest` (a new folder): MLflow's transformers flavor
    (MLmodel, requirements, signature, the tokenizer component) around `serving_copy(checkpoint)`; returns its
    manifest.

    MLflow 3.17 cannot package a local checkpoint folder under transformers 5 (its pipeline table holds class
    names there), so the flavor is written from the loaded model and its model files are then replaced by the
    checkpoint's own, byte for byte as trained and covered by their manifest."""
    import mlflow.transformers
    import torch
    import transformers
    from mlflow.models import infer_signature

    from trainer.checkpoint import serving_copy
    from trainer.model_loading import load_model, modality_of
    from trainer.recipe import ModelConfig

    if modality_of(checkpoint) == "vision":
        return _package_vision(checkpoint, dest)
    model, tokenizer = load_model(str(checkpoint), ModelConfig(dtype="auto"))
    signature = infer_signature("What is 1+1?", "2", params={"max_new_tokens": 256, "do_sample": False})
    # MLflow's own requirement inference imports torchvision for any transformers model; the CPU torch here
    # has none
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"]
    mlflow.transformers.save_model(
        {"model": model, "tokenizer": tokenizer},
        str(dest),
        task=TASK,
        signature=signature,
        pip_requirements=requirements,
    )
    del model
    shutil.rmtree(dest / MODEL_DIR)
    return serving_copy(checkpoint, dest / MODEL_DIR)


def _package_vision(checkpoint: str | Path, dest: Path) -> dict:
    """A vision checkpoint as a python-function MLflow model (MLflow's transformers flavor has no image-text
    task): `evaluation.serving.vision_pyfunc` loads the same serving files and generates as the trainer
    does."""
    import mlflow.pyfunc
    import pandas as pd
    import torch
    import transformers
    from mlflow.models import infer_signature

    from trainer.checkpoint import serving_copy

    with tempfile.TemporaryDirectory(prefix="grpoflow-vision-") as tmp:
        data = Path(tmp) / MODEL_DIR
        manifest = serving_copy(checkpoint, data)
        example = pd.DataFrame(
            {"prompt": ["How many objects are there in the image?"], "image": ["/path/to/image.png"]}
        )
        signature = infer_signature(example, ["<answer>3</answer>"], params={"max_new_tokens": 256})
        mlflow.pyfunc.save_model(
            str(dest),
            loader_module="evaluation.serving.vision_pyfunc",
            data_path=str(data),
            signature=signature,
            pip_requirements=[
                f"torch=={torch.__version__.split('+')[0]}",
                f"transformers=={transformers.__version__}",
                "pillow",
            ],
        )
    return manifest


def log_checkpoint_model(
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    name: str,
    checkpoint: str | Path,
    checkpoint_sha256: str,
) -> LoggedModel:
    """Upload the MLflow model of `checkpoint` as a logged model of `run_id`; marked FAILED if the upload
    fails."""
    with tempfile.TemporaryDirectory(prefix="grpoflow-register-") as tmp:
        local = Path(tmp) / "mlflow-model"
        package_checkpoint(checkpoint, local)
        from trainer.model_loading import modality_of

        task = VISION_TASK if modality_of(checkpoint) == "vision" else TASK
        logged = client.create_logged_model(
            experiment_id,
            name=name,
            source_run_id=run_id,
            model_type=task,
            tags={CHECKPOINT_TAG: checkpoint_sha256},
        )
        try:
            client.log_model_artifacts(logged.model_id, str(local))
        except BaseException:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        return client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)


def register_checkpoint(
    client: MlflowClient,
    name: str,
    experiment_id: str,
    run_id: str,
    checkpoint: str | Path,
    checkpoint_sha256: str,
    tags: dict,
    alias: str = "candidate",
) -> tuple[str, bool]:
    """(version, created) of `checkpoint` registered as `name`, its MLflow model logged by `run_id`; one
    version per checkpoint also when processes register it at once (see the module docstring)."""
    with registration_lock(client):
        return _register(client, name, experiment_id, run_id, checkpoint, checkpoint_sha256, tags, alias)


def registration_lock(client: MlflowClient):
    """A lock file beside the registry's store when it is on this machine (sqlite, a file store), waited for
    up to REGISTRATION_WAIT_S; nothing for a server or a remote database."""
    store = local_store(getattr(client, "_registry_uri", None) or client.tracking_uri)
    if store is None:
        return contextlib.nullcontext()
    return exclusive(
        store.parent,
        "the MLflow registry's folder",
        name=f".{store.name}.register.lock",
        wait_s=REGISTRATION_WAIT_S,
    )


def _register(
    client: MlflowClient,
    name: str,
    experiment_id: str,
    run_id: str,
    checkpoint: str | Path,
    checkpoint_sha256: str,
    tags: dict,
    alias: str,
) -> tuple[str, bool]:
    existing = find_version(client, name, checkpoint_sha256)
    if existing is not None:
        return str(existing.version), False
    try:
        client.create_registered_model(name, description="GRPO checkpoints registered by grpoflow")
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise
    logged = find_logged_model(client, experiment_id, checkpoint_sha256)
    uploaded = logged is None
    if uploaded:
        logged = log_checkpoint_model(client, experiment_id, run_id, name, checkpoint, checkpoint_sha256)
    all_tags = {
        **{k: str(v) for k, v in tags.items()},
        CHECKPOINT_TAG: checkpoint_sha256,
        MODEL_ID_TAG: logged.model_id,
    }
    # the model's own artifact location, not `models:/<id>`: MLflow's SQL registry resolves that one through
    # the process-wide tracking URI, not this client's (and keeps no model id: the tag above does)
    version = client.create_model_version(
        name, source=logged.artifact_location, run_id=run_id, tags=all_tags, model_id=logged.model_id
    )
    first = find_version(client, name, checkpoint_sha256)  # another process may have made one meanwhile
    if first is not None and str(first.version) != str(version.version):
        client.delete_model_version(name, version.version)
        if uploaded and model_id_of(first) != logged.model_id:
            client.delete_logged_model(logged.model_id)
        return str(first.version), False
    linked = json.loads(
        logged.tags.get(MLFLOW_MODEL_VERSIONS, "[]")
    )  # the Models tab's "registered as" column
    client.set_logged_model_tags(
        logged.model_id,
        {MLFLOW_MODEL_VERSIONS: json.dumps([*linked, {"name": name, "version": str(version.version)}])},
    )
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return str(version.version), True


def model_id_of(version) -> str | None:
    """The logged model a registered version is (None for versions registered as plain folders)."""
    return version.model_id or version.tags.get(MODEL_ID_TAG)
