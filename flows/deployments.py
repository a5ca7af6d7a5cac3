"""infra/prefect.yaml's deployments, made real: created on a Prefect server (`grpoflow deploy`), or served with
their schedules from one long-lived process (`grpoflow serve`), for users without a worker.

The YAML is the one home of each deployment's settings (entrypoint, parameters, schedules, work pool); both
commands read it. Both need a Prefect server (PREFECT_API_URL): Prefect's ephemeral API runs no scheduler, so
nothing scheduled would ever start. Call `services.configure()` first: Prefect reads its settings at import.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import yaml

from data.errors import UsageError
from data.redact import mask_uri, redact
from tasks.services import configure

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = REPO_ROOT / "infra" / "prefect.yaml"
DEPLOY_TIMEOUT_S = 600.0


def load_deployments(path: str | Path = PREFECT_FILE) -> list[dict]:
    """The `deployments` of a Prefect deployment file, each checked for what `deploy` and `serve` read."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such Prefect deployment file")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML: {e}") from None
    deployments = spec.get("deployments") if isinstance(spec, dict) else None
    if not isinstance(deployments, list) or not deployments:
        raise UsageError(f"{path}: expected a non-empty `deployments:` list")
    for i, d in enumerate(deployments):
        missing = [k for k in ("name", "entrypoint") if not isinstance(d, dict) or not d.get(k)]
        if missing:
            raise UsageError(f"{path}: deployments[{i}] lacks {', '.join(missing)}")
        if not (d.get("work_pool") or {}).get("name"):
            raise UsageError(f"{path}: deployment {d['name']!r} names no work_pool.name")
    return deployments


def require_server() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise UsageError("PREFECT_API_URL is not set: deployments and schedules need a Prefect server "
                         "(infra/services/up.sh starts one; then `source .state/services/services.env`)")
    from tasks.preflight import require_prefect_api
    require_prefect_api(url)
    return url


def deploy(path: str | Path = PREFECT_FILE, timeout_s: float = DEPLOY_TIMEOUT_S) -> dict:
    """Create the file's work pools (type process) where missing, then `prefect deploy --all` from the
    repository root (the runs' working directory). Returns the deployments' full names and the pools made."""
    deployments = load_deployments(path)
    url = require_server()
    created = [pool for pool in sorted({d["work_pool"]["name"] for d in deployments}) if _ensure_process_pool(pool)]
    cmd = [str(Path(sys.executable).with_name("prefect")), "deploy", "--all", "--prefect-file", str(Path(path).resolve())]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PREFECT_CLI_PROMPT": "false"})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"prefect deploy did not finish within {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"prefect deploy --all --prefect-file {path} failed ({proc.returncode}):\n"
                           f"{redact(proc.stdout[-2000:] + proc.stderr[-2000:])}")
    names = [f"{_flow_name(d)}/{d['name']}" for d in deployments]
    return {"deployments": names, "work_pools_created": created, "prefect_api_url": mask_uri(url)}


def serve(path: str | Path = PREFECT_FILE, limit: int | None = None) -> None:
    """Serve every deployment of the file from this process, schedules included, until interrupted."""
    from prefect import serve as prefect_serve

    require_server()
    runners = []
    for d in load_deployments(path):
        flow = _load_flow(d)
        runners.append(flow.to_deployment(name=d["name"], parameters=d.get("parameters") or {},
                                          schedules=[_schedule(s, d["name"]) for s in d.get("schedules") or []],
                                          description=d.get("description"), tags=d.get("tags"),
                                          concurrency_limit=d.get("concurrency_limit")))
    prefect_serve(*runners, limit=limit)


def _load_flow(d: dict):
    from prefect.flows import load_flow_from_entrypoint

    file, _, func = d["entrypoint"].partition(":")
    return load_flow_from_entrypoint(f"{REPO_ROOT / file}:{func}", use_placeholder_flow=False)


def _flow_name(d: dict) -> str:
    return _load_flow(d).name


def _schedule(s: dict, deployment: str):
    from prefect.schedules import Cron, Interval

    common = {"timezone": s.get("timezone"), "active": s.get("active", True), "parameters": s.get("parameters") or {}}
    if s.get("cron"):
        return Cron(s["cron"], **common)
    if s.get("interval"):
        anchor = s.get("anchor_date")
        if isinstance(anchor, str):
            anchor = datetime.datetime.fromisoformat(anchor)
        return Interval(float(s["interval"]), anchor_date=anchor, **common)
    raise UsageError(f"deployment {deployment!r}: a schedule needs `cron` or `interval`, got {sorted(s)}")


def _ensure_process_pool(name: str) -> bool:
    """Create the work pool `name` (type process) unless it exists; True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return True


# ---- the commands -------------------------------------------------------------------------------------------

def add_commands(sub, number) -> None:
    """`grpoflow deploy` and `grpoflow serve` (`number`: the CLI's numeric argparse type)."""
    file_help = f"Prefect deployment file (default {PREFECT_FILE.relative_to(REPO_ROOT)})"
    state_help = "where the embedded stores live (default .state, or $GRPOFLOW_STATE)"
    p = sub.add_parser("deploy", help="create the Prefect deployments (schedules included) on PREFECT_API_URL's server")
    p.add_argument("--prefect-file", default=PREFECT_FILE, help=file_help)
    p.add_argument("--state-dir", help=state_help)
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("serve", help="run the Prefect deployments with their schedules in this process (no worker)")
    p.add_argument("--prefect-file", default=PREFECT_FILE, help=file_help)
    p.add_argument("--limit", type=number(int, ge=1), help="at most this many flow runs at once")
    p.add_argument("--state-dir", help=state_help)
    p.set_defaults(func=cmd_serve, json=False)


def cmd_deploy(args) -> dict:
    configure(args.state_dir)
    result = deploy(args.prefect_file)
    print(f"deployed {', '.join(result['deployments'])} to {result['prefect_api_url']}",
          file=sys.stderr if args.json else sys.stdout)
    return result


def cmd_serve(args) -> None:
    configure(args.state_dir)
    serve(args.prefect_file, limit=args.limit)
