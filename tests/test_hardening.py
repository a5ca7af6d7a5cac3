"""Issue 15's hardening cases, each tested on the real component: nothing lost, nothing corrupt trained on,
no secret printed, every wait bounded, every bad input exit 2, a model server that a careless client cannot
starve or crash.

Sections: Cases 1-4: nothing lost, nothing corrupt trained on; Cases 5, 7, 8: no gate talked into passing, bounded waits, exit 2 for bad input; Cases 6 and 10: no secret shown or stored, outputs under the state directory; Case 9 and the serve-model part of case 7: the model server.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

from conftest import REPO_ROOT, loopback_http, shared
from data.manifest import IntegrityError, OutputDirError, atomic_dir, read_manifest, sha256_dir, sha256_file
from data.redact import mask_uri, redact
from flows.cli import main

# ==========================================================================================================
# Cases 1-4: nothing lost, nothing corrupt trained on
# ==========================================================================================================
# Issue 15, cases 1-4: nothing lost, nothing corrupt trained on (real CLI, real tiny model, real files).
#
# 1. An output directory is replaced only when it is a previous grpoflow output of the same kind.
# 2. Corrupt checkpoints are set aside and the newest intact one is resumed; a torn metrics line is repaired;
#    edited data is refused; a corrupt checkpoint is not loaded as a model.
# 3. A run directory resumed with a different training configuration (or other data) is refused, untouched.
# 4. A diverging run stops naming the step, before a checkpoint of non-finite weights is written.
#
# The trained run the resume tests start from is made once per module (2 steps, a checkpoint after each) and
# copied per test; recipe paths are relative to the test's working directory, so a copy is the same recipe.

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


def _tree(root: Path) -> dict[str, str]:
    """Every path under `root` (hidden ones too) with its sha256 ('dir' for directories)."""
    return {p.relative_to(root).as_posix(): "dir" if p.is_dir() else sha256_file(p) for p in root.rglob("*")}


def _prep(out, *extra: str) -> list[str]:
    return ["prep", "--task", "synthetic", "--source", "synthetic:addition", "--out", str(out), "--heldout", "0.1",
            "data.synthetic_rows=40", *extra]


# ------------------------------------------------------------------------------ 1. output directories

def test_prep_refuses_a_project_directory_and_the_current_directory(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "notes.txt").write_text("my notes\n")
    before = _tree(tmp_path)

    assert main(_prep(project)) == 2
    assert "project" in capsys.readouterr().err
    monkeypatch.chdir(project)
    assert main(_prep(".")) == 2
    err = capsys.readouterr().err
    assert "current directory" in err and str(project) in err
    assert _tree(tmp_path) == before  # nothing replaced, moved aside or left behind


def test_prep_refuses_an_unrelated_directory_and_a_file(tmp_path, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8 not really a cat")
    target = tmp_path / "train.jsonl"
    target.write_text('{"keep": "me"}\n')
    before = _tree(tmp_path)

    assert main(_prep(other)) == 2
    assert "not a grpoflow output" in capsys.readouterr().err
    assert main(_prep(target, "--json")) == 2
    out, err = capsys.readouterr()
    assert "not a directory" in err and json.loads(out.splitlines()[-1])["exit_code"] == 2
    assert _tree(tmp_path) == before


def test_prep_replaces_its_own_previous_output(tmp_path):
    out = tmp_path / "prepared"
    assert main(_prep(out)) == 0
    first = read_manifest(out)
    assert main(_prep(out, "data.synthetic_rows=60")) == 0
    second = read_manifest(out)
    assert first["rows"]["train"] + first["rows"]["heldout"] < second["rows"]["train"] + second["rows"]["heldout"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # no hidden leftovers
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(_prep(empty)) == 0 and (empty / "manifest.json").is_file()


def test_bootstrap_model_refuses_an_unrelated_out_before_any_work(tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.tex").write_text("\\section{}\n")
    before = _tree(tmp_path)
    assert main(["bootstrap-model", "--out", str(other)]) == 2
    assert str(other) in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_an_output_of_another_kind_is_not_replaced(tmp_path):
    """Checkpoints go through the same check: a prepared dataset is never replaced by a checkpoint."""
    out = tmp_path / "prepared"
    assert main(_prep(out)) == 0
    before = _tree(out)
    with pytest.raises(OutputDirError, match="prepared-dataset"):
        with atomic_dir(out, kind="checkpoint") as tmp:
            (tmp / "weights").write_text("x")
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]


# --------------------------------------------------------------------------------- a trained run

def _train_args(tiny_base: dict, *overrides: str) -> list[str]:
    return ["train", "--config", str(TINY), f"bootstrap.out={tiny_base['path']}", "data.out=data",
            "train.output_dir=run", "train.max_steps=2", "train.save_steps=1", "train.save_total_limit=3",
            "train.prompts_per_step=2", "train.num_generations=4", "train.eval_heldout=8",
            "train.micro_batch_size=8", "train.learning_rate=3e-4",
            # constant, whatever the recipe says: the resume rules below differ for a schedule tied to max_steps
            "train.lr_scheduler_type=constant", *overrides]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_base, tiny_data) -> Path:
    """A directory with `data/` (a copy of tiny_data) and `run/` (2 steps, checkpoint-1 and checkpoint-2)."""
    root = tmp_path_factory.mktemp("trained")
    shutil.copytree(tiny_data, root / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main(_train_args(tiny_base)) == 0
    assert (root / "run" / "latest").read_text().strip() == "checkpoint-2"
    return root


@pytest.fixture
def run(trained, tmp_path, monkeypatch) -> Path:
    """A private copy of the trained run; the working directory is its root."""
    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    monkeypatch.chdir(root)
    return root


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(checkpoint / "model.safetensors")


def _zero_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start, end = len(data) // 3, 2 * len(data) // 3
    data[start:end] = bytes(end - start)
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ 2. checkpoint integrity

def test_zeroed_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(run, trained, tiny_base, capsys, caplog):
    weights = run / "run" / "checkpoint-2" / "model.safetensors"
    size = weights.stat().st_size
    _zero_middle(weights)
    assert weights.stat().st_size == size
    with caplog.at_level(logging.WARNING, "grpoflow"):
        assert main(_train_args(tiny_base, "--json")) == 0
    summary = _summary(capsys)
    assert summary["resumed_from_step"] == 1
    assert any("checkpoint-2" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    assert (run / "run" / "checkpoint-2.corrupt" / "model.safetensors").stat().st_size == size  # kept to inspect
    # step 2 was trained again from checkpoint-1: the same weights as the original, uncorrupted step 2
    redone, original = _weights(run / "run" / "checkpoint-2"), _weights(trained / "run" / "checkpoint-2")
    for name in original:
        torch.testing.assert_close(redone[name], original[name], rtol=1e-5, atol=1e-6)
    assert read_manifest(run / "run" / "checkpoint-2")["sha256"] == sha256_dir(run / "run" / "checkpoint-2")


def test_truncated_checkpoint_falls_back_and_none_left_starts_fresh(run, tiny_base, capsys, caplog):
    for step in (1, 2):
        weights = run / "run" / f"checkpoint-{step}" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, "grpoflow"):
        assert main(_train_args(tiny_base, "--json")) == 0
    assert _summary(capsys)["resumed_from_step"] == 0
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint-1 is corrupt" in messages and "checkpoint-2 is corrupt" in messages
    assert "starting fresh" in messages
    assert [json.loads(line)["step"] for line in (run / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_latest_naming_a_missing_checkpoint_falls_back(run, tiny_base, capsys, caplog):
    shutil.rmtree(run / "run" / "checkpoint-2")
    with caplog.at_level(logging.WARNING, "grpoflow"):
        assert main(_train_args(tiny_base, "--json")) == 0
    assert _summary(capsys)["resumed_from_step"] == 1
    assert any("checkpoint-2, which is missing" in r.getMessage() for r in caplog.records)
    assert (run / "run" / "latest").read_text().strip() == "checkpoint-2"


def test_torn_last_metrics_line_is_dropped_on_resume(run, tiny_base, capsys, caplog):
    metrics = run / "run" / "metrics.jsonl"
    complete = metrics.read_text()
    metrics.write_text(complete + '{"step": 3, "reward": 0.2')  # the write a crash interrupted
    with caplog.at_level(logging.WARNING, "grpoflow"):
        assert main(_train_args(tiny_base, "--json")) == 0
    assert _summary(capsys)["resumed_from_step"] == 2
    assert metrics.read_text() == complete
    assert any("metrics.jsonl:3" in r.getMessage() and "partial" in r.getMessage() for r in caplog.records)


def test_an_unreadable_metrics_line_is_an_error_naming_file_and_line(run, tiny_base, capsys):
    metrics = run / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("{not json\n" + "".join(lines[1:]))
    before = _tree(run)
    assert main(_train_args(tiny_base)) == 2
    assert f"{run / 'run' / 'metrics.jsonl'}:1" in capsys.readouterr().err
    assert _tree(run) == before


def test_edited_data_is_refused_naming_the_file(run, tiny_base, capsys):
    train = run / "data" / "train.jsonl"
    rows = train.read_text().splitlines()
    first = json.loads(rows[0])
    first["answer"] = str(int(first["answer"]) + 1)
    train.write_text("\n".join([json.dumps(first), *rows[1:]]) + "\n")
    before = _tree(run)
    assert main(_train_args(tiny_base)) == 2
    assert "data/train.jsonl: its sha256 differs" in capsys.readouterr().err
    assert _tree(run) == before
    shutil.rmtree(run / "run")  # a fresh run on the edited data is refused the same way: nothing is trained
    assert main(_train_args(tiny_base)) == 2
    assert "data/train.jsonl: its sha256 differs" in capsys.readouterr().err
    assert not (run / "run").exists()


def test_data_other_than_the_checkpoint_recorded_is_refused(run, tiny_base, capsys):
    """Data re-made under the same name with a consistent manifest: the checkpoint's data_sha256 catches it."""
    data = run / "data"
    rows = (data / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(rows[1:]) + "\n")
    manifest = read_manifest(data)
    manifest["files"]["train.jsonl"] = sha256_file(data / "train.jsonl")
    manifest["rows"]["train"] -= 1
    manifest["sha256"] = sha256_dir(data)
    (data / "manifest.json").write_text(json.dumps(manifest))
    recorded = read_manifest(run / "run" / "checkpoint-2")["data_sha256"]
    assert recorded != manifest["sha256"]
    before = _tree(run)
    assert main(_train_args(tiny_base)) == 2
    err = capsys.readouterr().err
    assert "trained on other data" in err and recorded in err
    assert _tree(run) == before


