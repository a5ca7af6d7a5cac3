"""Operations, for real: the team services (a Prefect server and an MLflow server, both on PostgreSQL, and a
Prefect process worker) started by `infra/services/up.sh` on loopback ports chosen at run time, the
deployments of `infra/prefect.yaml` created by `grpoflow deploy`, a scheduled pipeline run picked up by the
worker, the regression gate triggered as CI triggers it, and the CI workflow's own commands.

The Prefect API runs with basic auth (a fresh auth string per run) and the database URL carries a password
(PostgreSQL here trusts loopback, so any password connects): both are secrets that must appear in no log, no
MLflow param or tag and no file the services write. The module's services are stopped by `down.sh`, and
their databases dropped, whatever the tests do.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from k8s_templates import K8S, check_against_kubernetes_schema, rendered_job

from conftest import REPO_ROOT, scored_copy, shared, stop_group
from data.manifest import read_manifest

pytestmark = pytest.mark.slow

PG = "127.0.0.1:5432"
SERVICES = REPO_ROOT / "infra" / "services"
PREFECT_BIN = str(Path(sys.executable).with_name("prefect"))
RUN_TIMEOUT_S = 900  # a flow run of the tiny recipe, worker start-up included, on 2 busy cores
BENCH = "aime24"


def free_port() -> int:
    from trainer.launch import free_port as port

    return port()


def gone(pid: int) -> bool:
    """No such process, or a zombie (it has exited; nobody has reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def stop_session(pid: int, timeout: float = 60) -> None:
    """Stop a session leader that is not this test's child (what up.sh started), and its group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


def psql(command: str) -> None:
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-c", command],
        check=True,
        capture_output=True,
        timeout=60,
    )


class Services:
    """What up.sh started, and how a client talks to it."""

    def __init__(self, root: Path, pg_password: str, auth: str):
        self.root, self.dir = root, root / "services"
        self.pg_password, self.auth = pg_password, auth
        self.tag = secrets.token_hex(3)
        self.dbs = (f"grpoflow_ops_prefect_{self.tag}", f"grpoflow_ops_mlflow_{self.tag}")
        self.prefect_port, self.mlflow_port = free_port(), free_port()
        self.api = f"http://127.0.0.1:{self.prefect_port}/api"
        self.mlflow = f"http://127.0.0.1:{self.mlflow_port}"

    def up_env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
        env.update(
            GRPOFLOW_PG_URL=f"postgresql://postgres:{self.pg_password}@{PG}",
            GRPOFLOW_PREFECT_DB=self.dbs[0],
            GRPOFLOW_MLFLOW_DB=self.dbs[1],
            GRPOFLOW_PREFECT_PORT=str(self.prefect_port),
            GRPOFLOW_MLFLOW_PORT=str(self.mlflow_port),
            GRPOFLOW_MLFLOW_WORKERS="1",
            GRPOFLOW_PYTHON=sys.executable,
            PREFECT_SERVER_API_AUTH_STRING=self.auth,
            PREFECT_UI_ENABLED="false",  # lighter on 2 cores; the API is what is tested
            PREFECT_WORKER_QUERY_SECONDS="3",
            GRPOFLOW_HEARTBEAT_S="30",
            GRPOFLOW_ZOMBIE_AFTER_S="40",
        )  # Prefect's shortest heartbeat
        env.update(extra)
        return env

    def client_env(self) -> dict:
        """What a user has after `source services.env` and setting the auth string."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
        env.update(
            PREFECT_API_URL=self.api,
            PREFECT_API_AUTH_STRING=self.auth,
            MLFLOW_TRACKING_URI=self.mlflow,
            PREFECT_HOME=str(self.root / "client-prefect"),
            GRPOFLOW_STATE=str(self.root / "client-state"),
        )
        return env

    def request(self, method: str, path: str, body: dict | None = None, auth: str | None = "") -> dict | list:
        """The Prefect REST API, with the auth string unless `auth` is None."""
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = "Basic " + base64.b64encode((auth or self.auth).encode()).decode()
        req = urllib.request.Request(
            self.api + path,
            method=method,
            headers=headers,
            data=None if body is None else json.dumps(body).encode(),
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def flow_runs(
        self, deployment_id: str, scheduled: bool | None = None, tag: str | None = None
    ) -> list[dict]:
        """The deployment's flow runs, oldest first: all, only the schedule's, or only those triggered; only
        those carrying `tag` when given (a test tags the runs it triggers and so finds its own, whatever the
        module's other tests ran before it)."""
        body = {"deployments": {"id": {"any_": [deployment_id]}}}
        if tag:
            body["flow_runs"] = {"tags": {"all_": [tag]}}
        runs = self.request("POST", "/flow_runs/filter", body)
        return sorted(
            (r for r in runs if scheduled is None or r["auto_scheduled"] == scheduled),
            key=lambda r: r["created"],
        )

    def deployment(self, name: str) -> dict:
        return self.request("GET", f"/deployments/name/{name}")

    def wait_for_final(self, flow_run_id: str, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.request("GET", f"/flow_runs/{flow_run_id}")
            if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return run
            time.sleep(2)
        raise AssertionError(
            f"flow run {flow_run_id} not finished within {timeout_s} s: {run['state']}\n{self.worker_log()}"
        )

    def worker_log(self) -> str:
        log = self.dir / "logs" / "worker.log"
        return log.read_text()[-4000:] if log.exists() else "(no worker log)"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    s = Services(
        tmp_path_factory.mktemp("ops"),
        pg_password=f"pw-{secrets.token_hex(8)}",
        auth=f"ops:{secrets.token_hex(12)}",
    )
    try:
        up = subprocess.run(
            ["bash", str(SERVICES / "up.sh"), str(s.dir)],
            cwd=REPO_ROOT,
            env=s.up_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert up.returncode == 0, up.stderr[-4000:] + "".join(
            f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in (s.dir / "logs").glob("*.log")
        )
        yield s
    finally:
        running = [int(p.read_text()) for p in (s.dir / "pids").glob("*") if "." not in p.name]  # not records
        down = subprocess.run(
            ["bash", str(SERVICES / "down.sh"), str(s.dir)], capture_output=True, text=True, timeout=300
        )
        for db in s.dbs:
            subprocess.run(
                [
                    "psql",
                    "-h",
                    "127.0.0.1",
                    "-U",
                    "postgres",
                    "-c",
                    f"drop database if exists {db} with (force)",
                ],
                capture_output=True,
                timeout=60,
            )
        assert down.returncode == 0, down.stderr
        assert all(gone(pid) for pid in running), (running, down.stderr)


def overrides(tiny_base: dict, eval_out: Path | None = None) -> list[str]:
    """The tiny recipe, a few steps, a two-problem AIME evaluation (the gate's benchmark) from
    ../shared/data."""
    found = [
        f"bootstrap.out={tiny_base['path']}",
        "data.synthetic_rows=600",
        "train.max_steps=4",
        "train.save_steps=2",
        "train.eval_heldout=16",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        f"eval.benchmarks=[{BENCH}]",
        "eval.limit=2",
        "eval.max_tokens=16",
        f"eval.local_paths={{{BENCH}: {shared(BENCH)}}}",
    ]
    return found + ([f"eval.out={eval_out}"] if eval_out else [])


def grpoflow(
    services: Services, *args: str, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO_ROOT,
        env={**services.client_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_tag(what: str) -> str:
    """A flow-run tag no other run carries (`prefect deployment run --tag`): how a test finds its own runs."""
    return f"{what}-{secrets.token_hex(4)}"


def prefect(services: Services, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PREFECT_BIN, *args],
        cwd=REPO_ROOT,
        env=services.client_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- the services ------------------------------------------------------------------------------------------


def test_up_writes_what_a_client_needs_and_no_secret(services):
    env_file = (services.dir / "services.env").read_text()
    assert f"export PREFECT_API_URL={services.api}" in env_file
    assert f"export MLFLOW_TRACKING_URI={services.mlflow}" in env_file
    for path in services.dir.rglob("*"):
        if path.is_file() and path.suffix in (".env", ".log", ""):
            text = path.read_text(errors="replace")
            assert services.pg_password not in text and services.auth.split(":")[1] not in text, path


def test_an_unauthenticated_client_is_refused_by_the_prefect_api(services):
    with pytest.raises(urllib.error.HTTPError) as refused:
        services.request("POST", "/flows/filter", {}, auth=None)
    assert refused.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as wrong:
        services.request("POST", "/flows/filter", {}, auth="ops:not-the-password")
    assert wrong.value.code == 401
    assert isinstance(services.request("POST", "/flows/filter", {}), list)
    env = {**services.client_env(), "PREFECT_API_AUTH_STRING": ""}
    proc = subprocess.run(
        [PREFECT_BIN, "deployment", "ls"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0


def test_the_worker_gets_no_server_secret_only_the_client_auth_string(services):
    """The worker's environment (which every flow run it starts inherits) holds neither the database's admin
    URL nor the Prefect server's own auth setting; it holds the client's PREFECT_API_AUTH_STRING, without
    which the worker and its runs could not talk to an API that has auth on."""
    env = environ_of(int((services.dir / "pids" / "worker").read_text()))
    assert "GRPOFLOW_PG_URL" not in env and "PREFECT_SERVER_API_AUTH_STRING" not in env, sorted(env)
    assert not [k for k, v in env.items() if services.pg_password in v], "the database password is there"
    assert not [k for k in env if k.startswith(("PREFECT_SERVER_", "PREFECT_API_DATABASE_"))], sorted(env)
    assert env["PREFECT_API_AUTH_STRING"] == services.auth and env["PREFECT_API_URL"] == services.api
    assert env["MLFLOW_TRACKING_URI"] == services.mlflow


def test_down_leaves_alone_the_process_a_stale_pid_file_names(tmp_path):
    """Pid files whose PIDs are now other processes (after a reboot, or long after the service exited): one
    with no record of the service's start, one whose PID started when recorded but runs another command.
    down.sh signals neither them nor their groups and drops the stale files; a process the record does prove
    its own (start time and command line) it stops."""
    pids = tmp_path / "pids"
    pids.mkdir()
    strangers = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(3)]
    try:
        reused, other_command, own = strangers
        (pids / "worker").write_text(f"{reused.pid}\n")
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()

        def started(pid: int) -> str:  # field 22 of /proc/PID/stat, after the name in parentheses
            return f"{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]} {boot}\n"

        for name, proc, command in (
            ("mlflow-server", other_command, f"{sys.executable} -m mlflow server"),
            ("prefect-server", own, "sleep 600"),
        ):
            (pids / f"{name}.start").write_text(started(proc.pid))
            (pids / f"{name}.cmd").write_text(command + "\n")
            (pids / name).write_text(f"{proc.pid}\n")
        down = subprocess.run(
            ["bash", str(SERVICES / "down.sh"), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "GRPOFLOW_STOP_TIMEOUT": "10"},
        )
        assert down.returncode == 0, down.stderr
        assert reused.poll() is None and other_command.poll() is None, down.stderr  # not signalled
        assert "worker stopped" not in down.stderr and "mlflow-server stopped" not in down.stderr
        assert f"pid {reused.pid} is another process now" in down.stderr
        assert own.wait(timeout=30) == -signal.SIGINT and "prefect-server stopped" in down.stderr
        assert not any(pids.iterdir())  # stale or done with, every record is gone
    finally:
        for proc in strangers:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def up_again(services):
    """up.sh run again over the running services, with the worker's pid file naming an unrelated process (a
    `sleep` in a session of its own, like a reused PID after a reboot). The worker it starts polls a spare
    pool (no run of this module goes there); it is stopped, and the module worker's record put back, at
    once."""
    pids = services.dir / "pids"
    kept = {p: p.read_bytes() for p in [*pids.glob("worker*"), services.dir / "services.env"]}
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        for p in pids.glob("worker*"):
            p.unlink()
        (pids / "worker").write_text(f"{stranger.pid}\n")
        up = subprocess.run(
            ["bash", str(SERVICES / "up.sh"), str(services.dir)],
            cwd=REPO_ROOT,
            env=services.up_env(GRPOFLOW_WORK_POOL=f"ops-spare-{services.tag}"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        worker = int((pids / "worker").read_text()) if (pids / "worker").exists() else None
        stranger_alive = stranger.poll() is None
        if worker and worker != stranger.pid:
            stop_session(worker)
        return {"up": up, "stranger": stranger.pid, "stranger_alive": stranger_alive, "worker": worker}
    finally:
        stranger.kill()
        stranger.wait()
        for p in pids.glob("worker*"):
            p.unlink()
        for p, data in kept.items():
            p.write_bytes(data)


def test_up_starts_a_worker_when_its_pid_file_names_another_process_and_keeps_its_own_servers(
    services, up_again
):
    up = up_again["up"]
    assert up.returncode == 0, up.stderr
    assert "prefect-server already running" in up.stderr and "mlflow-server already running" in up.stderr
    assert "worker started" in up.stderr and up_again["worker"] != up_again["stranger"], up.stderr
    assert up_again["stranger_alive"], "up.sh signalled the process a stale pid file named"


def test_up_run_again_leaves_one_heartbeat_automation(services, up_again):
    assert up_again["up"].returncode == 0, up_again["up"].stderr
    name = "grpoflow: a run whose heartbeat stopped is Crashed"
    found = services.request("POST", "/automations/filter", {"automations": {"name": {"any_": [name]}}})
    assert len(found) == 1, [a["id"] for a in found]


def test_up_with_the_prefect_port_taken_fails_and_stops_what_it_started(tmp_path):
    """Another service already answers 200 at the Prefect port's /api/health (a plain HTTP server): up.sh must
    not take it for its Prefect server, whose own start fails on the port in use. It exits non-zero naming the
    port, stops the MLflow server it started, leaves no pid file, and leaves the other service alone."""
    s = Services(tmp_path, pg_password="unused", auth="ops:x")
    (tmp_path / "www" / "api").mkdir(parents=True)
    (tmp_path / "www" / "api" / "health").write_text("true")
    other = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "http.server",
            str(s.prefect_port),
            "--bind",
            "127.0.0.1",
            "--directory",
            str(tmp_path / "www"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{s.api}/health", timeout=5).close()
                break
            except OSError:
                assert other.poll() is None and time.monotonic() < deadline, "the other service did not start"
                time.sleep(0.2)
        up = subprocess.run(
            ["bash", str(SERVICES / "up.sh"), str(s.dir)],
            cwd=REPO_ROOT,
            capture_output=True,
            env=s.up_env(GRPOFLOW_SERVICES_TIMEOUT="240"),
            text=True,
            timeout=600,
        )
        assert up.returncode == 1, up.stderr
        assert "prefect-server up" not in up.stderr
        assert f"port {s.prefect_port} is another service's" in up.stderr and "already in use" in up.stderr
        [mlflow_pid] = [
            int(line.split("(pid ")[1].split(",")[0])
            for line in up.stderr.splitlines()
            if "mlflow-server started" in line
        ]
        assert gone(mlflow_pid) and "mlflow-server stopped" in up.stderr, (
            up.stderr + (s.dir / "logs" / "mlflow-server.log").read_text()[-3000:]
        )
        assert not any((s.dir / "pids").iterdir()) and not (s.dir / "services.env").exists()
        assert other.poll() is None
    finally:
        subprocess.run(["bash", str(SERVICES / "down.sh"), str(s.dir)], capture_output=True, timeout=300)
        stop_group(other)
        for db in s.dbs:
            subprocess.run(
                [
                    "psql",
                    "-h",
                    "127.0.0.1",
                    "-U",
                    "postgres",
                    "-c",
                    f"drop database if exists {db} with (force)",
                ],
                capture_output=True,
                timeout=60,
            )


# ---- deployments, a schedule, the pipeline through the worker ----------------------------------------------


@pytest.fixture(scope="module")
def deployed(services, tiny_base):
    """infra/prefect.yaml deployed as it is; then, through the API, its nightly deployment given parameters
    that make the run small and, for its schedule, a weekly interval anchored a minute ago. Nothing of that
    schedule comes due while the module runs (its next run is a week away): `scheduled_run` asks the server
    for the run at the anchor, so that no run starts by itself in the middle of another test."""
    proc = grpoflow(services, "deploy", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    as_shipped = {
        "result": json.loads(proc.stdout.strip().splitlines()[-1]),
        "nightly": services.deployment("grpo-pipeline/nightly"),
        "gate": services.deployment("regression-eval/gate"),
    }
    nightly = as_shipped["nightly"]
    anchor = int(time.time()) - 60
    services.request(
        "PATCH",
        f"/deployments/{nightly['id']}",
        {
            "parameters": {**nightly["parameters"], "overrides": overrides(tiny_base)},
            "schedules": [
                {"schedule": {"interval": 7 * 24 * 3600, "anchor_date": utc_iso(anchor)}, "active": True}
            ],
        },
    )
    return {**as_shipped, "anchor": anchor}


def utc_iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(timestamp))


def test_deploy_creates_both_deployments_with_the_shipped_schedule_and_pool(services, deployed):
    assert deployed["result"]["deployments"] == ["grpo-pipeline/nightly", "regression-eval/gate"]
    nightly, gate = deployed["nightly"], deployed["gate"]
    [schedule] = nightly["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "Europe/Paris"
    assert nightly["parameters"]["config"] == "configs/tiny-cpu.yaml"
    assert nightly["work_pool_name"] == gate["work_pool_name"] == "grpoflow-process"
    assert gate["schedules"] == [] and gate["parameters"]["fail_on_regression"] is True
    pool = services.request("GET", "/work_pools/grpoflow-process")
    assert pool["type"] == "process"


def renamed_copy(path: Path, suffix: str, pool: str | None = None) -> Path:
    """infra/prefect.yaml with each deployment renamed (`nightly<suffix>`), on `pool` when given."""
    spec = yaml.safe_load((REPO_ROOT / "infra" / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        d["name"] += suffix
        if pool:
            d["work_pool"]["name"] = pool
    path.write_text(yaml.safe_dump(spec))
    return path


def test_deploy_puts_the_process_pool_deployments_on_the_configured_work_pool(services, tmp_path):
    """GRPOFLOW_WORK_POOL (services.env sets it to the pool up.sh's worker polls) is the pool of the file's
    process-pool deployments: else their runs would wait on a pool no worker polls."""
    pool = f"ops-pool-{services.tag}"
    copy = renamed_copy(tmp_path / "prefect.yaml", "-pooled")
    proc = grpoflow(
        services, "deploy", "--prefect-file", str(copy), "--json", env={"GRPOFLOW_WORK_POOL": pool}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["grpo-pipeline/nightly-pooled", "regression-eval/gate-pooled"]
    assert [services.deployment(name)["work_pool_name"] for name in names] == [pool, pool]
    assert services.request("GET", f"/work_pools/{pool}")["type"] == "process"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["work_pools"] == dict.fromkeys(names, pool) and pool in result["work_pools_created"]


def serve_until_polling(
    services: Services, copy: Path, names: list[str], log_dir: Path, *flags: str
) -> subprocess.Popen:
    """`grpoflow serve` on `copy`, returned once its runner polls for their runs (each deployment READY: on a
    pool no worker polls, only the serving process marks them so), its SIGTERM handler in place by then."""
    with (log_dir / "serve.out").open("w") as out, (log_dir / "serve.log").open("w") as log:
        serving = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", "--prefect-file", str(copy), *flags],
            cwd=REPO_ROOT,
            env=services.client_env(),
            stdout=out,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while True:
        try:
            if all(services.deployment(name)["status"] == "READY" for name in names):
                return serving
        except urllib.error.HTTPError:  # not created yet
            pass
        if serving.poll() is not None or time.monotonic() > deadline:
            stop_group(serving)
            log = (log_dir / "serve.log").read_text()
            raise AssertionError(f"serve ended ({serving.returncode}) or no poll in 300 s\n{log[-3000:]}")
        time.sleep(1)


def test_stopping_serve_leaves_the_deployments_that_were_active_active(services, tmp_path):
    """Deployed for a worker, then served and stopped with SIGTERM (as a service manager stops it): the
    deployments stay active on their pool, as they were (Prefect's serve alone pauses them all on its way
    out)."""
    idle = f"ops-idle-{services.tag}"  # a pool no worker polls
    copy = renamed_copy(tmp_path / "prefect.yaml", "-kept", pool=idle)
    names = ["grpo-pipeline/nightly-kept", "regression-eval/gate-kept"]
    proc = grpoflow(services, "deploy", "--prefect-file", str(copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [services.deployment(n)["paused"] for n in names] == [False, False]
    serving = serve_until_polling(services, copy, names, tmp_path)
    assert stop_group(serving, signal.SIGTERM) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    for name in names:
        after = services.deployment(name)
        assert after["paused"] is False, (name, (tmp_path / "serve.log").read_text()[-3000:])
        assert after["work_pool_name"] == idle, name
    assert "left active" in (tmp_path / "serve.log").read_text()


def test_serve_with_json_prints_what_it_paused_once_stopped(services, tmp_path):
    """`grpoflow serve --json` on deployments it creates: stopped by SIGTERM, it exits 0, pauses them (nobody
    runs them once it is gone) and its last stdout line is the JSON summary."""
    copy = renamed_copy(tmp_path / "prefect.yaml", "-json")
    names = ["grpo-pipeline/nightly-json", "regression-eval/gate-json"]
    serving = serve_until_polling(services, copy, names, tmp_path, "--json")
    assert stop_group(serving, signal.SIGTERM) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "serve.out").read_text().strip().splitlines()[-1])
    assert summary["deployments"] == names and summary["paused"] == names and summary["left_active"] == []
    assert summary["prefect_api_url"] == services.api
    assert [services.deployment(n)["paused"] for n in names] == [True, True]


@pytest.fixture(scope="module")
def scheduled_run(services, deployed):
    """The interval schedule's run at its anchor, run by the worker to its end. The server makes it from the
    deployment's schedule when asked (POST /deployments/{id}/schedule for the anchor, past by then, so the run
    is due at once): the run its scheduler makes for a schedule, auto-scheduled, at a time the test chooses
    rather than one it races."""
    deployment = services.deployment("grpo-pipeline/nightly")
    at = utc_iso(deployed["anchor"])
    services.request(
        "POST",
        f"/deployments/{deployment['id']}/schedule",
        {"start_time": at, "end_time": at, "min_runs": 1, "max_runs": 1},
    )
    runs = services.flow_runs(deployment["id"], scheduled=True)
    at_anchor = [
        r for r in runs if datetime.fromisoformat(r["expected_start_time"]).timestamp() == deployed["anchor"]
    ]
    assert len(at_anchor) == 1, (at, [r["expected_start_time"] for r in runs])
    return services.wait_for_final(at_anchor[0]["id"])


@pytest.fixture(scope="module")
def scheduled_version(services, scheduled_run):
    """The model version the scheduled run registered, found by its `prefect_flow_run_id` tag: the module's
    other runs register versions of their own, before or after it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=services.mlflow, registry_uri=services.mlflow)  # not the run's client
    versions = client.search_model_versions(
        f"name='grpoflow-tiny' and tags.prefect_flow_run_id = '{scheduled_run['id']}'"
    )
    assert len(versions) == 1, (scheduled_run["state"], [v.version for v in versions])
    return versions[0]


def test_a_scheduled_run_is_picked_up_by_the_worker_and_completes(services, scheduled_run):
    assert scheduled_run["state"]["type"] == "COMPLETED", (scheduled_run["state"], services.worker_log())
    assert scheduled_run["auto_scheduled"] is True  # made by the schedule, not by a person


def test_the_run_registered_a_version_with_its_lineage_on_the_mlflow_server(
    services, scheduled_version, tmp_path
):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=services.mlflow, registry_uri=services.mlflow)  # a second client
    version = scheduled_version
    for tag in ("dataset_sha256", "recipe_sha256", "checkpoint_sha256", "git_commit", "base_model"):
        assert version.tags[tag], tag
    run = client.get_run(version.run_id)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # stored by the server, not a local path
    assert version.source.startswith("mlflow-artifacts:")  # the MLflow model, stored by the server
    import mlflow

    local = (
        Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=version.source, dst_path=str(tmp_path), tracking_uri=services.mlflow
            )
        )
        / "model"
    )
    assert (local.parent / "MLmodel").is_file() and any(local.glob("*.safetensors"))
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["checkpoint_sha256"] == version.tags["checkpoint_sha256"]
    assert manifest["left_out"] == ["trainer_state.pt"] and not (local / "trainer_state.pt").exists()
    # the flow's results sit where up.sh told the worker to keep them (the storage every worker must reach)
    assert any((services.dir / "results").iterdir())


def test_a_triggered_rerun_is_served_from_cache_and_a_deleted_checkpoint_is_trained_again(
    services, scheduled_version
):
    deployment = services.deployment("grpo-pipeline/nightly")
    tag = run_tag("rerun")
    proc = prefect(services, "deployment", "run", "grpo-pipeline/nightly", "--tag", tag, "--watch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [triggered] = services.flow_runs(deployment["id"], tag=tag)
    cached = task_states(services, triggered["id"])
    assert cached["train-policy"] == "Cached" and cached["prepare-data"] == "Cached", cached

    # the one the cached train result points to: the checkpoint the scheduled run registered
    [checkpoint] = [
        c
        for c in (services.dir / "state").glob("runs/*/*/checkpoint-*")
        if read_manifest(c)["sha256"] == scheduled_version.tags["checkpoint_sha256"]
    ]
    shutil.rmtree(checkpoint)
    tag = run_tag("retrain")
    proc = prefect(services, "deployment", "run", "grpo-pipeline/nightly", "--tag", tag, "--watch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [retrained] = services.flow_runs(deployment["id"], tag=tag)
    states = task_states(services, retrained["id"])
    assert states["prepare-data"] == "Cached" and states["train-policy"] == "Completed", states
    assert checkpoint.is_dir()  # trained again, not a dead path handed on


def task_runs(services: Services, flow_run_id: str) -> dict[str, dict]:
    """Each task's run in a flow run as the Prefect API has it, by task name (the latest, for a stage run
    again)."""
    runs = services.request(
        "POST",
        "/task_runs/filter",
        {"flow_runs": {"id": {"any_": [flow_run_id]}}, "sort": "EXPECTED_START_TIME_ASC"},
    )
    return {r["name"].rsplit("-", 1)[0]: r for r in runs}


def task_states(services: Services, flow_run_id: str) -> dict[str, str]:
    """Each task's final state name in a flow run, by task name (the last attempt)."""
    return {name: r["state"]["name"] for name, r in task_runs(services, flow_run_id).items()}


# ---- the regression gate, as CI triggers it ----------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_dirs(services, scheduled_version, tmp_path_factory):
    """The EvalScope work dir of the scheduled run's evaluation (of the version it registered), as a clearly
    better and a clearly worse copy."""
    work_dir = services.dir / "state" / "eval" / f"grpoflow-tiny-v{scheduled_version.version}"
    assert (work_dir / "report.json").is_file(), sorted((services.dir / "state" / "eval").iterdir())
    root = tmp_path_factory.mktemp("scored")
    return {
        "good": scored_copy(work_dir, root / "good", BENCH, [1.0, 1.0]),
        "bad": scored_copy(work_dir, root / "bad", BENCH, [0.0, 0.0]),
    }


def gate_params(candidate: str, baseline: str, tiny_base: dict) -> list[str]:
    return [
        "--param",
        f"candidate={candidate}",
        "--param",
        f"baseline={baseline}",
        "--params",
        json.dumps({"overrides": overrides(tiny_base)}),
    ]


def test_the_gate_deployment_passes_a_model_against_itself(services, scheduled_version, tiny_base):
    model = f"models:/grpoflow-tiny/{scheduled_version.version}"
    proc = prefect(
        services,
        "deployment",
        "run",
        "regression-eval/gate",
        "--watch",
        *gate_params(model, model, tiny_base),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_gate_deployment_fails_a_clearly_worse_model_and_its_state_says_why(
    services, eval_dirs, tiny_base
):
    tag = run_tag("worse")
    proc = prefect(
        services,
        "deployment",
        "run",
        "regression-eval/gate",
        "--tag",
        tag,
        "--watch",
        *gate_params(str(eval_dirs["bad"]), str(eval_dirs["good"]), tiny_base),
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    gate = services.deployment("regression-eval/gate")
    [final] = services.flow_runs(gate["id"], tag=tag)
    assert final["state"]["type"] == "FAILED" and final["state"]["name"] == "Regression", final["state"]
    assert f"{BENCH} -1.0000" in final["state"]["message"] and "max_drop 0.02" in final["state"]["message"]


def test_serve_runs_the_files_deployments_with_their_schedules_without_a_worker(
    services, scheduled_version, tiny_base, tmp_path
):
    """`grpoflow serve` on a copy of infra/prefect.yaml whose deployments are renamed (`-served`): they appear
    on the server with the file's schedule, and a triggered gate runs in the serving process."""
    import signal

    model = f"models:/grpoflow-tiny/{scheduled_version.version}"
    spec = yaml.safe_load((REPO_ROOT / "infra" / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        d["name"] += "-served"
        d["parameters"]["overrides"] = overrides(tiny_base)
    copy = tmp_path / "prefect.yaml"
    copy.write_text(yaml.safe_dump(spec))
    log = (tmp_path / "serve.log").open("w")
    serving = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", "--prefect-file", str(copy)],
        cwd=REPO_ROOT,
        env=services.client_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                nightly = services.deployment("grpo-pipeline/nightly-served")
                gate = services.deployment("regression-eval/gate-served")
                break
            except urllib.error.HTTPError:
                assert serving.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "serve.log"
                ).read_text()
                time.sleep(1)
        assert nightly["schedules"][0]["schedule"]["cron"] == "0 2 * * *"
        assert nightly["schedules"][0]["schedule"]["timezone"] == "Europe/Paris" and gate["schedules"] == []
        proc = prefect(
            services,
            "deployment",
            "run",
            "regression-eval/gate-served",
            "--watch",
            *gate_params(model, model, tiny_base),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + (tmp_path / "serve.log").read_text()[-3000:]
        [ran] = services.flow_runs(gate["id"], scheduled=False)
        assert ran["state"]["type"] == "COMPLETED" and ran["work_pool_name"] is None  # no worker, no pool
    finally:
        stop_group(serving, signal.SIGINT)  # Prefect's serve pauses its schedules on the way out
        log.close()


def workflow_steps() -> tuple[dict, list[dict]]:
    spec = yaml.safe_load((REPO_ROOT / ".github" / "workflows" / "regression-eval.yml").read_text())
    job = spec["jobs"]["gate"]
    return job.get("env", {}), [s for s in job["steps"] if "run" in s]


def run_workflow(services: Services, tmp: Path, values: dict) -> tuple[int, str, str]:
    """The workflow's `run` steps, in order, in bash as a runner runs them, with the job's env filled from
    `values` (what the repository's secrets and variables hold) instead of GitHub's `${{ }}` expressions."""
    job_env, steps = workflow_steps()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    env.update({name: values.get(name, "") for name in job_env})  # an unset secret is an empty string there
    env.update(
        RUNNER_TEMP=str(tmp),
        GITHUB_STEP_SUMMARY=str(tmp / "summary.md"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    tmp.mkdir(parents=True)
    (tmp / "summary.md").touch()
    work = tmp / "checkout"  # the repository as a runner checks it out (links: the venv is the one made here)
    work.mkdir(parents=True)
    for entry in REPO_ROOT.iterdir():
        if entry.name not in (".git", ".state"):
            (work / entry.name).symlink_to(entry)
    failed = 0
    for step in steps:
        if step.get("if") != "always()" and failed:
            continue
        proc = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", step["run"]],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        failed = failed or proc.returncode
    return (
        failed,
        (work / "gate.json").read_text() if (work / "gate.json").exists() else "",
        (tmp / "summary.md").read_text(),
    )


def test_the_ci_workflow_passes_an_equal_candidate_and_fails_a_worse_one_with_exit_1(
    services, scheduled_version, eval_dirs, tiny_base, tmp_path
):
    job_env, steps = workflow_steps()
    assert {"MLFLOW_TRACKING_URI", "CANDIDATE", "BASELINE", "MAX_DROP", "GATE_CONFIG"} <= set(job_env)
    # the team's recipe: the evaluation settings the pipeline ran with, so that its evaluation is reused
    from trainer.recipe import load_recipe

    config = tmp_path / "team-recipe.yaml"
    config.write_text(
        yaml.safe_dump(load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", overrides(tiny_base)).to_dict())
    )
    values = {
        "MLFLOW_TRACKING_URI": services.mlflow,
        "MAX_DROP": "0.02",
        "GATE_CONFIG": str(config),
        "CANDIDATE": f"models:/grpoflow-tiny/{scheduled_version.version}",
        "BASELINE": f"models:/grpoflow-tiny/{scheduled_version.version}",
    }
    code, out, summary = run_workflow(services, tmp_path / "same", values)
    assert code == 0, out
    assert json.loads(out.strip().splitlines()[-1])["passed"] is True and BENCH in summary

    worse = {**values, "CANDIDATE": str(eval_dirs["bad"]), "BASELINE": str(eval_dirs["good"])}
    code, out, summary = run_workflow(services, tmp_path / "worse", worse)
    assert code == 1, out  # a regression, told apart from a broken check (2)
    assert json.loads(out.strip().splitlines()[-1])["passed"] is False and "FAIL" in summary.upper()

    broken = {**values, "BASELINE": "models:/no-such-model@champion"}
    code, out, _ = run_workflow(services, tmp_path / "broken", broken)
    assert code == 2, out


# ---- faults ------------------------------------------------------------------------------------------------


def test_a_run_killed_with_its_worker_is_crashed_and_a_rerun_on_a_new_worker_resumes_it(
    services, deployed, tiny_base
):
    """The worker and its flow-run process SIGKILLed mid-training (what losing the machine does: killing the
    worker alone leaves the run going on by itself, since Prefect starts each run in a session of its own).
    The heartbeat automation up.sh installs marks the run Crashed; up.sh again starts a new worker; the rerun
    resumes training from the last checkpoint: each step in metrics.jsonl once, the checkpoints before the
    kill untouched."""
    import signal

    steps = 30
    params = {
        "config": "configs/tiny-cpu.yaml",
        "overrides": overrides(tiny_base) + [f"train.max_steps={steps}", "train.save_steps=5"],
    }
    deployment = services.deployment("grpo-pipeline/nightly")
    runs_root = services.dir / "state" / "runs" / "tiny-cpu"
    before = set(runs_root.glob("*"))  # none yet when no run of the module has trained before this test
    run = services.request("POST", f"/deployments/{deployment['id']}/create_flow_run", {"parameters": params})
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (new := [d for d in runs_root.glob("*") if d not in before and (d / "checkpoint-10").is_dir()]):
        assert time.monotonic() < deadline, (
            f"no checkpoint-10 within {RUN_TIMEOUT_S} s\n{services.worker_log()}"
        )
        time.sleep(0.25)
    [out] = new
    flow_pid = int(
        str(services.request("GET", f"/flow_runs/{run['id']}")["infrastructure_pid"]).rsplit(":", 1)[-1]
    )
    run_env = environ_of(flow_pid)  # a flow run's code sees no server secret either
    assert "GRPOFLOW_PG_URL" not in run_env and "PREFECT_SERVER_API_AUTH_STRING" not in run_env
    assert not [k for k, v in run_env.items() if services.pg_password in v]
    os.kill(int((services.dir / "pids" / "worker").read_text()), signal.SIGKILL)
    os.killpg(flow_pid, signal.SIGKILL)  # the run's own session: the engine and anything it started
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("checkpoint-*")}
    assert "checkpoint-10" in kept and f"checkpoint-{steps}" not in kept

    killed_at = time.monotonic()
    crashed = services.wait_for_final(run["id"], timeout_s=300)
    print(
        f"worker and run killed after checkpoint-{max(int(n[11:]) for n in kept)}: "
        f"{crashed['state']['type']} {time.monotonic() - killed_at:.0f} s later"
    )
    assert crashed["state"]["type"] == "CRASHED", crashed["state"]
    assert "no heartbeat" in crashed["state"]["message"]

    up = subprocess.run(
        ["bash", str(SERVICES / "up.sh"), str(services.dir)],
        cwd=REPO_ROOT,
        env=services.up_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert up.returncode == 0 and "worker started" in up.stderr, up.stderr  # a new one, not the dead one
    proc = prefect(
        services, "deployment", "run", "grpo-pipeline/nightly", "--params", json.dumps(params), "--watch"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # none lost, none repeated
    for name, mtime in kept.items():  # resumed from them, not trained again from step 1
        if (out / name).is_dir():
            assert (out / name).stat().st_mtime_ns == mtime, name
    assert (out / f"checkpoint-{steps}").is_dir()


# The run whose MLflow server is stopped gets a patient MLflow client, through its own environment (Prefect's
# job variables; grpoflow keeps a value the user set): a refused connection retried for about 30 s per call
# (0, 2, 4, 8 and 16 s apart) instead of grpoflow's 2 s. The registration's three attempts (5 s, then 20 s
# apart) then span about 90 s from the first one's failure: the time up.sh has to bring MLflow back.
PATIENT_MLFLOW_CLIENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def retried(run: dict) -> bool:
    """The task run's first attempt failed: it waits for its retry, or runs it."""
    return run["run_count"] >= 2 or run["state"]["name"] in ("AwaitingRetry", "Retrying")


def test_mlflow_stopped_during_registration_and_back_within_the_retry_window_gives_one_version(
    services, deployed, tiny_base
):
    """The MLflow server SIGKILLed the moment training is done (registration starts next), and started again
    by up.sh once the registration has failed and waits for its retry (its task run's state on the Prefect
    API): a retry reaches it, and the checkpoint is one version."""
    from mlflow import MlflowClient

    params = {"config": "configs/tiny-cpu.yaml", "overrides": overrides(tiny_base) + ["train.max_steps=2"]}
    deployment = services.deployment("grpo-pipeline/nightly")
    run = services.request(
        "POST",
        f"/deployments/{deployment['id']}/create_flow_run",
        {"parameters": params, "job_variables": {"env": PATIENT_MLFLOW_CLIENT}},
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while task_states(services, run["id"]).get("train-policy") != "Completed":
        assert time.monotonic() < deadline, services.worker_log()
        time.sleep(0.05)
    os.killpg(int((services.dir / "pids" / "mlflow-server").read_text()), signal.SIGKILL)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    # MLflow stays down until the registration's first attempt has failed on it, and no longer
    while True:
        register = task_runs(services, run["id"]).get("register-checkpoint")
        if register and retried(register):
            break
        assert not (register and register["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED")), (
            f"the registration ended {register['state']['name']} at its first attempt, as if MLflow had not "
            f"been stopped\n{services.worker_log()}"
        )
        assert time.monotonic() < deadline, f"no retry of the registration\n{services.worker_log()}"
        time.sleep(0.5)
    restarting = time.monotonic()
    up = subprocess.run(
        ["bash", str(SERVICES / "up.sh"), str(services.dir)],
        cwd=REPO_ROOT,
        env=services.up_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert up.returncode == 0 and "mlflow-server started" in up.stderr, up.stderr
    restarted_s = time.monotonic() - restarting
    final = services.wait_for_final(run["id"])
    assert final["state"]["type"] == "COMPLETED", (final["state"], services.worker_log())
    register = task_runs(services, run["id"])["register-checkpoint"]
    print(
        f"MLflow killed as training ended, restarted once the registration waited for its retry (up.sh took "
        f"{restarted_s:.0f} s): registration ran {register['run_count']} times, flow run "
        f"{final['state']['name']} in {final['total_run_time']:.0f} s"
    )
    assert register["run_count"] >= 2 and register["state"]["type"] == "COMPLETED", register["state"]
    client = MlflowClient(tracking_uri=services.mlflow, registry_uri=services.mlflow)
    [version] = client.search_model_versions(
        f"name='grpoflow-tiny' and tags.prefect_flow_run_id = '{run['id']}'"
    )
    same_checkpoint = client.search_model_versions(
        f"name='grpoflow-tiny' and tags.checkpoint_sha256 = '{version.tags['checkpoint_sha256']}'"
    )
    # one version per checkpoint: the retries made no second one
    assert [v.version for v in same_checkpoint] == [version.version]


# ---- secrets and bad services ------------------------------------------------------------------------------


def test_no_secret_in_logs_flow_run_logs_or_mlflow(services, scheduled_run):
    from mlflow import MlflowClient

    secrets_ = (services.pg_password, services.auth.split(":")[1])
    for path in services.dir.rglob("*.log"):
        text = path.read_text(errors="replace")
        assert not any(s in text for s in secrets_), path
    logs = services.request(
        "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [scheduled_run["id"]]}}}
    )
    assert logs and not any(s in json.dumps(logs) for s in secrets_)
    assert not any(s in json.dumps(scheduled_run["parameters"]) for s in secrets_)
    client = MlflowClient(tracking_uri=services.mlflow)
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            dump = json.dumps({"params": run.data.params, "tags": run.data.tags})
            assert not any(s in dump for s in secrets_), run.info.run_id


def test_up_with_postgresql_refusing_fails_naming_the_masked_url_and_starts_nothing(tmp_path):
    s = Services(tmp_path, pg_password="hunter2-secret", auth="ops:x")
    port = free_port()  # nothing listens there
    env = s.up_env(GRPOFLOW_PG_URL=f"postgresql://postgres:hunter2-secret@127.0.0.1:{port}")
    proc = subprocess.run(
        ["bash", str(SERVICES / "up.sh"), str(s.dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"postgresql://postgres:***@127.0.0.1:{port}/postgres" in proc.stderr
    assert "hunter2-secret" not in proc.stdout + proc.stderr
    assert not (s.dir / "services.env").exists() and not any((s.dir / "pids").iterdir())


# ---- the GPU work pools ------------------------------------------------------------------------------------


def create_pool(services: Services, name: str, template: Path) -> subprocess.CompletedProcess:
    return prefect(
        services,
        "work-pool",
        "create",
        name,
        "--type",
        "kubernetes",
        "--base-job-template",
        str(template),
        timeout=120,
    )


def test_the_kubernetes_gpu_template_is_accepted_by_prefect_and_asks_for_eight_gpus(services, tmp_path):
    """Prefect's server stores it, its worker renders the Job it would create, and that Job is valid for the
    Kubernetes API's schema (no cluster: `tests/k8s_templates.py`)."""
    template = K8S / "gpu-pool.json"
    name = f"grpoflow-gpu-{services.tag}"
    proc = create_pool(services, name, template)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pool = services.request("GET", f"/work_pools/{name}")
    job = pool["base_job_template"]["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    [container] = job["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    variables = pool["base_job_template"]["variables"]["properties"]
    assert (
        variables["gpus"]["default"] == 8 and variables["env"]["default"]["GRPOFLOW_STATE"] == "/shared/state"
    )
    manifest = rendered_job(pool["base_job_template"], {"name": "grpoflow-gpu"}, services.api, services.auth)
    check_against_kubernetes_schema(manifest)
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["prefect", "flow-run", "execute"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # the server checks what it stores: a placeholder without its variable is refused
    broken = json.loads(template.read_text())
    del broken["variables"]["properties"]["gpus"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    proc = create_pool(services, f"{name}-broken", tmp_path / "broken.json")
    assert proc.returncode != 0 and "gpus" in proc.stdout + proc.stderr


def test_the_multi_node_template_starts_one_pod_per_node_pod_0_the_flow_the_others_joining(services):
    """infra/k8s/gpu-nodes-pool.json: stored by Prefect's server; rendered by its worker for `nodes` 3 it is
    an Indexed Job of 3 pods, each with 8 GPUs and a DNS name under the headless service (whose manifest is
    valid too); pod 0 runs the flow run's command, the others `grpoflow join` at pod 0's name. Both valid
    for the Kubernetes API's schema. (The pods' command run on two hosts: tests/test_multihost.py.)"""
    name = f"grpoflow-nodes-{services.tag}"
    proc = create_pool(services, name, K8S / "gpu-nodes-pool.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stored = services.request("GET", f"/work_pools/{name}")["base_job_template"]
    manifest = rendered_job(stored, {"name": "grpoflow-32b", "nodes": 3}, services.api, services.auth)
    check_against_kubernetes_schema(manifest)
    service = yaml.safe_load((K8S / "nodes-service.yaml").read_text())
    check_against_kubernetes_schema(service)
    spec = manifest["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == "grpoflow-nodes"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None"
    [container] = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    [script] = container["args"]
    assert container["command"] == ["/bin/sh", "-c"]
    assert "exec prefect flow-run execute" in script
    assert 'exec grpoflow join --node-rank "$JOB_COMPLETION_INDEX"' in script
    assert 'GRPOFLOW_RENDEZVOUS="$node0:29400"' in script and "${HOSTNAME%-*}-0.grpoflow-nodes" in script
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "PREFECT__FLOW_RUN_ID" in env and env["GRPOFLOW_STATE"] == "/shared/state"


def test_a_joining_node_stops_waiting_when_its_flow_run_has_ended(services):
    """`grpoflow join` (a pod other than 0 of the multi-node template) waits for node 0's rendezvous while the
    flow run lives: a flow run that failed before training (here: one the server holds as Failed) ends the
    wait with exit 2 naming the flow run and its state, long before --wait-s."""
    flow = services.request("POST", "/flows/", {"name": f"grpo-pipeline-{services.tag}"})
    run = services.request(
        "POST", "/flow_runs/", {"flow_id": flow["id"], "state": {"type": "FAILED", "name": "Failed"}}
    )
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "join",
            "--node-rank",
            "1",
            "--rendezvous",
            f"127.0.0.1:{free_port()}",
            "--wait-s",
            "600",
        ],
        cwd=REPO_ROOT,
        env=services.client_env() | {"PREFECT__FLOW_RUN_ID": run["id"]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"flow run {run['id']} ended (Failed) before its training started" in proc.stderr
    assert time.monotonic() - started < 120
    assert services.auth.split(":")[1] not in proc.stdout + proc.stderr


def test_run_with_its_postgresql_store_refusing_is_exit_2_naming_the_masked_url_and_writes_nothing(
    tmp_path, tiny_base
):
    port = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    env["MLFLOW_TRACKING_URI"] = f"postgresql://postgres:hunter2-secret@127.0.0.1:{port}/grpoflow"
    state = tmp_path / "state"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--state-dir",
            str(state),
            "--json",
            *overrides(tiny_base),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"postgresql://postgres:***@127.0.0.1:{port}/grpoflow" in proc.stderr
    assert "hunter2-secret" not in proc.stdout + proc.stderr
    written = (
        [p.relative_to(state).parts[0] for p in state.rglob("*") if p.is_file()] if state.exists() else []
    )
    assert not {"data", "runs", "eval", "mlartifacts", "mlflow.db"} & set(written), written
