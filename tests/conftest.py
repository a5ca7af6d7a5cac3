"""Shared fixtures and helpers: the real reference data in ../shared/data, one tiny base model per test
session, the `grpoflow` command in a subprocess, and loopback servers and ports."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The property-based tests (hypothesis): the same examples on every run (derandomize), so that CI is
# reproducible and a failure reruns as it failed; no example database written into the repository; no
# per-example deadline (a shared 2-core runner is no clock). Each property states its own number of examples
# where 200 would cost too much.
# An environment made before hypothesis joined the dev extra (a vLLM one) still runs its own tests.
if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The files that take longest (`--durations`, 2026-12-05), longest first: under `--dist loadfile` a worker
# takes whole files in collection order, and a long file left to the end runs alone while the other worker
# idles (the last run's tail: 5 minutes of one worker). Only the order in which files start changes.
LONGEST_FIRST = (
    "test_operations.py",
    "test_compare.py",
    "test_pipeline.py",
    "test_multiturn.py",
    "test_gpu_semantics.py",
    "test_multihost.py",
    "test_async.py",
    "test_lora.py",
    "test_deepspeed.py",
    "test_redaction.py",
    "test_trainer.py",
    "test_evaluation.py",
    "test_multimodal.py",
    "test_serving.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def shared(*parts: str) -> Path:
    """A path in the reference data; a test that needs what is not there fails, naming it (a skip would hide
    about fifty tests in a CI run that lost ../shared/data)."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.fail(
            f"reference data not found: {path} (tests read ../shared/data next to the repo; "
            "see ../shared/data/SOURCES.md)",
            pytrace=False,
        )
    return path


@pytest.fixture()
def shared_data() -> Path:
    return shared()


def require_vllm(how_to_run: str) -> None:
    """Skip the calling module when this Python has no vLLM, unless GRPOFLOW_REQUIRE_VLLM=1 (set by `make
    test-vllm` and `make bench`): there a missing vLLM is an error, never a skip."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("GRPOFLOW_REQUIRE_VLLM") == "1":
        raise RuntimeError(
            "GRPOFLOW_REQUIRE_VLLM=1 but vLLM is not installed in this Python "
            f"({sys.executable}): `make install-vllm` creates .venv-vllm"
        )
    pytest.skip(f"vLLM is not installed here: {how_to_run}", allow_module_level=True)


@pytest.fixture
def loss_ratios(monkeypatch) -> list[tuple]:
    """(first pass?, ratio) for every call the trainer makes to the real `trainer.loss.per_token_loss`, in
    order. A call is its micro-batch's first pass when its old log-probs tensor was not passed before: the
    trainer keeps pass one's detached log-probs and passes that same tensor on every later pass."""
    from trainer import loss

    calls, seen, real = [], [], loss.per_token_loss

    def recording(logps, old_logps, *args, **kwargs):
        per_token, stats = real(logps, old_logps, *args, **kwargs)
        calls.append((not any(old_logps is s for s in seen), stats["ratio"]))
        seen.append(old_logps)
        return per_token, stats

    monkeypatch.setattr(loss, "per_token_loss", recording)
    return calls


@pytest.fixture(scope="session")
def tiny_recipe():
    from trainer.recipe import load_recipe

    return load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml")


@pytest.fixture(scope="session")
def tiny_base(tiny_recipe) -> dict:
    """The embedded default's base model (about 2.5 minutes on 2 cores the first time).

    It lives where `make run` keeps it (.state/models/tiny-base): the bootstrap is deterministic and
    cached by its config hash, so a cached copy is the same model.
    """
    from trainer.bootstrap import bootstrap

    out = REPO_ROOT / tiny_recipe.bootstrap.out
    return bootstrap(
        tiny_recipe.bootstrap, out=out, system_prompt=tiny_recipe.data.system_prompt, progress=False
    )


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, tiny_recipe) -> Path:
    """A small prepared copy of the embedded default's data (600 synthetic addition problems)."""
    from data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "addition"
    prepare(**{**tiny_recipe.data.prepare_kwargs(), "out": out, "synthetic_rows": 600})
    return out


@pytest.fixture(scope="session")
def memorising_model(tiny_base, tmp_path_factory) -> str:
    """The tiny base model over-trained to answer a fixed handful of MATH-500 and AIME problems right
    (`memorised_model`; about 30 s on one thread)."""
    from memorised_model import train_memorising_model

    return str(
        train_memorising_model(tiny_base["path"], tmp_path_factory.mktemp("models") / "memorising", shared())
    )