def test_a_corrupt_checkpoint_is_not_loaded_as_a_model(run, tiny_recipe, capsys):
    from trainer.model_loading import load_model

    checkpoint = run / "run" / "checkpoint-2"
    load_model(str(checkpoint), tiny_recipe.model)  # intact: loads
    _zero_middle(checkpoint / "model.safetensors")
    with pytest.raises(IntegrityError, match="model.safetensors"):
        load_model(str(checkpoint), tiny_recipe.model)
    # nor evaluated: EvalScope would load it in its own process, so `eval` checks it first (exit 2, no run)
    state = run / "eval-state"
    capsys.readouterr()
    paths = f"eval.local_paths={{math_500: {shared('math_500')}, aime24: {shared('aime24')}}}"
    assert main(["eval", str(checkpoint), "--state-dir", str(state), "eval.limit=1", paths, "--json"]) == 2
    assert "model.safetensors" in capsys.readouterr().err and not (state / "eval").exists()


# ---------------------------------------------------------------------- 3. a changed configuration

@pytest.mark.parametrize("override, key", [("train.learning_rate=1e-3", "train.learning_rate"),
                                           ("train.beta=0.04", "train.beta"),
                                           ("data.out=data2", "data.out")])
def test_resuming_with_a_changed_configuration_is_refused(run, tiny_base, capsys, override, key):
    if key == "data.out":
        shutil.copytree(run / "data", run / "data2")
    before = _tree(run)
    assert main(_train_args(tiny_base, override, "--json")) == 2
    out, err = capsys.readouterr()
    assert key in err and "different configuration" in err
    assert json.loads(out.splitlines()[-1])["exit_code"] == 2
    assert _tree(run) == before  # not half-applied: no metrics cut, no checkpoint, no pointer moved


