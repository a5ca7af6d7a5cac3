"""The asynchronous rollout trainer on CPU processes: weight sync, staleness, learning, a worker dead or
stalled, DDP ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO_ROOT, rollout_workers_once
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


def small(tmp_path: Path, tiny_base: dict, data: Path, *overrides: str) -> list[str]:
    return [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=16",
        "train.micro_batch_size=4",
        *overrides,
    ]


@pytest.mark.parametrize("carrier", ["shared memory", "gloo"])
def test_weight_sync_delivers_bit_identical_weights(tiny_base, carrier, monkeypatch, caplog):
    """Workers on this CPU read the weights out of shared memory; gloo's broadcast is what they take where
    /dev/shm has no room (and what workers on other devices take). Either way, twice: the second sync
    reuses the shared block the first one brought."""
    import shutil
    import types

    from transformers import AutoModelForCausalLM

    from trainer.rollout.weight_sync import sync_order
    from trainer.rollout.worker_processes import RolloutWorkers

    if carrier == "gloo":  # a /dev/shm with no room to spare (a container's default 64 MB is one)
        full = types.SimpleNamespace(total=64 << 20, used=64 << 20, free=0)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    model = AutoModelForCausalLM.from_pretrained(tiny_base["path"])
    workers = RolloutWorkers(tiny_base["path"], timeout_s=120)
    try:
        for version in (7, 8):
            with torch.no_grad():
                for _, p in model.named_parameters():
                    p.add_(torch.randn_like(p) * 0.01)  # the trainer's weights move away from the worker's
            before = workers.worker_weights(1)
            ours = dict(sync_order(model))
            assert not all(torch.equal(before[n], ours[n]) for n in ours)
            sync = workers.sync_weights(model, version=version)
            after = workers.worker_weights(1)
            assert after.keys() == ours.keys() and sync.seconds > 0
            assert sync.bytes == sum(t.numel() * t.element_size() for t in ours.values())
            for name, tensor in ours.items():
                assert torch.equal(after[name], tensor), name
        assert (workers._shared is not None) == (carrier == "shared memory")
        fell_back = [r.getMessage() for r in caplog.records if "gloo's broadcast instead" in r.getMessage()]
        assert len(fell_back) == (carrier == "gloo"), fell_back  # said once, at the first sync
    finally:
        workers.close()
    assert [p.exitcode for p in workers.procs] == [0]  # it ended at "stop", not killed by close's timeout


def test_async_batches_are_one_step_stale_and_importance_corrected(tmp_path, tiny_base, tiny_data):
    recipe = load_recipe(
        TINY,
        small(
            tmp_path,
            tiny_base,
            tiny_data,
            "rollout.async=true",
            "train.max_steps=3",
            "train.learning_rate=1e-3",
        ),
    )
    result = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False).train()
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [r["staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert "importance_ratio/mean" not in rows[0]  # first batch: behaviour policy == current policy
    for r in rows[1:]:
        assert r["importance_ratio/min"] <= r["importance_ratio/mean"] <= r["importance_ratio/max"] <= 2.0
        assert r["importance_ratio/min"] != r["importance_ratio/max"]  # the policies really differ
    # through shared memory the weights of an update go out at the end of its step, behind them the request
    # of the batch two steps on (step 0's update, version 1: batch 2); the last two updates feed no batch
    assert [r["weight_sync/bytes"] > 0 for r in rows] == [True, False, False]
    assert rows[0]["timing/weight_sync_s"] > 0
    for r in rows:
        assert 0.0 <= r["trainer_idle_fraction"] <= 1.0 and 0.0 <= r["rollout_idle_fraction"] <= 1.0


@pytest.mark.slow
def test_async_rollout_raises_heldout_accuracy_over_the_runs_own_start(tmp_path, tiny_base, tiny_recipe):
    """rollout.async=true learns: the tiny recipe cut to 100 steps of 16 prompts at temperature 1.0 (the
    recipe's shape when this was measured) at lr 1e-4 decaying to 0, every batch after the first one policy
    version stale, raises greedy held-out accuracy on 256 problems by at least 1 point over the same run's
    before-training score (a gain, not a level: the base model differs between AVX2 and AVX-512 CPUs), and
    the mean sampled reward of the last 10 steps by 0.03 over the first 10's. Measured, 4 seeds on each of
    two bases: +9.0 to +11.3 points (AVX-512 base) and +3.1 to +5.9 (an AVX2 one); sampled reward +0.07 to
    +0.16. The margins leave room for a base that learns more slowly than those (the sampled reward's is the
    firmer of the two)."""
    from data.prepare import prepare

    data = tmp_path / "data"  # the recipe's 4,000 problems, 413 held out (the small copy holds 63)
    prepare(**{**tiny_recipe.data.prepare_kwargs(), "out": data})
    recipe = load_recipe(
        TINY,
        [
            f"bootstrap.out={tiny_base['path']}",
            f"data.out={data}",
            f"train.output_dir={tmp_path / 'run'}",
            "rollout.async=true",
            "train.max_steps=100",
            "train.prompts_per_step=16",
            "train.temperature=1.0",
            "train.learning_rate=1e-4",
            "train.save_steps=100",
        ],
    )
    result = GRPOTrainer(recipe, tiny_base["path"], data, progress=False).train()
    before, after = result.heldout_before, result.heldout_after
    assert before["n"] == after["n"] == 256
    assert after["accuracy"] >= before["accuracy"] + 0.01, (before, after)
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [r["staleness"] for r in rows] == [0.0] + [1.0] * 99  # it really trained asynchronously
    first, last = (sum(r["reward"] for r in part) / len(part) for part in (rows[:10], rows[-10:]))
    assert last >= first + 0.03, (first, last)


def _train(tmp_path, tiny_base, data, *overrides):
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(TINY),
        *small(tmp_path, tiny_base, data, *overrides),
        "--json",
    ]


def test_killed_rollout_worker_fails_the_run_naming_it_and_rerun_resumes(tmp_path, tiny_base, tiny_data):
    cmd = _train(
        tmp_path,
        tiny_base,
        tiny_data,
        "rollout.async=true",
        "rollout.sync_timeout_s=60",
        "train.max_steps=40",
        "train.save_steps=2",
    )
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "run" / "latest"
    workers = rollout_workers_once(proc, latest)
    os.kill(workers[0].pid, signal.SIGKILL)
    killed = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert time.time() - killed < 60  # well inside the 60 s sync timeout: death is noticed, not waited out
    assert "rollout worker 1" in err and f"pid {workers[0].pid}" in err and "died" in err

    checkpoint_step = int(latest.read_text().split("-")[1])
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == checkpoint_step >= 2 and summary["steps"] == 40
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    # the first batch after resuming comes from the checkpoint's own weights: not stale
    assert rows[checkpoint_step]["staleness"] == 0.0 and rows[checkpoint_step + 1]["staleness"] == 1.0


def test_rollout_worker_that_dies_before_joining_the_weight_sync_group_ends_the_start_at_once(tiny_base):
    """A worker that exits before it joins the weight-sync group (here: it refuses a thread count of 0) ends
    the trainer's wait when it dies, not when rollout.sync_timeout_s (600 s here) runs out; the error names
    it, and no worker is left behind."""
    from trainer.rollout.worker_processes import RolloutWorkerError, RolloutWorkers

    started = time.monotonic()
    with pytest.raises(RolloutWorkerError) as caught:
        RolloutWorkers(tiny_base["path"], threads_per_worker=0, timeout_s=600)
    assert time.monotonic() - started < 300  # a spawn and an import of torch, against the 600 s timeout
    message = str(caught.value)
    assert "rollout worker 1 (pid" in message and "died with exit code 1" in message, message
    assert "during forming the weight-sync group" in message, message
    pid = int(message.split("(pid ")[1].split(")")[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_stalled_rollout_worker_fails_the_run_after_the_sync_timeout_naming_it(
    tmp_path, tiny_base, tiny_data
):
    """A worker that is alive but makes no progress (SIGSTOP) is waited on for rollout.sync_timeout_s, not
    forever: the run exits 1 with an error naming the worker's pid and the setting, and does not leave the
    worker behind."""
    timeout_s = 20
    cmd = _train(
        tmp_path,
        tiny_base,
        tiny_data,
        "rollout.async=true",
        f"rollout.sync_timeout_s={timeout_s}",
        "train.max_steps=40",
        "train.save_steps=1000",
        "train.eval_heldout=0",
    )
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    worker = None
    try:
        deadline = time.time() + 300
        while (
            not (metrics.exists() and metrics.stat().st_size)
            and time.time() < deadline
            and proc.poll() is None
        ):
            time.sleep(0.1)  # a first step trained: the worker is up and serving batches
        assert metrics.exists(), proc.communicate()[1][-3000:]
        workers = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "spawn_main" in " ".join(c.cmdline())
        ]
        assert workers, "no rollout worker process found"
        worker = workers[0]
        worker.send_signal(signal.SIGSTOP)  # alive, holding its pipes and sockets, answering nothing
        try:  # a bound against hanging, not a speed check: the timeout, then 10x its length of slack
            out, err = proc.communicate(timeout=11 * timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the run still waits on the stalled worker {11 * timeout_s} s later"
            ) from None
        assert proc.returncode == 1, err[-3000:]
        assert f"rollout worker 1 (pid {worker.pid})" in err, err[-3000:]
        assert f"rollout.sync_timeout_s={timeout_s}" in err, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 1
        # the failed run stopped its worker on the way out, also a stopped one
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    finally:
        if worker is not None and worker.is_running():
            worker.send_signal(signal.SIGCONT)
            worker.kill()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


DDP_SCRIPT = """
import sys, torch
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe
recipe = load_recipe(sys.argv[1], sys.argv[4:])
trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
trainer.setup()
batch, _ = trainer.rollout_source().next(0)
batch.advantages = torch.linspace(-1, 1, len(batch))
grads = {}
def keep_grads(optimizer, args, kwargs):  # the gradient the optimizer steps with (after DDP's all-reduce)
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:  # under LoRA the adapters alone
            grads[name] = p.grad.detach().clone()
trainer.strategy.optimizer.register_step_pre_hook(keep_grads)
trainer.optimize(batch)
if trainer.rank == 0:
    torch.save({"grads": grads, "weights": {k: v.detach().clone() \
for k, v in trainer.model.state_dict().items()}},
               sys.argv[3])
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_rank_gloo_ddp_update_equals_one_rank(tmp_path, tiny_base, tiny_data, lora):
    script = tmp_path / "one_update.py"
    script.write_text(DDP_SCRIPT)
    args = small(
        tmp_path,
        tiny_base,
        tiny_data,
        "train.learning_rate=1e-3",
        "train.micro_batch_size=2",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
    )
    if lora:  # DDP over a PEFT model: the adapters' gradients are all-reduced, the frozen base has none
        args = [*args, "model.lora={r: 4, alpha: 8}"]
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"weights-{ranks}.pt"
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                str(script),
                str(TINY),
                tiny_base["path"],
                str(out),
                *args,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[ranks] = torch.load(out)
    from safetensors.torch import load_file

    base = load_file(Path(tiny_base["path"]) / "model.safetensors")
    one, two = results[1], results[2]
    if lora:
        adapters = {n for n in one["weights"] if "lora_" in n}
        assert set(one["grads"]) == adapters and len(adapters) == 2 * 4 * 7  # A and B of 7 projections x 4
        # B starts at zero and A's gradient is B-weighted: after one update only B has moved
        base = {n: torch.zeros_like(one["weights"][n]) for n in adapters if "lora_B" in n}
    assert any(not torch.equal(base[n], one["weights"][n]) for n in base), "the update changed nothing"
    # The same gradient reaches the optimizer: summed over two ranks' halves of the batch (DDP) it equals
    # the one-rank gradient up to float summation order. That order noise reached 1.8e-7 on a component of
    # 6e-4 (AVX2 kernels, relative 3e-4): atol 1e-6 absorbs it and still catches a gradient halved or doubled
    # on any component above 1e-5.
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-6)
    # and so the weights move alike. Adam's first step is about lr * g / |g|: a gradient component that is
    # mathematically zero (e.g. k_proj.bias: softmax ignores a bias shared by all keys) is pure float noise
    # and may step anywhere in [-lr, lr], so all but such components must agree to 1e-6.
    close = [
        torch.isclose(two["weights"][n], one["weights"][n], rtol=1e-5, atol=1e-6).flatten() for n in base
    ]
    assert torch.cat(close).float().mean() > 0.999
