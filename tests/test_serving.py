"""Serving a checkpoint: the transformers server in a real subprocess on loopback, called with the real
`openai` client; `grpoflow serve-model` and `grpoflow eval --serve` as a user runs them.

vLLM cannot run here (no GPU, not installed): its adapter is checked against a fake `vllm` module that
only records its command line and answers `/health`; the test says so in its name.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager

import pytest
from memorised_model import completion, eval_overrides, evaluated_problems, reviews, text_of

from conftest import REPO_ROOT, shared
from evaluation import load_result
from evaluation.serving import ServerLimits, ServingInputError, get_json, served_model
from evaluation.serving.guards import api_key_from_env

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]


def grpoflow(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


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

    replies = [client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=32,
                                              temperature=0) for _ in range(2)]
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
    reply = client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=24,
                                           temperature=1.0, top_p=0.95, n=3, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.message.role == "assistant" for c in reply.choices)
    # completion tokens are summed over the choices; each choice is at most max_tokens long
    assert 3 <= reply.usage.completion_tokens <= 3 * 24
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    again = client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=24,
                                           temperature=1.0, top_p=0.95, n=3, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_completions_with_stop_and_errors(server, client):
    import openai

    reply = client.completions.create(model=server.model_name, prompt=["<think>", "1+1"], max_tokens=16,
                                      temperature=0, stop=["</think>"])
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
            replies[i] = client.chat.completions.create(model=server.model_name, messages=questions[i],
                                                        max_tokens=16, temperature=0)
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
    # batched or not, each answer is the one the same checkpoint gives that question alone, greedily, in this process
    engine, tokenizer = local_engine
    for i, question in enumerate(questions):
        [[alone]] = engine.generate(encode_prompts(tokenizer, [{"prompt": question}]), 1,
                                    SamplingParams(max_tokens=16, temperature=0.0))
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
    """`grpoflow eval --serve` on the memorising model, with the settings of the session's direct evaluation of it
    (`memorised_model.eval_overrides`): the same verdict on every problem, and the same answers where it knows them."""
    proc = grpoflow("eval", memorising_model, *eval_overrides(shared()), f"eval.out={tmp_path / 'eval'}",
                    f"data.out={tmp_path / 'no-prepared-data'}", "--serve", "--concurrency", "4",
                    "--state-dir", str(tmp_path / "state"), "--json")
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    served = json.loads(out.strip().splitlines()[-1])
    assert served["served_by"] == "transformers" and served["num_samples"] == memorised_eval.num_samples
    assert served["scores"] == memorised_eval.scores == {"math_500": 0.4, "aime24": 0.5}
    report = json.loads(open(served["report"]).read())
    assert report["eval_type"] == "openai_api" and report["model"] == "memorising"
    assert report["api_url"].startswith("http://127.0.0.1:") and report["eval_batch_size"] == 4

    through_endpoint, direct = reviews(load_result(served["work_dir"])), reviews(memorised_eval)
    assert {k: r["sample_score"]["score"]["value"] for k, r in through_endpoint.items()} == \
        {k: r["sample_score"]["score"]["value"] for k, r in direct.items()}
    for p in evaluated_problems(shared()):
        if p.memorised:
            answers = {text_of(r[p.benchmark, p.key]["messages"][-1]) for r in (through_endpoint, direct)}
            assert answers == {completion(p.answer)}


# ---- connections and the API key: a server as `serve-model --max-connections 16 --api-key-env` ---------------
# The key is given as a file's content reads: with a trailing newline. Every client here is 127.0.0.1, one
# client address, whose default share is a quarter of the 16 connections; 127.0.0.2 is another client.

KEY_VAR, KEY = "GRPOFLOW_TEST_SERVING_KEY", "sk-serving-5b7e0c93d1a2"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS, PER_CLIENT = 16, 4
QUESTION_TEXT = {"prompt": "1+1", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def keyed_server(tiny_base, tmp_path_factory):
    """(port, stderr path) of `grpoflow serve-model --max-connections 16 --api-key-env VAR` (VAR = key + newline)."""
    err_path = tmp_path_factory.mktemp("keyed-server") / "stderr.log"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-model", tiny_base["path"], "--json",
                                 "--api-key-env", KEY_VAR, "--max-connections", str(MAX_CONNECTIONS)],
                                cwd=REPO_ROOT, text=True, env={**os.environ, KEY_VAR: KEY + "\n"},
                                stdout=subprocess.PIPE, stderr=err)
    try:
        ready = ready_line(proc, timeout_s=180)
        yield int(ready["url"].rsplit(":", 1)[1].removesuffix("/v1")), err_path
        assert proc.poll() is None, f"the server died during the tests:\n{err_path.read_text()[-3000:]}"
        assert stop_cleanly(proc, signal.SIGTERM)["engine"] == "transformers"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def call(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None,
         source: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one request on its own connection, from the address `source` if given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60,
                                      source_address=(source, 0) if source else None)
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
    for wrong in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                  {"Authorization": f"Bearer {KEY}x"}):
        status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, wrong)
        assert status == 401 and json.loads(body)["error"]["param"] == "authorization", (wrong, body)
    assert KEY not in err.read_text()


def test_the_bearer_scheme_is_case_insensitive(keyed_server):
    port, _ = keyed_server
    for scheme in ("bearer", "BEARER", "bEaReR"):
        status, body = call(port, "POST", "/v1/completions", QUESTION_TEXT, {"Authorization": f"{scheme} {KEY}"})
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
        idle = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30))
                for _ in range(MAX_CONNECTIONS)]
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
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n"
                         .encode())
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
    while (status := call(port, "POST", "/v1/completions", QUESTION_TEXT, AUTH)[0]) == 503 and time.monotonic() < end:
        time.sleep(0.1)
    assert status == 200


def test_a_connection_that_never_completes_its_headers_is_closed_after_the_header_timeout(keyed_server):
    """The default --header-timeout (10 s), counted from the connection's opening: a silent socket and one
    sending a header line every half second are both closed; a server without the timeout keeps them for good."""
    port, _ = keyed_server
    default = 10.0  # --header-timeout
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent, \
            socket.create_connection(("127.0.0.1", port), timeout=30) as dripping:
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
    with pytest.raises(ServingInputError, match=r"--max-connections-per-client \(32\) cannot exceed "
                                                r"--max-connections \(16\)"):
        ServerLimits(max_connections=16, max_connections_per_client=32)
    for field, flag in (("header_timeout_s", "--header-timeout"), ("body_timeout_s", "--body-timeout"),
                        ("keep_alive_timeout_s", "--keep-alive-timeout")):
        with pytest.raises(ServingInputError, match=flag):
            ServerLimits(**{field: 0.0})


def _has_vllm() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None