def test_training_longer_and_checkpointing_differently_may_resume(run, tiny_base, capsys):
    assert main(_train_args(tiny_base, "train.max_steps=3", "train.save_steps=3", "--json")) == 0
    summary = _summary(capsys)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    assert read_manifest(run / "run" / "checkpoint-3")["recipe"]["train"]["max_steps"] == 3


def test_stopping_before_the_checkpoint_or_a_decaying_schedule_change_is_refused(run, tiny_base, capsys):
    assert main(_train_args(tiny_base, "train.max_steps=1")) == 2
    assert "past train.max_steps=1" in capsys.readouterr().err
    # a linear schedule is defined by max_steps: changing both is two differing keys
    assert main(_train_args(tiny_base, "train.max_steps=3", "train.lr_scheduler_type=linear")) == 2
    err = capsys.readouterr().err
    assert "train.max_steps" in err and "train.lr_scheduler_type" in err


# ------------------------------------------------------------------------- 4. a diverging run

def test_a_diverging_run_stops_naming_the_step_before_saving(tmp_path, tiny_base, tiny_data, monkeypatch, capsys):
    shutil.copytree(tiny_data, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    code = main(_train_args(tiny_base, "train.learning_rate=1e30", "train.max_steps=4", "--json"))
    out, err = capsys.readouterr()
    assert code == 1, err[-2000:]
    error = json.loads(out.splitlines()[-1])["error"]
    assert error.startswith("NonFiniteError: step ") and "non-finite" in error
    failed_step = int(error.split("step ")[1].split(":")[0])
    run_dir = tmp_path / "run"
    saved = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*"))
    assert all(step < failed_step for step in saved)
    for step in saved:  # what was saved is finite
        assert all(torch.isfinite(t).all() for t in _weights(run_dir / f"checkpoint-{step}").values())
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert [r["step"] for r in rows] == list(range(1, failed_step)) and all(math.isfinite(r["loss"]) for r in rows)



# ==========================================================================================================
# Cases 5, 7, 8: no gate talked into passing, bounded waits, exit 2 for bad input
# ==========================================================================================================
# Issue 15, cases 5, 7 and 8: no gate talked into passing, every network wait bounded, every bad input exit 2.
#
# 5. Non-finite and out-of-range numbers are refused everywhere: CLI flags (`gate --max-drop nan`), every float
#    of the recipe, the gate itself.
# 7. An endpoint, an MLflow server or a Prefect API that does not answer (a real listening socket that never
#    replies, a closed port, an endpoint that hangs on requests) is one line and exit 2 naming it, credentials
#    masked, within a bound; MLflow's HTTP retries are bounded unless the user set them.
# 8. User input that used to end in a traceback is exit 2 with file/field/value, checked before any model;
#    `--json` prints its object on every exit (argparse errors, SIGINT); a read-only `--out` and a full disk
#    (real tmpfs mounts in a private mount namespace) are one line each.
#
# Every command runs as a real `grpoflow` subprocess; the subprocess timeout is a guard, never the assertion.

GUARD_S = 240  # a command that hangs fails the test here instead of hanging the suite
ERRORS_SECRET = "s3cr3t-Pa55"


# --- helpers -------------------------------------------------------------------------------------------------------

def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    env.update(extra or {})
    return env


def grpoflow_run(*args: str, env: dict | None = None, prefix: list[str] = ()) -> subprocess.CompletedProcess:
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

    with loopback_http(Handler) as server:
        try:
            yield server.server_address[1]
        finally:
            release.set()  # a handler still waiting is let go before the server shuts down


# --- 5. a gate that cannot be talked into passing; finite, in-range numbers everywhere -----------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_gate_refuses_a_non_finite_or_negative_max_drop_with_exit_2(value, tmp_path):
    proc = grpoflow_run("gate", "--candidate", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"), "--max-drop", value,
                    "--state-dir", str(tmp_path / "state"), "--json")
    line = one_line_error(proc, "gate")
    assert "--max-drop" in line and repr(value) in line
    assert last_json(proc) == {"error": line.split(": error: ", 1)[1], "exit_code": 2}


def test_the_gate_itself_refuses_nan_instead_of_passing_a_total_drop(tmp_path):
    from evaluation.compare import compare, gate
    from tasks.regression import run_comparison
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
    ("eval.max_tokens=0", "eval.max_tokens: must be >= 1, got 0"),
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
    proc = grpoflow_run(*_eval_args(tmp_path, f"http://127.0.0.1:{port}/v1", "eval.request_timeout_s=5", "--json"))
    line = one_line_error(proc, "eval")
    assert f"the evaluation endpoint at http://127.0.0.1:{port}/v1/models is unreachable: no answer within 5 s" in line
    assert last_json(proc)["exit_code"] == 2


def test_eval_against_a_closed_port_is_exit_2_with_credentials_masked(closed_port, tmp_path):
    proc = grpoflow_run(*_eval_args(tmp_path, f"http://user:{ERRORS_SECRET}@127.0.0.1:{closed_port}/v1", "--json"))
    line = one_line_error(proc, "eval")
    assert f"http://user:***@127.0.0.1:{closed_port}/v1/models is unreachable: connection refused" in line
    assert ERRORS_SECRET not in proc.stdout + proc.stderr
    assert last_json(proc)["exit_code"] == 2


def test_an_endpoint_that_hangs_on_requests_is_bounded_by_eval_request_timeout_s(hanging_endpoint, tmp_path):
    """/v1/models answers, so the check passes; every completion hangs: EvalScope gives up after its bounded
    attempts of eval.request_timeout_s each, and that is one line naming the endpoint."""
    proc = grpoflow_run(*_eval_args(tmp_path, f"http://127.0.0.1:{hanging_endpoint}/v1", "eval.request_timeout_s=2"))
    line = one_line_error(proc, "eval")
    assert f"the evaluation endpoint at http://127.0.0.1:{hanging_endpoint}/v1 stopped answering" in line
    assert "APITimeoutError after 3 attempts of up to 2 s (eval.request_timeout_s)" in line


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_gate_with_an_unreachable_mlflow_server_is_one_line_exit_2(server, silent_port, closed_port, tmp_path):
    port = closed_port if server == "closed" else silent_port.getsockname()[1]
    proc = grpoflow_run("gate", "--candidate", "models:/grpoflow-tiny/2", "--baseline", "models:/grpoflow-tiny@champion",
                    "--state-dir", str(tmp_path / "state"), "--json",
                    env={"MLFLOW_TRACKING_URI": f"http://ci:{ERRORS_SECRET}@127.0.0.1:{port}"})
    line = one_line_error(proc, "gate")
    reason = "connection refused" if server == "closed" else "no answer within 10 s"
    assert f"MLflow tracking store at http://ci:***@127.0.0.1:{port} is unreachable: {reason} " \
           "(MLFLOW_TRACKING_URI)" in line
    assert ERRORS_SECRET not in proc.stdout + proc.stderr and last_json(proc)["exit_code"] == 2


def test_compare_with_an_unreachable_mlflow_server_is_one_line_exit_2(closed_port, tmp_path):
    proc = grpoflow_run("compare", "models:/grpoflow-tiny/1", "models:/grpoflow-tiny/2", "--state-dir",
                    str(tmp_path / "state"), env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed_port}"})
    assert "is unreachable: connection refused" in one_line_error(proc, "compare")


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_run_with_a_dead_prefect_api_is_exit_2_before_the_pipeline_starts(server, silent_port, closed_port,
                                                                           tmp_path):
    port = closed_port if server == "closed" else silent_port.getsockname()[1]
    state = tmp_path / "state"
    proc = grpoflow_run("run", "--state-dir", str(state), "--json",
                    env={"PREFECT_API_URL": f"http://user:{ERRORS_SECRET}@127.0.0.1:{port}/api"})
    line = one_line_error(proc, "run")
    reason = "connection refused" if server == "closed" else "no answer within 10 s"
    assert f"the Prefect API at http://user:***@127.0.0.1:{port}/api/health is unreachable: {reason} " \
           "(PREFECT_API_URL)" in line
    assert ERRORS_SECRET not in proc.stdout + proc.stderr and last_json(proc)["exit_code"] == 2
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
    ("train.learning_rate=-1", "train.learning_rate: must be > 0, got -1.0"),
    ("train.temperature=.nan", "train.temperature: must be a finite number, got nan"),
])
def test_recipe_input_errors_are_exit_2_naming_file_and_field(override, message, tmp_path):
    proc = grpoflow_run("eval", str(tmp_path / "no-such-checkpoint"), override, "--state-dir", str(tmp_path / "s"))
    line = one_line_error(proc, "eval")
    assert message in line and "configs/tiny-cpu.yaml + overrides" in line


