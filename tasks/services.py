"""Where the pipeline's services live: the embedded default (no servers), or the user's servers.

Embedded default: Prefect's ephemeral API with PREFECT_HOME in the project's state folder (a generous
start-up timeout, since the default 20 s is not enough on 2 cores; analytics off), and MLflow tracking in
`sqlite:///<state>/mlflow.db` with artifacts under `<state>/mlartifacts`. When PREFECT_API_URL or
MLFLOW_TRACKING_URI is set, those servers are used instead and nothing here overrides them.

Everything the pipeline writes lives under the state folder or in the tracking server's artifact store, never
in the directory a command was started from: a recipe's relative output paths are placed under the state
folder (`place_outputs`), and a database-backed MLFLOW_TRACKING_URI gets `<state>/mlartifacts` as the artifact
root of the experiments grpoflow creates (MLflow's own default would be `./mlruns` of the working directory).

Credentials in MLFLOW_TRACKING_URI, MLFLOW_REGISTRY_URI or PREFECT_API_URL are used to connect and shown
nowhere: `describe()`, `ui_commands()` and `flow_parameters()` carry the URIs masked, and
`tasks.tracking.client_for` takes a masked URI's credentials from the environment variable that holds it.

`configure()` must run before Prefect is imported: Prefect reads its settings at import time.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from data.redact import mask_uri

DEFAULT_STATE = Path(__file__).resolve().parent.parent / ".state"
STATE_PREFIX = ".state"  # how the recipes spell "the state folder" in their relative output paths
# Tracking URIs whose server keeps the artifacts; for any other (a database, a file store) the client does.
SERVER_SCHEMES = ("http", "https", "databricks", "databricks-uc", "uc")
# The recipe's outputs: (section, field). Inputs (model.name_or_path, eval.local_paths) stay as given.
OUTPUT_PATHS = (("bootstrap", "out"), ("data", "out"), ("train", "output_dir"), ("eval", "out"))


@dataclass(frozen=True)
class Services:
    state_dir: Path
    tracking_uri: str
    registry_uri: str
    artifact_root: str | None  # None when the tracking server decides
    prefect_api_url: str | None  # None: the ephemeral API under state_dir/prefect

    def describe(self) -> dict:
        """What to show a person: the URIs with their credentials masked."""
        return {
            "state_dir": str(self.state_dir),
            "tracking_uri": mask_uri(self.tracking_uri),
            "registry_uri": mask_uri(self.registry_uri),
            "prefect": mask_uri(self.prefect_api_url)
            if self.prefect_api_url
            else f"ephemeral, PREFECT_HOME={self.state_dir / 'prefect'}",
        }

    def flow_parameters(self) -> dict:
        """The services as flows and tasks get them (Prefect stores parameters): URIs masked, the real ones
        are read from the environment by `tasks.tracking.client_for`."""
        return {
            "tracking_uri": mask_uri(self.tracking_uri),
            "registry_uri": mask_uri(self.registry_uri),
            "artifact_root": self.artifact_root,
            "state_dir": str(self.state_dir),
        }

    def ui_commands(self) -> list[str]:
        tracking = mask_uri(self.tracking_uri)
        cmds = [
            f"mlflow ui --backend-store-uri {tracking}"
            if tracking.startswith("sqlite")
            else f"open {tracking}"
        ]
        cmds.append(
            f"PREFECT_HOME={self.state_dir / 'prefect'} prefect server start"
            if not self.prefect_api_url
            else f"open {mask_uri(self.prefect_api_url)}"
        )
        return cmds

    def output_path(self, path: str | os.PathLike) -> Path:
        """Where a recipe's output path lives: absolute as given; relative under the state folder, whose name
        the recipes spell `.state` (`.state/eval` is `<state>/eval`, `eval` is `<state>/eval` too)."""
        path = Path(path).expanduser()
        if path.is_absolute():
            return path
        parts = path.parts[1:] if path.parts[:1] == (STATE_PREFIX,) else path.parts
        return self.state_dir.joinpath(*parts)

    def place_outputs(self, recipe):
        """`recipe` (a `trainer.recipe.Recipe`) with its output paths (`OUTPUT_PATHS`) under the state
        folder."""
        sections = {}
        for section, name in OUTPUT_PATHS:
            config = sections.get(section, getattr(recipe, section))
            placed = str(self.output_path(getattr(config, name)))
            sections[section] = dataclasses.replace(config, **{name: placed})
        return dataclasses.replace(recipe, **sections)


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
    # MLflow prints "View run ... at: <server URL>" on stdout, credentials included, and into --json's stdout
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    tracking = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state / 'mlflow.db'}"
    artifact_root = None if _server_keeps_artifacts(tracking) else str(state / "mlartifacts")
    registry = os.environ.get("MLFLOW_REGISTRY_URI") or tracking
    return Services(state, tracking, registry, artifact_root, api_url)


def recipe_and_services(
    config: str | os.PathLike | None, overrides: list[str] | tuple = (), state_dir: str | Path | None = None
):
    """The recipe at `config` (`key=value` overrides applied) with its outputs under the state folder, and the
    services this process reaches: what a command and a deployment's flow run both start from."""
    from trainer.recipe import load_recipe

    services = configure(state_dir)
    return services.place_outputs(load_recipe(config, list(overrides))), services


def _server_keeps_artifacts(tracking_uri: str) -> bool:
    """A tracking server has its own artifact store; a database or file store would use `./mlruns`."""
    return urlsplit(tracking_uri).scheme.lower() in SERVER_SCHEMES
