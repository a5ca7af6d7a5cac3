"""Registered versions are MLflow models: loadable with MLflow's own API, lean, idempotent, with linked
metrics.

Real MLflow on a sqlite store in the test's folder; a real grpoflow checkpoint (the tiny base model after one
real AdamW step, saved by the trainer's own `save_checkpoint`, so it carries `trainer_state.pt` with Adam's
moments). Loading runs with HF_HUB_OFFLINE=1: nothing may come from a hub.
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
import torch

from conftest import REPO_ROOT, registrable_copy, shared, stop_group
from data.manifest import read_manifest, verify_output

NAME = "reg-tiny"
PROMPT = "<think>12+30="


def tree_bytes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tiny_base, tmp_path_factory) -> Path:
    from trainer.checkpoint import save_checkpoint
    from trainer.model_loading import load_model
    from trainer.recipe import ModelConfig

    model, tokenizer = load_model(tiny_base["path"], ModelConfig(dtype="float32"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(
        **tokenizer(["1+1=2"], return_tensors="pt"),
        labels=tokenizer(["1+1=2"], return_tensors="pt").input_ids,
    ).loss.backward()
    optimizer.step()
    out = tmp_path_factory.mktemp("run")
    return save_checkpoint(
        out,
        1,
        model,
        tokenizer,
        {"optimizer": optimizer.state_dict(), "step": 1},
        {"data_sha256": "d" * 64},
        keep=2,
    )


def register(client, experiment: str, checkpoint: Path) -> tuple[str, bool]:
    from tasks.registry import register_checkpoint

    run_id = client.create_run(experiment, run_name="register").info.run_id
    return register_checkpoint(
        client,
        NAME,
        experiment,
        run_id,
        checkpoint,
        read_manifest(checkpoint)["sha256"],
        {"base_model": "tiny"},
    )


def greedy_direct(checkpoint: Path, new_tokens: int) -> str:
    from trainer.model_loading import load_model

    model, tokenizer = load_model(str(checkpoint))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_version_loads_through_pyfunc_and_the_transformers_flavor_and_generates_what_the_checkpoint_does(
    store, checkpoint
):
    import mlflow

    client, experiment, _ = store
    assert register(client, experiment, checkpoint) == ("1", True)
    direct = greedy_direct(checkpoint, 12)
    assert direct.strip()  # the tiny model says something here

    served = mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    assert served.metadata.flavors["transformers"]["task"] == "text-generation"
    [reply] = served.predict([PROMPT], params={"max_new_tokens": 12, "do_sample": False})
    # the pipeline answers with the prompt and the continuation; ours is that continuation
    assert reply.replace(" ", "").endswith(direct.replace(" ", "")), (reply, direct)

    pipe = mlflow.transformers.load_model(f"models:/{NAME}@candidate")
    [out] = pipe(PROMPT, max_new_tokens=12, do_sample=False, return_full_text=False)
    assert out["generated_text"].replace(" ", "") == direct.replace(" ", "")


def test_the_registry_copy_holds_what_serving_needs_and_no_training_state(store, checkpoint):
    from tasks.registry import MODEL_DIR

    client, experiment, artifacts = store
    register(client, experiment, checkpoint)
    from tasks.registry import model_id_of

    version = client.get_model_version(NAME, "1")
    model = client.get_logged_model(model_id_of(version))
    assert (
        version.source == model.artifact_location
        and model.tags["checkpoint_sha256"]
        == read_manifest(checkpoint)["sha256"]
        == version.tags["checkpoint_sha256"]
    )
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": NAME, "version": "1"}]
    stored = Path(model.artifact_location.removeprefix("file://"))
    files = tree_bytes(stored)
    assert "MLmodel" in files and f"{MODEL_DIR}/model.safetensors" in files
    assert {
        f"{MODEL_DIR}/{f}"
        for f in (
            "config.json",
            "tokenizer.json",
            "chat_template.jinja",
            "generation_config.json",
            "manifest.json",
        )
    } <= set(files)
    assert not any("trainer_state" in f or f.startswith(f"{MODEL_DIR}/zero") for f in files)
    served = verify_output(stored / MODEL_DIR)  # every file the registry holds matches its manifest
    assert served["checkpoint_sha256"] == read_manifest(checkpoint)["sha256"] and served["left_out"] == [
        "trainer_state.pt"
    ]
    for name in tree_bytes(checkpoint):  # byte for byte as trained
        if name not in ("trainer_state.pt", "manifest.json"):
            assert (stored / MODEL_DIR / name).read_bytes() == (checkpoint / name).read_bytes(), name
    # all the registration wrote: the checkpoint less Adam's moments, plus the flavor's few small files
    written, whole = sum(tree_bytes(artifacts).values()), sum(tree_bytes(checkpoint).values())
    state = (checkpoint / "trainer_state.pt").stat().st_size
    print(f"checkpoint {whole} B (trainer_state.pt {state} B); registration wrote {written} B")
    assert (
        written < whole - state + 200_000 and state > 1.5 * (checkpoint / "model.safetensors").stat().st_size
    )


def test_a_second_registration_adds_no_version_and_writes_no_byte(store, checkpoint):
    client, experiment, artifacts = store
    assert register(client, experiment, checkpoint) == ("1", True)
    before = tree_bytes(artifacts)
    assert register(client, experiment, checkpoint) == ("1", False)
    assert tree_bytes(artifacts) == before
    assert [str(v.version) for v in client.search_model_versions(f"name='{NAME}'")] == ["1"]
    assert len(client.search_logged_models([experiment])) == 1


def test_a_model_uploaded_by_an_attempt_that_died_before_its_version_is_reused(store, checkpoint):
    from tasks.registry import log_checkpoint_model, model_id_of

    client, experiment, artifacts = store
    run_id = client.create_run(experiment, run_name="register").info.run_id
    first = log_checkpoint_model(
        client, experiment, run_id, NAME, checkpoint, read_manifest(checkpoint)["sha256"]
    )
    before = tree_bytes(artifacts)
    assert register(client, experiment, checkpoint) == ("1", True)  # the retry
    assert model_id_of(client.get_model_version(NAME, "1")) == first.model_id
    assert tree_bytes(artifacts) == before and len(client.search_logged_models([experiment])) == 1


def test_evaluation_metrics_are_numbers_linked_to_the_model_and_equal_the_report(
    store, memorising_model, tiny_base, tmp_path
):
    """The memorising model registered, downloaded from the registry and evaluated on MATH-500: its known
    score (right on 4 of the 10 problems) and the thinking metrics of its answers are the version's linked
    metrics, equal to the report's."""
    from memorised_model import MAX_TOKENS, evaluated_problems, reasoning
    from transformers import AutoTokenizer

    from evaluation import run_evalscope
    from tasks.evaluation import record_evaluation, resolve_model
    from tasks.registry import model_id_of
    from trainer.recipe import EvalConfig

    client, experiment, _ = store
    memorising = registrable_copy(memorising_model, tiny_base["path"], tmp_path / "memorising")
    register(client, experiment, memorising)
    ref = resolve_model(f"models:/{NAME}/1", client, tmp_path / "cache")  # downloaded from the registry
    assert ref.local_path.endswith("v1/model")
    assert read_manifest(ref.local_path)["sha256"] == read_manifest(memorising)["sha256"]
    settings = EvalConfig(
        benchmarks=["math_500"],
        limit=2,
        max_tokens=MAX_TOKENS,
        local_paths={"math_500": str(shared("math_500"))},
        out=str(tmp_path / "eval"),
    )
    result = run_evalscope(
        ref.local_path,
        settings.benchmarks,
        work_dir=tmp_path / "eval" / "v1",
        local_paths=settings.local_paths,
        limit=settings.limit,
        max_tokens=settings.max_tokens,
    )
    run_id = record_evaluation(
        client, experiment, ref, {**result.scores, "heldout_accuracy": 0.375}, settings, result.report_json
    )
    report = json.loads(result.report_json.read_text())
    linked = {
        m.key: m for m in client.get_logged_model(model_id_of(client.get_model_version(NAME, "1"))).metrics
    }
    # EvalScope's limit is per subset: 2 problems from each of MATH-500's 5 levels, 4 of them memorised
    right = [p for p in evaluated_problems(shared()) if p.benchmark == "math_500" and p.memorised]
    assert linked["math_500"].value == report["scores"]["math_500"] == len(right) / 10 == 0.4
    assert linked["heldout_accuracy"].value == 0.375
    assert all(m.run_id == run_id for m in linked.values())
    thinking = {k: m.value for k, m in linked.items() if k.startswith("thinking/")}
    assert thinking["thinking/samples"] == result.num_samples["math_500"] == 10 == thinking["thinking/graded"]
    assert thinking["thinking/correct"] == len(right) and thinking["thinking/accuracy"] == 0.4
    assert thinking["thinking/evalscope_accuracy"] == 0.4
    # where it is right its reasoning is the one it was taught: the answer in the second of three paragraphs,
    # so every right answer came before the reasoning ended, and first-correct plus reflection tokens is the
    # taught reasoning's length
    tokenizer = AutoTokenizer.from_pretrained(ref.local_path)
    lengths = [len(tokenizer.encode(reasoning(p.answer), add_special_tokens=False)) for p in right]
    taught = sum(lengths) / len(lengths)
    assert thinking["thinking/overthinking/samples"] == len(right)
    first, reflection = thinking["thinking/first_correct_tokens"], thinking["thinking/reflection_tokens"]
    assert 0 < first < taught and first + reflection == pytest.approx(taught)
    assert client.get_run(run_id).data.metrics == {k: m.value for k, m in linked.items()}
    assert client.get_model_version(NAME, "1").tags["eval.math_500"] == "0.4000"


