"""Run directories and their checkpoints: one run at a time writes a run directory, what a killed writer
left there is removed by the next run, and a resumed run trains on nothing lost or corrupt.

Every run is a real `grpoflow train` (a subprocess, or `flows.cli.main` in this process) on the tiny base
model, a few steps long. Where a test needs a run to be in the middle of its work, a training callback (a
real plug-in file) holds it there until the test lets it go, so nothing depends on how fast this machine
trains.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, grpoflow_run, last_json, one_line_error, shared, stop_group, tree_digest
from data.manifest import IntegrityError, read_manifest, sha256_dir, sha256_file
from flows.cli import main

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
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(TINY),
        "--json",
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={run}",
        "train.max_steps=2",
        "train.save_steps=1",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=4",
        "train.micro_batch_size=8",
        "train.max_completion_length=16",
        "train.lr_scheduler_type=constant",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *overrides,
    ]


def _env() -> dict:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")
        and not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))
    }


def _start(cmd: list[str], logs: Path, **kwargs) -> subprocess.Popen:
    """`cmd` in a session of its own, its output in files (a pipe nobody reads while it runs could fill
    up)."""
    kwargs = {"cwd": REPO_ROOT, "env": _env(), **kwargs}
    return subprocess.Popen(
        cmd,
        stdout=(logs.with_suffix(".out")).open("w"),
        stderr=logs.open("w"),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )


def _wait_for(path: Path, proc: subprocess.Popen, logs: Path, timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(
                f"the process ended ({proc.returncode}) before {path.name}: {logs.read_text()[-3000:]}"
            )
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def test_a_second_run_on_a_busy_run_directory_exits_2_naming_the_holder_and_the_first_is_intact(
    tmp_path, tiny_base, tiny_data
):
    plugin = tmp_path / "hold" / "hold.py"
    plugin.parent.mkdir()
    plugin.write_text(HOLD_AT_STEP)
    run, logs = tmp_path / "run", tmp_path / "first.log"
    first = _start(
        _train_cmd(
            tiny_base, tiny_data, run, "train.learning_rate=1e-4", f"train.callbacks=['{plugin}:Hold']"
        ),
        logs,
    )
    try:
        _wait_for(
            plugin.parent / "reached-1", first, logs
        )  # the first run is training, held after its step 1
        second = subprocess.run(
            _train_cmd(tiny_base, tiny_data, run, "train.learning_rate=5e-2"),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=GUARD_S,
            env=_env(),
            stdin=subprocess.DEVNULL,
        )
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
    writer = _start(
        [sys.executable, str(script), tiny_base["path"], str(run), str(marker)],
        logs,
        cwd=tmp_path,
        env={**_env(), "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        _wait_for(marker, writer, logs)
    finally:
        stop_group(writer, signal.SIGKILL, timeout=10)
    assert writer.returncode == -signal.SIGKILL
    [partial] = list(run.glob(".checkpoint-3.tmp-*"))
    assert Path(marker.read_text()) == partial and (partial / "model.safetensors").is_file()
    assert not (run / "checkpoint-3").exists()

    proc = subprocess.run(
        _train_cmd(tiny_base, tiny_data, run, "train.max_steps=1"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        env=_env(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not partial.exists()
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".mlflow")) == [
        ".lock",
        "checkpoint-1",
        "heldout",
        "latest",
        "metrics.jsonl",
        "summary.json",
    ]
    assert f"removed {partial}: left by a run that stopped while writing a checkpoint" in proc.stderr


# ==========================================================================================================
# Resuming a run directory: nothing lost, nothing corrupt trained on (real CLI, real tiny model, real files)
# ==========================================================================================================
# Corrupt checkpoints are set aside and the newest intact one is resumed; a checkpoint that a full disk cut
# short leaves nothing and the previous one is resumed; a torn metrics line is repaired;
# edited data is refused; a corrupt checkpoint is not loaded as a model; a run directory resumed with a
# different training configuration (or other data) is refused, untouched; a diverging run stops naming the
# step, before a checkpoint of non-finite weights is written.
#
# The trained run the resume tests start from is made once per module (2 steps, a checkpoint after each) and
# copied per test; recipe paths are relative to the test's working directory, so a copy is the same recipe.


def _train_args(tiny_base: dict, *overrides: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TINY),
        f"bootstrap.out={tiny_base['path']}",
        "data.out=data",
        "train.output_dir=run",
        "train.max_steps=2",
        "train.save_steps=1",
        "train.save_total_limit=3",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=8",
        "train.micro_batch_size=8",
        "train.learning_rate=3e-4",
        # constant, whatever the recipe says: the resume rules below differ for a schedule tied to
        # max_steps
        "train.lr_scheduler_type=constant",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *overrides,
    ]


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


# ---- corrupt checkpoints, torn metrics and edited data -------------------------------------------------


def test_zeroed_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(
    run, trained, tiny_base, capsys, caplog
):
    weights = run / "run" / "checkpoint-2" / "model.safetensors"
    size = weights.stat().st_size
    _zero_middle(weights)
    assert weights.stat().st_size == size
    with caplog.at_level(logging.WARNING, "grpoflow"):
        assert main(_train_args(tiny_base, "--json")) == 0
    summary = _summary(capsys)
    assert summary["resumed_from_step"] == 1
    assert any("checkpoint-2" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    # kept to inspect
    assert (run / "run" / "checkpoint-2.corrupt" / "model.safetensors").stat().st_size == size
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
    metrics = (run / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]


def test_a_checkpoint_that_runs_out_of_room_fails_naming_it_and_the_previous_one_is_resumed(run, tiny_base):
    """A file size limit stands for a full disk: the writer fails mid-file with an OSError the same way (a
    real full disk needs a mount of its own: test_prep's tmpfs)."""
    args = _train_args(tiny_base, "train.max_steps=3", "--json")  # one step more than the trained run
    checkpoint = run / "run" / "checkpoint-2"
    previous = tree_digest(checkpoint)
    weights, state = (checkpoint / name for name in ("model.safetensors", "trainer_state.pt"))
    # a file size limit (`prlimit --fsize`) between the sizes of the weights and the training state: step 3's
    # checkpoint fails mid-write, after its weights are written and while its training state is
    limit = (weights.stat().st_size + state.stat().st_size) // 2
    assert weights.stat().st_size < limit < state.stat().st_size
    full = grpoflow_run(*args, cwd=run, prefix=["prlimit", f"--fsize={limit}"])
    line = one_line_error(full, "train", code=1)
    assert f"writing: {run / 'run' / 'checkpoint-3'}; " in line and "file too large" in line, line
    assert last_json(full) == {"error": line.split(": error: ", 1)[1], "exit_code": 1}
    # nothing of checkpoint-3 is left, not even its temporary directory; checkpoint-2 is as it was
    assert sorted(p.name for p in (run / "run").iterdir()) == [
        ".lock",
        "checkpoint-1",
        "checkpoint-2",
        "heldout",
        "latest",
        "metrics.jsonl",
        "summary.json",  # the first run's, which ended at checkpoint-2
    ]
    assert tree_digest(checkpoint) == previous
    assert (run / "run" / "latest").read_text().strip() == "checkpoint-2"

    again = grpoflow_run(*args, cwd=run)  # with room to write again: resumes from checkpoint-2
    assert again.returncode == 0, again.stderr[-3000:]
    summary = last_json(again)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    assert summary["checkpoint"] == str(run / "run" / "checkpoint-3")
    metrics = (run / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3]


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
    before = tree_digest(run)
    assert main(_train_args(tiny_base)) == 2
    assert f"{run / 'run' / 'metrics.jsonl'}:1" in capsys.readouterr().err
    assert tree_digest(run) == before


def test_edited_data_is_refused_naming_the_file(run, tiny_base, capsys):
    train = run / "data" / "train.jsonl"
    rows = train.read_text().splitlines()
    first = json.loads(rows[0])
    first["answer"] = str(int(first["answer"]) + 1)
    train.write_text("\n".join([json.dumps(first), *rows[1:]]) + "\n")
    before = tree_digest(run)
    assert main(_train_args(tiny_base)) == 2
    assert "data/train.jsonl: its sha256 differs" in capsys.readouterr().err
    assert tree_digest(run) == before
    shutil.rmtree(run / "run")  # a fresh run on the edited data is refused the same way: nothing is trained
    assert main(_train_args(tiny_base)) == 2
    assert "data/train.jsonl: its sha256 differs" in capsys.readouterr().err
    assert not (run / "run").exists()


def test_data_other_than_the_checkpoint_recorded_is_refused(run, tiny_base, capsys):
    """Data re-made under the same name with a consistent manifest: the checkpoint's data_sha256 catches
    it."""
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
    before = tree_digest(run)
    assert main(_train_args(tiny_base)) == 2
    err = capsys.readouterr().err
    assert "trained on other data" in err and recorded in err
    assert tree_digest(run) == before


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


# ---- resuming with a changed configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.learning_rate=1e-3", "train.learning_rate"),
        ("train.beta=0.04", "train.beta"),
        ("data.out=data2", "data.out"),
        ("model.lora={r: 4}", "model.lora.r: (unset) -> 4"),  # full fine-tuning's run resumed as LoRA
    ],
)
def test_resuming_with_a_changed_configuration_is_refused(run, tiny_base, capsys, override, key):
    if key == "data.out":
        shutil.copytree(run / "data", run / "data2")
    before = tree_digest(run)
    assert main(_train_args(tiny_base, override, "--json")) == 2
    out, err = capsys.readouterr()
    assert key in err and "different configuration" in err
    assert json.loads(out.splitlines()[-1])["exit_code"] == 2
    assert tree_digest(run) == before  # not half-applied: no metrics cut, no checkpoint, no pointer moved