@pytest.fixture(scope="session")
def memorised_eval(memorising_model, tmp_path_factory):
    """The memorising model's EvalScope evaluation on `memorised_model.evaluated_problems` (an `EvalResult`;
    its scores are known problem by problem). Shared: a test that writes into its work dir works on a copy."""
    from memorised_model import evaluate_known_problems

    return evaluate_known_problems(memorising_model, shared(), tmp_path_factory.mktemp("eval") / "memorising")


@pytest.fixture(scope="session")
def plain_eval(tiny_base, tmp_path_factory):
    """The tiny base model's evaluation with the same settings: it solves none of the problems."""
    from memorised_model import evaluate_known_problems

    return evaluate_known_problems(tiny_base["path"], shared(), tmp_path_factory.mktemp("eval") / "plain")


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """A real MLflow tracking store and registry (sqlite) under `tmp_path`: (client, experiment id,
    artifact root)."""
    from mlflow import MlflowClient

    from tasks import tracking

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    client = MlflowClient(uri, registry_uri=uri)
    experiment = tracking.ensure_experiment(client, "grpoflow", str(tmp_path / "artifacts"))
    return client, experiment, tmp_path / "artifacts"


def random_causal_lm(architecture: str, **config):
    """A small randomly initialised `Qwen2ForCausalLM` or `LlamaForCausalLM` (architecture "qwen2" / "llama"),
    seeded, in eval mode: vocabulary 64, hidden 32, MLP 48, 2 layers of 4 heads unless `config` says
    otherwise."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[architecture]
    torch.manual_seed(0)
    defaults = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        eos_token_id=2,
        pad_token_id=0,
    )
    return model_class(config_class(**{**defaults, **config})).eval()


def registrable_copy(model: str | Path, base: str | Path, dst: Path) -> Path:
    """A copy of `model` with the manifest registration reads (the base model's, with `model`'s files): the
    memorising model as a version to register."""
    from data.manifest import combined_sha256, file_hashes, read_manifest, write_json_atomic

    shutil.copytree(model, dst)
    (dst / "manifest.json").unlink(missing_ok=True)
    files = file_hashes(dst)
    write_json_atomic(
        dst / "manifest.json", {**read_manifest(base), "files": files, "sha256": combined_sha256(files)}
    )
    return dst


@contextmanager
def loopback_http(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    """A real HTTP server on 127.0.0.1 (a free port) serving `handler` in daemon threads, shut down on
    exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def scored_copy(src: Path, dst: Path, bench: str, scores: list[float]) -> Path:
    """A copy of a real EvalScope work dir whose per-sample scores on `bench` are set to `scores`
    (report.json's score follows).

    A test fixture standing for "a version whose predictions are better/worse": the tiny model solves no
    AIME problem, so a real evaluation of it cannot show a regression by itself. Everything else is
    EvalScope's. Where a real difference is wanted, `memorised_eval` against `plain_eval` is one.
    """
    shutil.copytree(src, dst)
    report = json.loads((dst / "report.json").read_text())
    [rel] = report["review_paths"][bench]
    lines = [json.loads(line) for line in (dst / rel).read_text().splitlines() if line.strip()]
    assert len(lines) == len(scores)
    for line, score in zip(lines, scores, strict=True):
        value = line["sample_score"]["score"]["value"]
        value[next(iter(value))] = score
    (dst / rel).write_text("".join(json.dumps(line) + "\n" for line in lines))
    report["scores"][bench] = sum(scores) / len(scores)
    (dst / "report.json").write_text(json.dumps(report))
    return dst


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Stop a process started with its own session (`start_new_session=True`) and everything it started: `sig`
    to the group, SIGKILL after `timeout` seconds. Returns its exit status."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


# ---- the `grpoflow` command in a subprocess, ports that refuse or never answer, and tree digests --------

CLI_GUARD_S = 240  # a command that hangs fails its test here instead of hanging the suite
URL_SECRET = "s3cr3t-Pa55"  # a password in a URL: checked never to be printed


def stopped_after(run: Path, step: int) -> None:
    """The run directory as a run stopped right after writing checkpoint `step` leaves it: the newer
    checkpoints gone, `latest` naming that one (metrics.jsonl keeps its later rows: resuming cuts them)."""
    for path in run.glob("checkpoint-*"):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    (run / "latest").write_text(f"checkpoint-{step}\n")


