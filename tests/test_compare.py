"""Comparison and regression gate: the paired bootstrap by hand, then `grpoflow compare` / `grpoflow gate` on
real EvalScope work dirs and on versions registered in a real sqlite MLflow store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, scored_copy, shared
from evaluation.compare import Row, compare, gate, load_samples, markdown_table, paired_bootstrap

BENCH = "aime24"


# --- the maths, by hand ---------------------------------------------------------------------------------------

def test_identical_scores_give_zero_with_a_zero_width_interval():
    assert paired_bootstrap([1, 0, 1, 1, 0], [1, 0, 1, 1, 0]) == (0.0, 0.0, 0.0)


def test_a_constant_improvement_is_exact():
    # every problem is one better: every resample's mean difference is exactly 1
    assert paired_bootstrap([0, 0.5, 0, 1], [1, 1.5, 1, 2]) == (1.0, 1.0, 1.0)


def test_two_problems_interval_is_the_hand_computed_one():
    # differences [0, 1]: a resample's mean is 0 (p=1/4), 0.5 (p=1/2) or 1 (p=1/4); the 2.5% and 97.5%
    # quantiles fall inside the two outer masses
    assert paired_bootstrap([1, 0], [1, 1]) == (0.5, 0.0, 1.0)


def test_noisy_interval_brackets_the_true_difference_and_is_deterministic():
    import numpy as np

    rng = np.random.default_rng(7)
    a = rng.integers(0, 2, 400).astype(float)
    b = np.clip(a + rng.choice([-1, 0, 0, 1, 1], 400), 0, 1)
    diff, lo, hi = paired_bootstrap(list(a), list(b), seed=3)
    assert diff == pytest.approx(float((b - a).mean()))
    # the true mean difference: from a=0 the noise adds 1 with p=2/5 (+0.4), from a=1 it takes 1 away with
    # p=1/5 (-0.2); a is 0 or 1 with p=1/2 each: 0.5 * 0.4 - 0.5 * 0.2 = 0.1
    assert lo < 0.1 < hi and lo < diff < hi and hi - lo < 0.15
    assert paired_bootstrap(list(a), list(b), seed=3) == (diff, lo, hi)
    assert paired_bootstrap(list(a), list(b), seed=4) != (diff, lo, hi)
    # a wider confidence level gives a wider interval
    _, lo99, hi99 = paired_bootstrap(list(a), list(b), seed=3, confidence=0.99)
    assert lo99 <= lo and hi99 >= hi


def test_bootstrap_rejects_unpaired_or_empty_input():
    with pytest.raises(ValueError, match="got 2 and 1"):
        paired_bootstrap([1, 0], [1])
    with pytest.raises(ValueError, match="at least one problem"):
        paired_bootstrap([], [])


def _samples(**benches: dict) -> dict:
    return {bench: {"accuracy": ids} for bench, ids in benches.items()}


def test_compare_pairs_problems_by_id_and_says_what_it_dropped():
    base = _samples(math={"p1": 1.0, "p2": 1.0, "p3": 0.0, "only-base": 1.0})
    cand = _samples(math={"p3": 1.0, "p2": 1.0, "p1": 1.0, "only-cand": 0.0})
    [row] = compare(base, cand)
    # common problems p1, p2, p3: baseline 2/3, candidate 3/3, difference (0 + 0 + 1) / 3
    assert (row.benchmark, row.metric, row.n, row.dropped, row.gated) == ("math", "accuracy", 3, 2, True)
    assert row.a == pytest.approx(2 / 3) and row.b == 1.0 and row.diff == pytest.approx(1 / 3)
    assert 0.0 == row.ci_low <= row.diff <= row.ci_high == 1.0
    table = markdown_table([row])
    assert "| math | accuracy | 0.667 | 1.000 | +0.333 | [+0.000, +1.000] | 3 |" in table
    assert "math accuracy: 2" in table

    with pytest.raises(ValueError, match="no problem in common"):
        compare(_samples(math={"a": 1.0}), _samples(math={"b": 1.0}))
    with pytest.raises(ValueError, match=r"different benchmarks: baseline \['math'\], candidate \['aime'\]"):
        compare(_samples(math={"a": 1.0}), _samples(aime={"a": 1.0}))


def test_gate_fails_only_when_the_whole_interval_is_below_the_allowed_drop():
    def row(bench, lo, hi):
        return Row(bench, "accuracy", 0.5, 0.5 + (lo + hi) / 2, (lo + hi) / 2, lo, hi, 100, 0, gated=True)

    thinking = Row("math", "reasoning_tokens", 10, 1, -9, -9, -9, 100, 0, gated=False)  # never gated
    rows = [row("clearly-worse", -0.10, -0.03), row("maybe-worse", -0.10, 0.01), row("edge", -0.05, -0.02),
            row("better", 0.01, 0.05), thinking]
    result = gate(rows, max_drop=0.02)
    assert not result.passed and [r.benchmark for r in result.failing] == ["clearly-worse"]
    assert len(result.checked) == 4
    assert "FAIL" in result.markdown() and "| clearly-worse |" in result.markdown()
    assert gate(rows, max_drop=0.05).passed


# --- real EvalScope work dirs ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluated(tiny_base, tmp_path_factory) -> Path:
    """A real EvalScope evaluation of the tiny model: 4 AIME problems, 16 tokens each."""
    from evaluation import run_evalscope

    work_dir = tmp_path_factory.mktemp("eval") / "tiny"
    run_evalscope(tiny_base["path"], [BENCH], work_dir=work_dir, local_paths={BENCH: str(shared(BENCH))},
                  limit=4, max_tokens=16)
    return work_dir


def with_scores(src: Path, dst: Path, scores: list[float]) -> Path:
    return scored_copy(src, dst, BENCH, scores)


def grpoflow(*args: str, state: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "flows.cli", *args, "--state-dir", str(state)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, env=full_env)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_work_dir_samples_are_keyed_by_subset_and_sample_id(evaluated):
    samples = load_samples(evaluated)
    assert list(samples) == [BENCH] and sorted(samples[BENCH]["accuracy"]) == [f"default/{i}" for i in range(4)]
    report = json.loads((evaluated / "report.json").read_text())
    scores = samples[BENCH]["accuracy"].values()
    assert sum(scores) / len(scores) == report["scores"][BENCH]


def test_gate_passes_a_model_against_itself(evaluated, tmp_path):
    proc = grpoflow("gate", "--candidate", str(evaluated), "--baseline", str(evaluated / "report.json"),
                    f"eval.out={tmp_path / 'out'}", "--json", state=tmp_path / "state")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["passed"] is True and result["exit_code"] == 0 and result["gate"]["failing"] == []
    [row] = result["rows"]
    assert (row["benchmark"], row["diff"], row["ci_low"], row["ci_high"], row["n"]) == (BENCH, 0.0, 0.0, 0.0, 4)


def test_gate_fails_a_clearly_worse_candidate_with_exit_1_and_a_table(evaluated, tmp_path):
    good = with_scores(evaluated, tmp_path / "good", [1.0, 1.0, 1.0, 1.0])
    worse = with_scores(evaluated, tmp_path / "worse", [1.0, 0.0, 0.0, 0.0])
    proc = grpoflow("gate", "--candidate", str(worse), "--baseline", str(good), f"eval.out={tmp_path / 'out'}",
                    state=tmp_path / "state")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # differences [0, -1, -1, -1]: mean -0.75; a resample averages above -0.25 only with p = 1/256
    assert "Gate FAIL" in proc.stdout and "| aime24 | accuracy | 1.000 | 0.250 | -0.750 | [-1.000, -0.250] | 4 |" \
        in proc.stdout

    # the same verdict in JSON; `compare` itself has no verdict and exits 0
    result = last_json(grpoflow("gate", "--candidate", str(worse), "--baseline", str(good), "--json",
                                f"eval.out={tmp_path / 'out'}", state=tmp_path / "state"))
    assert result["passed"] is False and result["exit_code"] == 1
    assert [r["benchmark"] for r in result["gate"]["failing"]] == [BENCH]
    proc = grpoflow("compare", str(good), str(worse), f"eval.out={tmp_path / 'out'}", state=tmp_path / "state")
    assert proc.returncode == 0 and "-0.750" in proc.stdout and "comparison.png" in proc.stdout


def test_thinking_metrics_are_compared_when_the_work_dir_has_them(evaluated, tiny_base, tmp_path):
    thinking = pytest.importorskip("evaluation.thinking")
    a = with_scores(evaluated, tmp_path / "a", [0.0, 0.0, 0.0, 0.0])
    b = with_scores(evaluated, tmp_path / "b", [0.0, 0.0, 0.0, 0.0])
    thinking.analyze(a, tiny_base["path"])
    thinking.analyze(b, tiny_base["path"])
    rows = compare(load_samples(a), load_samples(b))
    by_metric = {r.metric: r for r in rows}
    assert "reasoning_tokens" in by_metric and not by_metric["reasoning_tokens"].gated
    assert by_metric["reasoning_tokens"].n == 4 and by_metric["reasoning_tokens"].diff == 0.0
    assert gate(rows).checked == [by_metric["accuracy"]]


def test_unreachable_mlflow_is_exit_2_with_a_clear_message(evaluated, tmp_path):
    for uri in ("sqlite:////proc/grpoflow-no-such-dir/x.db", "http://127.0.0.1:9"):
        proc = grpoflow("gate", "--candidate", "models:/grpoflow-tiny/2", "--baseline", "models:/grpoflow-tiny@champion",
                        state=tmp_path / "state",
                        env={"MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                             "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"})
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "grpoflow gate: error:" in proc.stderr and uri in proc.stderr and "unreachable" in proc.stderr


# --- registered versions in a real sqlite MLflow ------------------------------------------------------------------

def register(client, experiment_id: str, checkpoint: Path, name: str) -> str:
    from data.manifest import read_manifest
    from tasks.registry import register_checkpoint

    run_id = client.create_run(experiment_id, run_name="register").info.run_id
    version, created = register_checkpoint(client, name, experiment_id, run_id, checkpoint,
                                           read_manifest(checkpoint)["sha256"], {"base_model": str(checkpoint)})
    assert created
    return version


def test_compare_two_registered_versions_evaluates_once_and_logs_the_plot(tiny_base, tmp_path):
    from mlflow import MlflowClient

    from data.manifest import combined_sha256, file_hashes, read_manifest, write_json_atomic
    from evaluation import run_evalscope
    from tasks import tracking
    from tasks.evaluation import ModelRef, record_evaluation
    from trainer.recipe import load_recipe

    state, name = tmp_path / "state", "cmp-tiny"
    overrides = [f"eval.out={tmp_path / 'eval'}", f"eval.benchmarks=[{BENCH}]", "eval.limit=4", "eval.max_tokens=16",
                 f"eval.local_paths={{{BENCH}: {shared(BENCH)}}}"]
    uri = f"sqlite:///{state / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    experiment_id = tracking.ensure_experiment(client, "grpoflow", str(state / "mlartifacts"))

    # version 2 is the same weights with one more config key: another checkpoint, the same answers
    second = tmp_path / "second"
    shutil.copytree(tiny_base["path"], second)
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**config, "grpoflow_test_copy": 2}))
    files = file_hashes(second)
    write_json_atomic(second / "manifest.json", {**read_manifest(second), "files": files,
                                                 "sha256": combined_sha256(files)})
    assert register(client, experiment_id, Path(tiny_base["path"]), name) == "1"
    assert register(client, experiment_id, second, name) == "2"

    # version 1 was evaluated the way the pipeline does it: <eval.out>/<name>-v<version>, recorded in MLflow
    e = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", overrides).eval
    result = run_evalscope(tiny_base["path"], e.benchmarks, work_dir=Path(e.out) / f"{name}-v1",
                           local_paths=e.local_paths, limit=e.limit, max_tokens=e.max_tokens)
    v1_eval = record_evaluation(client, experiment_id, ModelRef(f"models:/{name}/1", tiny_base["path"], None, name,
                                                                "1"), result.scores, e, result.report_json)

    proc = grpoflow("compare", f"models:/{name}/1", f"models:/{name}@candidate", *overrides, "--json", state=state)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = last_json(proc)
    assert first["baseline"]["reused"] is True and first["baseline"]["eval_run_id"] == v1_eval
    # the evaluation compare reused is the one whose metrics MLflow's model view shows for version 1
    from tasks.registry import model_id_of
    linked = client.get_logged_model(model_id_of(client.get_model_version(name, "1"))).metrics
    assert {m.run_id for m in linked} == {v1_eval} and {m.key: m.value for m in linked}[BENCH] == result.scores[BENCH]
    assert first["candidate"]["reused"] is False and first["candidate"]["model_version"] == "2"
    assert Path(first["candidate"]["work_dir"]) == tmp_path / "eval" / f"{name}-v2"
    [row] = [r for r in first["rows"] if r["metric"] == "accuracy"]
    assert {k: row[k] for k in ("benchmark", "metric", "n", "diff", "ci_low", "ci_high")} == \
        {"benchmark": BENCH, "metric": "accuracy", "n": 4, "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    # both evaluations were recorded with their thinking-efficiency samples, compared (not gated) beside it
    thinking = {r["metric"]: r for r in first["rows"] if r["metric"] != "accuracy"}
    assert thinking["reasoning_tokens"]["n"] == 4 and thinking["reasoning_tokens"]["diff"] == 0.0
    assert not any(r["gated"] for r in thinking.values())
    assert f"| {BENCH} | accuracy |" in first["table"]

    run = client.get_run(first["mlflow_run_id"])
    assert run.data.tags["baseline"] == f"models:/{name}/1" and run.data.tags["candidate_model_version"] == "2"
    assert run.data.metrics[f"{BENCH}.accuracy.diff"] == 0.0 and run.data.metrics[f"{BENCH}.accuracy.n"] == 4
    logged = {Path(f.path).name for f in client.list_artifacts(first["mlflow_run_id"], "comparison")}
    assert {"comparison.png", "comparison.md", "comparison.json"} <= logged
    png = client.download_artifacts(first["mlflow_run_id"], "comparison/comparison.png", str(tmp_path / "dl"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert client.get_model_version(name, "2").tags["eval_mlflow_run_id"] == first["candidate"]["eval_run_id"]

    # the second time both evaluations are reused; a passing gate with --promote crowns version 2
    proc = grpoflow("gate", "--candidate", f"models:/{name}/2", "--baseline", f"models:/{name}/1", "--promote",
                    *overrides, "--json", state=state)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = last_json(proc)
    assert again["baseline"]["reused"] and again["candidate"]["reused"]
    assert again["candidate"]["eval_run_id"] == first["candidate"]["eval_run_id"]
    assert again["promoted"] == f"models:/{name}/2"
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"
    evaluations = client.search_runs([experiment_id], "attributes.run_name = 'evaluate'")
    assert len(evaluations) == 2

    # an unknown alias is an error of the input: exit 2, named
    proc = grpoflow("gate", "--candidate", f"models:/{name}@nope", "--baseline", f"models:/{name}/1", *overrides,
                    state=state)
    assert proc.returncode == 2 and f"models:/{name}@nope: not found in MLflow" in proc.stderr


def test_regression_eval_flow_returns_the_verdict_under_prefect(evaluated, tmp_path):
    """The flow CI triggers run: real Prefect (ephemeral API under the state dir), real sqlite MLflow."""
    good = with_scores(evaluated, tmp_path / "good", [1.0, 1.0, 1.0, 1.0])
    script = (
        "import json, sys\n"
        "from tasks.services import configure\n"
        "s = configure(sys.argv[1])\n"
        "from flows.regression_eval import regression_eval\n"
        "from trainer.recipe import load_recipe\n"
        "recipe = load_recipe(None, [f'eval.out={sys.argv[4]}']).to_dict()\n"
        "services = {'tracking_uri': s.tracking_uri, 'artifact_root': s.artifact_root, 'state_dir': str(s.state_dir)}\n"
        "print(json.dumps(regression_eval(sys.argv[2], sys.argv[3], 0.02, False, recipe, services), default=str))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "state"), str(evaluated), str(good),
                           str(tmp_path / "out")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["passed"] is False and [r["benchmark"] for r in result["failing"]] == [BENCH]
    assert result["rows"][0]["diff"] == -1.0 and Path(result["plot"]).is_file()
