"""A Prefect Kubernetes work pool's base job template made into the Job its worker would create for a flow
run, and that Job checked against the Kubernetes API's own schema.

The rendering is prefect-kubernetes' (`KubernetesWorkerJobConfiguration.from_template_and_values`, then
`prepare_for_flow_run`, what the worker does before it creates the Job); the schema check is
kubernetes-validate's (the API's OpenAPI schema of a Kubernetes release, strict: an unknown field fails).
No cluster is involved: what the API server would then do with the Job is not checked here.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from pathlib import Path

from conftest import REPO_ROOT

K8S = REPO_ROOT / "infra" / "k8s"
# Prefect's worker requires these two pod-spec fields, at 1 (its own default template has them there); the API
# server drops them (they are Job fields), so the schema check leaves them out
WORKER_ONLY_POD_FIELDS = ("parallelism", "completions")


def rendered_job(
    template: dict | Path,
    values: dict,
    api_url: str,
    auth_string: str | None = None,
    flow_run_name: str = "r",
) -> dict:
    """The Job manifest for a flow run named `flow_run_name`, `values` the deployment's job variables.
    `api_url`: the Prefect API the worker would use; it is asked for nothing unless the template names a
    Prefect block or variable."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    if isinstance(template, Path):
        template = json.loads(template.read_text())

    async def configuration():
        async with PrefectClient(api=api_url, auth_string=auth_string) as client:
            return await KubernetesWorkerJobConfiguration.from_template_and_values(
                template, values, client=client
            )

    config = asyncio.run(configuration())
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name=flow_run_name))
    return config.job_manifest


def check_against_kubernetes_schema(manifest: dict, name: str = "grpoflow-job") -> None:
    """Raise kubernetes_validate's ValidationError naming the field unless `manifest` (given the name the API
    server would generate) is a valid object of the newest Kubernetes release it knows."""
    import kubernetes_validate

    manifest = copy.deepcopy(manifest)
    if manifest.get("kind") == "Job":
        pod = manifest["spec"]["template"]["spec"]
        for field in WORKER_ONLY_POD_FIELDS:
            pod.pop(field, None)
        manifest["metadata"].setdefault("name", name)
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
