"""The `grpoflow` command as a user runs it: subprocesses, `--json` as the last line, exit codes."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    CLI_GUARD_S,
    REPO_ROOT,
    clean_env,
    ctrl_c_when,
    eval_cli_args,
    grpoflow_run,
    hold_once_at,
    shared,
)


def grpoflow(*args: str, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prep_json_on_real_gsm8k(tmp_path):
    out = tmp_path / "X"
    proc = grpoflow(
        "prep",
        "--task",
        "gsm8k",
        "--source",
        str(shared("gsm8k", "train.jsonl")),
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = last_json(proc)
    assert summary["rows"]["train"] + summary["rows"]["heldout"] == 7473
    assert summary["out"] == str(out) and summary["manifest"] == str(out / "manifest.json")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sha256"] == summary["sha256"] and manifest["task"] == "gsm8k"


def test_prep_broken_line_fails_with_line_number_and_leaves_nothing(tmp_path):
    lines = shared("countdown", "test.jsonl").read_text().splitlines()
    lines[4] = '{"input": "1,2,3", "output": '
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    out = tmp_path / "X"
    proc = grpoflow("prep", "--task", "countdown", "--source", str(broken), "--out", str(out), "--json")
    assert proc.returncode == 2
    assert f"{broken}:5" in proc.stderr and "not valid JSON" in proc.stderr
    assert last_json(proc)["exit_code"] == 2
    assert not out.exists() and list(tmp_path.iterdir()) == [broken]

    proc = grpoflow(
        "prep", "--task", "countdown", "--source", str(broken), "--out", str(out), "--skip-invalid", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    summary = last_json(proc)
    assert (
        summary["rows"]["train"] + summary["rows"]["heldout"] == 255 and sum(summary["dropped"].values()) == 1
    )


def test_prep_recipe_flags_and_unknown_override(tmp_path):
    proc = grpoflow(
        "prep",
        "--task",
        "synthetic",
        "--source",
        "synthetic:countdown",
        "--out",
        str(tmp_path / "s"),
        "data.synthetic_rows=50",
        "--heldout",
        "10",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    rows = last_json(proc)["rows"]
    assert rows["heldout"] == 10 and rows["train"] + rows["heldout"] <= 50
    proc = grpoflow("prep", "--task", "gsm8k", "data.sourse=x", "--json")
    assert proc.returncode == 2 and "did you mean 'source'" in proc.stderr


def test_bootstrap_model_json_reports_cached_model(tiny_base):
    proc = grpoflow("bootstrap-model", "--out", tiny_base["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    summary = last_json(proc)
    assert summary["cached"] is True and summary["path"] == tiny_base["path"]
    manifest = json.loads(Path(summary["manifest"]).read_text())
    assert summary["heldout_accuracy"] == tiny_base["heldout_accuracy"] == manifest["heldout_accuracy"]
    assert summary["warmup_steps"] == manifest["warmup_steps"] == manifest["history"][-1]["step"]

    # the reported accuracy is the saved model's: greedy answers of the checkpoint on the warm-up's held-out
    # rows, scored here again. The warm-up measured it with the machine's thread count and these tests run
    # with fewer threads (float sums in another order), so one answer may flip on a near-tie: one row of
    # slack, no more.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.schema import resolve_system_prompt
    from trainer.bootstrap import TextKit
    from trainer.heldout import evaluate_greedy
    from trainer.recipe import load_recipe
    from trainer.rewards import accuracy_reward, format_reward
    from trainer.rollout.hf_engine import HFEngine

    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml")
    cfg = recipe.bootstrap
    rows = TextKit.rows(
        cfg.task, cfg.heldout_rows, cfg.seed, "eval", resolve_system_prompt(recipe.data.system_prompt)
    )
    assert len(rows) == manifest["heldout_rows"]
    tokenizer = AutoTokenizer.from_pretrained(summary["path"])
    model = AutoModelForCausalLM.from_pretrained(summary["path"], dtype=torch.float32).eval()
    again = evaluate_greedy(
        HFEngine(model, tokenizer), tokenizer, rows, accuracy_reward, format_reward, max_tokens=24
    )
    assert abs(again["accuracy"] - summary["heldout_accuracy"]) <= 1 / len(rows) + 1e-9


# ==========================================================================================================
# `--json` on every exit (argparse errors, SIGINT); user errors are one class, exit 2
# ==========================================================================================================


@pytest.mark.parametrize(
    "args", [["prep", "--bogus", "--json"], ["gate", "--json"], ["prep", "--limit", "0", "--json"]]
)
def test_json_is_printed_on_argparse_errors(args):
    proc = grpoflow_run(*args)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    result = last_json(proc)
    assert result["exit_code"] == 2 and result["error"]


def test_json_is_printed_on_sigint_with_exit_130(silent_port, tmp_path):
    port = silent_port.getsockname()[1]
    # A test run started in the background (`make test &`) has SIGINT ignored, and a child inherits that:
    # Python then installs no KeyboardInterrupt handler. The child gets the default back, as in a terminal.
    args = eval_cli_args(tmp_path, f"http://127.0.0.1:{port}/v1", "--json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO_ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        readable, _, _ = select.select([silent_port], [], [], CLI_GUARD_S)  # the command is now waiting on us
        assert readable, "the command never connected"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=CLI_GUARD_S)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1]) == {"error": "interrupted", "exit_code": 130}
    assert "grpoflow eval: error: interrupted" in stderr


def test_ctrl_c_in_train_exits_130_with_json_and_the_rerun_resumes_from_the_last_checkpoint(
    tmp_path, tiny_base, tiny_data
):
    run = tmp_path / "run"
    args = [
        "train",
        "--json",
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        f"train.output_dir={run}",
        "train.max_steps=2",
        "train.save_steps=1",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=4",
        "train.micro_batch_size=8",
        "train.max_completion_length=16",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        f"train.callbacks=['{hold_once_at(2, tmp_path / 'hold')}']",  # Ctrl-C after step 2's metrics row
    ]
    proc = ctrl_c_when(tmp_path / "hold" / "held", *args, logs=tmp_path / "interrupted")
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert last_json(proc) == {"error": "interrupted", "exit_code": 130}
    assert "grpoflow train: error: interrupted" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == [
        ".lock",
        "checkpoint-1",
        "heldout",
        "latest",
        "metrics.jsonl",
    ]  # no checkpoint of step 2, nothing half-written
    assert (run / "latest").read_text().strip() == "checkpoint-1"

    again = grpoflow_run(*args)  # the same command again
    assert again.returncode == 0, again.stderr[-3000:]
    summary = last_json(again)
    assert summary["resumed_from_step"] == 1 and summary["checkpoint"] == str(run / "checkpoint-2")
    assert f"resuming from {run / 'checkpoint-1'} (step 1)" in again.stderr
    # step 2's row of the interrupted run was dropped and step 2 trained once, after checkpoint-1
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_every_user_error_derives_from_one_class_the_cli_maps_to_exit_2():
    from data.errors import DataError, GrpoflowUserError, ServiceUnavailable
    from data.manifest import IntegrityError, OutputDirError
    from evaluation.evalscope_runner import EvalInputError
    from flows.cli import UsageError
    from trainer.extras import MissingExtraError
    from trainer.plugins import PluginError
    from trainer.rewards import RewardSpecError
    from trainer.typed_config import ConfigError

    for cls in (
        ConfigError,
        DataError,
        RewardSpecError,
        PluginError,
        MissingExtraError,
        UsageError,
        ServiceUnavailable,
        EvalInputError,
        IntegrityError,
        OutputDirError,
    ):
        assert issubclass(cls, GrpoflowUserError), cls
    # still what callers caught before
    assert issubclass(ConfigError, ValueError) and issubclass(MissingExtraError, ImportError)
