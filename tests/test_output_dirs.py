"""Output directories: `grpoflow` replaces a directory only when it holds a previous grpoflow output of the
same kind (prepared data, a base model, a checkpoint); a project folder, the current directory, someone's
files or a plain file are refused with exit 2 and left exactly as they were.

Real CLI, real files: each test compares every path and sha256 under its folder before and after.
"""

from __future__ import annotations

import json

import pytest

from conftest import tree_digest
from data.manifest import OutputDirError, atomic_dir, read_manifest
from flows.cli import main


def _prep(out, *extra: str) -> list[str]:
    return [
        "prep",
        "--task",
        "synthetic",
        "--source",
        "synthetic:addition",
        "--out",
        str(out),
        "--heldout",
        "0.1",
        "data.synthetic_rows=40",
        *extra,
    ]


def test_prep_refuses_a_project_directory_and_the_current_directory(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "notes.txt").write_text("my notes\n")
    before = tree_digest(tmp_path)

    assert main(_prep(project)) == 2
    assert "project" in capsys.readouterr().err
    monkeypatch.chdir(project)
    assert main(_prep(".")) == 2
    err = capsys.readouterr().err
    assert "current directory" in err and str(project) in err
    assert tree_digest(tmp_path) == before  # nothing replaced, moved aside or left behind


def test_prep_refuses_an_unrelated_directory_and_a_file(tmp_path, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8 not really a cat")
    target = tmp_path / "train.jsonl"
    target.write_text('{"keep": "me"}\n')
    before = tree_digest(tmp_path)

    assert main(_prep(other)) == 2
    assert "not a grpoflow output" in capsys.readouterr().err
    assert main(_prep(target, "--json")) == 2
    out, err = capsys.readouterr()
    assert "not a directory" in err and json.loads(out.splitlines()[-1])["exit_code"] == 2
    assert tree_digest(tmp_path) == before


def test_prep_replaces_its_own_previous_output(tmp_path):
    out = tmp_path / "prepared"
    assert main(_prep(out)) == 0
    first = read_manifest(out)
    assert main(_prep(out, "data.synthetic_rows=60")) == 0
    second = read_manifest(out)
    rows_of = [manifest["rows"]["train"] + manifest["rows"]["heldout"] for manifest in (first, second)]
    assert rows_of[0] < rows_of[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # no hidden leftovers
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(_prep(empty)) == 0 and (empty / "manifest.json").is_file()


def test_bootstrap_model_refuses_an_unrelated_out_before_any_work(tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.tex").write_text("\\section{}\n")
    before = tree_digest(tmp_path)
    assert main(["bootstrap-model", "--out", str(other)]) == 2
    assert str(other) in capsys.readouterr().err
    assert tree_digest(tmp_path) == before


def test_an_output_of_another_kind_is_not_replaced(tmp_path):
    """Checkpoints go through the same check: a prepared dataset is never replaced by a checkpoint."""
    out = tmp_path / "prepared"
    assert main(_prep(out)) == 0
    before = tree_digest(out)
    with pytest.raises(OutputDirError, match="prepared-dataset"):
        with atomic_dir(out, kind="checkpoint") as tmp:
            (tmp / "weights").write_text("x")
    assert tree_digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]
