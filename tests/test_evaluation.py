"""EvalScope runs: real EvalScope on the tiny checkpoint and the reference data in ../shared/data, its
report files read back independently, pass@k on the memorising model (right on purpose, so its samples'
verdicts differ) against the unbiased estimator, and the errors a caller sees for bad inputs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from memorised_model import MAX_TOKENS

from conftest import (
    CLI_GUARD_S,
    REPO_ROOT,
    URL_SECRET,
    eval_cli_args,
    grpoflow_run,
    last_json,
    loopback_http,
    one_line_error,
    shared,
)
from data.errors import ServiceUnavailable
from evaluation import load_result, run_evalscope
from evaluation.compare import load_samples

LEVELS = [f"Level {i}" for i in range(1, 6)]


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _primary(report: dict) -> dict:
    """The report's headline metric, found the way a reader of EvalScope's JSON would."""
    [metric] = [m for m in report["metrics"] if m["identity"] == report["primary_metric_identity"]]
    return metric


def test_tiny_checkpoint_on_math500_and_aime24_reports_evalscope_numbers(tiny_base, tmp_path, capfd):
    math500, aime24 = shared("math_500"), shared("aime24")
    env_before = dict(os.environ)
    work_dir = tmp_path / "eval"
    result = run_evalscope(
        tiny_base["path"],
        ["math_500", "aime24"],
        work_dir=work_dir,
        limit=2,
        max_tokens=32,
        local_paths={"math_500": str(math500), "aime24": str(aime24)},
    )

    # quiet: EvalScope's chatter went to its log file, and the offline switches stayed in the child
    out, _ = capfd.readouterr()
    assert out == "" and dict(os.environ) == env_before
    log = result.log_path.read_text()
    assert "Start loading benchmark dataset: math_500" in log and "from modelscope" not in log

    assert set(result.scores) == {"math_500", "aime24"}
    assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in result.scores.values())
    # EvalScope's limit is per subset: 2 problems from each MATH-500 level
    assert result.num_samples == {"math_500": 10, "aime24": 2}
    assert list(result.subsets["math_500"]) == LEVELS and list(result.subsets["aime24"]) == ["default"]
    assert result.pass_at_k == {}

    ours = json.loads((work_dir / "report.json").read_text())
    assert ours["scores"] == result.scores and ours["num_samples"] == result.num_samples
    assert ours["offline"] is True and ours["evalscope_version"] and ours["limit"] == 2
    assert ours["generation_config"] == {"max_tokens": 32, "do_sample": False}
    for bench in ("math_500", "aime24"):
        report = json.loads(result.report_paths[bench].read_text())
        metric = _primary(report)
        assert ours["scores"][bench] == metric["score"]
        subsets = {s["name"]: (s["score"], s["num"]) for c in metric["categories"] for s in c["subsets"]}
        assert {name: score for name, (score, _) in subsets.items()} == ours["subsets"][bench]
        if bench == "math_500":
            assert {num for _, num in subsets.values()} == {2}

        # per-sample files: one review per generation, scored; the mean of their scores is the report's
        reviews = [r for p in result.review_paths[bench] for r in _lines(p)]
        predictions = [r for p in result.predictions_paths[bench] for r in _lines(p)]
        assert len(reviews) == len(predictions) == result.num_samples[bench]
        # the per-sample key is the adapter's own spelling: aime24 writes "acc", math_500 "accuracy"
        values = [r["sample_score"]["score"]["value"] for r in reviews]
        accs = [v["accuracy"] if "accuracy" in v else v["acc"] for v in values]
        assert metric["score"] == pytest.approx(sum(accs) / len(accs))
        assert all(r["target"] and r["messages"][-1]["role"] == "assistant" for r in reviews)
        assert all(p["model_output"]["usage"]["output_tokens"] <= 32 for p in predictions)

    # report.json is the record: read back, returned again for the same request, guarded against another
    assert load_result(work_dir) == result
    assert (
        run_evalscope(
            tiny_base["path"],
            ["math_500", "aime24"],
            work_dir=work_dir,
            limit=2,
            max_tokens=32,
            local_paths={"math_500": str(math500), "aime24": str(aime24)},
        )
        == result
    )
    with pytest.raises(FileExistsError, match="other settings .*limit: 2 there, 1 now"):
        run_evalscope(
            tiny_base["path"],
            ["math_500", "aime24"],
            work_dir=work_dir,
            limit=1,
            max_tokens=32,
            local_paths={"math_500": str(math500), "aime24": str(aime24)},
        )


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021): the chance that k of n samples, c of them correct, drawn without replacement hold
    one correct sample, 1 - C(n - c, k) / C(n, k)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_repeats_add_evalscope_pass_at_k(memorising_model, tmp_path):
    # the first 4 AIME problems: one memorised, one memorised with a right and a wrong answer in equal measure
    # (memorised_model.COIN), two unknown; sampled at temperature 1, the counts of right samples differ by
    # problem
    aime24 = shared("aime24")
    result = run_evalscope(
        memorising_model,
        ["aime24"],
        work_dir=tmp_path,
        limit=4,
        repeats=4,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        local_paths={"aime24": str(aime24)},
    )
    assert result.num_samples == {"aime24": 4}
    report = json.loads(result.report_paths["aime24"].read_text())
    assert _primary(report)["identity"]["aggregation"] == "mean" and _primary(report)["num"] == 16

    # per-sample verdicts from EvalScope's reviews, grouped by problem
    correct: dict[int, list[float]] = {}
    for review in _lines(result.review_paths["aime24"][0]):
        correct.setdefault(review["sample_score"]["group_id"], []).append(
            review["sample_score"]["score"]["value"]["acc"]
        )
    assert sorted(correct) == [0, 1, 2, 3] and all(len(v) == 4 for v in correct.values())
    assert sum(correct[0]) == sum(correct[2]) == 0  # AIME 60 and 62 were never taught
    counts = [int(sum(v)) for v in correct.values()]
    assert result.scores["aime24"] == pytest.approx(sum(counts) / 16)
    assert result.pass_at_k["aime24"] == pytest.approx(
        {k: sum(unbiased_pass_at_k(4, c, k) for c in counts) / 4 for k in (1, 2, 3, 4)}
    )
    # a comparison averages a problem's repeated samples, one value per problem
    assert load_samples(tmp_path)["aime24"]["accuracy"] == {
        f"default/{g}": sum(v) / 4 for g, v in correct.items()
    }

    # so do the thinking metrics: each of the 16 rows names its problem, and a comparison sees 4 problems
    # whose reasoning-token count is the mean of their 4 samples' (16 keys, one per sample, before problem_id)
    from evaluation.thinking import analyze

    rows = analyze(tmp_path, memorising_model, progress=False).rows
    assert sorted(r["problem_id"] for r in rows) == sorted(f"default/{g}" for g in correct for _ in range(4))
    by_problem: dict[str, list[float]] = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r["reasoning_tokens"])
    thinking = load_samples(tmp_path)["aime24"]["reasoning_tokens"]
    assert thinking == pytest.approx({p: sum(v) / len(v) for p, v in by_problem.items()})
    assert len(thinking) == 4 and all(len(v) == 4 for v in by_problem.values())


# ---- served models: EvalScope's openai_api mode against a stub endpoint ----------------------------------
# No model server (vLLM, LMDeploy) runs here; the stub answers every question correctly, so the test checks
# the wiring (URL, key from the environment, generation settings) and EvalScope's scoring end to end.

GPQA_ROWS = [
    {
        "Question": f"Which made-up compound number {i} is inert?",
        "Correct Answer": f"Compound Q{i}",
        "Incorrect Answer 1": f"Compound X{i}",
        "Incorrect Answer 2": f"Compound Y{i}",
        "Incorrect Answer 3": f"Compound Z{i}",
    }
    for i in range(3)
]


@contextmanager
def stub_chat_endpoint(answer):
    """An OpenAI-compatible /v1/chat/completions that replies `answer(prompt)`; yields (url, requests)."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
            content = answer(body["messages"][-1]["content"])
            reply = json.dumps(
                {
                    "id": "stub",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": content},
                        }
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    with loopback_http(Handler) as server:
        yield f"http://127.0.0.1:{server.server_port}/v1", requests


def test_openai_api_mode_scores_a_served_model_with_the_key_from_the_environment(tmp_path, monkeypatch):
    aime24 = shared("aime24")
    aime_answers = {r["problem"]: r["answer"] for r in _lines(aime24 / "test.jsonl")}
    gpqa_dir = tmp_path / "gpqa"
    gpqa_dir.mkdir()
    (gpqa_dir / "gpqa_diamond.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GPQA_ROWS))
    correct = {r["Correct Answer"] for r in GPQA_ROWS}

    def answer(prompt):
        for letter, text in re.findall(r"^([A-D])\) (.*)$", prompt, flags=re.M):
            if text.strip() in correct:
                return f"It is {text}.\nANSWER: {letter}"
        [solution] = [a for problem, a in aime_answers.items() if problem in prompt]
        return f"So the answer is \\boxed{{{solution}}}."

    monkeypatch.setenv("STUB_API_KEY", "sk-stub-secret")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with stub_chat_endpoint(answer) as (url, requests):
        result = run_evalscope(
            "stub/model",
            ["aime24", "gpqa_diamond"],
            work_dir=tmp_path / "eval",
            limit=2,
            max_tokens=16,
            api_url=url,
            api_key_env="STUB_API_KEY",
            local_paths={"aime24": str(aime24), "gpqa_diamond": str(gpqa_dir)},
        )

    assert result.scores == {"aime24": 1.0, "gpqa_diamond": 1.0}
    assert result.num_samples == {"aime24": 2, "gpqa_diamond": 2}
    assert len(requests) == 4
    assert {(r["path"], r["auth"], r["model"], r["max_tokens"], r["temperature"]) for r in requests} == {
        ("/v1/chat/completions", "Bearer sk-stub-secret", "stub/model", 16, 0.0)
    }
    ours = json.loads(result.report_json.read_text())
    assert (
        ours["eval_type"] == "openai_api" and ours["api_key_env"] == "STUB_API_KEY" and ours["dtype"] is None
    )
    for path in result.work_dir.rglob("*"):
        assert not path.is_file() or "sk-stub-secret" not in path.read_text(errors="replace"), path


def _grpoflow_eval(url: str, state, *extra: str) -> subprocess.CompletedProcess:
    args = [
        "eval",
        url,
        "eval.benchmarks=[aime24]",
        f"eval.local_paths={{aime24: {shared('aime24')}}}",
        "eval.limit=1",
        "eval.max_tokens=16",
        "--state-dir",
        str(state),
        "--json",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "NO_PROXY": "127.0.0.1,localhost"},
        stdin=subprocess.DEVNULL,
    )


def test_grpoflow_eval_gives_each_endpoint_its_own_evaluation(tmp_path):
    """`grpoflow eval URL` on two endpoints one after the other, both serving the model name `default` on
    loopback: each is evaluated (its own requests, its own score), each in a work dir of its own under
    eval.out. `--work-dir` names the work dir; one holding an evaluation made with other settings is
    refused in one line, exit 2, naming the flag, before any request."""
    aime_answers = {r["problem"]: r["answer"] for r in _lines(shared("aime24") / "test.jsonl")}

    def right(prompt):
        [solution] = [a for problem, a in aime_answers.items() if problem in prompt]
        return f"So the answer is \\boxed{{{solution}}}."

    state = tmp_path / "state"
    with (
        stub_chat_endpoint(right) as (url_a, requests_a),
        stub_chat_endpoint(lambda prompt: "So the answer is \\boxed{-1}.") as (url_b, requests_b),
    ):
        first = _grpoflow_eval(url_a, state)
        second = _grpoflow_eval(url_b, state)
        assert first.returncode == 0 and second.returncode == 0, (first.stderr[-3000:], second.stderr[-3000:])
        a, b = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (first, second))
        assert (a["scores"], b["scores"]) == ({"aime24": 1.0}, {"aime24": 0.0})
        assert (len(requests_a), len(requests_b)) == (1, 1)
        work_dirs = [Path(a["work_dir"]), Path(b["work_dir"])]
        assert work_dirs[0] != work_dirs[1] and {d.parent for d in work_dirs} == {(state / "eval").resolve()}
        assert all((d / "report.json").is_file() for d in work_dirs)

        refused = _grpoflow_eval(url_b, state, "--work-dir", b["work_dir"], "eval.max_tokens=8")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    [line] = [x for x in refused.stderr.splitlines() if x.startswith("grpoflow eval: error:")]
    assert (
        f"{b['work_dir']} already holds an evaluation made with other settings (generation_config: " in line
    )
    assert line.endswith("pass --work-dir DIR to evaluate into another directory")
    assert len(requests_b) == 1


