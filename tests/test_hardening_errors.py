"""Issue 15, cases 5, 7 and 8: no gate talked into passing, every network wait bounded, every bad input exit 2.

5. Non-finite and out-of-range numbers are refused everywhere: CLI flags (`gate --max-drop nan`), every float
   of the recipe, the gate itself.
7. An endpoint, an MLflow server or a Prefect API that does not answer (a real listening socket that never
   replies, a closed port, an endpoint that hangs on requests) is one line and exit 2 naming it, credentials
   masked, within a bound; MLflow's HTTP retries are bounded unless the user set them.
8. User input that used to end in a traceback is exit 2 with file/field/value, checked before any model;
   `--json` prints its object on every exit (argparse errors, SIGINT); a read-only `--out` and a full disk
   (real tmpfs mounts in a private mount namespace) are one line each.

Every command runs as a real `grpoflow` subprocess; the subprocess timeout is a guard, never the assertion.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO_ROOT, shared

GUARD_S = 240  # a command that hangs fails the test here instead of hanging the suite
SECRET = "s3cr3t-Pa55"


# --- helpers -------------------------------------------------------------------------------------------------------

def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    env.update(extra or {})
    return env


def grpoflow(*args: str, env: dict | None = None, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=GUARD_S, env=_env(env), stdin=subprocess.DEVNULL)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_line_error(proc: subprocess.CompletedProcess, command: str, code: int = 2) -> str:
    """The command's one error line, after checking the exit code and that no traceback was printed."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"grpoflow {command}: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def in_tmpfs(mountpoint: Path, options: str) -> list[str]:
    """A command prefix running the command in a private mount namespace with a real tmpfs at `mountpoint`
    (`unshare -m` as root, `unshare -rm` otherwise); the mount disappears with the process. After the command,
    what is left in the tmpfs is printed to stderr as `LEFT:<names>`."""
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = ('mount -t tmpfs -o "$1" tmpfs "$0" || exit 97; shift; "$@"; rc=$?; '
              'echo "LEFT:$(ls -A "$0" | tr "\\n" " ")" >&2; exit $rc')
    return [*unshare, "sh", "-c", script, str(mountpoint), options]


