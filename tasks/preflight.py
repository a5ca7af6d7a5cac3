"""What would stop a command late, checked before it starts: its outputs can be written, its services answer,
and the recipe's evaluation settings are usable. Every refusal is a one-line `GrpoflowUserError` (exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from data.errors import UsageError

PREFECT_PROBE_TIMEOUT_S = 10.0


def check_writable(path: str | Path, setting: str) -> None:
    """Refuse an output path whose nearest existing folder cannot be written (read-only file system, no
    permission) before any work; an output is written next to its final place and renamed there."""
    path = Path(path).expanduser().resolve()
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{setting} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        raise UsageError(
            f"{setting} {path}: cannot write in {folder} "
            f"({'read-only file system' if read_only else 'permission denied'})"
        )


def check_before_run(recipe, services, source: str) -> None:
    """Before the pipeline: the recipe is one the trainer supports, the Prefect API and MLflow answer (a dead
    server is one line, not minutes of client retries), the evaluation settings are usable, and a multi-node
    recipe has node 0's rendezvous (GRPOFLOW_RENDEZVOUS)."""
    from tasks import tracking
    from trainer.grpo import check_supported
    from trainer.launch import RENDEZVOUS_ENV, check_endpoint

    check_supported(recipe)
    check_endpoint(recipe, os.environ.get(RENDEZVOUS_ENV))
    if services.prefect_api_url:
        require_prefect_api(services.prefect_api_url)
    tracking.client_for(services.tracking_uri, services.registry_uri)
    check_eval_settings(recipe, source)


def require_prefect_api(url: str) -> None:
    """One line naming the Prefect API (exit 2) unless its /health answers within PREFECT_PROBE_TIMEOUT_S."""
    from data.reachability import require_reachable

    require_reachable(
        url.rstrip("/") + "/health", "the Prefect API", PREFECT_PROBE_TIMEOUT_S, hint="PREFECT_API_URL"
    )


def check_eval_settings(recipe, source: str, endpoint: str | None = None, **endpoint_settings) -> None:
    """The recipe's `eval` section checked as EvalScope will use it (benchmark names, local paths, an API key
    variable), and an endpoint's reachability, before any model is resolved, downloaded, trained or served.
    `source` names the recipe in the message; `endpoint_settings`: api_key_env, eval_batch_size."""
    from evaluation import EvalInputError, check_evaluation

    try:
        check_evaluation(recipe.eval, api_url=endpoint, **endpoint_settings)
    except EvalInputError as err:
        raise UsageError(f"{source}: eval: {err}") from None