# ---- endpoints that never finish answering, or answer too much: each request bounded whole -----------------

DRIP_S = 60  # how long the endpoint below keeps one answer going when the client lets it
MODELS = json.dumps({"object": "list", "data": [{"id": "stub/model", "object": "model"}]}).encode()


@contextmanager
def raw_endpoint(answer):
    """An OpenAI-compatible endpoint on 127.0.0.1 that answers GET /v1/models and writes each POST's whole
    raw HTTP response with `answer(wfile, attempt)` (attempt 0, 1, ...); yields (url, attempts): the
    monotonic start and end of each POST, its end when `answer` returned or the client hung up."""
    attempts: list[dict] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(MODELS)))
            self.end_headers()
            self.wfile.write(MODELS)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                attempt = {"start": time.monotonic()}
                attempts.append(attempt)
            try:
                answer(self.wfile, len(attempts) - 1)
            except OSError:  # the client hung up
                pass
            attempt["end"] = time.monotonic()
            self.close_connection = True

        def log_message(self, *args):
            pass

    with loopback_http(Handler) as server:
        yield f"http://127.0.0.1:{server.server_port}/v1", attempts


def _drip(wfile, head: bytes, piece: bytes) -> None:
    """`head`, then `piece` five times a second for DRIP_S seconds: never a pause long enough for a read to
    time out."""
    wfile.write(head)
    wfile.flush()
    until = time.monotonic() + DRIP_S
    while time.monotonic() < until:
        wfile.write(piece)
        wfile.flush()
        time.sleep(0.2)


