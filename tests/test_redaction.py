"""Secrets: URIs and free text shown with their credentials masked, and no secret in any output, log, file,
MLflow field or database row of a pipeline run, an endpoint evaluation and comparisons.

Everything here is real: MLflow on PostgreSQL (trust auth on 127.0.0.1 accepts any password, so a password in
the tracking URI is used and harmless), the Prefect pipeline, EvalScope, and the tiny checkpoint served by
`evaluation.serving` behind a small HTTP relay that refuses requests without the endpoint's credentials.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from conftest import clean_env, grpoflow_run, loopback_http, shared
from data.redact import mask_uri, redact

PG = "127.0.0.1:5432"
PIPELINE_GUARD_S = 900  # a pipeline run that hangs fails here instead of hanging the suite


# ---- masking ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("postgresql://u:PASS@127.0.0.1:5432/db", "postgresql://u:***@127.0.0.1:5432/db"),
        ("http://user:TOKEN@host:8000/v1", "http://user:***@host:8000/v1"),
        ("https://TOKEN@host/v1", "https://***@host/v1"),
        ("http://host/v1?api_key=K&model=m", "http://host/v1?api_key=***&model=m"),
        (
            "https://h/x?X-Amz-Signature=S&sig=T&Access_Token=A&page=2",
            "https://h/x?X-Amz-Signature=***&sig=***&Access_Token=***&page=2",
        ),
        ("postgresql+psycopg2://u:pa/ss?w@h/db", "postgresql+psycopg2://u:***@h/db"),
        ("sqlite:////tmp/state/mlflow.db", "sqlite:////tmp/state/mlflow.db"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("http://u:***@h/v1?api_key=***", "http://u:***@h/v1?api_key=***"),  # idempotent
        ("models:/grpoflow-tiny@champion", "models:/grpoflow-tiny@champion"),
        ("/a/checkpoint", "/a/checkpoint"),
    ],
)
def test_mask_uri_hides_userinfo_and_secret_query_values_only(uri, shown):
    assert mask_uri(uri) == shown


def test_redact_masks_every_uri_in_free_text():
    text = (
        "MLflow at 'postgresql://u:PW1@127.0.0.1:5432/db' is unreachable (see http://a:PW2@h/v1?token=PW3), "
        "endpoint https://PW4@h/v1."
    )
    out = redact(text)
    assert not any(f"PW{i}" in out for i in range(1, 5)), out
    assert out == (
        "MLflow at 'postgresql://u:***@127.0.0.1:5432/db' is unreachable (see http://a:***@h/v1?token=***), "
        "endpoint https://***@h/v1."
    )


# ---- no secret stored: helpers ---------------------------------------------------------------------------


@pytest.fixture
def pg_database():
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    name = f"grpoflow_secrets_{secrets.token_hex(4)}"
    psql = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-c"]
    subprocess.run([*psql, f"create database {name}"], check=True, capture_output=True, timeout=60)
    yield name
    subprocess.run([*psql, f"drop database if exists {name} with (force)"], capture_output=True, timeout=60)


@contextmanager
def guarded_relay(upstream: str, user: str, password: str, query_key: str):
    """An HTTP relay on loopback to `upstream` that answers 401 unless a request carries HTTP Basic auth
    `user:password` and `?api_key=<query_key>`; yields (its base URL, the credentials each request
    carried)."""
    seen: list[dict] = []
    expected_auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def _relay(self, body: bytes | None) -> None:
            url = urlsplit(self.path)
            got = {"auth": self.headers.get("Authorization"), "api_key": parse_qs(url.query).get("api_key")}
            seen.append({"request": f"{self.command} {url.path}", **got})
            if got != {"auth": expected_auth, "api_key": [query_key]}:
                self.send_response(401)
                self.end_headers()
                return
            request = urllib.request.Request(
                upstream + url.path,
                data=body,
                method=self.command,
                headers={"Content-Type": self.headers.get("Content-Type", "")},
            )
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    request, timeout=300
                ) as r:
                    status, payload = r.status, r.read()
            except urllib.error.HTTPError as e:
                status, payload = e.code, e.read()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._relay(None)

        def do_POST(self):
            self._relay(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        def log_message(self, *args):
            pass

    with loopback_http(Handler) as server:
        yield f"http://127.0.0.1:{server.server_port}", seen


@contextmanager
def mlflow_server(root: Path):
    """A real MLflow tracking server on loopback (sqlite store, artifacts proxied into `root`); yields its
    URL."""
    import socket

    root.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'server.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=clean_env(),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    url + "/health", timeout=2
                ):
                    break
            except OSError:
                assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
                threading.Event().wait(0.5)
        else:
            raise AssertionError("the MLflow server did not answer within 120 s")
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()


def files_holding(root: Path, needles: dict[str, bytes]) -> list[str]:
    """'<path>: <secret name>' for every file under `root` whose name or bytes hold a secret."""
    found = []
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        found += [
            f"{path}: {name}"
            for name, needle in needles.items()
            if needle in data or needle in str(path).encode()
        ]
    return found


def mlflow_text(tracking_uri: str) -> str:
    """Every param, tag, metric name, artifact path, registered model and version field of the store, as
    text."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    parts = []
    for exp in client.search_experiments():
        parts.append(repr((exp.name, exp.artifact_location, exp.tags)))
        for run in client.search_runs([exp.experiment_id], max_results=1000):
            parts.append(
                repr(
                    (
                        run.info,
                        run.data.params,
                        run.data.tags,
                        sorted(run.data.metrics),
                        run.inputs.dataset_inputs if run.inputs else None,
                    )
                )
            )
            stack = [None]
            while stack:
                for item in client.list_artifacts(run.info.run_id, stack.pop()):
                    parts.append(item.path)
                    if item.is_dir:
                        stack.append(item.path)
        for logged in client.search_logged_models(
            [exp.experiment_id]
        ):  # registered versions are MLflow models
            parts.append(
                repr(
                    (
                        logged.name,
                        logged.artifact_location,
                        logged.tags,
                        logged.params,
                        [(m.key, m.value) for m in logged.metrics or []],
                    )
                )
            )
    for model in client.search_registered_models():
        parts.append(repr((model.name, model.description, model.tags, model.aliases)))
        for mv in client.search_model_versions(f"name='{model.name}'"):
            parts.append(repr((mv.version, mv.source, mv.run_id, mv.run_link, mv.description, mv.tags)))
    return "\n".join(parts)


