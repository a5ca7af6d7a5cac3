"""Issue 15, case 9 and case 7 (serve-model): the model server under a careless or hostile client.

Every test runs `grpoflow serve-model` as a user does, on the real tiny model, over real HTTP on
127.0.0.1. Ordering is asserted, never a duration: "the small request completed while the big one was
still being generated", "/health answered while the big body was being handled".
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import REPO_ROOT

KEY_VAR, KEY = "GRPOFLOW_TEST_SERVER_KEY", "sk-test-9f2c61d0a7e84b35"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a big request: 32 sampled completions of up to 1000 tokens (at temperature 2 a tiny model rarely says EOS)
BIG = {"prompt": "1+1", "n": 32, "max_tokens": 1000, "temperature": 2.0, "seed": 1}


def grpoflow(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, text=True,
                            env={**os.environ, **(env or {})}, **kwargs)


@contextmanager
def served(model: str, tmp: Path, *flags: str):
    """`grpoflow serve-model MODEL --json FLAGS` with its stderr in a file; yields (port, stderr path, process)."""
    err_path = tmp / "server.stderr"
    with open(err_path, "w") as err:
        proc = grpoflow("serve-model", model, "--json", "--api-key-env", KEY_VAR, *flags,
                        env={KEY_VAR: KEY}, stdout=subprocess.PIPE, stderr=err)
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


def call(port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 300):
    """(status, parsed JSON body) of one request on its own connection."""
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
    status, body = call(port, "GET", "/health", timeout=60)
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
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{head}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
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


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@pytest.fixture(scope="module")
def server(tiny_base, tmp_path_factory):
    """A server with small limits, so that each is easy to cross."""
    with served(tiny_base["path"], tmp_path_factory.mktemp("server"), "--max-sequences", "32", "--max-tokens", "1000",
                "--max-stop", "4", "--max-stop-length", "16", "--max-body-bytes", "100000") as (port, err, proc):
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
# inputs that used to answer HTTP 500 (or crash the generation)
MALFORMED = {
    "seed": ("/v1/completions", {"prompt": "1+1", "max_tokens": 2, "temperature": 1.0, "seed": 2 ** 70}),
    "body": ("/v1/completions", b"[" * 40_000 + b"]" * 40_000),  # nested deeper than the JSON decoder goes
    "top_p": ("/v1/completions", b'{"prompt": "1+1", "max_tokens": 2, "top_p": NaN}'),
    "temperature": ("/v1/completions", b'{"prompt": "1+1", "max_tokens": 2, "temperature": Infinity}'),
}


@pytest.mark.parametrize("field", [*TOO_MUCH, *MALFORMED])
def test_limits_and_bad_fields_are_400_naming_the_field(server, field):
    port, _ = server
    path, body = {**TOO_MUCH, **MALFORMED}[field]
    status, reply = call(port, "POST", path, body, AUTH)
    assert status == 400, reply
    assert reply["error"]["param"] == field and reply["error"]["message"].startswith(field), reply


def test_a_stop_string_over_the_length_limit_and_a_prompt_filling_the_context_are_400(server):
    port, _ = server
    status, reply = call(port, "POST", "/v1/completions", {"prompt": "1+1", "stop": ["x" * 17]}, AUTH)
    assert status == 400 and reply["error"]["param"] == "stop" and "--max-stop-length" in reply["error"]["message"]
    # a prompt as long as the context, without max_tokens: it used to crash the generation (HTTP 500)
    status, reply = call(port, "POST", "/v1/completions", {"prompt": [5] * 1024}, AUTH)
    assert status == 400 and reply["error"]["param"] == "prompt" and "1024" in reply["error"]["message"]
    # a temperature too small to divide by is greedy, as in vLLM (it used to give NaN probabilities: 500)
    greedy = {"prompt": "1+1", "max_tokens": 6}
    status, tiny_t = call(port, "POST", "/v1/completions", {**greedy, "temperature": 1e-40}, AUTH)
    assert status == 200, tiny_t
    assert tiny_t["choices"][0]["text"] == call(port, "POST", "/v1/completions", {**greedy, "temperature": 0},
                                                AUTH)[1]["choices"][0]["text"]


def test_an_oversized_body_is_refused_before_it_is_read(server):
    port, _ = server
    # the body: 1.2 MB of stop strings; the headers alone get the answer, no byte of it is sent
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 1200000\r\n\r\n".encode())
        status, reply = read_response(sock)
    assert status == 413 and reply["error"]["param"] == "body", reply
    assert "1200000 bytes" in reply["error"]["message"] and "--max-body-bytes" in reply["error"]["message"]
    # without a Content-Length (chunked), the count stops at the limit: 60 kB sent, then 60 kB more
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(2):
            assert not answered(sock)
            sock.sendall(b"%x\r\n%s\r\n" % (60_000, b"x" * 60_000))
        status, reply = read_response(sock)
    assert status == 413 and "over 100000 bytes" in reply["error"]["message"]
    assert health(port)["status"] == "ok"


# ---- scheduling: fairness, cancellation ---------------------------------------------------------------------

def test_a_small_request_completes_while_a_big_one_is_still_generated(server):
    port, _ = server
    before = health(port)
    big = raw_request(port, "/v1/completions", BIG)
    with big:
        wait_for(port, lambda h: h["active"] == before["active"] + 1, "the big request started")
        status, small = call(port, "POST", "/v1/completions", {"prompt": "2+2", "max_tokens": 8, "temperature": 0},
                             AUTH)
        assert status == 200 and small["usage"]["completion_tokens"] <= 8
        # the big one has not answered yet and is still being generated
        assert not answered(big)
        assert health(port)["active"] == before["active"] + 1
    # closing its connection cancels it (next test: that it stops)
    wait_for(port, lambda h: h["active"] == before["active"], "the big request stopped after its client left")


def test_a_disconnected_client_stops_its_generation(server):
    port, err = server
    before = health(port)
    with raw_request(port, "/v1/completions", {**BIG, "seed": 2}):
        wait_for(port, lambda h: h["active"] == before["active"] + 1, "the big request started")
    after = wait_for(port, lambda h: h["cancelled"] == before["cancelled"] + 1 and h["active"] == before["active"],
                     "the generation of the disconnected request stopped")
    assert after["requests"] == before["requests"], "the disconnected request was generated to the end"
    stopped = re.findall(r"cmpl-\w+: the client disconnected; its generation stopped after (\d+) of 1000 tokens",
                         err.read_text())
    assert stopped and int(stopped[-1]) < 1000


def test_the_api_key_is_required_on_v1_and_health_stays_open(server):
    port, _ = server
    question = {"prompt": "1+1", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert call(port, "GET", "/v1/models", headers=headers)[0] == 401
        status, reply = call(port, "POST", "/v1/completions", question, headers)
        assert status == 401 and reply["error"]["param"] == "authorization"
    assert call(port, "GET", "/v1/models", headers=AUTH)[0] == 200
    assert call(port, "POST", "/v1/completions", question, AUTH)[0] == 200
    assert call(port, "GET", "/health")[0] == 200


@pytest.fixture(scope="module")
def roomy_server(tiny_base, tmp_path_factory):
    """A server whose limits let the issue's 1.2 MB body of 100k stop strings in."""
    with served(tiny_base["path"], tmp_path_factory.mktemp("roomy"), "--max-body-bytes", "4000000", "--max-stop",
                "300000", "--max-stop-length", "64") as (port, err, proc):
        yield port, err