def test_grpoflow_eval_without_benchmarks_is_exit_2_before_any_model(tmp_path):
    """`eval.benchmarks: []` is a valid recipe (its held-out split is its evaluation, in `grpoflow run`), but
    `grpoflow eval` has nothing to run with it."""
    proc = grpoflow_run("eval", str(tmp_path / "no-such-checkpoint"), "eval.benchmarks=[]",
                        "--state-dir", str(tmp_path / "s"))
    line = one_line_error(proc, "eval")
    assert "configs/tiny-cpu.yaml: eval.benchmarks: needs at least 1 entry to evaluate a model, got []" in line


@pytest.mark.parametrize("overrides, message", [
    (["eval.benchmarks=[aime_24]", "eval.local_paths={}"],
     "eval: unknown benchmark 'aime_24': EvalScope"),
    (["eval.benchmarks=[aime24]"],  # the config's local_paths still names math_500
     "eval: local_paths names benchmark 'math_500', which is not among ['aime24']"),
])
def test_eval_settings_are_checked_before_the_model_is_even_looked_up(overrides, message, tmp_path):
    # the checkpoint does not exist: had the model been resolved first, that would be the error
    proc = grpoflow_run("eval", str(tmp_path / "no-such-checkpoint"), *overrides, "--state-dir", str(tmp_path / "s"))
    line = one_line_error(proc, "eval")
    assert message in line and "configs/tiny-cpu.yaml" in line
    if "aime_24" in message:
        assert "did you mean 'aime24'" in line


