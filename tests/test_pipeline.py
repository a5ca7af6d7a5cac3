"""The pipeline end to end: real Prefect (ephemeral API), real sqlite MLflow, real EvalScope, real training.

Each test runs `grpoflow run` as a user would, in a subprocess with its own state folder, on a few
training steps and a two-problem EvalScope run over ../shared/data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    REPO_ROOT,
    URL_SECRET,
    ctrl_c_when,
    grpoflow_run,
    hold_once_at,
    last_json,
    one_line_error,
    shared,
)
from data.manifest import read_manifest, sha256_dir

pytestmark = pytest.mark.slow


def pipeline_args(tmp: Path, tiny_base: dict, *overrides: str) -> list[str]:
    """`grpoflow run` on a few training steps and a two-problem evaluation, its state under `tmp`."""
    return [
        "run",
        "--state-dir",
        str(tmp / "state"),
        "--json",
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tmp / 'data'}",
        "data.synthetic_rows=600",
        f"train.output_dir={tmp / 'runs'}",
        "train.max_steps=4",
        "train.save_steps=2",
        "train.eval_heldout=32",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        f"eval.out={tmp / 'eval'}",
        "eval.limit=2",
        "eval.max_tokens=24",
        f"eval.local_paths={{math_500: {shared('math_500')}, aime24: {shared('aime24')}}}",
        *overrides,
    ]


def run_pipeline(
    tmp: Path, tiny_base: dict, *overrides: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "flows.cli", *pipeline_args(tmp, tiny_base, *overrides)]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    full_env.update(env or {})
    return subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500, env=full_env)


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mlflow_client(tmp: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp / 'state' / 'mlflow.db'}"
    return MlflowClient(uri, registry_uri=uri)


def test_pipeline_lineage_caching_and_rerun_downstream_of_a_change(tmp_path, tiny_base):
    first = summary_of(run_pipeline(tmp_path, tiny_base))
    assert first["cached_stages"] == [] and first["model_version"] == "1"
    assert set(first["scores"]) >= {"math_500", "aime24", "heldout_accuracy"}
    assert all(0.0 <= v <= 1.0 for v in first["scores"].values())

    client = mlflow_client(tmp_path)
    [version] = client.search_model_versions("name='grpoflow-tiny'")
    data_manifest = read_manifest(tmp_path / "data")
    ckpt = Path(first["checkpoint"])
    assert version.tags["dataset_sha256"] == data_manifest["sha256"]
    assert version.tags["checkpoint_sha256"] == read_manifest(ckpt)["sha256"] == sha256_dir(ckpt)
    assert version.tags["recipe_sha256"] == first["recipe_sha256"]
    assert version.tags["prefect_flow_run_id"] == first["prefect_flow_run_id"] != ""
    assert version.tags["base_model"] == tiny_base["path"] and version.tags["steps_trained"] == "4"
    assert len(version.tags["git_commit"]) >= 40
    assert str(client.get_model_version_by_alias("grpoflow-tiny", "candidate").version) == "1"
    assert float(version.tags["eval.math_500"]) == pytest.approx(first["scores"]["math_500"], abs=1e-4)

    # the registered source is an MLflow model holding the checkpoint less its training state
    import mlflow

    local = mlflow.artifacts.download_artifacts(
        artifact_uri=version.source,
        dst_path=str(tmp_path / "dl"),
        tracking_uri=f"sqlite:///{tmp_path / 'state' / 'mlflow.db'}",
    )
    assert "MLmodel" in os.listdir(local)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(Path(local) / "model"))
    assert "trainer_state.pt" in os.listdir(ckpt) and "trainer_state.pt" not in os.listdir(
        Path(local) / "model"
    )
    # the evaluation's scores are numbers linked to that model: what MLflow's model comparison shows
    from tasks.registry import model_id_of

    linked = {m.key: m.value for m in client.get_logged_model(model_id_of(version)).metrics}
    assert {k: linked[k] for k in first["scores"]} == pytest.approx(first["scores"])

    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])
    }
    assert {"pipeline-tiny-cpu", "prepare", "train", "register", "evaluate"} <= set(runs)
    parent = runs["pipeline-tiny-cpu"].info.run_id
    assert all(
        runs[s].data.tags["mlflow.parentRunId"] == parent
        for s in ("prepare", "train", "register", "evaluate")
    )
    train = runs["train"]
    assert train.inputs.dataset_inputs[0].dataset.digest == data_manifest["sha256"][:36]
    assert len(client.get_metric_history(train.info.run_id, "reward")) == 4
    # every per-step metric under the name metrics.jsonl (and TRL) gives it, its steps the x axis
    rows = [json.loads(line) for line in (ckpt.parent / "metrics.jsonl").read_text().splitlines()]
    named = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    assert {"clip_ratio/high_mean", "completions/mean_length", "frac_reward_zero_std"} <= named
    assert named <= set(train.data.metrics), named - set(train.data.metrics)
    history = client.get_metric_history(train.info.run_id, "completions/mean_length")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["completions/mean_length"]) for r in rows]
    assert {a.path for a in client.list_artifacts(train.info.run_id, "plots")} == {
        "plots/reward.png",
        "plots/completion_length.png",
    }
    assert runs["evaluate"].data.metrics["math_500"] == pytest.approx(first["scores"]["math_500"])
    report = json.loads(Path(first["eval_report"]).read_text())
    assert report["scores"]["math_500"] == pytest.approx(first["scores"]["math_500"])

    second = summary_of(run_pipeline(tmp_path, tiny_base))
    assert second["cached_stages"] == ["prepare", "base_model", "train", "register", "evaluate"]
    assert second["model_version"] == "1"

    changed = summary_of(run_pipeline(tmp_path, tiny_base, "train.learning_rate=2e-5"))
    assert changed["cached_stages"] == ["prepare", "base_model"]
    assert changed["model_version"] == "2" and changed["recipe_sha256"] != first["recipe_sha256"]
    assert len(client.search_model_versions("name='grpoflow-tiny'")) == 2


FAULT = """
from pathlib import Path
MARKER = Path({marker!r})

