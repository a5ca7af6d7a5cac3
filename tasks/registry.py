"""Registering checkpoints in the MLflow model registry, idempotently, with lineage tags.

A version is identified by its checkpoint's content hash: registering the same checkpoint again (a retried
task, a rerun flow) returns the existing version instead of creating a second one.
"""

from __future__ import annotations

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

CHECKPOINT_TAG = "checkpoint_sha256"


def find_version(client: MlflowClient, name: str, checkpoint_sha256: str):
    try:
        found = client.search_model_versions(f"name='{name}' and tags.{CHECKPOINT_TAG}='{checkpoint_sha256}'")
    except MlflowException as e:
        if "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
            return None
        raise
    return min(found, key=lambda v: int(v.version)) if found else None


def register_checkpoint(client: MlflowClient, name: str, run_id: str, artifact_path: str, checkpoint_sha256: str,
                        tags: dict, alias: str = "candidate") -> tuple[str, bool]:
    """(version, created): log nothing twice; the source is the checkpoint's artifact folder in `run_id`."""
    existing = find_version(client, name, checkpoint_sha256)
    if existing is not None:
        return str(existing.version), False
    try:
        client.create_registered_model(name, description="GRPO checkpoints registered by grpoflow")
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    all_tags = {**{k: str(v) for k, v in tags.items()}, CHECKPOINT_TAG: checkpoint_sha256}
    version = client.create_model_version(name, source=source, run_id=run_id, tags=all_tags)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return str(version.version), True