SSE_CHUNK = b'data: {"id": "s", "object": "chat.completion.chunk", "model": "m", "choices": []}\n\n'
DRIPS = [  # one per attempt: the status line and then a header forever, a body forever, a stream of chunks
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Drip: ", b"a"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{", b" "),
    (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"%x\r\n%s\r\n" % (len(SSE_CHUNK), SSE_CHUNK),
    ),
]


def test_an_endpoint_that_drips_forever_fails_each_request_at_its_deadline(tmp_path, monkeypatch):
    """eval.request_timeout_s is a deadline for the whole request, not for each read: an endpoint that drips
    its headers, its body or a stream of chunks without ever pausing is given up on after each attempt's
    2 s, within the attempts and intervals the message states."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with raw_endpoint(lambda wfile, n: _drip(wfile, *DRIPS[n % len(DRIPS)])) as (url, attempts):
        with pytest.raises(ServiceUnavailable) as err:
            run_evalscope(
                "stub/model",
                ["aime24"],
                work_dir=tmp_path / "eval",
                limit=1,
                max_tokens=16,
                api_url=url,
                local_paths={"aime24": str(shared("aime24"))},
                request_timeout_s=2,
            )
        deadline = time.monotonic() + 10
        while any("end" not in a for a in attempts) and time.monotonic() < deadline:
            time.sleep(0.1)  # the endpoint notices the last hang-up at its next write

    message = str(err.value)
    assert message.startswith(
        f"the evaluation endpoint at {url} stopped answering on benchmark 'aime24': "
        "APITimeoutError after 3 attempts of up to 2 s (eval.request_timeout_s), 5 s apart"
    )
    assert "Traceback" not in message and 'File "' not in message and "\n" not in message
    assert len(attempts) == 3
    durations = [a["end"] - a["start"] for a in attempts]
    assert all(d < 15 for d in durations), durations  # each ended near its 2 s, none lasted the drip's 60 s
    log = (tmp_path / "eval" / "evalscope" / "run.log").read_text()
    assert "within 2 s (the deadline for the whole request)" in log


BIG_ANSWER_BYTES = 30 * 1024 * 1024


def _big_answer(wfile, attempt: int) -> None:
    """A 30 MB chat completion, with its Content-Length on even attempts and without one (the connection's
    end ends it) on odd ones, written a megabyte at a time."""
    content = "x" * BIG_ANSWER_BYTES
    body = json.dumps(
        {
            "id": "big",
            "object": "chat.completion",
            "created": 0,
            "model": "stub/model",
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17},
        }
    ).encode()
    length = b"Content-Length: %d\r\n" % len(body) if attempt % 2 == 0 else b"Connection: close\r\n"
    wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + length + b"\r\n")
    for start in range(0, len(body), 1 << 20):
        wfile.write(body[start : start + (1 << 20)])
    wfile.flush()


EVAL_IN_A_PROCESS = """
import json, resource, sys
from evaluation import run_evalscope
url, aime24, work_dir = sys.argv[1:]
try:
    run_evalscope("stub/model", ["aime24"], work_dir=work_dir, limit=1, max_tokens=16, api_url=url,
                  local_paths={"aime24": aime24}, request_timeout_s=60)
    outcome = "finished"
