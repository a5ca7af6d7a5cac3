"""Trainer ranks on two hosts (network namespaces joined by a private switch, `tests/multihost.py`):
torchrun's c10d rendezvous across them, DDP on gloo over their own interfaces, the shared-run-directory check
at start.

The disk is this machine's, which stands for the filesystem a cluster mounts on every node; each host has its
own network stack and processes. Needs root for `ip netns` (CI runs as root): without it these tests fail, by
design, rather than skip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from multihost import Hosts, netns_available

from conftest import REPO_ROOT, clean_env

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
PORT = 29400
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
        "train.max_steps=3",
        "train.save_steps=3",
        "train.prompts_per_step=4",
        "train.num_generations=4",
        "train.eval_heldout=0",
        "train.micro_batch_size=8",
        *overrides,
        "--json",
    ]


def rank_env() -> dict:
    env = clean_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"})
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def on_hosts(hosts: Hosts, runs: list[Path], tiny_base: dict, data: Path, *overrides: str) -> list:
    """`grpoflow train` as one trainer rank on each host, to its end: (returncode, stdout, stderr) each."""
    procs = start_on_hosts(hosts, runs, tiny_base, data, *overrides)
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]


def start_on_hosts(hosts: Hosts, runs: list[Path], tiny_base: dict, data: Path, *overrides: str) -> list:
    """`grpoflow train` started as one trainer rank on each host (torchrun, c10d rendezvous at host 0), host k
    writing to `runs[k]`; the processes."""
    return [
        hosts.popen(
            k,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(runs)}",
                "--nproc_per_node=1",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={hosts.address(0)}:{PORT}",
                "--rdzv_id=grpoflow-test",
                f"--rdzv_conf=is_host={str(k == 0).lower()},join_timeout=60",
                f"--local_addr={hosts.address(k)}",
                *train_args(run, tiny_base, data, *overrides),
            ],
            cwd=REPO_ROOT,
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, run in enumerate(runs)
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


def test_two_hosts_train_as_two_local_ranks_do(tmp_path, tiny_base, tiny_data):
    """The tiny recipe, 3 steps, one trainer rank per host against two local gloo ranks (torchrun
    --standalone): every metric and every weight the same to the last bit (tolerance 0: the same gloo
    all-reduce over two ranks sums in the same order, whatever carries its bytes)."""
    from safetensors.torch import load_file

    on_this_host(tmp_path / "local", tiny_base, tiny_data)
    with Hosts(2) as hosts:
        answers = on_hosts(hosts, [tmp_path / "hosts"] * 2, tiny_base, tiny_data)
    for code, _, err in answers:
        assert code == 0, err[-3000:]
    summary = json.loads(answers[0][1].strip().splitlines()[-1])
    assert summary["steps"] == 3
    two_hosts, two_ranks = metrics(tmp_path / "hosts"), metrics(tmp_path / "local")
    assert [r["step"] for r in two_hosts] == [1, 2, 3] and two_hosts == two_ranks
    weights = [load_file(tmp_path / run / "checkpoint-3" / "model.safetensors") for run in ("hosts", "local")]
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