def test_eval_with_an_unset_api_key_variable_is_exit_2(closed_port, tmp_path):
    proc = grpoflow_run("eval", f"http://127.0.0.1:{closed_port}/v1", "--api-key-env", "GRPOFLOW_TEST_NO_SUCH_KEY",
                    "--state-dir", str(tmp_path / "s"))
    assert "--api-key-env GRPOFLOW_TEST_NO_SUCH_KEY: the environment variable GRPOFLOW_TEST_NO_SUCH_KEY is not " \
           "set" in one_line_error(proc, "eval")


def _gsm8k_rows(n: int = 20) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i} more. How many now?",
             "answer": f"He has {i} + {i} = {2 * i}.\n#### {2 * i}"} for i in range(1, n + 1)]


def test_prep_without_task_is_refused_for_a_file_and_inferred_for_the_generator(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows()))
    proc = grpoflow_run("prep", "--source", str(source), "--out", str(tmp_path / "out"))
    line = one_line_error(proc, "prep")
    assert f"data: task: required for source '{source}' (prep --task, or data.task)" in line and "gsm8k" in line
    assert not (tmp_path / "out").exists()
    proc = grpoflow_run("prep", "--source", "synthetic:addition", "--out", str(tmp_path / "syn"), "data.synthetic_rows=40")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "syn" / "manifest.json").read_text())["task"] == "synthetic"


def test_prep_heldout_that_is_neither_fraction_nor_count_is_refused(tmp_path):
    proc = grpoflow_run("prep", "--task", "synthetic", "--source", "synthetic:addition", "--heldout", "1.5",
                    "--out", str(tmp_path / "out"))
    assert "heldout: 1.5 is neither a fraction in (0, 1) nor a whole number of rows" in one_line_error(proc, "prep")