except Exception as e:
    outcome = f"{type(e).__name__}: {e}"
print(json.dumps({"outcome": outcome, "max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def test_an_answer_over_the_response_limit_is_refused_naming_the_limit_in_bounded_memory(tmp_path):
    """A 30 MB answer to a request for 16 tokens is refused, whether it announces its length or not, naming
    the endpoint and the limit (4 MiB for max_tokens=16); EvalScope's process never holds it (its peak
    memory, measured as the evaluating process's largest child, stays far below what 30 MB parsed takes)."""
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost"}
    with raw_endpoint(_big_answer) as (url, attempts):
        proc = subprocess.run(
            [sys.executable, "-c", EVAL_IN_A_PROCESS, url, str(shared("aime24")), str(tmp_path / "eval")],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outcome"] == (
        f"EndpointAnswerTooLarge: the evaluation endpoint at {url} answered on benchmark 'aime24' with more "
        "than 4,194,304 bytes, the limit for eval.max_tokens=16 (1,024 bytes a token, at least 4,194,304); "
        f"EvalScope's log: {tmp_path / 'eval' / 'evalscope' / 'run.log'}"
    )
    assert len(attempts) == 3  # retried like any failed request, each refused
    assert result["max_rss_kb"] < 1.5 * 1024 * 1024, result


# ---- errors: named, and raised before any model is loaded -----------------------------------------------


@pytest.fixture
def fake_checkpoint(tmp_path):
    """A directory that passes the checkpoint check; no test below gets as far as loading it."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_missing_checkpoint_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match="model checkpoint directory not found: .*no-such-checkpoint"):
        run_evalscope(str(missing), ["aime24"], work_dir=tmp_path / "eval")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a save_pretrained checkpoint directory: no config.json"):
        run_evalscope(str(tmp_path / "empty"), ["aime24"], work_dir=tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_missing_local_path_names_the_benchmark(fake_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="local_path for benchmark 'math_500' not found: .*nowhere"):
        run_evalscope(
            str(fake_checkpoint),
            ["math_500"],
            work_dir=tmp_path / "eval",
            local_paths={"math_500": str(tmp_path / "nowhere")},
        )
    with pytest.raises(ValueError, match="local_paths names benchmark 'aime25', which is not among"):
        run_evalscope(
            str(fake_checkpoint),
            ["aime24"],
            work_dir=tmp_path / "eval",
            local_paths={"aime25": str(tmp_path)},
        )


def test_bad_settings_are_named(fake_checkpoint, tmp_path):
    ckpt = str(fake_checkpoint)
    with pytest.raises(ValueError, match="repeats=4 with temperature=0"):
        run_evalscope(ckpt, ["aime24"], work_dir=tmp_path, repeats=4)
    with pytest.raises(ValueError, match="limit must be a positive integer, got 0"):
        run_evalscope(ckpt, ["aime24"], work_dir=tmp_path, limit=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        run_evalscope(ckpt, ["aime24"], work_dir=tmp_path, dtype="fp8")
    with pytest.raises(ValueError, match="environment variable GRPOFLOW_TEST_UNSET_KEY is not set"):
        run_evalscope(
            "m",
            ["aime24"],
            work_dir=tmp_path,
            api_url="http://127.0.0.1:9/v1",
            api_key_env="GRPOFLOW_TEST_UNSET_KEY",
        )


def test_unknown_benchmark_is_named_with_suggestions(fake_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"unknown benchmark 'math500'.*did you mean 'math_500'"):
        run_evalscope(str(fake_checkpoint), ["math500"], work_dir=tmp_path / "eval")
    assert not (tmp_path / "eval" / "report.json").exists()


def test_evalscope_failure_is_one_line_naming_the_benchmark_the_error_and_the_log(fake_checkpoint, tmp_path):
    empty = tmp_path / "aime24-empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="EvalScope failed on benchmark 'aime24'") as err:
        run_evalscope(
            str(fake_checkpoint), ["aime24"], work_dir=tmp_path / "eval", local_paths={"aime24": str(empty)}
        )
    message, log = str(err.value), tmp_path / "eval" / "evalscope" / "run.log"
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message
    assert str(empty) in message and message.endswith(f"; EvalScope's log: {log}")
    assert "Traceback" in log.read_text()  # the traceback stays in the log
    assert not (tmp_path / "eval" / "report.json").exists()


# ==========================================================================================================
# Endpoints that do not answer, settings checked first, outputs under the state directory
# ==========================================================================================================

# Every command runs as a real `grpoflow` subprocess; its timeout is a guard, never the assertion.


@pytest.fixture
def hanging_endpoint():
    """A real HTTP server that answers GET /v1/models like an OpenAI endpoint and never answers a
    completion."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            release.wait(CLI_GUARD_S)

        def log_message(self, *args):
            pass

    with loopback_http(Handler) as server:
        try:
            yield server.server_address[1]
        finally:
            release.set()  # a handler still waiting is let go before the server shuts down


def test_eval_against_a_server_that_never_answers_is_exit_2_naming_it(silent_port, tmp_path):
    port = silent_port.getsockname()[1]
    proc = grpoflow_run(
        *eval_cli_args(tmp_path, f"http://127.0.0.1:{port}/v1", "eval.request_timeout_s=5", "--json")
    )
    line = one_line_error(proc, "eval")
    assert (
        f"the evaluation endpoint at http://127.0.0.1:{port}/v1/models is unreachable: no answer within 5 s"
    ) in line
    assert last_json(proc)["exit_code"] == 2


def test_eval_against_a_closed_port_is_exit_2_with_credentials_masked(closed_port, tmp_path):
    endpoint = f"http://user:{URL_SECRET}@127.0.0.1:{closed_port}/v1"
    proc = grpoflow_run(*eval_cli_args(tmp_path, endpoint, "--json"))
    line = one_line_error(proc, "eval")
    assert f"http://user:***@127.0.0.1:{closed_port}/v1/models is unreachable: connection refused" in line
    assert URL_SECRET not in proc.stdout + proc.stderr
    assert last_json(proc)["exit_code"] == 2


def test_an_endpoint_that_hangs_on_requests_is_bounded_by_eval_request_timeout_s(hanging_endpoint, tmp_path):
    """/v1/models answers, so the check passes; every completion hangs: EvalScope gives up after its bounded
    attempts of eval.request_timeout_s each, and that is one line naming the endpoint."""
    proc = grpoflow_run(
        *eval_cli_args(tmp_path, f"http://127.0.0.1:{hanging_endpoint}/v1", "eval.request_timeout_s=2")
    )
    line = one_line_error(proc, "eval")
    assert f"the evaluation endpoint at http://127.0.0.1:{hanging_endpoint}/v1 stopped answering" in line
    assert "APITimeoutError after 3 attempts of up to 2 s (eval.request_timeout_s)" in line


def test_grpoflow_eval_without_benchmarks_is_exit_2_before_any_model(tmp_path):
    """`eval.benchmarks: []` is a valid recipe (its held-out split is its evaluation, in `grpoflow run`), but
    `grpoflow eval` has nothing to run with it."""
    proc = grpoflow_run(
        "eval", str(tmp_path / "no-such-checkpoint"), "eval.benchmarks=[]", "--state-dir", str(tmp_path / "s")
    )
    line = one_line_error(proc, "eval")
    assert (
        "configs/tiny-cpu.yaml: eval.benchmarks: needs at least 1 entry to evaluate a model, got []"
    ) in line


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["eval.benchmarks=[aime_24]", "eval.local_paths={}"],
            "eval: unknown benchmark 'aime_24': EvalScope",
        ),
        (
            ["eval.benchmarks=[aime24]"],  # the config's local_paths still names math_500
            "eval: local_paths names benchmark 'math_500', which is not among ['aime24']",
        ),
    ],
)
def test_eval_settings_are_checked_before_the_model_is_even_looked_up(overrides, message, tmp_path):
    # the checkpoint does not exist: had the model been resolved first, that would be the error
    proc = grpoflow_run(
        "eval", str(tmp_path / "no-such-checkpoint"), *overrides, "--state-dir", str(tmp_path / "s")
    )
    line = one_line_error(proc, "eval")
    assert message in line and "configs/tiny-cpu.yaml" in line
    if "aime_24" in message:
        assert "did you mean 'aime24'" in line


