"""Run directories and their checkpoints: one run at a time writes a run directory, and what a killed writer
left there is removed by the next run.

Every run is a real `grpoflow train` process on the tiny base model, a few steps long. Where a test needs a
run to be in the middle of its work, a training callback (a real plug-in file) holds it there until the test
lets it go, so nothing depends on how fast this machine trains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, stop_group

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
GUARD_S = 300  # a command that hangs fails the test here instead of hanging the suite

# A training callback that reports each step and then waits (bounded) until the test lets the run go on.
HOLD_AT_STEP = """
import time
from pathlib import Path

HERE = Path(__file__).parent


class Hold:
    def on_step(self, step, metrics):
        (HERE / f"reached-{step}").write_text("")
        deadline = time.monotonic() + 240
        while not (HERE / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
"""

# A checkpoint writer that is killed while writing: the trainer's own `save_checkpoint`, whose tokenizer save
# (after the weights are written) reports and then waits for the SIGKILL.
KILLED_WRITER = """
import sys, time
from pathlib import Path

import torch

from trainer.checkpoint import save_checkpoint
from trainer.model_loading import load_model
from trainer.recipe import ModelConfig

base, out, marker = sys.argv[1:]
model, tokenizer = load_model(base, ModelConfig(dtype="float32"))


class SlowTokenizer:
    def save_pretrained(self, directory):
        tokenizer.save_pretrained(directory)
        Path(marker).write_text(str(directory))
        time.sleep(240)


save_checkpoint(Path(out), 3, model, SlowTokenizer(), {"step": 3}, {}, keep=2)
"""


def _train_cmd(tiny_base: dict, data: Path, run: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", "--config", str(TINY), "--json",
            f"bootstrap.out={tiny_base['path']}", f"data.out={data}", f"train.output_dir={run}",
            "train.max_steps=2", "train.save_steps=1", "train.prompts_per_step=2", "train.num_generations=4",
            "train.eval_heldout=4", "train.micro_batch_size=8", "train.max_completion_length=16",
            "train.lr_scheduler_type=constant", *overrides]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")
            and not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}


def _start(cmd: list[str], logs: Path, **kwargs) -> subprocess.Popen:
    """`cmd` in a session of its own, its output in files (a pipe nobody reads while it runs could fill up)."""
    kwargs = {"cwd": REPO_ROOT, "env": _env(), **kwargs}
    return subprocess.Popen(cmd, stdout=(logs.with_suffix(".out")).open("w"), stderr=logs.open("w"),
                            start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)


def _wait_for(path: Path, proc: subprocess.Popen, logs: Path, timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the process ended ({proc.returncode}) before {path.name}: {logs.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def test_a_second_run_on_a_busy_run_directory_exits_2_naming_the_holder_and_the_first_is_intact(
        tmp_path, tiny_base, tiny_data):
    plugin = tmp_path / "hold" / "hold.py"
    plugin.parent.mkdir()
    plugin.write_text(HOLD_AT_STEP)
    run, logs = tmp_path / "run", tmp_path / "first.log"
    first = _start(_train_cmd(tiny_base, tiny_data, run, "train.learning_rate=1e-4",
                              f"train.callbacks=['{plugin}:Hold']"), logs)
    try:
        _wait_for(plugin.parent / "reached-1", first, logs)  # the first run is training, held after its step 1
        second = subprocess.run(_train_cmd(tiny_base, tiny_data, run, "train.learning_rate=5e-2"), cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=GUARD_S, env=_env(), stdin=subprocess.DEVNULL)
        (plugin.parent / "go").write_text("")
        first.wait(timeout=GUARD_S)
    finally:
        stop_group(first, signal.SIGKILL, timeout=10)
    out, err = logs.with_suffix(".out").read_text(), logs.read_text()
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    [line] = [x for x in second.stderr.splitlines() if x.startswith("grpoflow train: error:")]
    assert f"train.output_dir {run} is in use by another grpoflow process: pid {first.pid} " in line, line
    assert "-m flows.cli train" in line and "train.learning_rate=1e-4" in line and " since " in line, line
    assert json.loads(second.stdout.strip().splitlines()[-1])["exit_code"] == 2

    assert first.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["checkpoint"] == str(run / "checkpoint-2") and summary["steps"] == 2
    for step in (1, 2):  # every checkpoint is the first run's, intact
        manifest = json.loads((run / f"checkpoint-{step}" / "manifest.json").read_text())
        assert manifest["recipe"]["train"]["learning_rate"] == 1e-4 and manifest["step"] == step
    from trainer.checkpoint import checkpoint_problem
    assert checkpoint_problem(run / "checkpoint-2") is None
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "latest").read_text().strip() == "checkpoint-2"
    assert (run / ".lock").read_text() == ""  # released: no holder recorded


def test_a_checkpoint_cut_short_by_sigkill_is_removed_by_the_next_run(tmp_path, tiny_base, tiny_data):
    run, marker = tmp_path / "run", tmp_path / "writing"
    script = tmp_path / "killed_writer.py"
    script.write_text(KILLED_WRITER)
    logs = tmp_path / "writer.log"
    writer = _start([sys.executable, str(script), tiny_base["path"], str(run), str(marker)], logs, cwd=tmp_path,
                    env={**_env(), "PYTHONPATH": str(REPO_ROOT)})
    try:
        _wait_for(marker, writer, logs)
    finally:
        stop_group(writer, signal.SIGKILL, timeout=10)
    assert writer.returncode == -signal.SIGKILL
    [partial] = list(run.glob(".checkpoint-3.tmp-*"))
    assert Path(marker.read_text()) == partial and (partial / "model.safetensors").is_file()
    assert not (run / "checkpoint-3").exists()

    proc = subprocess.run(_train_cmd(tiny_base, tiny_data, run, "train.max_steps=1"), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=GUARD_S, env=_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not partial.exists()
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".mlflow")) == [
        ".lock", "checkpoint-1", "latest", "metrics.jsonl"]
    assert f"removed {partial}: left by a run that stopped while writing a checkpoint" in proc.stderr