def test_prep_latin1_csv_and_corrupt_parquet_are_exit_2_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    latin1 = tmp_path / "latin1.csv"
    latin1.write_text("question,answer\n" + "".join(f"Café {i}: how much?,It costs {i} #### {i}\n"
                                                     for i in range(1, 11)), encoding="latin-1")
    line = one_line_error(grpoflow_run("prep", "--task", "gsm8k", "--source", str(latin1), "--out", str(tmp_path / "a")),
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
    line = one_line_error(grpoflow_run("prep", "--task", "gsm8k", "--source", str(corrupt), "--out", str(tmp_path / "b")),
                          "prep")
    assert f"{corrupt}: unreadable Parquet data after row" in line and "damaged or truncated" in line


def test_prep_reads_a_csv_with_a_byte_order_mark(tmp_path):
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfquestion,answer\n" + b"".join(
        f"What is {i} + {i}?,{i} + {i} = {2 * i} #### {2 * i}\n".encode() for i in range(1, 11)))
    proc = grpoflow_run("prep", "--task", "gsm8k", "--source", str(bom), "--out", str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert last_json(proc)["rows"] == {"train": 9, "heldout": 1}
    first = json.loads((tmp_path / "out" / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"][-1]["content"].startswith("What is") and first["answer"].isdigit()


def test_prep_out_on_a_read_only_file_system_is_exit_2_naming_it(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = grpoflow_run("prep", "--task", "synthetic", "--source", "synthetic:addition", "data.synthetic_rows=40",
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
    proc = grpoflow_run("prep", "--task", "gsm8k", "--source", str(source), "--out", str(out), "--json",
                    prefix=in_tmpfs(mnt, "size=16k"))
    line = one_line_error(proc, "prep", code=1)
    assert f"disk full (no space left on device) writing: {out}" in line
    assert last_json(proc)["exit_code"] == 1
    assert re.search(r"^LEFT:$", proc.stderr, re.M), proc.stderr[-500:]  # no half-written directory left


@pytest.mark.parametrize("args", [["prep", "--bogus", "--json"], ["gate", "--json"], ["prep", "--limit", "0",
                                                                                      "--json"]])
def test_json_is_printed_on_argparse_errors(args):
    proc = grpoflow_run(*args)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    result = last_json(proc)
    assert result["exit_code"] == 2 and result["error"]


def test_json_is_printed_on_sigint_with_exit_130(silent_port, tmp_path):
    port = silent_port.getsockname()[1]
    # A test run started in the background (`make test &`) has SIGINT ignored, and a child inherits that:
    # Python then installs no KeyboardInterrupt handler. The child gets the default back, as in a terminal.
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *_eval_args(tmp_path, f"http://127.0.0.1:{port}/v1",
                                                                            "--json")],
                            cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
    proc = grpoflow_run("run", "--state-dir", str(state), "eval.benchmarks=[math500]", "eval.local_paths={}")
    assert "unknown benchmark 'math500'" in one_line_error(proc, "run")
    assert not (state / "data").exists()



# ==========================================================================================================
# Cases 6 and 10: no secret shown or stored, outputs under the state directory
# ==========================================================================================================
# Hardening, issue 15 cases 6 (no secret shown or stored) and 10 (outputs under the state folder).
#
# Everything here is real: MLflow on PostgreSQL (trust auth on 127.0.0.1 accepts any password, so a password in
# the tracking URI is used and harmless), the Prefect pipeline, EvalScope, and the tiny checkpoint served by
# `evaluation.serving` behind a small HTTP relay that refuses requests without the endpoint's credentials.

PG = "127.0.0.1:5432"


# ---- masking ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("uri, shown", [
    ("postgresql://u:PASS@127.0.0.1:5432/db", "postgresql://u:***@127.0.0.1:5432/db"),
    ("http://user:TOKEN@host:8000/v1", "http://user:***@host:8000/v1"),
    ("https://TOKEN@host/v1", "https://***@host/v1"),
    ("http://host/v1?api_key=K&model=m", "http://host/v1?api_key=***&model=m"),
    ("https://h/x?X-Amz-Signature=S&sig=T&Access_Token=A&page=2", "https://h/x?X-Amz-Signature=***&sig=***&Access_Token=***&page=2"),
    ("postgresql+psycopg2://u:pa/ss?w@h/db", "postgresql+psycopg2://u:***@h/db"),
    ("sqlite:////tmp/state/mlflow.db", "sqlite:////tmp/state/mlflow.db"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("http://u:***@h/v1?api_key=***", "http://u:***@h/v1?api_key=***"),  # idempotent
    ("models:/grpoflow-tiny@champion", "models:/grpoflow-tiny@champion"),
    ("/a/checkpoint", "/a/checkpoint"),
])
def test_mask_uri_hides_userinfo_and_secret_query_values_only(uri, shown):
    assert mask_uri(uri) == shown


def test_redact_masks_every_uri_in_free_text():
    text = ("MLflow at 'postgresql://u:PW1@127.0.0.1:5432/db' is unreachable (see http://a:PW2@h/v1?token=PW3), "
            "endpoint https://PW4@h/v1.")
    out = redact(text)
    assert not any(f"PW{i}" in out for i in range(1, 5)), out
    assert out == ("MLflow at 'postgresql://u:***@127.0.0.1:5432/db' is unreachable (see http://a:***@h/v1?token=***), "
                   "endpoint https://***@h/v1.")


# ---- helpers ----------------------------------------------------------------------------------------------

def grpoflow_in(*args: str, cwd: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def cli_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "GRPOFLOW_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)
    return env


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
    `user:password` and `?api_key=<query_key>`; yields (its base URL, the credentials each request carried)."""
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
            request = urllib.request.Request(upstream + url.path, data=body, method=self.command,
                                             headers={"Content-Type": self.headers.get("Content-Type", "")})
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=300) as r:
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
    """A real MLflow tracking server on loopback (sqlite store, artifacts proxied into `root`); yields its URL."""
    import socket

    root.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
                             "--artifacts-destination", str(root / "artifacts")],
                            cwd=root, stdout=log, stderr=subprocess.STDOUT, env=cli_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=2):
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
        found += [f"{path}: {name}" for name, needle in needles.items()
                  if needle in data or needle in str(path).encode()]
    return found


def mlflow_text(tracking_uri: str) -> str:
    """Every param, tag, metric name, artifact path, registered model and version field of the store, as text."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    parts = []
    for exp in client.search_experiments():
        parts.append(repr((exp.name, exp.artifact_location, exp.tags)))
        for run in client.search_runs([exp.experiment_id], max_results=1000):
            parts.append(repr((run.info, run.data.params, run.data.tags, sorted(run.data.metrics),
                               run.inputs.dataset_inputs if run.inputs else None)))
            stack = [None]
            while stack:
                for item in client.list_artifacts(run.info.run_id, stack.pop()):
                    parts.append(item.path)
                    if item.is_dir:
                        stack.append(item.path)
        for logged in client.search_logged_models([exp.experiment_id]):  # registered versions are MLflow models
            parts.append(repr((logged.name, logged.artifact_location, logged.tags, logged.params,
                               [(m.key, m.value) for m in logged.metrics or []])))
    for model in client.search_registered_models():
        parts.append(repr((model.name, model.description, model.tags, model.aliases)))
        for mv in client.search_model_versions(f"name='{model.name}'"):
            parts.append(repr((mv.version, mv.source, mv.run_id, mv.run_link, mv.description, mv.tags)))
    return "\n".join(parts)


# ---- case 6: no secret in any output ----------------------------------------------------------------------

@pytest.mark.slow
def test_no_secret_in_any_output_log_artifact_param_or_tag_of_a_run_and_an_endpoint_eval(
        tiny_base, tmp_path, pg_database):
    """The pipeline on MLflow/PostgreSQL with a password in MLFLOW_TRACKING_URI, then `eval` of the tiny model
    served behind an endpoint whose URL has user:TOKEN userinfo and ?api_key=..., with --api-key-env, then
    `compare` and a failing `eval`, then `compare` on an MLflow server whose URL has a password: no output,
    file, MLflow field or database row holds a secret, and the endpoint still received its credentials."""
    from evaluation.serving import served_model

    suffix = secrets.token_hex(6)
    secret = {"pg_password": f"PgPass{suffix}", "url_token": f"UrlToken{suffix}", "query_key": f"QueryKey{suffix}",
              "api_key": f"EnvKey{suffix}"}
    needles = {name: value.encode() for name, value in secret.items()}
    needles["basic_auth"] = base64.b64encode(f"evaluser:{secret['url_token']}".encode())
    tracking_uri = f"postgresql://postgres:{secret['pg_password']}@{PG}/{pg_database}"
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    env = cli_env(MLFLOW_TRACKING_URI=tracking_uri, H2_ENDPOINT_KEY=secret["api_key"])
    aime24 = str(shared("aime24"))
    evals = ["eval.benchmarks=[aime24]", f"eval.local_paths={{aime24: {aime24}}}", "eval.limit=1",
             "eval.max_tokens=16"]
    outputs = []

    run = grpoflow_in("run", "--state-dir", str(state), "--json", f"model.name_or_path={tiny_base['path']}",
                   "data.synthetic_rows=600", "train.max_steps=2", "train.save_steps=2", "train.eval_heldout=16",
                   *evals, cwd=cwd, env=env)
    outputs += [run.stdout, run.stderr]
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["tracking_uri"] == f"postgresql://postgres:***@{PG}/{pg_database}"
    assert summary["state"]["tracking_uri"] == summary["tracking_uri"]

    with served_model(tiny_base["path"], max_batch_size=8) as served, \
            guarded_relay(served.url.removesuffix("/v1"), "evaluser", secret["url_token"], secret["query_key"]) \
            as (relay, seen):
        endpoint = f"http://evaluser:{secret['url_token']}@{relay.removeprefix('http://')}/v1?api_key={secret['query_key']}"
        ev = grpoflow_in("eval", endpoint, "--served-model-name", served.model_name, "--api-key-env", "H2_ENDPOINT_KEY",
                      "--concurrency", "2", "--state-dir", str(state), "--json", *evals, cwd=cwd, env=env)
    outputs += [ev.stdout, ev.stderr]
    assert ev.returncode == 0, ev.stderr[-4000:]
    evaluated = json.loads(ev.stdout.strip().splitlines()[-1])
    assert evaluated["model"] == f"http://evaluser:***@{relay.removeprefix('http://')}/v1?api_key=***"
    assert evaluated["num_samples"] == {"aime24": 1}
    # every generation request carried the endpoint's credentials (a reachability probe carries none)
    generations = [s for s in seen if s["request"] == "POST /v1/chat/completions"]
    assert generations and all(s == {"request": "POST /v1/chat/completions", "auth": "Basic " + needles["basic_auth"]
                                     .decode(), "api_key": [secret["query_key"]]} for s in generations), seen
    assert Path(evaluated["work_dir"]).is_relative_to(state)

    cmp = grpoflow_in("compare", summary["eval_report"], evaluated["report"], "--state-dir", str(state), "--json",
                   *evals, cwd=cwd, env=env)
    outputs += [cmp.stdout, cmp.stderr]
    assert cmp.returncode == 0, cmp.stderr[-4000:]
    assert json.loads(cmp.stdout.strip().splitlines()[-1])["tracking_uri"].startswith("postgresql://postgres:***@")

    missing = grpoflow_in("eval", "models:/no-such-model@champion", "--state-dir", str(state), "--json", *evals,
                       cwd=cwd, env=env)
    outputs += [missing.stdout, missing.stderr]
    assert missing.returncode != 0, missing.stderr[-4000:]
    assert f"postgresql://postgres:***@{PG}/{pg_database}" in missing.stderr  # named, masked

    # the same against a tracking server whose URL carries a password (MLflow prints run URLs on stdout)
    secret["http_password"] = f"HttpPass{suffix}"
    needles["http_password"] = secret["http_password"].encode()
    with mlflow_server(tmp_path / "server") as server:
        http_uri = server.replace("http://", f"http://tracker:{secret['http_password']}@")
        cmp = grpoflow_in("compare", summary["eval_report"], evaluated["report"], "--state-dir", str(state), "--json",
                       *evals, cwd=cwd, env={**env, "MLFLOW_TRACKING_URI": http_uri})
        outputs += [cmp.stdout, cmp.stderr]
        assert cmp.returncode == 0, cmp.stderr[-4000:]
        assert json.loads(cmp.stdout.strip().splitlines()[-1])["tracking_uri"] == \
            server.replace("http://", "http://tracker:***@")
        store_text = mlflow_text(server)
    leaks = [f"tracking server: {name}" for name, needle in needles.items() if needle.decode() in store_text]
    leaks += files_holding(tmp_path / "server", needles)

    leaks += [f"output {i}: {name}" for i, text in enumerate(outputs) for name, needle in needles.items()
              if needle.decode() in text]
    leaks += files_holding(state, needles) + files_holding(cwd, needles)
    store = mlflow_text(tracking_uri)
    leaks += [f"MLflow: {name}" for name, needle in needles.items() if needle.decode() in store]
    dump = subprocess.run(["pg_dump", "-h", "127.0.0.1", "-U", "postgres", pg_database], capture_output=True,
                          timeout=120, check=True).stdout
    leaks += [f"database: {name}" for name, needle in needles.items() if needle in dump]
    assert not leaks, "\n".join(leaks)
    assert "endpoint" not in store or "***" in store  # the eval run is there, its model tag masked
    assert list(cwd.iterdir()) == []  # case 10 too: nothing in the working directory


# ---- case 10: outputs under the state folder -------------------------------------------------------------

@pytest.mark.slow
def test_eval_and_compare_write_under_the_state_dir_never_the_working_directory(tiny_base, tmp_path):
    """`eval` and `compare` started in an empty directory, with --state-dir elsewhere and MLFLOW_TRACKING_URI
    naming a database: the recipe's relative eval.out lands under the state dir, MLflow's artifacts in
    <state>/mlartifacts, and the working directory stays empty (before: ./.state/eval and ./mlruns)."""
    cwd, state = tmp_path / "cwd", tmp_path / "state"
    cwd.mkdir()
    env = cli_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    (tmp_path / "store").mkdir()
    evals = ["eval.benchmarks=[aime24]", f"eval.local_paths={{aime24: {shared('aime24')}}}", "eval.limit=1",
             "eval.max_tokens=8", "eval.out=evaluations"]  # relative: under the state dir

    ev = grpoflow_in("eval", tiny_base["path"], "--state-dir", str(state), "--json", *evals, cwd=cwd, env=env)
    assert ev.returncode == 0, ev.stderr[-4000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert Path(result["work_dir"]) == state / "evaluations" / Path(tiny_base["path"]).name
    assert (Path(result["work_dir"]) / "report.json").is_file()

    cmp = grpoflow_in("compare", result["work_dir"], result["report"], "--state-dir", str(state), "--json", *evals,
                   cwd=cwd, env=env)
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



# ==========================================================================================================
# Case 9 and the serve-model part of case 7: the model server
# ==========================================================================================================
# Issue 15, case 9 and case 7 (serve-model): the model server under a careless or hostile client.
#
# Every test runs `grpoflow serve-model` as a user does, on the real tiny model, over real HTTP on
# 127.0.0.1. Ordering is asserted, never a duration: "the small request completed while the big one was
# still being generated", "/health answered while the big body was being handled".

KEY_VAR, KEY = "GRPOFLOW_TEST_SERVER_KEY", "sk-test-9f2c61d0a7e84b35"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a big request: 32 sampled completions of up to 1000 tokens (at temperature 2 a tiny model rarely says EOS)
# ignore_eos: the model's EOS cannot end it early (on a fast CPU 64 completions that all stopped early took < 2 s)
BIG = {"prompt": "1+1", "n": 32, "max_tokens": 1000, "temperature": 2.0, "seed": 1, "ignore_eos": True}


def grpoflow_serve(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, text=True,
                            env={**os.environ, **(env or {})}, **kwargs)


@contextmanager
def served(model: str, tmp: Path, *flags: str):
    """`grpoflow serve-model MODEL --json FLAGS` with its stderr in a file; yields (port, stderr path, process)."""
    err_path = tmp / "server.stderr"
    with open(err_path, "w") as err:
        proc = grpoflow_serve("serve-model", model, "--json", "--api-key-env", KEY_VAR, *flags,
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
        code, _, err = run_cli(tiny_base["path"], "--host", host, "--port", "8123", "--api-key-env", KEY_VAR,
                               env={KEY_VAR: KEY})
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"{host}:8123" in err, err
    code, _, err = run_cli(tiny_base["path"], "--port", "70000")
    assert code == 2 and "127.0.0.1:70000" in err
    code, _, err = run_cli(tiny_base["path"], "--request-timeout", "nan")
    assert code == 2 and "--request-timeout" in err