# ---- no secret in any output -------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_secret_in_any_output_log_artifact_param_or_tag_of_a_run_and_an_endpoint_eval(
    tiny_base, tmp_path, pg_database
):
    """The pipeline on MLflow/PostgreSQL with a password in MLFLOW_TRACKING_URI, then `eval` of the tiny model
    served behind an endpoint whose URL has user:TOKEN userinfo and ?api_key=..., with --api-key-env, then
    `compare` and a failing `eval`, then `compare` on an MLflow server whose URL has a password: no output,
    file, MLflow field or database row holds a secret, and the endpoint still received its credentials."""
    from evaluation.serving import served_model

    suffix = secrets.token_hex(6)
    secret = {
        "pg_password": f"PgPass{suffix}",
        "url_token": f"UrlToken{suffix}",
        "query_key": f"QueryKey{suffix}",
        "api_key": f"EnvKey{suffix}",
    }
    needles = {name: value.encode() for name, value in secret.items()}
    needles["basic_auth"] = base64.b64encode(f"evaluser:{secret['url_token']}".encode())
    tracking_uri = f"postgresql://postgres:{secret['pg_password']}@{PG}/{pg_database}"
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    env = {"MLFLOW_TRACKING_URI": tracking_uri, "H2_ENDPOINT_KEY": secret["api_key"]}
    aime24 = str(shared("aime24"))
    evals = [
        "eval.benchmarks=[aime24]",
        f"eval.local_paths={{aime24: {aime24}}}",
        "eval.limit=1",
        "eval.max_tokens=16",
    ]
    outputs = []

    run = grpoflow_run(
        "run",
        "--state-dir",
        str(state),
        "--json",
        f"model.name_or_path={tiny_base['path']}",
        "data.synthetic_rows=600",
        "train.max_steps=2",
        "train.save_steps=2",
        "train.eval_heldout=16",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *evals,
        cwd=cwd,
        env=env,
        timeout=PIPELINE_GUARD_S,
    )
    outputs += [run.stdout, run.stderr]
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["tracking_uri"] == f"postgresql://postgres:***@{PG}/{pg_database}"
    assert summary["state"]["tracking_uri"] == summary["tracking_uri"]

    with (
        served_model(tiny_base["path"], max_batch_size=8) as served,
        guarded_relay(
            served.url.removesuffix("/v1"), "evaluser", secret["url_token"], secret["query_key"]
        ) as (relay, seen),
    ):
        endpoint = (
            f"http://evaluser:{secret['url_token']}@{relay.removeprefix('http://')}"
            f"/v1?api_key={secret['query_key']}"
        )
        ev = grpoflow_run(
            "eval",
            endpoint,
            "--served-model-name",
            served.model_name,
            "--api-key-env",
            "H2_ENDPOINT_KEY",
            "--concurrency",
            "2",
            "--state-dir",
            str(state),
            "--json",
            *evals,
            cwd=cwd,
            env=env,
            timeout=PIPELINE_GUARD_S,
        )
    outputs += [ev.stdout, ev.stderr]
    assert ev.returncode == 0, ev.stderr[-4000:]
    evaluated = json.loads(ev.stdout.strip().splitlines()[-1])
    assert evaluated["model"] == f"http://evaluser:***@{relay.removeprefix('http://')}/v1?api_key=***"
    assert evaluated["num_samples"] == {"aime24": 1}
    # every generation request carried the endpoint's credentials (a reachability probe carries none)
    generations = [s for s in seen if s["request"] == "POST /v1/chat/completions"]
    assert generations and all(
        s
        == {
            "request": "POST /v1/chat/completions",
            "auth": "Basic " + needles["basic_auth"].decode(),
            "api_key": [secret["query_key"]],
        }
        for s in generations
    ), seen
    assert Path(evaluated["work_dir"]).is_relative_to(state)

    cmp = grpoflow_run(
        "compare",
        summary["eval_report"],
        evaluated["report"],
        "--state-dir",
        str(state),
        "--json",
        *evals,
        cwd=cwd,
        env=env,
        timeout=PIPELINE_GUARD_S,
    )
    outputs += [cmp.stdout, cmp.stderr]
    assert cmp.returncode == 0, cmp.stderr[-4000:]
    assert json.loads(cmp.stdout.strip().splitlines()[-1])["tracking_uri"].startswith(
        "postgresql://postgres:***@"
    )

    missing = grpoflow_run(
        "eval",
        "models:/no-such-model@champion",
        "--state-dir",
        str(state),
        "--json",
        *evals,
        cwd=cwd,
        env=env,
        timeout=PIPELINE_GUARD_S,
    )
    outputs += [missing.stdout, missing.stderr]
    assert missing.returncode != 0, missing.stderr[-4000:]
    assert f"postgresql://postgres:***@{PG}/{pg_database}" in missing.stderr  # named, masked

    # the same against a tracking server whose URL carries a password (MLflow prints run URLs on stdout)
    secret["http_password"] = f"HttpPass{suffix}"
    needles["http_password"] = secret["http_password"].encode()
    with mlflow_server(tmp_path / "server") as server:
        http_uri = server.replace("http://", f"http://tracker:{secret['http_password']}@")
        cmp = grpoflow_run(
            "compare",
            summary["eval_report"],
            evaluated["report"],
            "--state-dir",
            str(state),
            "--json",
            *evals,
            cwd=cwd,
            env={**env, "MLFLOW_TRACKING_URI": http_uri},
            timeout=PIPELINE_GUARD_S,
        )
        outputs += [cmp.stdout, cmp.stderr]
        assert cmp.returncode == 0, cmp.stderr[-4000:]
        assert json.loads(cmp.stdout.strip().splitlines()[-1])["tracking_uri"] == server.replace(
            "http://", "http://tracker:***@"
        )
        store_text = mlflow_text(server)
    leaks = [f"tracking server: {name}" for name, needle in needles.items() if needle.decode() in store_text]
    leaks += files_holding(tmp_path / "server", needles)

    leaks += [
        f"output {i}: {name}"
        for i, text in enumerate(outputs)
        for name, needle in needles.items()
        if needle.decode() in text
    ]
    leaks += files_holding(state, needles) + files_holding(cwd, needles)
    store = mlflow_text(tracking_uri)
    leaks += [f"MLflow: {name}" for name, needle in needles.items() if needle.decode() in store]
    dump = subprocess.run(
        ["pg_dump", "-h", "127.0.0.1", "-U", "postgres", pg_database],
        capture_output=True,
        timeout=120,
        check=True,
    ).stdout
    leaks += [f"database: {name}" for name, needle in needles.items() if needle in dump]
    assert not leaks, "\n".join(leaks)
    assert "endpoint" not in store or "***" in store  # the eval run is there, its model tag masked
    assert list(cwd.iterdir()) == []  # and nothing was written in the working directory
