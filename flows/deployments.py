"""infra/prefect.yaml's deployments, made real: created on a Prefect server (`grpoflow deploy`), or served
with their schedules from one long-lived process (`grpoflow serve`), for users without a worker.

The YAML is the one home of each deployment's settings (entrypoint, parameters, schedules, work pool); both
commands read it. Both need a Prefect server (PREFECT_API_URL): Prefect's ephemeral API runs no scheduler, so
nothing scheduled would ever start. Call `services.configure()` first: Prefect reads its settings at import.

`deploy` puts the deployments that name the process pool `grpoflow-process` on $GRPOFLOW_WORK_POOL when it is
set (infra/services/up.sh writes it to services.env: the pool its worker polls); a deployment naming another
pool (a GPU pool) keeps it. `serve` takes over deployments of the same names while it runs; when it stops,
those that were active before it started stay active (a worker runs them again), and the others are paused,
since nobody runs them once the serving process is gone.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from data.errors import UsageError
from data.redact import mask_uri, redact
from tasks.services import configure

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = REPO_ROOT / "infra" / "prefect.yaml"
DEPLOY_TIMEOUT_S = 600.0
PROCESS_POOL = "grpoflow-process"  # the file's pool for this machine's worker; GRPOFLOW_WORK_POOL renames it


def load_deployments(path: str | Path = PREFECT_FILE) -> list[dict]:
    """The `deployments` of a Prefect deployment file, each checked for what `deploy` and `serve` read."""
    return _load_spec(path)["deployments"]


def _load_spec(path: str | Path) -> dict:
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
    return spec


def work_pool(d: dict) -> str:
    """The pool a deployment goes to: its own, except that the process pool is the configured one."""
    name = d["work_pool"]["name"]
    return (os.environ.get("GRPOFLOW_WORK_POOL") or name) if name == PROCESS_POOL else name


def require_server() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise UsageError(
            "PREFECT_API_URL is not set: deployments and schedules need a Prefect server "
            "(infra/services/up.sh starts one; then `source .state/services/services.env`)"
        )
    from tasks.preflight import require_prefect_api

    require_prefect_api(url)
    return url


def deploy(path: str | Path = PREFECT_FILE, timeout_s: float = DEPLOY_TIMEOUT_S) -> dict:
    """Create the deployments' work pools (type process) where missing, then `prefect deploy --all` from the
    repository root (the runs' working directory). Returns the deployments' full names, their pools and the
    pools made."""
    spec = _load_spec(path)
    url = require_server()
    pools = [work_pool(d) for d in spec["deployments"]]
    created = [pool for pool in sorted(set(pools)) if _ensure_process_pool(pool)]
    with tempfile.TemporaryDirectory(prefix="grpoflow-deploy-") as tmp:
        resolved = Path(path).resolve()
        if pools != [d["work_pool"]["name"] for d in spec["deployments"]]:
            for d, pool in zip(spec["deployments"], pools, strict=True):
                d["work_pool"]["name"] = pool
            resolved = Path(tmp) / "prefect.yaml"  # the file with the configured pool; entrypoints are cwd's
            resolved.write_text(yaml.safe_dump(spec, sort_keys=False))
        cmd = [
            str(Path(sys.executable).with_name("prefect")),
            "deploy",
            "--all",
            "--prefect-file",
            str(resolved),
        ]
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "PREFECT_CLI_PROMPT": "false"},
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"prefect deploy did not finish within {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"prefect deploy --all --prefect-file {path} failed ({proc.returncode}):\n"
            f"{redact(proc.stdout[-2000:] + proc.stderr[-2000:])}"
        )
    names = [f"{_flow_name(d)}/{d['name']}" for d in spec["deployments"]]
    return {
        "deployments": names,
        "work_pools": dict(zip(names, pools, strict=True)),
        "work_pools_created": created,
        "prefect_api_url": mask_uri(url),
    }


def serve(path: str | Path = PREFECT_FILE, limit: int | None = None) -> dict:
    """Serve every deployment of the file from this process, schedules included, until interrupted (SIGINT or
    SIGTERM). Then pause those it made active, and leave active those that were before it started (Prefect's
    `serve` would pause them all: `grpoflow deploy`'s deployments would stop running on the worker)."""
    from prefect import serve as prefect_serve

    url = require_server()
    runners = []
    for d in load_deployments(path):
        flow = _load_flow(d)
        runners.append(
            flow.to_deployment(
                name=d["name"],
                parameters=d.get("parameters") or {},
                schedules=[_schedule(s, d["name"]) for s in d.get("schedules") or []],
                description=d.get("description"),
                tags=d.get("tags"),
                concurrency_limit=d.get("concurrency_limit"),
            )
        )
    names = [r.full_name for r in runners]
    active_before = [name for name, paused in _paused(names).items() if paused is False]
    try:
        prefect_serve(*runners, limit=limit, pause_on_shutdown=False)
    finally:  # a SIGTERM before the runner started ends in SystemExit: pause what serve unpaused all the same
        to_pause = [name for name in names if name not in active_before]
        _pause(to_pause)
    outcome = (("paused", to_pause), ("left active", active_before))
    print(
        f"stopped serving {', '.join(names)}: "
        + "; ".join(f"{label} {', '.join(group)}" for label, group in outcome if group),
        file=sys.stderr,
    )
    return {
        "deployments": names,
        "paused": to_pause,
        "left_active": active_before,
        "prefect_api_url": mask_uri(url),
    }


def _paused(names: list[str]) -> dict[str, bool | None]:
    """Each deployment's `paused` on the server (None: there is none of that name)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                found[name] = client.read_deployment_by_name(name).paused
            except ObjectNotFound:
                found[name] = None
    return found


def _pause(names: list[str]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.pause_deployment(client.read_deployment_by_name(name).id)
            except ObjectNotFound:  # stopped before serve had made it
                continue


def _load_flow(d: dict):
    from prefect.flows import load_flow_from_entrypoint

    file, _, func = d["entrypoint"].partition(":")
    return load_flow_from_entrypoint(f"{REPO_ROOT / file}:{func}", use_placeholder_flow=False)


def _flow_name(d: dict) -> str:
    return _load_flow(d).name


def _schedule(s: dict, deployment: str):
    from prefect.schedules import Cron, Interval

    common = {
        "timezone": s.get("timezone"),
        "active": s.get("active", True),
        "parameters": s.get("parameters") or {},
    }
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


# ---- the commands ------------------------------------------------------------------------------------------


def add_commands(sub, number) -> None:
    """`grpoflow deploy` and `grpoflow serve` (`number`: the CLI's numeric argparse type)."""
    file_help = f"Prefect deployment file (default {PREFECT_FILE.relative_to(REPO_ROOT)})"
    state_help = "where the embedded stores live (default .state, or $GRPOFLOW_STATE)"
    p = sub.add_parser(
        "deploy", help="create the Prefect deployments (schedules included) on PREFECT_API_URL's server"
    )
    p.add_argument("--prefect-file", default=PREFECT_FILE, help=file_help)
    p.add_argument("--state-dir", help=state_help)
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser(
        "serve", help="run the Prefect deployments with their schedules in this process (no worker)"
    )
    p.add_argument("--prefect-file", default=PREFECT_FILE, help=file_help)
    p.add_argument("--limit", type=number(int, ge=1), help="at most this many flow runs at once")
    p.add_argument("--state-dir", help=state_help)
    p.add_argument(
        "--json",
        action="store_true",
        help="once stopped, print a JSON summary (what it paused, what it left active) as "
        "the last line of stdout",
    )
    p.set_defaults(func=cmd_serve)


def cmd_deploy(args) -> dict:
    configure(args.state_dir)
    result = deploy(args.prefect_file)
    pools = sorted(set(result["work_pools"].values()))
    print(
        f"deployed {', '.join(result['deployments'])} to {result['prefect_api_url']} "
        f"(work pool {', '.join(pools)})",
        file=sys.stderr if args.json else sys.stdout,
    )
    return result


def cmd_serve(args) -> dict:
    configure(args.state_dir)
    return serve(args.prefect_file, limit=args.limit)