def test_a_setting_newer_than_the_checkpoint_is_no_change_at_its_default():
    """A checkpoint made by a grpoflow before a setting existed records no value for it: resuming it with
    the setting at its default (what that grpoflow did) is allowed, with another value refused."""
    from trainer.checkpoint import config_changes
    from trainer.recipe import load_recipe

    current = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml").to_dict()
    saved = json.loads(json.dumps(current))
    del saved["train"]["importance_sampling_level"], saved["rollout"]["importance_correction"]
    assert config_changes(saved, current) == []
    gspo = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", ["train.importance_sampling_level=sequence"])
    assert config_changes(saved, gspo.to_dict()) == ["train.importance_sampling_level: (unset) -> 'sequence'"]
    saved["train"]["importance_sampling_level"] = "token"  # recorded: compared as it is
    assert config_changes(saved, gspo.to_dict()) == ["train.importance_sampling_level: 'token' -> 'sequence'"]


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


# ---- a diverging run: no checkpoint of non-finite weights -------------------------------------------------


def test_a_diverging_run_stops_naming_the_step_before_saving(
    tmp_path, tiny_base, tiny_data, monkeypatch, capsys
):
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
    assert [r["step"] for r in rows] == list(range(1, failed_step))
    assert all(math.isfinite(r["loss"]) for r in rows)