def test_eval_with_an_unset_api_key_variable_is_exit_2(closed_port, tmp_path):
    proc = grpoflow_run(
        "eval",
        f"http://127.0.0.1:{closed_port}/v1",
        "--api-key-env",
        "GRPOFLOW_TEST_NO_SUCH_KEY",
        "--state-dir",
        str(tmp_path / "s"),
    )
    assert (
        "--api-key-env GRPOFLOW_TEST_NO_SUCH_KEY: the environment variable GRPOFLOW_TEST_NO_SUCH_KEY "
        "is not set"
    ) in one_line_error(proc, "eval")


@pytest.mark.slow
def test_eval_and_compare_write_under_the_state_dir_never_the_working_directory(tiny_base, tmp_path):
    """`eval` and `compare` started in an empty directory, with --state-dir elsewhere and MLFLOW_TRACKING_URI
    naming a database: the recipe's relative eval.out lands under the state dir, MLflow's artifacts in
    <state>/mlartifacts, and the working directory stays empty."""
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"}
    (tmp_path / "store").mkdir()
    evals = [
        "eval.benchmarks=[aime24]",
        f"eval.local_paths={{aime24: {shared('aime24')}}}",
        "eval.limit=1",
        "eval.max_tokens=8",
        "eval.out=evaluations",
    ]  # relative: under the state dir

    ev = grpoflow_run(
        "eval", tiny_base["path"], "--state-dir", str(state), "--json", *evals, cwd=cwd, env=env, timeout=900
    )
    assert ev.returncode == 0, ev.stderr[-4000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert Path(result["work_dir"]) == state / "evaluations" / Path(tiny_base["path"]).name
    assert (Path(result["work_dir"]) / "report.json").is_file()

    cmp = grpoflow_run(
        "compare",
        result["work_dir"],
        result["report"],
        "--state-dir",
        str(state),
        "--json",
        *evals,
        cwd=cwd,
        env=env,
        timeout=900,
    )
    assert cmp.returncode == 0, cmp.stderr[-4000:]
    compared = json.loads(cmp.stdout.strip().splitlines()[-1])
    assert Path(compared["plot"]).is_relative_to(state / "evaluations" / "comparisons")

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])
    assert {r.info.run_name for r in runs} == {"evaluate", "compare"}
    for r in runs:
        assert r.info.artifact_uri.startswith((state / "mlartifacts").as_uri()), r.info.artifact_uri
    assert (state / "mlartifacts").is_dir()
    assert list(cwd.iterdir()) == []
