"""Issue 15, cases 1-4: nothing lost, nothing corrupt trained on (real CLI, real tiny model, real files).

1. An output directory is replaced only when it is a previous grpoflow output of the same kind.
2. Corrupt checkpoints are set aside and the newest intact one is resumed; a torn metrics line is repaired;
   edited data is refused; a corrupt checkpoint is not loaded as a model.
3. A run directory resumed with a different training configuration (or other data) is refused, untouched.
4. A diverging run stops naming the step, before a checkpoint of non-finite weights is written.

The trained run the resume tests start from is made once per module (2 steps, a checkpoint after each) and
copied per test; recipe paths are relative to the test's working directory, so a copy is the same recipe.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from data.manifest import IntegrityError, OutputDirError, atomic_dir, read_manifest, sha256_dir, sha256_file
from flows.cli import main

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
            "train.micro_batch_size=8", "train.learning_rate=3e-4", *overrides]


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


def test_a_corrupt_checkpoint_is_not_loaded_as_a_model(run, tiny_recipe):
    from trainer.model_loading import load_policy

    checkpoint = run / "run" / "checkpoint-2"
    load_policy(str(checkpoint), tiny_recipe)  # intact: loads
    _zero_middle(checkpoint / "model.safetensors")
    with pytest.raises(IntegrityError, match="model.safetensors"):
        load_policy(str(checkpoint), tiny_recipe)


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
