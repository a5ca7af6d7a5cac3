"""Comparison and regression gate: the paired bootstrap by hand, then `grpoflow compare` / `grpoflow gate` on
real EvalScope work dirs and on versions registered in a real sqlite MLflow store."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from memorised_model import eval_overrides, evaluated_problems, reasoning

from conftest import REPO_ROOT, URL_SECRET, grpoflow_run, one_line_error, registrable_copy, shared
from evaluation.compare import Row, compare, gate, load_samples, markdown_table, paired_bootstrap

BENCH = "aime24"


# --- the maths, by hand -------------------------------------------------------------------------------------


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
    rows = [
        row("clearly-worse", -0.10, -0.03),
        row("maybe-worse", -0.10, 0.01),
        row("edge", -0.05, -0.02),
        row("better", 0.01, 0.05),
        thinking,
    ]
    result = gate(rows, max_drop=0.02)
    assert not result.passed and [r.benchmark for r in result.failing] == ["clearly-worse"]
    assert len(result.checked) == 4
    assert "FAIL" in result.markdown() and "| clearly-worse |" in result.markdown()
    assert gate(rows, max_drop=0.05).passed


# --- real EvalScope work dirs: the memorising model, whose scores are known problem by problem, and the ----
# plain tiny model, which solves none of the problems (conftest's memorised_eval and plain_eval, shared by
# the session)


def grpoflow(*args: str, state: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--state-dir", str(state)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=full_env,
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def accuracy_rows(result: dict) -> set[tuple]:
    return {
        (r["benchmark"], r["a"], r["b"], r["diff"], r["ci_low"], r["ci_high"], r["n"])
        for r in result["rows"]
        if r["metric"] == "accuracy"
    }


def test_work_dir_samples_are_keyed_by_problem_id(memorised_eval):
    samples = load_samples(memorised_eval.work_dir)
    # MATH-500 problems by their unique_id, AIME problems (which have none) by subset and place
    assert sorted(samples["aime24"]["accuracy"]) == ["default/0", "default/1"]
    assert sorted(samples["math_500"]["accuracy"])[:3] == [
        "test/algebra/1349.json",
        "test/algebra/2584.json",
        "test/intermediate_algebra/134.json",
    ]
    assert samples["math_500"]["accuracy"]["test/intermediate_algebra/134.json"] == 1.0  # memorised (Level 1)
    assert samples["math_500"]["accuracy"]["test/precalculus/1303.json"] == 0.0  # not memorised (Level 1)
    report = json.loads(memorised_eval.report_json.read_text())
    for bench, metrics in samples.items():
        scores = metrics["accuracy"].values()
        assert sum(scores) / len(scores) == pytest.approx(report["scores"][bench]) and len(scores) in (2, 10)


def test_gate_passes_a_model_against_itself(memorised_eval, plain_eval, tmp_path):
    proc = grpoflow(
        "gate",
        "--candidate",
        str(memorised_eval.work_dir),
        "--baseline",
        str(memorised_eval.report_json),
        f"eval.out={tmp_path / 'out'}",
        "--json",
        state=tmp_path / "state",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["passed"] is True and result["exit_code"] == 0 and result["gate"]["failing"] == []
    assert accuracy_rows(result) == {
        ("aime24", 0.5, 0.5, 0.0, 0.0, 0.0, 2),
        ("math_500", 0.4, 0.4, 0.0, 0.0, 0.0, 10),
    }

    # the memorising model over the plain one: better on every memorised problem, which the gate passes
    proc = grpoflow(
        "gate",
        "--candidate",
        str(memorised_eval.work_dir),
        "--baseline",
        str(plain_eval.work_dir),
        f"eval.out={tmp_path / 'out'}",
        "--json",
        state=tmp_path / "state",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["passed"] is True and {(r[0], r[3]) for r in accuracy_rows(result)} == {
        ("aime24", 0.5),
        ("math_500", 0.4),
    }


def test_gate_fails_a_clearly_worse_candidate_with_exit_1_and_a_table(memorised_eval, plain_eval, tmp_path):
    worse, good = str(plain_eval.work_dir), str(memorised_eval.work_dir)
    proc = grpoflow(
        "gate",
        "--candidate",
        worse,
        "--baseline",
        good,
        f"eval.out={tmp_path / 'out'}",
        state=tmp_path / "state",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # MATH-500: differences -1 on the 4 memorised problems of 10; a resample's mean is
    # -Binomial(10, 0.4) / 10, whose 2.5% and 97.5% points fall inside the masses at -0.7 and -0.1
    # (P(X <= 1) = 0.046, P(X <= 6) = 0.945).
    # AIME: differences [0, -1], so the interval reaches 0 and that benchmark does not fail.
    assert "Gate FAIL" in proc.stdout and "1 of 2 benchmarks" in proc.stdout
    assert "| math_500 | accuracy | 0.400 | 0.000 | -0.400 | [-0.700, -0.100] | 10 |" in proc.stdout

    # the same verdict in JSON; `compare` itself has no verdict and exits 0
    result = last_json(
        grpoflow(
            "gate",
            "--candidate",
            worse,
            "--baseline",
            good,
            "--json",
            f"eval.out={tmp_path / 'out'}",
            state=tmp_path / "state",
        )
    )
    assert result["passed"] is False and result["exit_code"] == 1
    assert [r["benchmark"] for r in result["gate"]["failing"]] == ["math_500"]
    proc = grpoflow("compare", good, worse, f"eval.out={tmp_path / 'out'}", state=tmp_path / "state")
    assert proc.returncode == 0 and "-0.400" in proc.stdout and "comparison.png" in proc.stdout


def _thinking_values(work_dir: Path, metric: str) -> dict[tuple[str, str], float]:
    rows = [json.loads(line) for line in (work_dir / "thinking" / "samples.jsonl").read_text().splitlines()]
    return {(r["benchmark"], f"{r['subset']}/{r['id']}"): r[metric] for r in rows if r[metric] is not None}


def test_thinking_metrics_are_compared_when_the_work_dir_has_them(
    memorised_eval, plain_eval, memorising_model, tiny_base, tmp_path
):
    from transformers import AutoTokenizer

    from evaluation import thinking

    plain = shutil.copytree(plain_eval.work_dir, tmp_path / "plain")
    memorised = shutil.copytree(memorised_eval.work_dir, tmp_path / "memorised")
    thinking.analyze(plain, tiny_base["path"])
    thinking.analyze(memorised, memorising_model)
    rows = compare(load_samples(plain), load_samples(memorised))
    by_metric = {(r.benchmark, r.metric): r for r in rows}
    assert gate(rows).checked == [by_metric["aime24", "accuracy"], by_metric["math_500", "accuracy"]]
    assert not any(r.gated for r in rows if r.metric != "accuracy")

    # where the memorising model was right its reasoning is the one it was taught, so its length is known
    tokenizer = AutoTokenizer.from_pretrained(memorising_model)
    samples = [
        json.loads(line) for line in (memorised / "thinking" / "samples.jsonl").read_text().splitlines()
    ]
    right = [r for r in samples if r["correct"]]
    assert len(right) == sum(p.memorised for p in evaluated_problems(shared())) == 5
    for r in right:
        taught = len(tokenizer.encode(reasoning(r["gold"][0]), add_special_tokens=False))
        assert r["reasoning_tokens"] == taught and 0 < r["first_correct_tokens"] < taught
    # every other number is the paired mean difference of the two sample files: plain (baseline) vs memorising
    for metric in ("reasoning_tokens", "paragraphs", "thought_num"):
        a, b = _thinking_values(plain, metric), _thinking_values(memorised, metric)
        for bench, n in (("math_500", 10), ("aime24", 2)):
            common = sorted(k for k in a.keys() & b.keys() if k[0] == bench)
            row = by_metric[bench, metric]
            assert (row.n, row.dropped) == (len(common), 0) == (n, 0)
            assert row.a == pytest.approx(sum(a[k] for k in common) / n)
            assert row.diff == pytest.approx(sum(b[k] - a[k] for k in common) / n)
    assert by_metric["math_500", "reasoning_tokens"].diff != 0  # a pair that differs, not one model twice
    # defined on correct answers only, and the plain model has none: nothing to pair, so no row
    assert ("math_500", "first_correct_tokens") not in by_metric and (
        "math_500",
        "token_efficiency",
    ) not in by_metric


def test_unreachable_mlflow_is_exit_2_with_a_clear_message(tmp_path):
    for uri in ("sqlite:////proc/grpoflow-no-such-dir/x.db", "http://127.0.0.1:9"):
        proc = grpoflow(
            "gate",
            "--candidate",
            "models:/grpoflow-tiny/2",
            "--baseline",
            "models:/grpoflow-tiny@champion",
            state=tmp_path / "state",
            env={
                "MLFLOW_TRACKING_URI": uri,
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
            },
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "grpoflow gate: error:" in proc.stderr and uri in proc.stderr and "unreachable" in proc.stderr


# --- registered versions in a real sqlite MLflow ------------------------------------------------------------


def register(client, experiment_id: str, checkpoint: Path, name: str) -> str:
    from data.manifest import read_manifest
    from tasks.registry import register_checkpoint

    run_id = client.create_run(experiment_id, run_name="register").info.run_id
    version, created = register_checkpoint(
        client,
        name,
        experiment_id,
        run_id,
        checkpoint,
        read_manifest(checkpoint)["sha256"],
        {"base_model": str(checkpoint)},
    )
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
    overrides = [
        f"eval.out={tmp_path / 'eval'}",
        f"eval.benchmarks=[{BENCH}]",
        "eval.limit=4",
        "eval.max_tokens=16",
        f"eval.local_paths={{{BENCH}: {shared(BENCH)}}}",
    ]
    uri = f"sqlite:///{state / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    experiment_id = tracking.ensure_experiment(client, "grpoflow", str(state / "mlartifacts"))

    # version 2 is the same weights with one more config key: another checkpoint, the same answers
    second = tmp_path / "second"
    shutil.copytree(tiny_base["path"], second)
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**config, "grpoflow_test_copy": 2}))
    files = file_hashes(second)
    write_json_atomic(
        second / "manifest.json", {**read_manifest(second), "files": files, "sha256": combined_sha256(files)}
    )
    assert register(client, experiment_id, Path(tiny_base["path"]), name) == "1"
    assert register(client, experiment_id, second, name) == "2"

    # version 1 was evaluated the way the pipeline does it: <eval.out>/<name>-v<version>, recorded in MLflow
    e = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", overrides).eval
    result = run_evalscope(
        tiny_base["path"],
        e.benchmarks,
        work_dir=Path(e.out) / f"{name}-v1",
        local_paths=e.local_paths,
        limit=e.limit,
        max_tokens=e.max_tokens,
    )
    v1_eval = record_evaluation(
        client,
        experiment_id,
        ModelRef(f"models:/{name}/1", tiny_base["path"], None, name, "1"),
        result.scores,
        e,
        result.report_json,
    )

    proc = grpoflow(
        "compare", f"models:/{name}/1", f"models:/{name}@candidate", *overrides, "--json", state=state
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = last_json(proc)
    assert first["baseline"]["reused"] is True and first["baseline"]["eval_run_id"] == v1_eval
    # the evaluation compare reused is the one whose metrics MLflow's model view shows for version 1
    from tasks.registry import model_id_of

    linked = client.get_logged_model(model_id_of(client.get_model_version(name, "1"))).metrics
    assert {m.run_id for m in linked} == {v1_eval} and {m.key: m.value for m in linked}[
        BENCH
    ] == result.scores[BENCH]
    assert first["candidate"]["reused"] is False and first["candidate"]["model_version"] == "2"
    assert Path(first["candidate"]["work_dir"]) == tmp_path / "eval" / f"{name}-v2"
    [row] = [r for r in first["rows"] if r["metric"] == "accuracy"]
    assert {k: row[k] for k in ("benchmark", "metric", "n", "diff", "ci_low", "ci_high")} == {
        "benchmark": BENCH,
        "metric": "accuracy",
        "n": 4,
        "diff": 0.0,
        "ci_low": 0.0,
        "ci_high": 0.0,
    }
    # both evaluations were recorded with their thinking-efficiency samples, compared (not gated) beside it
    thinking = {r["metric"]: r for r in first["rows"] if r["metric"] != "accuracy"}
    assert thinking["reasoning_tokens"]["n"] == 4 and thinking["reasoning_tokens"]["diff"] == 0.0
    assert not any(r["gated"] for r in thinking.values())
    assert f"| {BENCH} | accuracy |" in first["table"]

    run = client.get_run(first["mlflow_run_id"])
    assert (
        run.data.tags["baseline"] == f"models:/{name}/1" and run.data.tags["candidate_model_version"] == "2"
    )
    assert run.data.metrics[f"{BENCH}.accuracy.diff"] == 0.0 and run.data.metrics[f"{BENCH}.accuracy.n"] == 4
    logged = {Path(f.path).name for f in client.list_artifacts(first["mlflow_run_id"], "comparison")}
    assert {"comparison.png", "comparison.md", "comparison.json"} <= logged
    png = client.download_artifacts(first["mlflow_run_id"], "comparison/comparison.png", str(tmp_path / "dl"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert client.get_model_version(name, "2").tags["eval_mlflow_run_id"] == first["candidate"]["eval_run_id"]

    # the second time both evaluations are reused; a passing gate with --promote crowns version 2
    proc = grpoflow(
        "gate",
        "--candidate",
        f"models:/{name}/2",
        "--baseline",
        f"models:/{name}/1",
        "--promote",
        *overrides,
        "--json",
        state=state,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = last_json(proc)
    assert again["baseline"]["reused"] and again["candidate"]["reused"]
    assert again["candidate"]["eval_run_id"] == first["candidate"]["eval_run_id"]
    assert again["promoted"] == f"models:/{name}/2"
    assert client.get_run(again["mlflow_run_id"]).data.tags["promoted"] == f"champion -> models:/{name}/2"
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"
    evaluations = client.search_runs([experiment_id], "attributes.run_name = 'evaluate'")
    assert len(evaluations) == 2

    # an unknown alias is an error of the input: exit 2, named
    proc = grpoflow(
        "gate",
        "--candidate",
        f"models:/{name}@nope",
        "--baseline",
        f"models:/{name}/1",
        *overrides,
        state=state,
    )
    assert proc.returncode == 2 and f"models:/{name}@nope: not found in MLflow" in proc.stderr


def test_regression_eval_flow_returns_the_verdict_under_prefect(memorised_eval, plain_eval, tmp_path):
    """The flow CI triggers run: real Prefect (ephemeral API under the state dir), real sqlite MLflow. It runs
    the steps `grpoflow gate` runs and returns what `gate --json` prints, but for the exit code."""
    script = (
        "import json, math, sys\n"
        "from tasks.services import configure\n"
        "s = configure(sys.argv[1])\n"
        "from flows.regression_eval import regression_eval\n"
        "from trainer.recipe import load_recipe\n"
        "recipe = load_recipe(None, [f'eval.out={sys.argv[4]}']).to_dict()\n"
        "services = {'tracking_uri': s.tracking_uri, 'artifact_root': s.artifact_root, "
        "'state_dir': str(s.state_dir)}\n"
        "try:\n"
        "    regression_eval(sys.argv[2], sys.argv[3], math.nan, False, recipe, services)\n"
        "except ValueError as e:\n"
        "    print(json.dumps({'refused': str(e)}))\n"
        "print(json.dumps(regression_eval(sys.argv[2], sys.argv[3], 0.02, False, recipe, services), "
        "default=str))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(tmp_path / "state"),
            str(plain_eval.work_dir),
            str(memorised_eval.work_dir),
            str(tmp_path / "out"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, result = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    # a NaN allowed drop would pass any regression: refused before anything is evaluated or logged
    assert refused == {"refused": "max_drop must be a finite number >= 0, got nan"}
    # the plain model as the candidate, the memorising one as the baseline: MATH-500 fails (see above)
    assert result["passed"] is False and [r["benchmark"] for r in result["gate"]["failing"]] == ["math_500"]
    assert result["promoted"] is None and result["baseline"]["reused"] and result["candidate"]["reused"]
    diffs = {r["benchmark"]: r["diff"] for r in result["rows"] if r["metric"] == "accuracy"}
    assert diffs == {"math_500": pytest.approx(-0.4), "aime24": -0.5} and Path(result["plot"]).is_file()


def test_a_failing_gate_with_promote_leaves_the_champion_where_it_was(
    memorised_eval, plain_eval, memorising_model, tiny_base, tmp_path
):
    """`grpoflow gate --promote`, then the regression-eval flow with `promote` as its deployment runs it
    (`fail_on_regression`), on a candidate worse than the champion: exit 1, then a Failed `Regression` state;
    the `champion` alias stays on the version it was on and no comparison run is tagged `promoted`."""
    from mlflow import MlflowClient

    from tasks import tracking
    from tasks.comparison import WORK_DIR_TAG
    from tasks.evaluation import ModelRef, record_evaluation
    from trainer.recipe import load_recipe

    state, name = tmp_path / "state", "champion-tiny"
    overrides = [*eval_overrides(shared()), f"eval.out={tmp_path / 'eval'}"]
    uri = f"sqlite:///{state / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    experiment_id = tracking.ensure_experiment(client, "grpoflow", str(state / "mlartifacts"))
    # version 1 the memorising model, version 2 the plain one, each recorded with the session's evaluation of
    # it (made with these settings), which the gate reuses
    memorising = registrable_copy(memorising_model, tiny_base["path"], tmp_path / "memorising")
    settings = load_recipe(None, overrides).eval
    for version, (model, evaluated) in enumerate(
        [(memorising, memorised_eval), (Path(tiny_base["path"]), plain_eval)], start=1
    ):
        assert register(client, experiment_id, model, name) == str(version)
        ref = ModelRef(f"models:/{name}/{version}", None, None, name, str(version))
        run_id = record_evaluation(
            client, experiment_id, ref, dict(evaluated.scores), settings, evaluated.report_json
        )
        client.set_tag(run_id, WORK_DIR_TAG, str(evaluated.work_dir))
    client.set_registered_model_alias(name, "champion", "1")
    champion, candidate = f"models:/{name}@champion", f"models:/{name}/2"

    def champion_and_promoted_runs() -> tuple[str, list[str]]:
        runs = client.search_runs([experiment_id])
        version = str(client.get_model_version_by_alias(name, "champion").version)
        return version, [r.info.run_id for r in runs if "promoted" in r.data.tags]

    gate = ("gate", "--candidate", candidate, "--baseline", champion, "--promote", *overrides, "--json")
    proc = grpoflow(*gate, state=state)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["baseline"]["reused"] and result["candidate"]["reused"]
    assert result["passed"] is False and [r["benchmark"] for r in result["gate"]["failing"]] == ["math_500"]
    assert result["promoted"] is None and "champion ->" not in proc.stdout
    assert champion_and_promoted_runs() == ("1", [])

    # the flow's gate: the same steps under real Prefect (an ephemeral API under the state dir)
    script = (
        "import json, sys\n"
        "from tasks.services import configure\n"
        "s = configure(sys.argv[1])\n"
        "from flows.regression_eval import regression_eval\n"
        "from trainer.recipe import load_recipe\n"
        "recipe = load_recipe(None, sys.argv[4:]).to_dict()\n"
        "state = regression_eval(sys.argv[2], sys.argv[3], 0.02, True, recipe, s.flow_parameters(), "
        "fail_on_regression=True, return_state=True)\n"
        "print(json.dumps({'failed': state.is_failed(), 'name': state.name, 'message': state.message}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(state), candidate, champion, *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict["failed"] and verdict["name"] == "Regression", verdict
    assert verdict["message"].startswith(f"regression: {candidate} is worse than {champion}"), verdict
    assert champion_and_promoted_runs() == ("1", [])


# --- versions evaluated on their held-out split (eval.benchmarks: []) ---------------------------------------


def heldout_data(out: Path) -> Path:
    """A prepared data dir whose held-out split is `evaluated_problems`, prompted as the memorising model was
    taught (no system prompt), so that its greedy answers are known problem by problem; two rows to train
    on."""
    from data.prepare import prepare

    source = out.parent / f"{out.name}-source.jsonl"
    rows = [
        {"question": p.prompt, "answer": p.answer, "split": "heldout"} for p in evaluated_problems(shared())
    ]
    rows += [
        {"question": "1+1", "answer": "2", "split": "train"},
        {"question": "2+2", "answer": "4", "split": "train"},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare("synthetic", str(source), out, system_prompt="none")
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def heldout_overrides(tmp_path: Path, data: Path) -> list[str]:
    # the memorising model's answers are 61 tokens at most; AIME prompts are long, and must not be cut
    return [
        f"eval.out={tmp_path / 'eval'}",
        "eval.benchmarks=[]",
        f"data.out={data}",
        "train.eval_heldout=12",
        "train.max_completion_length=64",
        "train.max_prompt_length=1024",
    ]


def test_heldout_only_versions_are_compared_and_gated_problem_by_problem(
    memorising_model, tiny_base, tmp_path
):
    from mlflow import MlflowClient

    from evaluation.heldout import heldout_settings
    from tasks import tracking
    from tasks.evaluation import ModelRef, evaluate_heldout, record_evaluation
    from trainer.recipe import load_recipe

    state, name = tmp_path / "state", "heldout-tiny"
    data = heldout_data(tmp_path / "data")
    overrides = heldout_overrides(tmp_path, data)
    uri = f"sqlite:///{state / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    experiment_id = tracking.ensure_experiment(client, "grpoflow", str(state / "mlartifacts"))
    assert register(client, experiment_id, Path(tiny_base["path"]), name) == "1"
    memorising = registrable_copy(memorising_model, tiny_base["path"], tmp_path / "memorising")
    assert register(client, experiment_id, memorising, name) == "2"

    # version 2 evaluated as `grpoflow run` evaluates a recipe with eval.benchmarks: []
    # (tasks.stages.evaluate_model)
    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", overrides)
    v2_dir = tmp_path / "eval" / f"{name}-v2"
    report = evaluate_heldout(memorising, recipe.model, heldout_settings(recipe), v2_dir)
    v2_eval = record_evaluation(
        client,
        experiment_id,
        ModelRef(f"models:/{name}/2", None, None, name, "2"),
        {"heldout_accuracy": report["scores"]["heldout"]},
        recipe.eval,
        v2_dir / "report.json",
    )
    # its answers, problem by problem: right exactly on the 5 memorised problems of 12
    problems = evaluated_problems(shared())
    held = [json.loads(line) for line in (v2_dir / "heldout" / "samples.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in held] == [p.answer for p in problems]
    assert [r["correct"] for r in held] == [float(p.memorised) for p in problems]
    assert report["scores"]["heldout"] == 5 / 12 and report["num_samples"] == {"heldout": 12}

    # the plain model (version 1) as the candidate: evaluated by the gate, version 2's evaluation reused
    proc = grpoflow(
        "gate",
        "--candidate",
        f"models:/{name}/1",
        "--baseline",
        f"models:/{name}/2",
        *overrides,
        "--json",
        state=state,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = last_json(proc)
    assert result["baseline"]["reused"] and result["baseline"]["eval_run_id"] == v2_eval
    assert (
        not result["candidate"]["reused"]
        and Path(result["candidate"]["work_dir"]) == tmp_path / "eval" / f"{name}-v1"
    )
    plain = [
        json.loads(line)
        for line in (tmp_path / "eval" / f"{name}-v1" / "heldout" / "samples.jsonl").read_text().splitlines()
    ]
    assert [r["id"] for r in plain] == [r["id"] for r in held] and not any(r["correct"] for r in plain)
    # differences -1 on the 5 memorised problems of 12: a resample's mean is -Binomial(12, 5/12) / 12, whose
    # 2.5% and 97.5% points are 2 and 8 (P(X <= 1) = 0.015, P(X <= 2) = 0.067, P(X <= 7) = 0.927,
    # P(X <= 8) = 0.979): the interval is [-8/12, -2/12], wholly below -0.02, so the gate fails
    [row] = result["rows"]
    assert (row["benchmark"], row["metric"], row["n"], row["dropped"]) == ("heldout", "accuracy", 12, 0)
    assert (row["a"], row["b"]) == (5 / 12, 0.0) and row["diff"] == pytest.approx(-5 / 12)
    assert (row["ci_low"], row["ci_high"]) == (pytest.approx(-8 / 12), pytest.approx(-2 / 12))
    assert result["passed"] is False and [r["benchmark"] for r in result["gate"]["failing"]] == ["heldout"]
    assert "| heldout | accuracy | 0.417 | 0.000 | -0.417 | [-0.667, -0.167] | 12 |" in result["table"]
    assert client.get_model_version(name, "1").tags["eval.heldout_accuracy"] == "0.0000"

    # the other way round (in this process: `run_comparison` is what the command and the flow run) both
    # evaluations are reused, and the gate passes
    from tasks.regression import run_comparison

    services = {
        "tracking_uri": uri,
        "registry_uri": uri,
        "artifact_root": str(state / "mlartifacts"),
        "state_dir": str(state),
    }
    result = run_comparison(f"models:/{name}/1", f"models:/{name}/2", recipe, services, max_drop=0.02)
    assert result["baseline"]["reused"] and result["candidate"]["reused"] and result["gate"]["passed"] is True
    assert [(r["diff"], r["ci_low"], r["ci_high"]) for r in result["rows"]] == [
        (pytest.approx(5 / 12), pytest.approx(2 / 12), pytest.approx(8 / 12))
    ]
    assert len(client.search_runs([experiment_id], "attributes.run_name = 'evaluate'")) == 2


def test_the_pipelines_heldout_evaluation_reuses_the_answers_training_kept(
    memorising_model, tiny_base, tmp_path
):
    """`grpoflow run` with eval.benchmarks: [] evaluates the trained checkpoint on its held-out rows: from the
    answers training scored after its last step (`trainer.heldout.write_samples`) when they are of the same
    rows and settings and unchanged, else by scoring the checkpoint again."""
    from data.manifest import read_manifest, write_json_atomic
    from data.prepare import load_prepared
    from tasks.stages import _heldout_evaluation
    from trainer.heldout import write_samples
    from trainer.recipe import load_recipe

    data = heldout_data(tmp_path / "data")
    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", heldout_overrides(tmp_path, data))
    # the memorising model as a checkpoint training wrote: its manifest names the recipe and the data
    checkpoint = registrable_copy(memorising_model, tiny_base["path"], tmp_path / "checkpoint")
    write_json_atomic(
        checkpoint / "manifest.json",
        {
            **read_manifest(checkpoint),
            "recipe": recipe.to_dict(),
            "data_sha256": read_manifest(data)["sha256"],
        },
    )
    problems = evaluated_problems(shared())
    # answers no model gave: seeing them in the evaluation shows that nothing was generated again
    kept = [
        {"id": r["id"], "completion": "kept", "answer": r["answer"], "correct": 1.0}
        for r in load_prepared(data, "heldout")
    ]
    after = write_samples(
        tmp_path / "run",
        "after",
        {"accuracy": 1.0, "format_rate": 0.0, "mean_length": 1.0, "n": len(kept), "samples": kept},
    )
    trained = {"checkpoint": str(checkpoint), "heldout_after": after}
    report = _heldout_evaluation(trained, tmp_path / "reused")
    held = read_jsonl(tmp_path / "reused" / "heldout" / "samples.jsonl")
    assert report["scores"] == {"heldout": 1.0} and {r["completion"] for r in held} == {"kept"}
    assert [r["id"] for r in held] == [r["id"] for r in kept] and len(held) == len(problems) == 12

    # the file changed since training named it: the checkpoint is scored again (right on the 5 memorised)
    Path(after["samples_path"]).write_text("")
    report = _heldout_evaluation(trained, tmp_path / "scored")
    held = read_jsonl(tmp_path / "scored" / "heldout" / "samples.jsonl")
    assert report["scores"] == {"heldout": 5 / 12} and [r["correct"] for r in held] == [
        float(p.memorised) for p in problems
    ]


def test_compare_takes_the_benchmarks_both_sides_have_and_names_the_rest(
    memorised_eval, memorising_model, tiny_base, tmp_path
):
    from evaluation.heldout import heldout_settings
    from tasks.evaluation import evaluate_heldout
    from trainer.recipe import load_recipe

    data = heldout_data(tmp_path / "data")
    recipe = load_recipe(REPO_ROOT / "configs" / "tiny-cpu.yaml", heldout_overrides(tmp_path, data))
    held_only = tmp_path / "held-only"
    evaluate_heldout(tiny_base["path"], recipe.model, heldout_settings(recipe), held_only)

    # EvalScope's benchmarks on one side, the held-out split on the other: nothing to compare, exit 2 naming
    # both
    proc = grpoflow(
        "gate",
        "--candidate",
        str(held_only),
        "--baseline",
        str(memorised_eval.work_dir),
        f"eval.out={tmp_path / 'out'}",
        state=tmp_path / "state",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no benchmark in common" in proc.stderr
    assert "baseline ['aime24', 'math_500'], candidate ['heldout']" in proc.stderr

    # a work dir with both (the memorising model's EvalScope run and its held-out answers) against the
    # held-out only one: the held-out split is compared, the EvalScope benchmarks are named as left out
    both = shutil.copytree(memorised_eval.work_dir, tmp_path / "both")
    held = evaluate_heldout(
        memorising_model, recipe.model, heldout_settings(recipe), tmp_path / "held-memorising"
    )
    shutil.copytree(tmp_path / "held-memorising" / "heldout", both / "heldout")
    report = json.loads((both / "report.json").read_text())
    (both / "report.json").write_text(json.dumps({**report, "heldout": held["heldout"]}))
    proc = grpoflow(
        "compare",
        str(held_only),
        str(both),
        f"eval.out={tmp_path / 'out'}",
        "--json",
        state=tmp_path / "state",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc)
    assert [(r["benchmark"], r["metric"], r["n"], r["diff"]) for r in result["rows"]] == [
        ("heldout", "accuracy", 12, pytest.approx(5 / 12))
    ]
    assert result["left_out"] == {"baseline_only": [], "candidate_only": ["aime24", "math_500"]}
    assert (
        "Benchmarks scored by one side only, not compared: candidate only: aime24, math_500."
        in result["table"]
    )


def test_held_out_results_of_different_data_are_not_paired(tiny_base, tmp_path):
    from evaluation.heldout import heldout_settings
    from tasks.evaluation import evaluate_heldout
    from trainer.recipe import load_recipe

    dirs = []
    for name, answer in (("data", "2"), ("other", "3")):  # the same ids, other gold answers: other problems
        data = tmp_path / name
        source = tmp_path / f"{name}.jsonl"
        source.write_text(
            "".join(
                json.dumps(r) + "\n"
                for r in [
                    {"question": "1+1", "answer": answer, "split": "heldout"},
                    {"question": "2+2", "answer": "4", "split": "train"},
                ]
            )
        )
        from data.prepare import prepare

        prepare("synthetic", str(source), data, system_prompt="none")
        recipe = load_recipe(
            REPO_ROOT / "configs" / "tiny-cpu.yaml", [f"data.out={data}", "train.eval_heldout=4"]
        )
        dirs.append(tmp_path / f"eval-{name}")
        evaluate_heldout(tiny_base["path"], recipe.model, heldout_settings(recipe), dirs[-1])
    proc = grpoflow("compare", *map(str, dirs), f"eval.out={tmp_path / 'out'}", state=tmp_path / "state")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "scored on different data" in proc.stderr and str(dirs[0]) in proc.stderr


# --- what a comparison refuses, naming it -------------------------------------------------------------------


def test_a_missing_version_is_named_with_its_side_before_the_other_is_evaluated(tiny_base, tmp_path):
    from mlflow import MlflowClient

    from tasks import tracking

    state, name = tmp_path / "state", "missing-tiny"
    uri = f"sqlite:///{state / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    experiment_id = tracking.ensure_experiment(client, "grpoflow", str(state / "mlartifacts"))
    assert register(client, experiment_id, Path(tiny_base["path"]), name) == "1"
    data = heldout_data(tmp_path / "data")
    for args in (
        ("--candidate", f"models:/{name}/99", "--baseline", f"models:/{name}/1"),
        ("--candidate", f"models:/{name}/1", "--baseline", str(tmp_path / "no-such-eval")),
    ):
        proc = grpoflow("gate", *args, *heldout_overrides(tmp_path, data), state=state)
        assert proc.returncode == 2, proc.stderr[-3000:]
        missing = args[1] if "99" in args[1] else args[3]
        role = "candidate" if "99" in args[1] else "baseline"
        assert f"grpoflow gate: error: {role} " in proc.stderr and missing in proc.stderr, proc.stderr[-3000:]
        assert not (tmp_path / "eval" / f"{name}-v1").exists()  # the existing side was not evaluated
    assert client.search_runs([experiment_id], "attributes.run_name = 'evaluate'") == []


def test_an_empty_or_keyless_report_json_is_exit_2_naming_the_file(memorised_eval, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    report = broken / "report.json"
    for content, command, says in (
        ("", ["compare", str(broken), str(memorised_eval.work_dir)], "the file is empty"),
        (
            "{}",
            ["gate", "--candidate", str(memorised_eval.work_dir), "--baseline", str(report)],
            "got an empty object {}",
        ),
    ):
        report.write_text(content)
        proc = grpoflow(*command, f"eval.out={tmp_path / 'out'}", state=tmp_path / "state")
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"error: {report}: " in proc.stderr and says in proc.stderr and "review_paths" in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"scores": {}}', "got an object with keys ['scores']"),
        ("[1]", "got a JSON list"),
        ('{"review_paths": ', "not valid JSON"),
        ('{"review_paths": {"aime24": "r.jsonl"}}', "a list of review file paths"),
        ('{"heldout": {}}', "naming its 'samples' file"),
    ],
)
def test_a_malformed_report_json_is_named_with_what_was_expected(tmp_path, content, says):
    (tmp_path / "report.json").write_text(content)
    with pytest.raises(ValueError, match="expected|must") as e:
        load_samples(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'report.json'}: ") and says in str(e.value)


# ==========================================================================================================
# A gate that cannot be talked into passing; an MLflow server that does not answer
# ==========================================================================================================
# Every command runs as a real `grpoflow` subprocess; its timeout is a guard, never the assertion.


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_gate_refuses_a_non_finite_or_negative_max_drop_with_exit_2(value, tmp_path):
    proc = grpoflow_run(
        "gate",
        "--candidate",
        str(tmp_path / "b"),
        "--baseline",
        str(tmp_path / "a"),
        "--max-drop",
        value,
        "--state-dir",
        str(tmp_path / "state"),
        "--json",
    )
    line = one_line_error(proc, "gate")
    assert "--max-drop" in line and repr(value) in line
    assert last_json(proc) == {"error": line.split(": error: ", 1)[1], "exit_code": 2}


def test_the_gate_itself_refuses_nan_instead_of_passing_a_total_drop(tmp_path):
    from evaluation.compare import compare, gate
    from tasks.regression import run_comparison
    from trainer.recipe import load_recipe

    # every problem solved before, none after: a drop of 1.0
    rows = compare(
        {"aime24": {"accuracy": {f"p{i}": 1.0 for i in range(8)}}},
        {"aime24": {"accuracy": {f"p{i}": 0.0 for i in range(8)}}},
    )
    assert not gate(rows, max_drop=0.02).passed
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="max_drop must be a finite number >= 0"):
            gate(rows, max_drop=bad)
    # refused before any store is opened or any evaluation runs
    with pytest.raises(ValueError, match="max_drop must be a finite number >= 0, got nan"):
        run_comparison(
            "a",
            "b",
            load_recipe(None).to_dict(),
            {"tracking_uri": "sqlite:////proc/no/db"},
            max_drop=math.nan,
        )


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_gate_with_an_unreachable_mlflow_server_is_one_line_exit_2(
    server, silent_port, closed_port, tmp_path
):
    port = closed_port if server == "closed" else silent_port.getsockname()[1]
    proc = grpoflow_run(
        "gate",
        "--candidate",
        "models:/grpoflow-tiny/2",
        "--baseline",
        "models:/grpoflow-tiny@champion",
        "--state-dir",
        str(tmp_path / "state"),
        "--json",
        env={"MLFLOW_TRACKING_URI": f"http://ci:{URL_SECRET}@127.0.0.1:{port}"},
    )
    line = one_line_error(proc, "gate")
    reason = "connection refused" if server == "closed" else "no answer within 10 s"
    assert (
        f"MLflow tracking store at http://ci:***@127.0.0.1:{port} is unreachable: {reason} "
        "(MLFLOW_TRACKING_URI)" in line
    )
    assert URL_SECRET not in proc.stdout + proc.stderr and last_json(proc)["exit_code"] == 2


def test_compare_with_an_unreachable_mlflow_server_is_one_line_exit_2(closed_port, tmp_path):
    proc = grpoflow_run(
        "compare",
        "models:/grpoflow-tiny/1",
        "models:/grpoflow-tiny/2",
        "--state-dir",
        str(tmp_path / "state"),
        env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed_port}"},
    )
    assert "is unreachable: connection refused" in one_line_error(proc, "compare")