def test_health_answers_while_a_huge_body_is_handled(roomy_server):
    """Parsing 3 MB and looking for 250k stop strings in 64 completions takes seconds of CPU, in a worker
    thread; it used to run on the event loop (the issue's 1.2 MB body held /health for 49 s)."""
    port, _ = roomy_server
    stops = [f"zz{i:07d}" for i in range(250_000)] + [" "]  # the space is found: the text is cut
    huge = raw_request(port, "/v1/completions", {"prompt": "1+1", "n": 64, "max_tokens": 32, "temperature": 1.0,
                                                 "seed": 3, "stop": stops})
    with huge:
        wait_for(port, lambda h: h["requests"] >= 1, "the huge request was generated")
        # generation is over; its response is being cut at the stop strings: /health still answers at once
        assert health(port)["status"] == "ok"
        assert not answered(huge), "the huge request was already answered: the test proves nothing"
        status, reply = read_response(huge)
    assert status == 200 and len(reply["choices"]) == 64


def test_a_request_past_its_timeout_gets_504_and_stops_being_generated(tiny_base, tmp_path):
    with served(tiny_base["path"], tmp_path, "--request-timeout", "2") as (port, err, _):
        # 64 x 1000 tokens: over a thousand forward passes, far more than 2 s
        status, reply = call(port, "POST", "/v1/completions", {**BIG, "n": 64}, AUTH)
        assert status == 504 and "--request-timeout" in reply["error"]["message"], reply
        after = wait_for(port, lambda h: h["active"] == 0, "the timed-out request stopped")
        assert after["timed_out"] == 1 and after["requests"] == 0
        assert re.search(r"timed out after 2 s; its generation stopped after \d+ of 1000 tokens", err.read_text())
        # a body that never arrives in full is answered too (408), not waited for
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
            status, reply = read_response(sock)
        assert status == 408 and reply["error"]["param"] == "body"


# ---- refusing to start: exit 2, one line naming host:port --------------------------------------------------

def run_cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = grpoflow("serve-model", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
        code, _, err = run_cli(tiny_base["path"], "--host", host, "--port", "8123", "--api-key-env", KEY_VAR,
                               env={KEY_VAR: KEY})
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"{host}:8123" in err, err
    code, _, err = run_cli(tiny_base["path"], "--port", "70000")
    assert code == 2 and "127.0.0.1:70000" in err
    code, _, err = run_cli(tiny_base["path"], "--request-timeout", "nan")
    assert code == 2 and "--request-timeout" in err
