"""Where the pipeline's services live: the embedded default (no servers), or the user's servers.

Embedded default: Prefect's ephemeral API with PREFECT_HOME in the project's state folder (a generous
start-up timeout, since the default 20 s is not enough on 2 cores; analytics off), and MLflow tracking in
`sqlite:///<state>/mlflow.db` with artifacts under `<state>/mlartifacts`. When PREFECT_API_URL or
MLFLOW_TRACKING_URI is set, those servers are used instead and nothing here overrides them.

`configure()` must run before Prefect is imported: Prefect reads its settings at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STATE = Path(__file__).resolve().parent.parent / ".state"


@dataclass(frozen=True)
class Services:
    state_dir: Path
    tracking_uri: str
    registry_uri: str
    artifact_root: str | None  # None when the tracking server decides
    prefect_api_url: str | None  # None: the ephemeral API under state_dir/prefect

    def describe(self) -> dict:
        return {"state_dir": str(self.state_dir), "tracking_uri": self.tracking_uri, "registry_uri": self.registry_uri,
                "prefect": self.prefect_api_url or f"ephemeral, PREFECT_HOME={self.state_dir / 'prefect'}"}

    def ui_commands(self) -> list[str]:
        cmds = [f"mlflow ui --backend-store-uri {self.tracking_uri}" if self.tracking_uri.startswith("sqlite")
                else f"open {self.tracking_uri}"]
        cmds.append(f"PREFECT_HOME={self.state_dir / 'prefect'} prefect server start" if not self.prefect_api_url
                    else f"open {self.prefect_api_url}")
        return cmds


def configure(state_dir: str | Path | None = None) -> Services:
    state = Path(state_dir or os.environ.get("GRPOFLOW_STATE") or DEFAULT_STATE).resolve()
    state.mkdir(parents=True, exist_ok=True)
    api_url = os.environ.get("PREFECT_API_URL") or None
    if not api_url:
        os.environ.setdefault("PREFECT_HOME", str(state / "prefect"))
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "240")
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    tracking = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state / 'mlflow.db'}"
    artifact_root = None if os.environ.get("MLFLOW_TRACKING_URI") else str(state / "mlartifacts")
    registry = os.environ.get("MLFLOW_REGISTRY_URI") or tracking
    return Services(state, tracking, registry, artifact_root, api_url)