@pytest.fixture
def silent_port():
    """A real TCP server on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield server
    server.close()


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def hanging_endpoint():
    """A real HTTP server that answers GET /v1/models like an OpenAI endpoint and never answers a completion."""
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            release.wait(GUARD_S)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    release.set()
    server.shutdown()
    server.server_close()


# --- 5. a gate that cannot be talked into passing; finite, in-range numbers everywhere -----------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_gate_refuses_a_non_finite_or_negative_max_drop_with_exit_2(value, tmp_path):
    proc = grpoflow("gate", "--candidate", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"), "--max-drop", value,
                    "--state-dir", str(tmp_path / "state"), "--json")
    line = one_line_error(proc, "gate")
    assert "--max-drop" in line and repr(value) in line
    assert last_json(proc) == {"error": line.split(": error: ", 1)[1], "exit_code": 2}


def test_the_gate_itself_refuses_nan_instead_of_passing_a_total_drop(tmp_path):
    from evaluation.compare import compare, gate
    from tasks.comparison import run_comparison
    from trainer.recipe import load_recipe

    # every problem solved before, none after: a drop of 1.0
    rows = compare({"aime24": {"accuracy": {f"p{i}": 1.0 for i in range(8)}}},
                   {"aime24": {"accuracy": {f"p{i}": 0.0 for i in range(8)}}})
    assert not gate(rows, max_drop=0.02).passed
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="max_drop must be a finite number >= 0"):
            gate(rows, max_drop=bad)
    # refused before any store is opened or any evaluation runs
    with pytest.raises(ValueError, match="max_drop must be a finite number >= 0, got nan"):
        run_comparison("a", "b", load_recipe(None).to_dict(), {"tracking_uri": "sqlite:////proc/no/db"},
                       max_drop=math.nan)


def _float_fields():
    """(dotted key, field) of every float-typed field of the recipe, nested sections included."""
    import dataclasses
    import typing

    from trainer.recipe import Recipe
    from trainer.typed_config import yaml_key

    out = []
    for section in dataclasses.fields(Recipe):
        cls = typing.get_type_hints(Recipe)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]  # float, float | None, list[float]
            if tp is float or float in typing.get_args(tp):
                out.append(f"{section.name}.{yaml_key(f)}")
    return out


def test_every_float_of_the_recipe_refuses_nan_and_infinity():
    from trainer.recipe import load_recipe
    from trainer.typed_config import ConfigError

    keys = _float_fields()
    assert {"train.learning_rate", "train.temperature", "eval.temperature", "eval.request_timeout_s",
            "bootstrap.target_accuracy", "rollout.sync_timeout_s"} <= set(keys)
    for key in keys:
        for value in (".nan", ".inf", "-.inf"):
            override = f"{key}=[{value}, 0.5]" if key == "bootstrap.target_accuracy" else f"{key}={value}"
            with pytest.raises(ConfigError, match="must be a finite number") as e:
                load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", [override])
            assert key in str(e.value) and "tiny-cpu.yaml" in str(e.value)
    with pytest.raises(ConfigError, match=r"rewards\[0\].args.weight: must be a finite number"):
        load_recipe(None, ["rewards=[{name: accuracy, args: {weight: .nan}}]"])


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=-1", "train.learning_rate: must be > 0, got -1.0"),
    ("train.learning_rate=0", "train.learning_rate: must be > 0, got 0.0"),
    ("train.temperature=0", "train.temperature: must be > 0, got 0.0"),
    ("train.top_p=1.5", "train.top_p: must be <= 1, got 1.5"),
    ("train.beta=-0.1", "train.beta: must be >= 0, got -0.1"),
    ("train.max_grad_norm=-1", "train.max_grad_norm: must be >= 0, got -1.0"),
    ("train.reward_timeout_s=0", "train.reward_timeout_s: must be > 0, got 0.0"),
    ("train.max_steps=0", "train.max_steps: must be >= 1, got 0"),
    ("eval.temperature=-0.5", "eval.temperature: must be >= 0, got -0.5"),
    ("eval.limit=0", "eval.limit: must be >= 1, got 0"),
    ("eval.repeats=0", "eval.repeats: must be >= 1, got 0"),
    ("eval.request_timeout_s=0", "eval.request_timeout_s: must be > 0, got 0.0"),
    ("eval.benchmarks=[]", "eval.benchmarks: needs at least 1 entry, got []"),
    ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization: must be > 0, got 0.0"),
    ("rollout.train_devices=[0, -1]", "rollout.train_devices[1]: must be >= 0, got -1"),
    ("data.heldout=-0.1", "data.heldout: must be >= 0, got -0.1"),
    ("data.heldout=1.5", "heldout: 1.5 is neither a fraction in (0, 1) nor a whole number of rows"),
    ("bootstrap.target_accuracy=[0.3, 1.2]", "bootstrap.target_accuracy[1]: must be <= 1, got 1.2"),
])
def test_recipe_values_out_of_their_range_are_refused_naming_the_key(override, message):
    from trainer.recipe import load_recipe
    from trainer.typed_config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_recipe(None, [override])
    assert message in str(e.value) and str(e.value).startswith("<defaults> + overrides")


def test_meaningful_edge_values_and_explicitly_non_finite_fields_are_accepted():
    from dataclasses import dataclass, field

    from trainer.recipe import load_recipe
    from trainer.typed_config import build

    r = load_recipe(None, ["eval.temperature=0", "train.max_grad_norm=0", "train.save_total_limit=0",
                           "train.eval_heldout=0", "data.heldout=0", "data.heldout=3", "train.beta=0"])
    assert (r.eval.temperature, r.train.max_grad_norm, r.data.heldout) == (0.0, 0.0, 3.0)

    @dataclass
    class Bounds:
        ceiling: float = field(default=math.inf, metadata={"finite": False})

    assert math.isinf(build(Bounds, {"ceiling": float("inf")}).ceiling)


# --- 7. every network wait bounded; an unreachable service is one line, exit 2 --------------------------------------

def _eval_args(tmp_path, model: str, *extra: str) -> list[str]:
    return ["eval", model, "eval.benchmarks=[aime24]", f"eval.local_paths={{aime24: {shared('aime24')}}}",
            "eval.limit=1", "eval.max_tokens=8", "--state-dir", str(tmp_path / "state"), *extra]


def test_eval_against_a_server_that_never_answers_is_exit_2_naming_it(silent_port, tmp_path):
    port = silent_port.getsockname()[1]
    proc = grpoflow(*_eval_args(tmp_path, f"http://127.0.0.1:{port}/v1", "eval.request_timeout_s=5", "--json"))
    line = one_line_error(proc, "eval")
    assert f"the evaluation endpoint at http://127.0.0.1:{port}/v1/models is unreachable: no answer within 5 s" in line
    assert last_json(proc)["exit_code"] == 2


def test_eval_against_a_closed_port_is_exit_2_with_credentials_masked(closed_port, tmp_path):
    proc = grpoflow(*_eval_args(tmp_path, f"http://user:{SECRET}@127.0.0.1:{closed_port}/v1", "--json"))
    line = one_line_error(proc, "eval")
    assert f"http://user:***@127.0.0.1:{closed_port}/v1/models is unreachable: connection refused" in line
    assert SECRET not in proc.stdout + proc.stderr
    assert last_json(proc)["exit_code"] == 2


def test_an_endpoint_that_hangs_on_requests_is_bounded_by_eval_request_timeout_s(hanging_endpoint, tmp_path):
    """/v1/models answers, so the check passes; every completion hangs: EvalScope gives up after its bounded
    attempts of eval.request_timeout_s each, and that is one line naming the endpoint."""
    proc = grpoflow(*_eval_args(tmp_path, f"http://127.0.0.1:{hanging_endpoint}/v1", "eval.request_timeout_s=2"))
    line = one_line_error(proc, "eval")
    assert f"the evaluation endpoint at http://127.0.0.1:{hanging_endpoint}/v1 stopped answering" in line
    assert "APITimeoutError after 3 attempts of up to 2 s (eval.request_timeout_s)" in line


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_gate_with_an_unreachable_mlflow_server_is_one_line_exit_2(server, silent_port, closed_port, tmp_path):
    port = closed_port if server == "closed" else silent_port.getsockname()[1]
    proc = grpoflow("gate", "--candidate", "models:/grpoflow-tiny/2", "--baseline", "models:/grpoflow-tiny@champion",
                    "--state-dir", str(tmp_path / "state"), "--json",
                    env={"MLFLOW_TRACKING_URI": f"http://ci:{SECRET}@127.0.0.1:{port}"})
    line = one_line_error(proc, "gate")
    reason = "connection refused" if server == "closed" else "no answer within 10 s"
    assert f"MLflow tracking store at http://ci:***@127.0.0.1:{port} is unreachable: {reason} " \
           "(MLFLOW_TRACKING_URI)" in line
    assert SECRET not in proc.stdout + proc.stderr and last_json(proc)["exit_code"] == 2


def test_compare_with_an_unreachable_mlflow_server_is_one_line_exit_2(closed_port, tmp_path):
    proc = grpoflow("compare", "models:/grpoflow-tiny/1", "models:/grpoflow-tiny/2", "--state-dir",
                    str(tmp_path / "state"), env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed_port}"})
    assert "is unreachable: connection refused" in one_line_error(proc, "compare")


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_run_with_a_dead_prefect_api_is_exit_2_before_the_pipeline_starts(server, silent_port, closed_port,
                                                                           tmp_path):
    port = closed_port if server == "closed" else silent_port.getsockname()[1]
    state = tmp_path / "state"
    proc = grpoflow("run", "--state-dir", str(state), "--json",
                    env={"PREFECT_API_URL": f"http://user:{SECRET}@127.0.0.1:{port}/api"})
    line = one_line_error(proc, "run")
    reason = "connection refused" if server == "closed" else "no answer within 10 s"
    assert f"the Prefect API at http://user:***@127.0.0.1:{port}/api/health is unreachable: {reason} " \
           "(PREFECT_API_URL)" in line
    assert SECRET not in proc.stdout + proc.stderr and last_json(proc)["exit_code"] == 2
    assert not (state / "data").exists() and not (state / "runs").exists()  # nothing was prepared or trained


def test_mlflow_http_retries_and_timeouts_are_bounded_unless_the_user_set_them(monkeypatch, tmp_path):
    from tasks import tracking

    for variable in tracking.HTTP_BOUNDS:  # set, then removed: monkeypatch restores the test's environment
        monkeypatch.setenv(variable, "0")
        monkeypatch.delenv(variable)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")  # the user's own setting wins
    tracking.client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"


# --- 8. user input: exit 2 naming file/field/value, before any model -----------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("eval.limit=0", "eval.limit: must be >= 1, got 0"),
    ("eval.benchmarks=[]", "eval.benchmarks: needs at least 1 entry, got []"),
    ("train.learning_rate=-1", "train.learning_rate: must be > 0, got -1.0"),
    ("train.temperature=.nan", "train.temperature: must be a finite number, got nan"),
])
def test_recipe_input_errors_are_exit_2_naming_file_and_field(override, message, tmp_path):
    proc = grpoflow("eval", str(tmp_path / "no-such-checkpoint"), override, "--state-dir", str(tmp_path / "s"))
    line = one_line_error(proc, "eval")
    assert message in line and "configs/tiny-cpu.yaml + overrides" in line


@pytest.mark.parametrize("overrides, message", [
    (["eval.benchmarks=[aime_24]", "eval.local_paths={}"],
     "eval: unknown benchmark 'aime_24': EvalScope"),
    (["eval.benchmarks=[aime24]"],  # the config's local_paths still names math_500
     "eval: local_paths names benchmark 'math_500', which is not among ['aime24']"),
])
def test_eval_settings_are_checked_before_the_model_is_even_looked_up(overrides, message, tmp_path):
    # the checkpoint does not exist: had the model been resolved first, that would be the error
    proc = grpoflow("eval", str(tmp_path / "no-such-checkpoint"), *overrides, "--state-dir", str(tmp_path / "s"))
    line = one_line_error(proc, "eval")
    assert message in line and "configs/tiny-cpu.yaml" in line
    if "aime_24" in message:
        assert "did you mean 'aime24'" in line


def test_eval_with_an_unset_api_key_variable_is_exit_2(closed_port, tmp_path):
    proc = grpoflow("eval", f"http://127.0.0.1:{closed_port}/v1", "--api-key-env", "GRPOFLOW_TEST_NO_SUCH_KEY",
                    "--state-dir", str(tmp_path / "s"))
    assert "--api-key-env GRPOFLOW_TEST_NO_SUCH_KEY: the environment variable GRPOFLOW_TEST_NO_SUCH_KEY is not " \
           "set" in one_line_error(proc, "eval")


def _gsm8k_rows(n: int = 20) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i} more. How many now?",
             "answer": f"He has {i} + {i} = {2 * i}.\n#### {2 * i}"} for i in range(1, n + 1)]


def test_prep_without_task_is_refused_for_a_file_and_inferred_for_the_generator(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows()))
    proc = grpoflow("prep", "--source", str(source), "--out", str(tmp_path / "out"))
    line = one_line_error(proc, "prep")
    assert f"data: task: required for source '{source}' (prep --task, or data.task)" in line and "gsm8k" in line
    assert not (tmp_path / "out").exists()
    proc = grpoflow("prep", "--source", "synthetic:addition", "--out", str(tmp_path / "syn"), "data.synthetic_rows=40")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "syn" / "manifest.json").read_text())["task"] == "synthetic"


def test_prep_heldout_that_is_neither_fraction_nor_count_is_refused(tmp_path):
    proc = grpoflow("prep", "--task", "synthetic", "--source", "synthetic:addition", "--heldout", "1.5",
                    "--out", str(tmp_path / "out"))
    assert "heldout: 1.5 is neither a fraction in (0, 1) nor a whole number of rows" in one_line_error(proc, "prep")


def test_prep_latin1_csv_and_corrupt_parquet_are_exit_2_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    latin1 = tmp_path / "latin1.csv"
    latin1.write_text("question,answer\n" + "".join(f"Café {i}: how much?,It costs {i} #### {i}\n"
                                                     for i in range(1, 11)), encoding="latin-1")
    line = one_line_error(grpoflow("prep", "--task", "gsm8k", "--source", str(latin1), "--out", str(tmp_path / "a")),
                          "prep")
    assert f"{latin1}:2: not UTF-8 text (byte 0xe9" in line and "save the file as UTF-8" in line

    rows = _gsm8k_rows(2000)
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({k: [r[k] + " " * 200 for r in rows] for k in ("question", "answer")}), good,
                   data_page_size=4096, compression="NONE")
    data = bytearray(good.read_bytes())
    data[len(data) // 2: len(data) // 2 + 3000] = b"A" * 3000  # a damaged page in the middle, footer intact
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(bytes(data))
    line = one_line_error(grpoflow("prep", "--task", "gsm8k", "--source", str(corrupt), "--out", str(tmp_path / "b")),
                          "prep")
    assert f"{corrupt}: unreadable Parquet data after row" in line and "damaged or truncated" in line


def test_prep_reads_a_csv_with_a_byte_order_mark(tmp_path):
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfquestion,answer\n" + b"".join(
        f"What is {i} + {i}?,{i} + {i} = {2 * i} #### {2 * i}\n".encode() for i in range(1, 11)))
    proc = grpoflow("prep", "--task", "gsm8k", "--source", str(bom), "--out", str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert last_json(proc)["rows"] == {"train": 9, "heldout": 1}
    first = json.loads((tmp_path / "out" / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"][-1]["content"].startswith("What is") and first["answer"].isdigit()


def test_prep_out_on_a_read_only_file_system_is_exit_2_naming_it(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = grpoflow("prep", "--task", "synthetic", "--source", "synthetic:addition", "data.synthetic_rows=40",
                    "--out", str(mnt / "sub" / "out"), "--json", prefix=in_tmpfs(mnt, "ro,size=64k"))
    line = one_line_error(proc, "prep")
    assert f"--out {mnt / 'sub' / 'out'}: cannot write in {mnt} (read-only file system)" in line
    assert last_json(proc) == {"error": line.split(": error: ", 1)[1], "exit_code": 2}


def test_a_full_disk_is_reported_as_disk_full_and_leaves_nothing_behind(tmp_path):
    source = tmp_path / "big.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows(400)))  # ~60 kB prepared
    mnt = tmp_path / "small"
    mnt.mkdir()
    out = mnt / "out"
    proc = grpoflow("prep", "--task", "gsm8k", "--source", str(source), "--out", str(out), "--json",
                    prefix=in_tmpfs(mnt, "size=16k"))
    line = one_line_error(proc, "prep", code=1)
    assert f"disk full (no space left on device) writing: {out}" in line
    assert last_json(proc)["exit_code"] == 1
    assert re.search(r"^LEFT:$", proc.stderr, re.M), proc.stderr[-500:]  # no half-written directory left


@pytest.mark.parametrize("args", [["prep", "--bogus", "--json"], ["gate", "--json"], ["prep", "--limit", "0",
                                                                                      "--json"]])
def test_json_is_printed_on_argparse_errors(args):
    proc = grpoflow(*args)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    result = last_json(proc)
    assert result["exit_code"] == 2 and result["error"]


def test_json_is_printed_on_sigint_with_exit_130(silent_port, tmp_path):
    port = silent_port.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *_eval_args(tmp_path, f"http://127.0.0.1:{port}/v1",
                                                                            "--json")],
                            cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        readable, _, _ = select.select([silent_port], [], [], GUARD_S)  # the command is now waiting on us
        assert readable, "the command never connected"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=GUARD_S)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1]) == {"error": "interrupted", "exit_code": 130}
    assert "grpoflow eval: error: interrupted" in stderr


def test_every_user_error_derives_from_one_class_the_cli_maps_to_exit_2():
    from data.errors import DataError, GrpoflowUserError, ServiceUnavailable
    from data.manifest import IntegrityError, OutputDirError
    from evaluation.evalscope_runner import EvalInputError
    from flows.cli import UsageError
    from trainer.extras import MissingExtraError
    from trainer.plugins import PluginError
    from trainer.rewards import RewardSpecError
    from trainer.typed_config import ConfigError

    for cls in (ConfigError, DataError, RewardSpecError, PluginError, MissingExtraError, UsageError,
                ServiceUnavailable, EvalInputError, IntegrityError, OutputDirError):
        assert issubclass(cls, GrpoflowUserError), cls
    # still what callers caught before
    assert issubclass(ConfigError, ValueError) and issubclass(MissingExtraError, ImportError)


def test_the_pipeline_is_not_started_with_an_unknown_benchmark(tmp_path):
    state = tmp_path / "state"
    proc = grpoflow("run", "--state-dir", str(state), "eval.benchmarks=[math500]", "eval.local_paths={}")
    assert "unknown benchmark 'math500'" in one_line_error(proc, "run")
    assert not (state / "data").exists()