def test_training_metrics_reach_mlflow_under_trls_names_with_steps(store):
    from tasks.tracking import MlflowTrainingCallback

    client, experiment, _ = store
    run_id = client.create_run(experiment).info.run_id
    callback = MlflowTrainingCallback(client, run_id)
    for step, value in ((1, 0.25), (2, 0.5)):
        callback.on_step(
            step,
            {
                "reward": value,
                "rewards/accuracy_reward/mean": value,
                "clip_ratio/high_mean": 0.0,
                "completions/mean_length": 10.0 * step,
                "pass@4": 1.0,
            },
        )
    metrics = client.get_run(run_id).data.metrics
    assert {
        "reward",
        "rewards/accuracy_reward/mean",
        "clip_ratio/high_mean",
        "completions/mean_length",
        "pass_at_4",
    } == set(metrics)
    history = client.get_metric_history(run_id, "completions/mean_length")
    assert [(m.step, m.value) for m in history] == [(1, 10.0), (2, 20.0)]


# ---------------------------------------------------------------------------- processes registering at once

GUARD_S = 300  # a process that hangs fails the test here instead of hanging the suite

# One registering process: it connects and opens its run, reports ready, and registers when the test says go,
# so that the two processes' registrations overlap.
REGISTER_WHEN_TOLD = """
import json, os, sys, time
from pathlib import Path

from mlflow import MlflowClient

from data.manifest import read_manifest
from tasks.registry import register_checkpoint

uri, experiment, checkpoint, name, go = sys.argv[1:]
client = MlflowClient(uri, registry_uri=uri)
run_id = client.create_run(experiment, run_name="register").info.run_id
Path(f"{go}.ready-{os.getpid()}").write_text("")
deadline = time.monotonic() + 240
while not Path(go).exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps(register_checkpoint(client, name, experiment, run_id, checkpoint,
                                     read_manifest(checkpoint)["sha256"], {"base_model": "tiny"})))
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_store(request, tmp_path, monkeypatch):
    """A store two processes share: a sqlite file on this machine, or a PostgreSQL database (as other machines
    would reach it: no lock file beside it), fresh for the test."""
    from mlflow import MlflowClient

    from tasks import tracking

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    database = None
    if request.param == "sqlite":
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    else:
        database = f"grpoflow_registry_{os.getpid()}_{time.monotonic_ns()}"
        subprocess.run([*PSQL, f"create database {database}"], check=True, capture_output=True, timeout=60)
        uri = f"postgresql://postgres@127.0.0.1:5432/{database}"
    try:
        client = MlflowClient(uri, registry_uri=uri)
        yield (
            client,
            tracking.ensure_experiment(client, "grpoflow", str(tmp_path / "artifacts")),
            request.param,
        )
    finally:
        if database:
            subprocess.run(
                [*PSQL, f"drop database if exists {database} with (force)"], capture_output=True, timeout=60
            )


PSQL = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-c"]


def test_two_processes_registering_one_checkpoint_at_once_make_one_version(
    shared_store, checkpoint, tmp_path
):
    """On a local store the second waits for the first (a lock file beside it) and uploads nothing; on a
    database others reach, both may upload, and the one whose version is not the first deletes its own."""
    client, experiment, kind = shared_store
    script, go = tmp_path / "register_when_told.py", tmp_path / "go"
    script.write_text(REGISTER_WHEN_TOLD)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), client.tracking_uri, experiment, str(checkpoint), NAME, str(go)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + GUARD_S
        while len(list(tmp_path.glob("go.ready-*"))) < 2:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            assert time.monotonic() < deadline, "the registering processes did not start"
            time.sleep(0.05)
        go.write_text("")
        outputs = [p.communicate(timeout=GUARD_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outputs]
    results = sorted(tuple(json.loads(out.strip().splitlines()[-1])) for out, _ in outputs)
    assert results == [("1", False), ("1", True)], results
    versions = client.search_model_versions(f"name='{NAME}'")
    assert [str(v.version) for v in versions] == ["1"]
    assert versions[0].tags["checkpoint_sha256"] == read_manifest(checkpoint)["sha256"]
    assert len(client.search_logged_models([experiment])) == 1
    if kind == "sqlite":  # one upload: the second found the first's version
        assert len(list((tmp_path / "artifacts").rglob("model.safetensors"))) == 1
    assert {k: str(v) for k, v in client.get_registered_model(NAME).aliases.items()} == {"candidate": "1"}


def test_two_pipelines_started_at_once_on_an_empty_state_dir_one_is_refused_naming_the_other(
    tmp_path, tiny_base
):
    """Both would make MLflow's sqlite schema (and Prefect's) in the same folder at once; the second to ask
    for the state folder is refused, exit 2, one line naming the first; the first goes on."""
    state = tmp_path / "state"
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "--state-dir",
        str(state),
        "--json",
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tmp_path / 'data'}",
        "data.synthetic_rows=600",
        f"train.output_dir={tmp_path / 'runs'}",
        "train.max_steps=2",
        "train.eval_heldout=4",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        f"eval.out={tmp_path / 'eval'}",
        "eval.limit=1",
        "eval.max_tokens=8",
        f"eval.local_paths={{math_500: {shared('math_500')}, aime24: {shared('aime24')}}}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPOFLOW_"))}
    logs = [tmp_path / f"run-{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        for log in logs
    ]
    try:
        deadline = time.monotonic() + GUARD_S
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither pipeline was refused the state folder"
            time.sleep(0.1)
        [refused] = [i for i, p in enumerate(procs) if p.poll() is not None]
        first = procs[1 - refused]
        first_status = first.poll()
    finally:
        for p in procs:
            stop_group(p, signal.SIGTERM, timeout=30)
    err = logs[refused].read_text()
    assert procs[refused].returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("grpoflow run: error:")]
    assert f"--state-dir {state} is in use by another grpoflow process: pid {first.pid} " in line, line
    assert "flows.cli run --state-dir" in line, line
    assert first_status in (None, 0), logs[1 - refused].read_text()[-3000:]  # still running (or done)


def test_processes_opening_a_new_sqlite_store_at_once_each_get_a_working_store(tmp_path):
    """MLflow makes an sqlite store's schema on its first use. Four processes open one new store at the
    same moment (each imports, waits for a start file, then calls `client_for` and writes an experiment):
    every one exits 0 with its experiment in the store, none dies in the schema's migration."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    script = (
        "import sys, time, pathlib\n"
        "from tasks import tracking\n"
        "go = pathlib.Path(sys.argv[2])\n"
        "(go.parent / ('ready-' + sys.argv[3])).touch()\n"
        "while not go.exists(): time.sleep(0.01)\n"
        "client = tracking.client_for(sys.argv[1])\n"
        "print(tracking.ensure_experiment(client, 'opened-by-' + sys.argv[3], None))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GRPOFLOW_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, uri, str(go), str(i)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    deadline = time.monotonic() + GUARD_S
    while not all(
        (tmp_path / f"ready-{i}").exists() for i in range(4)
    ):  # each imported MLflow: open together
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not start"
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=GUARD_S) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    from mlflow import MlflowClient

    names = {e.name for e in MlflowClient(tracking_uri=uri).search_experiments()}
    assert {f"opened-by-{i}" for i in range(4)} <= names


# ==========================================================================================================
# MLflow's HTTP client: bounded retries and timeouts
# ==========================================================================================================


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