def rollout_workers_once(proc: subprocess.Popen, marker: Path, timeout_s: float = 300) -> list:
    """The rollout worker processes (`psutil.Process`) of the training run `proc` once `marker` exists (e.g.
    its `latest` file: a checkpoint written); fails the test with the run's stderr if it never appears."""
    import psutil

    deadline = time.time() + timeout_s
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[1][-4000:]
    workers = [
        c for c in psutil.Process(proc.pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())
    ]
    assert workers, "no rollout worker process found"
    return workers


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under `root` (hidden ones too) with its sha256 ('dir' for directories)."""
    from data.manifest import sha256_file

    return {p.relative_to(root).as_posix(): "dir" if p.is_dir() else sha256_file(p) for p in root.rglob("*")}


def clean_env(extra: dict | None = None) -> dict:
    """This environment without the caller's Prefect, MLflow and grpoflow settings (each test states its own),
    with this checkout on PYTHONPATH and loopback bypassing any proxy; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(extra or {})
    return env


def vllm_server_command(python: str, model: str, host: str, port: int, max_len: int) -> list[str]:
    """vLLM's OpenAI server as the tests run it as a rollout server (served name `tiny`): processed
    log-probs, eager, and on CPU whole-prompt prefill (seeded requests). Run it with VLLM_SERVER_DEV_MODE=1
    (for /collective_rpc, the weight reload)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_len),
        "--logprobs-mode",
        "processed_logprobs",
        "--no-enable-chunked-prefill",
    ]


def torchrun(script: Path, *args, ranks: int, timeout: float = 600) -> subprocess.CompletedProcess:
    """`script args` run by `ranks` local processes under torchrun (`--standalone`), as `grpoflow train`
    launches trainer ranks; this process's own rank variables are kept out of theirs."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return subprocess.run(
        [sys.executable, *launcher, str(script), *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def grpoflow_run(
    *args: str,
    env: dict | None = None,
    prefix: list[str] = (),
    cwd: Path = REPO_ROOT,
    timeout: float = CLI_GUARD_S,
) -> subprocess.CompletedProcess:
    """`grpoflow ARGS` to its end in a subprocess (after the command prefix `prefix`), in `clean_env(env)`."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(env),
        stdin=subprocess.DEVNULL,
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_line_error(proc: subprocess.CompletedProcess, command: str, code: int = 2) -> str:
    """The command's one error line, after checking the exit code and that no traceback was printed."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"grpoflow {command}: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# A training callback that holds a run at one step the first time it gets there (the marker `held`, next to
# it, says it did) until the test interrupts it; a rerun of the same command goes through.
HOLD_ONCE = """
import time
from pathlib import Path

HELD = Path(__file__).with_name("held")


class HoldOnce:
    def on_step(self, step, metrics):
        if step == {step} and not HELD.exists():
            HELD.write_text("")
            time.sleep({guard_s})  # where the test's Ctrl-C lands
"""


def hold_once_at(step: int, directory: Path) -> str:
    """A `train.callbacks` entry holding the run at `step` (after that step's metrics row, before its
    checkpoint) the first time; `directory/held` appears when it does."""
    directory.mkdir(parents=True, exist_ok=True)
    plugin = directory / "hold_once.py"
    plugin.write_text(HOLD_ONCE.format(step=step, guard_s=CLI_GUARD_S))
    return f"{plugin}:HoldOnce"


def ctrl_c_when(marker: Path, *args: str, logs: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`grpoflow ARGS` as started from a terminal (a process group of its own, SIGINT at its default), and the
    terminal's Ctrl-C (SIGINT to the whole group: the command and whatever it started) once `marker` exists;
    to its end. Output goes to `logs`.out/.err (a pipe nobody reads while it runs could fill up)."""
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    with out.open("w") as stdout, err.open("w") as stderr:
        # a test run started in the background (`make test &`) has SIGINT ignored, which a child inherits:
        # the command gets the default back, as in a terminal
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=REPO_ROOT,
            env=clean_env(env),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + CLI_GUARD_S
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(
                    f"the command ended ({proc.returncode}) before {marker}: {err.read_text()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"{marker} did not appear within {CLI_GUARD_S} s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=CLI_GUARD_S)
    finally:
        stop_group(proc, signal.SIGKILL, timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def eval_cli_args(tmp_path: Path, model: str, *extra: str) -> list[str]:
    """`grpoflow eval MODEL` on one AIME problem, 8 tokens, with its state under `tmp_path`."""
    return [
        "eval",
        model,
        "eval.benchmarks=[aime24]",
        f"eval.local_paths={{aime24: {shared('aime24')}}}",
        "eval.limit=1",
        "eval.max_tokens=8",
        "--state-dir",
        str(tmp_path / "state"),
        *extra,
    ]


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
