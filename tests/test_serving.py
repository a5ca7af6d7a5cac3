"""Serving a checkpoint: the transformers server in a real subprocess on loopback, called with the real
`openai` client; `grpoflow serve-model` and `grpoflow eval --serve` as a user runs them.

vLLM cannot run here (no GPU, not installed): its adapter is checked against a fake `vllm` module that
only records its command line and answers `/health`; the test says so in its name.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memorised_model import completion, eval_overrides, evaluated_problems, reviews, text_of
from paced_model import Pace

from conftest import REPO_ROOT, shared
from evaluation import load_result
from evaluation.serving import ServerLimits, ServingInputError, get_json, served_model
from evaluation.serving.guards import api_key_from_env

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]


def grpoflow(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO_ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def ready_line(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    """The first stdout line of a `serve-model --json` process (its ready announcement)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not (box and box[0].strip()):
        proc.kill()  # its stderr ends only with it: read while it runs, the failure would hang instead
        raise AssertionError(f"no ready line within {timeout_s} s; stderr:\n{proc.communicate()[1]}")
    return json.loads(box[0])


@contextmanager
def serve_cli(*args: str, env=None):
    """`grpoflow serve-model ... --json` as a user runs it; yields (its process, its ready line)."""
    proc = grpoflow("serve-model", *args, "--json", env=env)
    try:
        yield proc, ready_line(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def stop_cleanly(proc: subprocess.Popen, sig: int) -> dict:
    """Send `sig`; the server must exit 0 and print its summary as the last line."""
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server(tiny_base):
    with served_model(tiny_base["path"], max_batch_size=8) as served:
        yield served
    assert served.process.returncode == 0, "the server did not shut down cleanly on SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_engine(tiny_base):
    """The same checkpoint in this process, as the trainer's HFEngine sees it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.rollout.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_base["path"])
    return HFEngine(AutoModelForCausalLM.from_pretrained(tiny_base["path"]), tokenizer), tokenizer


def test_models_and_health(server, client):
    assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
    assert [m.id for m in client.models.list().data] == [server.model_name] == ["tiny-base"]
    health = server.health()
    assert health["status"] == "ok" and health["engine"] == "transformers"
    assert {"batches", "requests"} <= set(health)


def test_greedy_is_deterministic_and_equals_hf_engine(server, client, local_engine):
    from trainer.prompts import encode_prompts
    from trainer.rollout.base import SamplingParams

    replies = [
        client.chat.completions.create(
            model=server.model_name, messages=QUESTION, max_tokens=32, temperature=0
        )
        for _ in range(2)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    engine, tokenizer = local_engine
    [prompt] = encode_prompts(tokenizer, [{"prompt": QUESTION}])
    [[expected]] = engine.generate([prompt], 1, SamplingParams(max_tokens=32, temperature=0.0))
    choice, usage = replies[0].choices[0], replies[0].usage
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_samples_and_their_usage(server, client, local_engine):
    _, tokenizer = local_engine
    reply = client.chat.completions.create(
        model=server.model_name, messages=QUESTION, max_tokens=24, temperature=1.0, top_p=0.95, n=3, seed=7
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.message.role == "assistant" for c in reply.choices)
    # completion tokens are summed over the choices; each choice is at most max_tokens long
    assert 3 <= reply.usage.completion_tokens <= 3 * 24
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    again = client.chat.completions.create(
        model=server.model_name, messages=QUESTION, max_tokens=24, temperature=1.0, top_p=0.95, n=3, seed=7
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_completions_with_stop_and_errors(server, client):
    import openai

    reply = client.completions.create(
        model=server.model_name, prompt=["<think>", "1+1"], max_tokens=16, temperature=0, stop=["</think>"]
    )
    assert len(reply.choices) == 2 and all("</think>" not in c.text for c in reply.choices)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other-model", messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=server.model_name, messages=[], max_tokens=4)


def test_concurrent_requests_are_batched(server, client, local_engine):
    from trainer.prompts import encode_prompts
    from trainer.rollout.base import SamplingParams

    before = server.health()
    start = threading.Barrier(8)
    replies, errors = {}, []
    # 1 to 3 digits: prompts of different lengths, padded to share a batch
    questions = [[{"role": "user", "content": f"What is {10 ** (i % 3) + i} + 5?"}] for i in range(8)]

    def ask(i: int) -> None:
        start.wait()
        try:
            replies[i] = client.chat.completions.create(
                model=server.model_name, messages=questions[i], max_tokens=16, temperature=0
            )
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(replies) == 8
    after = server.health()
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == 8 and 1 <= batches < requests
    # batched or not, each answer is the one the same checkpoint gives that question alone, greedily, in this
    # process
    engine, tokenizer = local_engine
    for i, question in enumerate(questions):
        [[alone]] = engine.generate(
            encode_prompts(tokenizer, [{"prompt": question}]),
            1,
            SamplingParams(max_tokens=16, temperature=0.0),
        )
        assert replies[i].choices[0].message.content == alone.text and alone.text


def test_vllm_without_vllm_names_the_vllm_extra(tiny_base):
    if _has_vllm():
        pytest.skip("vLLM is installed here")
    with pytest.raises(ServingInputError, match=r"pip install \.\[vllm\]"):
        with served_model(tiny_base["path"], engine="vllm"):
            pass
    proc = grpoflow("serve-model", tiny_base["path"], "--engine", "vllm", "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "pip install .[vllm]" in err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2


def test_a_server_dying_at_start_is_reported_with_the_checkpoint(tiny_base, tmp_path):
    broken = tmp_path / "broken-ckpt"
    shutil.copytree(tiny_base["path"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code") as info:
        with served_model(broken, startup_timeout_s=90):
            pass
    assert str(broken) in str(info.value) and "stderr" in str(info.value)
    assert time.monotonic() - started < 90


def test_serve_model_cli_prints_its_url_and_stops_cleanly_on_sigint(tiny_base):
    with serve_cli(tiny_base["path"], "--served-model-name", "tiny") as (proc, ready):
        assert set(ready) == {"url", "model", "pid", "engine"} and ready["pid"] == proc.pid
        assert ready["model"] == "tiny" and ready["engine"] == "transformers"
        assert get_json(ready["url"] + "/models")["data"][0]["id"] == "tiny"
        assert stop_cleanly(proc, signal.SIGINT) == {**ready, "batches": 0, "requests": 0}


def test_eval_serve_scores_through_the_endpoint_like_a_direct_run(memorising_model, memorised_eval, tmp_path):
    """`grpoflow eval --serve` on the memorising model, with the settings of the session's direct evaluation
    of it (`memorised_model.eval_overrides`): the same verdict on every problem, and the same answers where it
    knows them."""
    proc = grpoflow(
        "eval",
        memorising_model,
        *eval_overrides(shared()),
        f"eval.out={tmp_path / 'eval'}",
        f"data.out={tmp_path / 'no-prepared-data'}",
        "--serve",
        "--concurrency",
        "4",
        "--state-dir",
        str(tmp_path / "state"),
        "--json",
    )
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    served = json.loads(out.strip().splitlines()[-1])
    assert served["served_by"] == "transformers" and served["num_samples"] == memorised_eval.num_samples
    assert served["scores"] == memorised_eval.scores == {"math_500": 0.4, "aime24": 0.5}
    report = json.loads(open(served["report"]).read())
    assert report["eval_type"] == "openai_api" and report["model"] == "memorising"
    assert report["api_url"].startswith("http://127.0.0.1:") and report["eval_batch_size"] == 4

    through_endpoint, direct = reviews(load_result(served["work_dir"])), reviews(memorised_eval)
    assert {k: r["sample_score"]["score"]["value"] for k, r in through_endpoint.items()} == {
        k: r["sample_score"]["score"]["value"] for k, r in direct.items()
    }
    for p in evaluated_problems(shared()):
        if p.memorised:
            answers = {text_of(r[p.benchmark, p.key]["messages"][-1]) for r in (through_endpoint, direct)}
            assert answers == {completion(p.answer)}


# ---- connections and the API key: a server as `serve-model --max-connections 16 --api-key-env` -------------
# The key is given as a file's content reads: with a trailing newline. Every client here is 127.0.0.1, one
# client address, whose default share is a quarter of the 16 connections; 127.0.0.2 is another client.

KEY_VAR, KEY = "GRPOFLOW_TEST_SERVING_KEY", "sk-serving-5b7e0c93d1a2"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS, PER_CLIENT = 16, 4
QUESTION_TEXT = {"prompt": "1+1", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def keyed_server(tiny_base, tmp_path_factory):
    """(port, stderr path) of `grpoflow serve-model --max-connections 16 --api-key-env VAR` (VAR = key +
    newline)."""
    err_path = tmp_path_factory.mktemp("keyed-server") / "stderr.log"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "serve-model",
                tiny_base["path"],
                "--json",
                "--api-key-env",
                KEY_VAR,
                "--max-connections",
                str(MAX_CONNECTIONS),
            ],
            cwd=REPO_ROOT,
            text=True,
            env={**os.environ, KEY_VAR: KEY + "\n"},
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        ready = ready_line(proc, timeout_s=180)
        yield int(ready["url"].rsplit(":", 1)[1].removesuffix("/v1")), err_path
        assert proc.poll() is None, f"the server died during the tests:\n{err_path.read_text()[-3000:]}"
        assert stop_cleanly(proc, signal.SIGTERM)["engine"] == "transformers"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def call(
    port: int,
    method: str,
    path: str,
    body: dict | None = None,
    headers: dict | None = None,
    source: str | None = None,
) -> tuple[int, bytes]:
    """(status, body) of one request on its own connection, from the address `source` if given."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=60, source_address=(source, 0) if source else None
    )
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` (a read returns EOF, not data) within `within_s` seconds."""
    if not select.select([sock], [], [], within_s)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_a_key_read_with_its_trailing_newline_is_accepted_and_others_refused(keyed_server):
    port, err = keyed_server
    assert call(port, "GET", "/v1/models", headers=AUTH)[0] == 200
    status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
    for wrong in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
    ):
        status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, wrong)
        assert status == 401 and json.loads(body)["error"]["param"] == "authorization", (wrong, body)
    assert KEY not in err.read_text()


def test_the_bearer_scheme_is_case_insensitive(keyed_server):
    port, _ = keyed_server
    for scheme in ("bearer", "BEARER", "bEaReR"):
        status, body = call(
            port, "POST", "/v1/completions", QUESTION_TEXT, {"Authorization": f"{scheme} {KEY}"}
        )
        assert status == 200, (scheme, body)


def test_the_docs_and_the_schema_need_the_key(keyed_server):
    port, _ = keyed_server
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert call(port, "GET", path)[0] == 401, path
        assert call(port, "GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401, path
        status, body = call(port, "GET", path, headers=AUTH)
        assert status == 200, path
    assert "/v1/completions" in json.loads(call(port, "GET", "/openapi.json", headers=AUTH)[1])["paths"]
    assert call(port, "GET", "/health")[0] == 200  # open, for probes


def test_idle_connections_holding_every_slot_do_not_shut_out_health_or_a_completion(keyed_server):
    """16 silent sockets, as many as --max-connections: a new request closes the one idle longest."""
    port, _ = keyed_server
    with ExitStack() as stack:
        idle = [
            stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30))
            for _ in range(MAX_CONNECTIONS)
        ]
        status, body = call(port, "GET", "/health")
        assert status == 200, body
        status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH)
        assert status == 200, body
        # one client holds at most its share: each idle socket over it was closed for the next one
        closed, end = set(), time.monotonic() + 10
        while len(closed) < MAX_CONNECTIONS - PER_CLIENT and time.monotonic() < end:
            for sock in select.select([s for s in idle if s not in closed], [], [], 0.1)[0]:
                if closed_by_server(sock, within_s=0):
                    closed.add(sock)
        assert len(closed) >= MAX_CONNECTIONS - PER_CLIENT, f"{len(closed)} of the idle sockets were closed"


def test_a_client_at_its_connection_share_gets_503_and_another_client_is_served(keyed_server):
    """127.0.0.1 holds its 4 connections with requests in progress (uploads it has not finished): its 5th
    request gets 503 naming --max-connections-per-client; /health still answers it; 127.0.0.2 is served."""
    port, _ = keyed_server
    with ExitStack() as stack:
        for _ in range(PER_CLIENT):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30))
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n"
                "Expect: 100-continue\r\n\r\n".encode()
            )
            # the 100 Continue says the server is reading its body: a request in progress
            assert sock.recv(4096).startswith(b"HTTP/1.1 100"), "the upload did not start"
        status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH)
        assert status == 503, body
        assert "--max-connections-per-client" in json.loads(body)["error"]["message"]
        assert call(port, "GET", "/health")[0] == 200
        status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH, source="127.0.0.2")
        assert status == 200, body
    # its uploads abandoned, the client gets its share back
    end = time.monotonic() + 30
    while (
        status := call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH)[0]
    ) == 503 and time.monotonic() < end:
        time.sleep(0.1)
    assert status == 200


def test_a_connection_that_never_completes_its_headers_is_closed_after_the_header_timeout(keyed_server):
    """The default --header-timeout (10 s), counted from the connection's opening: a silent socket and one
    sending a header line every half second are both closed; a server without the timeout keeps them for
    good."""
    port, _ = keyed_server
    default = 10.0  # --header-timeout
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as silent,
        socket.create_connection(("127.0.0.1", port), timeout=30) as dripping,
    ):
        opened = time.monotonic()
        dripping.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        while not answered(dripping) and time.monotonic() - opened < default + 15:
            try:
                dripping.sendall(b"X-Slow: 1\r\n")
            except OSError:  # closed under us
                break
            time.sleep(0.5)
        assert closed_by_server(dripping, within_s=1), "a dripping header stayed open"
        assert closed_by_server(silent, within_s=max(0.0, default + 15 - (time.monotonic() - opened)))
    assert call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH)[0] == 200


def test_an_api_key_is_read_without_surrounding_whitespace(monkeypatch):
    monkeypatch.setenv(KEY_VAR, f"  {KEY}\r\n")
    assert api_key_from_env(KEY_VAR) == KEY
    for unusable in (" \n", f"{KEY[:4]}\x07{KEY[4:]}"):
        monkeypatch.setenv(KEY_VAR, unusable)
        with pytest.raises(ServingInputError, match=KEY_VAR):
            api_key_from_env(KEY_VAR)


def test_connection_limits_are_checked_and_a_client_share_defaults_to_a_quarter():
    assert ServerLimits(max_connections=16).connections_per_client == PER_CLIENT
    with pytest.raises(
        ServingInputError,
        match=r"--max-connections-per-client \(32\) cannot exceed "
        r"--max-connections \(16\)",
    ):
        ServerLimits(max_connections=16, max_connections_per_client=32)
    for field, flag in (
        ("header_timeout_s", "--header-timeout"),
        ("body_timeout_s", "--body-timeout"),
        ("keep_alive_timeout_s", "--keep-alive-timeout"),
    ):
        with pytest.raises(ServingInputError, match=flag):
            ServerLimits(**{field: 0.0})


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ==========================================================================================================
# `grpoflow serve-model` under a careless or hostile client
# ==========================================================================================================
# Over real HTTP on loopback, with small limits. Ordering is asserted, never a duration: "the small request
# completed while the big one was still being generated", "/health answered while the big body was being
# handled". Where an ordering would be a race with the CPU's speed, the test paces the model
# (tests/paced_model.py): it holds the forward passes, or the tokenizer calls of request handling, at a gate
# and lets them through when its ordering is set up, so the ordering holds on any machine. KEY_VAR, KEY and
# AUTH are the ones above.

# a big request: 32 sampled completions of 1000 tokens (ignore_eos: EOS cannot end it early), 1000 forward
# passes; the tests that send it hold its generation long before its end
BIG = {"prompt": "1+1", "n": 32, "max_tokens": 1000, "temperature": 2.0, "seed": 1, "ignore_eos": True}
# a request whose generation is the same on every call (greedy, EOS ignored): the forward passes the server
# runs while it answers it are its own when nothing else is being generated
WITNESS = {"prompt": "1+1", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def grpoflow_serve(
    *args: str, env: dict | None = None, pace: Pace | None = None, **kwargs
) -> subprocess.Popen:
    """`grpoflow ARGS`; with `pace`, in a process whose model the test paces."""
    return subprocess.Popen(
        pace.command(*args) if pace else [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO_ROOT,
        text=True,
        env={**os.environ, **(env or {})},
        **kwargs,
    )


@contextmanager
def served(model: str, tmp: Path, *flags: str, pace: Pace | None = None):
    """`grpoflow serve-model MODEL --json FLAGS` with its stderr in a file, its model paced by `pace` if
    given; yields (port, stderr path, process)."""
    err_path = tmp / "server.stderr"
    with open(err_path, "w") as err:
        proc = grpoflow_serve(
            "serve-model",
            model,
            "--json",
            "--api-key-env",
            KEY_VAR,
            *flags,
            env={KEY_VAR: KEY},
            pace=pace,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(180)
        assert box and box[0].strip(), f"no ready line; stderr:\n{err_path.read_text()}"
        yield int(json.loads(box[0])["url"].rsplit(":", 1)[1].removesuffix("/v1")), err_path, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def call_json(
    port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 300
):
    """(status, parsed JSON body) of one request on its own connection; `body` may be raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def health(port: int) -> dict:
    status, body = call_json(port, "GET", "/health", timeout=60)
    assert status == 200
    return body


def wait_for(port: int, condition, what: str, bound_s: float = 120) -> dict:
    """Poll /health until `condition(health)` holds (the bound only keeps a broken server from hanging CI)."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        state = health(port)
        if condition(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"{what}: never happened; last /health: {state}")


def raw_request(port: int, path: str, body: dict, headers: dict = AUTH) -> socket.socket:
    """Send a request on a raw socket and leave it unanswered (the caller reads or closes it)."""
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{head}"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the HTTP response on a raw socket."""
    sock.settimeout(300)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of a response"
        body += chunk
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="module")
def limited_pace(tmp_path_factory) -> Pace:
    """The gates of `limited_server`'s model: open, unless a test holds them."""
    return Pace(tmp_path_factory.mktemp("limited-pace"))


@pytest.fixture(scope="module")
def limited_server(tiny_base, tmp_path_factory, limited_pace):
    """A server with small limits, so that each is easy to cross; its model is paced by the tests that
    need an ordering (`limited_pace`)."""
    with served(
        tiny_base["path"],
        tmp_path_factory.mktemp("server"),
        "--max-sequences",
        "32",
        "--max-tokens",
        "1000",
        "--max-stop",
        "4",
        "--max-stop-length",
        "16",
        "--max-body-bytes",
        "100000",
        pace=limited_pace,
    ) as (port, err, proc):
        yield port, err
        assert proc.poll() is None, "the server died during the tests"
    assert KEY not in err.read_text(), "the API key was written to the server's log"


# ---- limits and client errors: 400 naming the field, never 500 ---------------------------------------------

TOO_MUCH = {
    "n": ("/v1/completions", {"prompt": ["1+1"] * 8, "n": 8, "max_tokens": 4}),  # 64 completions > 32
    "max_tokens": ("/v1/completions", {"prompt": "1+1", "max_tokens": 1001}),
    "stop": ("/v1/completions", {"prompt": "1+1", "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]}),
    "prompt": ("/v1/completions", {"prompt": ["1+1"] * 33, "max_tokens": 4}),
}
# malformed inputs: each is a 400 naming its field, never a 500 or a crashed generation
MALFORMED = {
    "seed": ("/v1/completions", {"prompt": "1+1", "max_tokens": 2, "temperature": 1.0, "seed": 2**70}),
    "body": ("/v1/completions", b"[" * 40_000 + b"]" * 40_000),  # nested deeper than the JSON decoder goes
    "top_p": ("/v1/completions", b'{"prompt": "1+1", "max_tokens": 2, "top_p": NaN}'),
    "temperature": ("/v1/completions", b'{"prompt": "1+1", "max_tokens": 2, "temperature": Infinity}'),
}


@pytest.mark.parametrize("field", [*TOO_MUCH, *MALFORMED])
def test_limits_and_bad_fields_are_400_naming_the_field(limited_server, field):
    port, _ = limited_server
    path, body = {**TOO_MUCH, **MALFORMED}[field]
    status, reply = call_json(port, "POST", path, body, AUTH)
    assert status == 400, reply
    assert reply["error"]["param"] == field and reply["error"]["message"].startswith(field), reply


# Generated request fields: every field the server reads, set to values at and past the edges of its type
# (tiny, huge, negative, non-finite, wrong type, text that is no character); the rest of the body stays a
# cheap valid request (2 tokens). The answer is 200, or a 4xx naming one of the fields set, never a 5xx.
_NUMBERS = st.one_of(
    st.sampled_from([0, -1, 1, 2, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, 10**400]),
    st.integers(),
    st.floats(),  # NaN and infinities included, sent as JSON's NaN / Infinity
    st.sampled_from([0.0, -0.0, 5e-324, 1e-5, 1e-300, 1e300, 1.7976931348623157e308, 0.5, 1.0, 1.0000001]),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    _NUMBERS,
    st.text(max_size=12),
    st.sampled_from(["", "1", "\ud800", "\x00", "x" * 50_000]),
)
_VALUES = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=3),
    st.lists(st.lists(st.integers(), max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=4), _SCALARS, max_size=2),
)
_MESSAGES = st.one_of(
    _VALUES,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "assistant"]), _SCALARS), "content": _VALUES}
        ),
        max_size=3,
    ),
)
_SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed", "stop", "stream")
_ENDPOINTS = {
    "/v1/completions": ({"prompt": "1+1"}, ("prompt", *_SAMPLING, "ignore_eos", "model")),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "1+1"}]},
        ("messages", *_SAMPLING, "ignore_eos", "model"),
    ),
}


def _cheap(body: dict) -> dict:
    """A valid mid-range token budget is no edge: it becomes 2 tokens, so that an example costs little."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and 2 < value <= 1000:
            body[name] = 2
    return body


@pytest.mark.parametrize("path", list(_ENDPOINTS))
@settings(max_examples=150)
@given(data=st.data())
def test_generated_request_fields_get_200_or_a_4xx_naming_the_field(limited_server, path, data):
    port, _ = limited_server
    base, fields = _ENDPOINTS[path]
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True), "fields")
    body = {**base, "max_tokens": 2, "max_completion_tokens": 2}
    for name in chosen:
        body[name] = data.draw(_MESSAGES if name == "messages" else _VALUES, name)
    raw = json.dumps(_cheap(body), allow_nan=True).encode()
    status, reply = call_json(port, "POST", path, raw, AUTH)
    assert status == 200 or 400 <= status < 500, (status, reply)
    if status != 200:
        param = reply["error"]["param"]
        assert param in chosen or (status == 413 and param == "body"), reply
        assert param in reply["error"]["message"], reply


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "prompt", "1+1 \ud800"),
        ("/v1/completions", "model", "\udfff"),
        ("/v1/completions", "stop", ["\ud800"]),
        ("/v1/chat/completions", "messages", [{"role": "user", "content": "\ud800"}]),
    ],
)
def test_text_with_a_lone_surrogate_escape_is_400_naming_its_field(limited_server, path, field, value):
    """JSON's `\\ud800` escape is valid JSON but no character: refused where it is read, not a 500 from the
    tokenizer or from writing the reply."""
    port, _ = limited_server
    base = _ENDPOINTS[path][0]
    status, reply = call_json(port, "POST", path, {**base, "max_tokens": 2, field: value}, AUTH)
    assert status == 400 and reply["error"]["param"] == field, (status, reply)
    assert "unpaired surrogate" in reply["error"]["message"], reply


def test_a_stop_string_over_the_length_limit_and_a_prompt_filling_the_context_are_400(limited_server):
    port, _ = limited_server
    status, reply = call_json(port, "POST", "/v1/completions", {"prompt": "1+1", "stop": ["x" * 17]}, AUTH)
    assert status == 400 and reply["error"]["param"] == "stop"
    assert "--max-stop-length" in reply["error"]["message"]
    # a prompt as long as the context, without max_tokens: no room left to generate
    status, reply = call_json(port, "POST", "/v1/completions", {"prompt": [5] * 1024}, AUTH)
    assert status == 400 and reply["error"]["param"] == "prompt" and "1024" in reply["error"]["message"]
    # a temperature too small to divide by is greedy, as in vLLM (not NaN probabilities)
    greedy = {"prompt": "1+1", "max_tokens": 6}
    status, tiny_t = call_json(port, "POST", "/v1/completions", {**greedy, "temperature": 1e-40}, AUTH)
    assert status == 200, tiny_t
    _, greedy_reply = call_json(port, "POST", "/v1/completions", {**greedy, "temperature": 0}, AUTH)
    assert tiny_t["choices"][0]["text"] == greedy_reply["choices"][0]["text"]


def test_an_oversized_body_is_refused_before_it_is_read(limited_server):
    port, _ = limited_server
    # a 1.2 MB body announced: the headers alone get the answer, no byte of the body is sent
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1200000\r\n\r\n".encode()
        )
        status, reply = read_response(sock)
    assert status == 413 and reply["error"]["param"] == "body", reply
    assert "1200000 bytes" in reply["error"]["message"] and "--max-body-bytes" in reply["error"]["message"]
    # without a Content-Length (chunked), the count stops at the limit: 60 kB sent, then 60 kB more
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        for _ in range(2):
            assert not answered(sock)
            sock.sendall(b"%x\r\n%s\r\n" % (60_000, b"x" * 60_000))
        status, reply = read_response(sock)
    assert status == 413 and "over 100000 bytes" in reply["error"]["message"]
    assert health(port)["status"] == "ok"


# ---- scheduling: fairness, cancellation ---------------------------------------------------------------


def forwards_of_witness(port: int, pace: Pace) -> int:
    """The forward passes the server runs while it answers WITNESS."""
    before = pace.entered("forward")
    status, reply = call_json(port, "POST", "/v1/completions", WITNESS, AUTH)
    assert status == 200, reply
    return pace.entered("forward") - before


def test_a_small_request_completes_while_a_big_one_is_still_generated(limited_server, limited_pace):
    """The model is paced by the test: the big request is held at its first decoding step until the small
    one is queued, then the forward passes go through one at a time until the small one is answered, so
    the big one is still far from its 1000 tokens then, however fast the CPU generates."""
    port, _ = limited_server
    pace, before = limited_pace, health(port)
    small_request = {"prompt": "2+2", "max_tokens": 8, "temperature": 0}
    with pace.holding("forward", passing=1), raw_request(port, "/v1/completions", BIG) as big:
        pace.wait_held("forward", "the big request's first decoding step", answered=lambda: answered(big))
        assert health(port)["active"] == before["active"] + 1
        with raw_request(port, "/v1/completions", small_request) as small:
            wait_for(port, lambda h: h["waiting"] == before["waiting"] + 1, "the small request was queued")
            let_through = pace.step_until("forward", lambda: answered(small), "the small request's answer")
            status, reply = read_response(small)
        assert status == 200 and reply["usage"]["completion_tokens"] <= 8
        # the big one has not answered yet and is still being generated (held at the gate)
        assert let_through < 1000 and not answered(big)
        assert health(port)["active"] == before["active"] + 1
    # closing its connection cancels it (next test: that it stops)
    wait_for(port, lambda h: h["active"] == before["active"], "the big request stopped after its client left")


def test_a_disconnected_client_stops_its_generation(limited_server, limited_pace):
    """The model is paced by the test: the big request is held at its first decoding step while its client
    leaves, then its forward passes go through one at a time until the server stops it, so a fast CPU
    cannot finish it first; the forward passes are counted to show that none follow."""
    port, err = limited_server
    pace = limited_pace
    alone = forwards_of_witness(port, pace)
    before = health(port)
    with pace.holding("forward", passing=1):
        with raw_request(port, "/v1/completions", {**BIG, "seed": 2}) as big:
            pace.wait_held("forward", "the big request's first decoding step", answered=lambda: answered(big))
            assert health(port)["active"] == before["active"] + 1
        pace.step_until(
            "forward",
            lambda: health(port)["active"] == before["active"],
            "the generation of the disconnected request stopped",
        )
    after = health(port)
    assert after["requests"] == before["requests"], "the disconnected request was generated to the end"
    assert after["cancelled"] == before["cancelled"] + 1
    stopped = re.findall(
        r"cmpl-\w+: the client disconnected; its generation stopped after (\d+) of 1000 "
        r"tokens",
        err.read_text(),
    )
    assert stopped and int(stopped[-1]) < 1000
    assert forwards_of_witness(port, pace) == alone, "the disconnected request is still being generated"


def test_the_api_key_is_required_on_v1_and_health_stays_open(limited_server):
    port, _ = limited_server
    question = {"prompt": "1+1", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert call_json(port, "GET", "/v1/models", headers=headers)[0] == 401
        status, reply = call_json(port, "POST", "/v1/completions", question, headers)
        assert status == 401 and reply["error"]["param"] == "authorization"
    assert call_json(port, "GET", "/v1/models", headers=AUTH)[0] == 200
    assert call_json(port, "POST", "/v1/completions", question, AUTH)[0] == 200
    assert call_json(port, "GET", "/health")[0] == 200


@pytest.fixture(scope="module")
def roomy_server(tiny_base, tmp_path_factory):
    """A server whose limits let a body of megabytes and hundreds of thousands of stop strings in; yields
    (port, the Pace of its model)."""
    tmp = tmp_path_factory.mktemp("roomy")
    pace = Pace(tmp / "pace")
    with served(
        tiny_base["path"],
        tmp,
        "--max-body-bytes",
        "4000000",
        "--max-stop",
        "300000",
        "--max-stop-length",
        "64",
        pace=pace,
    ) as (port, err, proc):
        yield port, pace


def test_health_answers_while_a_huge_body_is_handled(roomy_server):
    """Parsing 3 MB and looking for 250k stop strings in each completion is CPU work in worker threads, so
    the event loop keeps answering /health meanwhile. The model is paced by the test: the tokenizer calls
    of request handling are held at the gate, first the parse's (the prompt), then the reply's (cutting a
    completion at the stop string found), so /health is asked while each step is in progress, however
    fast the CPU does it."""
    port, pace = roomy_server
    # the last one is found (the tiny model writes answer tags, never a space): the completions are cut at it
    stops = [f"zz{i:07d}" for i in range(250_000)] + ["</answer>"]
    body = {"prompt": "1+1", "n": 8, "max_tokens": 32, "temperature": 1.0, "seed": 3, "stop": stops}
    before = health(port)
    with pace.holding("tokenizer"), raw_request(port, "/v1/completions", body) as huge:
        pace.wait_held("tokenizer", "the huge body parsed up to its prompt", answered=lambda: answered(huge))
        # its body is being parsed: /health answers at once
        assert health(port)["requests"] == before["requests"] and not answered(huge)
        pace.let_one_through("tokenizer")
        pace.wait_held("tokenizer", "the huge reply cut at a stop string", answered=lambda: answered(huge))
        # generation is over; its response is being cut at the stop strings: /health still answers at once
        assert health(port)["requests"] == before["requests"] + 1 and not answered(huge)
        pace.open("tokenizer")
        status, reply = read_response(huge)
    assert status == 200 and len(reply["choices"]) == 8
    assert all("</answer>" not in c["text"] for c in reply["choices"])


def test_a_request_past_its_timeout_gets_504_and_stops_being_generated(tiny_base, tmp_path):
    """The model is paced by the test: every forward pass is held at the gate until the 504 has come, so the
    request is still being generated at its 2 s timeout however fast the CPU; the forward passes are
    counted to show that no decoding step starts after the 504."""
    pace = Pace(tmp_path / "pace")
    with served(tiny_base["path"], tmp_path, "--request-timeout", "2", pace=pace) as (port, err, _):
        alone = forwards_of_witness(port, pace)
        start = pace.entered("forward")
        with pace.holding("forward"):
            status, reply = call_json(port, "POST", "/v1/completions", BIG, AUTH, timeout=60)
            assert status == 504 and "--request-timeout" in reply["error"]["message"], reply
        # counted once it leaves the server: timed out, or (were it not stopped) generated to its end
        after = wait_for(
            port, lambda h: h["timed_out"] + h["requests"] == 2 and h["active"] == 0, "the request ended"
        )
        assert after["timed_out"] == 1 and after["requests"] == 1, after  # 1: the witness
        ran = pace.entered("forward") - start
        assert ran <= 1, f"{ran} forward passes: the request was decoded after its 504 (its prefill at most)"
        assert re.search(
            r"timed out after 2 s; its generation stopped after \d+ of 1000 tokens", err.read_text()
        )
        assert forwards_of_witness(port, pace) == alone, "the timed-out request is still being generated"
        # a body that never arrives in full is answered too (408), not waited for
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"'.encode()
            )
            status, reply = read_response(sock)
        assert status == 408 and reply["error"]["param"] == "body"


# ---- refusing to start: exit 2, one line naming host:port --------------------------------------------------


def run_cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = grpoflow_serve("serve-model", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # it serves instead of refusing
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def test_a_non_loopback_host_without_an_api_key_is_refused(tiny_base):
    code, _, err = run_cli(tiny_base["path"], "--host", "0.0.0.0", "--port", "0")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--host 0.0.0.0" in err and "--api-key-env" in err
    code, _, err = run_cli(tiny_base["path"], "--api-key-env", "GRPOFLOW_NO_SUCH_VARIABLE")
    assert code == 2 and "GRPOFLOW_NO_SUCH_VARIABLE" in err and len(err.strip().splitlines()) == 1


def test_a_port_in_use_or_an_invalid_host_is_exit_2_naming_host_and_port(tiny_base):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(tiny_base["path"], "--port", str(port), "--json")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"127.0.0.1:{port}" in err and "already in use" in err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2
    for host in ("no-such-host.invalid", "300.1.1.1"):
        code, _, err = run_cli(
            tiny_base["path"], "--host", host, "--port", "8123", "--api-key-env", KEY_VAR, env={KEY_VAR: KEY}
        )
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"{host}:8123" in err, err
    code, _, err = run_cli(tiny_base["path"], "--port", "70000")
    assert code == 2 and "127.0.0.1:70000" in err
    code, _, err = run_cli(tiny_base["path"], "--request-timeout", "nan")
    assert code == 2 and "--request-timeout" in err