class FailOnceAfterCheckpoint:
    def on_checkpoint(self, step, path):
        if not MARKER.exists():
            MARKER.write_text(str(step))
            raise RuntimeError("injected failure after checkpoint " + str(step))

def make():
    return FailOnceAfterCheckpoint()
"""


def test_training_failure_is_retried_and_resumes_from_its_checkpoint(tmp_path, tiny_base):
    plugin = tmp_path / "fault.py"
    plugin.write_text(FAULT.format(marker=str(tmp_path / "failed-once")))
    summary = summary_of(run_pipeline(tmp_path, tiny_base, f"train.callbacks=['{plugin}:make']"))
    assert (tmp_path / "failed-once").read_text() == "2"
    metrics = [
        json.loads(line)
        for line in (Path(summary["checkpoint"]).parent / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # no step lost, none repeated
    assert len(mlflow_client(tmp_path).search_model_versions("name='grpoflow-tiny'")) == 1


def test_ctrl_c_in_run_exits_130_with_json_and_the_rerun_resumes_from_the_last_checkpoint(
    tmp_path, tiny_base
):
    """Ctrl-C stops Prefect's temporary server as well as the flow (one process group): what Prefect then
    fails on while reporting the crash is still an interrupt."""
    overrides = [
        "train.max_steps=2",
        "train.save_steps=1",
        "train.eval_heldout=4",
        "eval.limit=1",
        "eval.max_tokens=8",
        f"train.callbacks=['{hold_once_at(2, tmp_path / 'hold')}']",  # Ctrl-C after step 2's metrics row
    ]
    args = pipeline_args(tmp_path, tiny_base, *overrides)
    proc = ctrl_c_when(tmp_path / "hold" / "held", *args, logs=tmp_path / "interrupted")
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert last_json(proc) == {"error": "interrupted", "exit_code": 130}
    assert "grpoflow run: error: interrupted" in proc.stderr
    [run] = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]

    summary = summary_of(run_pipeline(tmp_path, tiny_base, *overrides))  # the same command again
    assert summary["checkpoint"] == str(run / "checkpoint-2") and summary["model_version"] == "1"
    # step 2's row of the interrupted run was dropped and step 2 trained once, after checkpoint-1
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_unreachable_registry_fails_clearly_and_keeps_the_checkpoint(tmp_path, tiny_base):
    bad = "sqlite:////proc/grpoflow-no-such-dir/registry.db"
    proc = run_pipeline(tmp_path, tiny_base, env={"MLFLOW_REGISTRY_URI": bad})
    assert proc.returncode == 1
    assert (
        "registering" in proc.stderr
        and bad in proc.stderr
        and "checkpoint on disk is untouched" in proc.stderr
    )
    [ckpt] = (tmp_path / "runs").glob("*/checkpoint-4")
    assert read_manifest(ckpt)["sha256"] == sha256_dir(ckpt)


def test_a_cached_result_whose_files_are_gone_is_named_by_missing_outputs(tmp_path):
    """What the flow checks on a cache hit before handing a stage's result on (a rerun when something is
    gone)."""
    from tasks.stages import missing_outputs

    (tmp_path / "data").mkdir()
    gone = str(tmp_path / "runs" / "checkpoint-4")
    assert missing_outputs({"out": str(tmp_path / "data"), "checkpoint": gone, "steps": 4}) == [gone]
    assert missing_outputs({"path": "Qwen/Qwen2.5-7B", "bootstrapped": False}) == []  # a hub id is no path
    assert missing_outputs({"path": gone, "bootstrapped": True}) == [gone]
    assert missing_outputs({"model_name": "m", "model_version": "1"}) == []


# ==========================================================================================================
# Refused before the pipeline starts: a dead Prefect API, an unknown benchmark
# ==========================================================================================================
# Every command runs as a real `grpoflow` subprocess; its timeout is a guard, never the assertion.


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_run_with_a_dead_prefect_api_is_exit_2_before_the_pipeline_starts(
    server, silent_port, closed_port, tmp_path
):
    port = closed_port if server == "closed" else silent_port.getsockname()[1]
    state = tmp_path / "state"
    proc = grpoflow_run(
        "run",
        "--state-dir",
        str(state),
        "--json",
        env={"PREFECT_API_URL": f"http://user:{URL_SECRET}@127.0.0.1:{port}/api"},
    )
    line = one_line_error(proc, "run")
    reason = "connection refused" if server == "closed" else "no answer within 10 s"
    assert (
        f"the Prefect API at http://user:***@127.0.0.1:{port}/api/health is unreachable: {reason} "
        "(PREFECT_API_URL)" in line
    )
    assert URL_SECRET not in proc.stdout + proc.stderr and last_json(proc)["exit_code"] == 2
    assert not (state / "data").exists() and not (state / "runs").exists()  # nothing was prepared or trained


def test_the_pipeline_is_not_started_with_an_unknown_benchmark(tmp_path):
    state = tmp_path / "state"
    proc = grpoflow_run("run", "--state-dir", str(state), "eval.benchmarks=[math500]", "eval.local_paths={}")
    assert "unknown benchmark 'math500'" in one_line_error(proc, "run")
    assert not (state / "data").exists()


def test_a_recipe_of_two_trainer_ranks_trains_as_two_ranks_in_the_pipeline(tmp_path, tiny_base):
    """The train stage starts the recipe's trainer ranks (two gloo ranks here: `rollout.train_devices` [0, 1]
    without GPUs) as `grpoflow train` would, instead of training as one rank in its own process: rank 0's
    summary says 2 ranks, and so does the stage's MLflow run, which holds each step as rank 0 wrote it to
    metrics.jsonl. The ranks' output goes to stderr: stdout holds the pipeline's JSON alone."""
    proc = run_pipeline(tmp_path, tiny_base, "rollout.train_devices=[0,1]", "eval.benchmarks=[]")
    summary = summary_of(proc)
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()]
    run_dir = Path(summary["checkpoint"]).parent
    assert json.loads((run_dir / "summary.json").read_text())["trainer_ranks"] == 2
    client = mlflow_client(tmp_path)
    [train] = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "attributes.run_name = 'train'"
    )
    assert train.data.params["trainer_ranks"] == "2"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for name in ("reward", "loss", "completions/mean_length"):
        logged = client.get_metric_history(train.info.run_id, name)
        assert [(m.step, m.value) for m in logged] == [(r["step"], r[name]) for r in rows], name


def test_a_multi_node_recipe_without_node_0s_rendezvous_is_refused_before_the_pipeline_starts(tmp_path):
    state = tmp_path / "state"
    proc = grpoflow_run("run", "--state-dir", str(state), "rollout.nodes=2")
    line = one_line_error(proc, "run")
    assert "rollout.nodes is 2" in line and "GRPOFLOW_RENDEZVOUS" in line and "grpoflow join" in line
    assert not (state / "data").exists()
