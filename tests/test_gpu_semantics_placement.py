"""Where the trainer's pieces compute on a GPU node, checked on the CPU: the device DeepSpeed and the
reference model get for a lone trainer whose in-process engine has a GPU of its own, the LMDeploy placements
that are refused, and the shared run directory that several nodes need (two real gloo ranks).

What CUDA itself decides cannot run here; where a test needs it, it emulates the one fact that matters (how
many GPUs the plan counts, which ordinal DeepSpeed makes current) and says so in its name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_trainer import TINY

from conftest import REPO_ROOT
from flows.cli import main
from trainer.launch import free_port
from trainer.placement import PlacementError, dry_run, plan
from trainer.recipe import RolloutConfig

_placement_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# ---- a lone trainer under DeepSpeed, its in-process engine on a GPU of its own ----------------------------

# Run as torchrun starts a lone trainer rank (LOCAL_RANK 0, CUDA_VISIBLE_DEVICES from the plan). Emulated:
# the two GPUs the plan counts (torch.cuda.device_count, which the plan reads through NVML), the ordinal
# DeepSpeed's accelerator makes current (recorded, then the CPU accelerator's own no-op), loading a model
# onto a GPU (the device asked for is recorded, the model loaded on the CPU), and the recipe's vLLM engine
# (the transformers engine stands in: setup only builds it). DeepSpeed's engine itself is real.
_placement_LONE_TRAINER = """
import dataclasses, json, sys
import torch
torch.cuda.device_count = lambda: 2
from deepspeed.accelerator import get_accelerator
import trainer.grpo as grpo
from trainer.model_loading import load_model
from trainer.placement import this_trainer
from trainer.recipe import load_recipe
from trainer.rollout.engines import make_engine

accelerator, made_current, loaded = get_accelerator(), [], []
cpu_set_device = accelerator.set_device
accelerator.set_device = lambda index: made_current.append(index) or cpu_set_device(index)

def load_on_cpu(path, cfg, device, **kwargs):
    loaded.append(device)
    return load_model(path, cfg, "cpu", **kwargs)

grpo.load_model = load_on_cpu
grpo.make_engine = lambda cfg, path, **kw: make_engine(
    dataclasses.replace(cfg, engine="transformers"), path, device="cpu", **kw
)
recipe = load_recipe(sys.argv[1], sys.argv[4:])
trainer = grpo.GRPOTrainer(recipe, sys.argv[2], sys.argv[3], progress=False)
trainer.setup()
_, me = this_trainer(recipe.rollout)
print(json.dumps({"trainer": me.device, "engine": me.engine_device, "loaded": loaded,
                  "deepspeed_current": made_current, "strategy": getattr(trainer.strategy, "device", None)}))
"""


def test_deepspeed_and_the_reference_use_the_lone_trainers_gpu_not_local_rank_0_emulated_two_gpus(
    tmp_path, tiny_base, tiny_data
):
    """A lone trainer (LOCAL_RANK 0) whose vLLM engine has GPU 1 sees it first: CUDA_VISIBLE_DEVICES=1,0, the
    engine on cuda:0, training on cuda:1. DeepSpeed makes ordinal `args.device_rank` current and moves the
    policy there, else LOCAL_RANK (`DeepSpeedEngine._set_distributed_vars`): it must be told 1, where the
    policy and the beta > 0 reference were loaded."""
    overrides = [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.eval_heldout=0",
        "train.micro_batch_size=4",
        "train.deepspeed=zero2",
        "train.beta=0.04",
        "rollout.engine=vllm",
        "rollout.train_devices=[0]",
        "rollout.rollout_devices=[1]",
    ]
    (tmp_path / "lone.py").write_text(_placement_LONE_TRAINER)
    env = {k: v for k, v in os.environ.items() if k not in _placement_LAUNCHER_VARS}
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        CUDA_VISIBLE_DEVICES="1,0",  # what `grpoflow train` starts this trainer with (the plan's mask)
        GRPOFLOW_GPUS="0,1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO_ROOT),
    )
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "lone.py"), str(TINY), tiny_base["path"], str(tiny_data), *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["trainer"], out["engine"]) == ("cuda:1", "cuda:0")  # the plan
    assert out["loaded"] == ["cuda:1", "cuda:1"]  # the policy, then the frozen reference
    assert out["deepspeed_current"] == [1], out  # not LOCAL_RANK 0, the engine's GPU
    assert out["strategy"] == "cuda:1"


# ---- LMDeploy: placed by its own Ray ----------------------------------------------------------------------


def test_lmdeploy_is_planned_only_where_each_engine_sees_no_gpu_but_its_own():
    """LMDeploy's Ray places its engine on any GPU its process sees: trainer ranks share theirs, so an
    in-process engine per rank (colocated or not) is refused naming the fields; a rollout worker sees only its
    engine's GPUs and a lone trainer its own, and those are planned."""
    refused = {
        "its 8 trainer ranks": RolloutConfig(engine="lmdeploy", colocate=True, num_engines=8),
        "colocated LMDeploy engine": RolloutConfig(engine="lmdeploy", colocate=True, train_devices=[0]),
        "its 2 trainer ranks": RolloutConfig(engine="lmdeploy", train_devices=[0, 1]),
        "its 8 trainer ranks would": RolloutConfig(engine="lmdeploy"),
    }
    for reason, cfg in refused.items():
        for planner in (plan, dry_run):
            with pytest.raises(PlacementError) as info:
                planner(cfg, 8)
            message = str(info.value)
            assert message.startswith("rollout.engine: lmdeploy") and reason in message, message
            assert "rollout.async" in message and "rollout.train_devices" in message

    workers = plan(
        RolloutConfig(
            engine="lmdeploy", async_=True, train_devices=[0, 1], rollout_devices=[2, 3], num_engines=2
        ),
        4,
    )
    assert [p.cuda_visible_devices for p in workers.workers] == ["2", "3"]
    lone = plan(RolloutConfig(engine="lmdeploy", train_devices=[0], rollout_devices=[1]), 2)
    assert (lone.trainers[0].device, lone.trainers[0].engine_device) == ("cuda:1", "cuda:0")
    assert (
        plan(RolloutConfig(engine="lmdeploy", train_devices=[0]), 8).trainers[0].cuda_visible_devices == "0"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.engine=lmdeploy"],  # the recipe's own 8 colocated ranks
        ["rollout.engine=lmdeploy", "rollout.colocate=false", "rollout.train_devices=[0, 1, 2, 3]"],
    ],
    ids=["colocated", "four-in-process-ranks"],
)
def test_dry_run_of_lmdeploy_on_several_ranks_exits_2_naming_rollout_engine(overrides, capsys):
    recipe = str(REPO_ROOT / "configs" / "countdown-qwen2.5-3b.yaml")
    args = ["train", "--config", recipe, "--dry-run", "--gpus", "8", "--json", *overrides]
    assert main(args) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error.startswith("rollout.engine: lmdeploy with") and "not supported yet" in error


# ---- several nodes: one shared run directory --------------------------------------------------------------

# A trainer rank of `grpoflow train` up to the end of its setup, once per run directory in argv[4:6] with
# {rank} filled in: one path for every rank, or one per rank as two hosts whose "same path" is each a local
# disk. Both setups run in one process group (the second joins none: it is there already).
_placement_SETUP = """
import json, os, sys
from pathlib import Path
from trainer.grpo import GRPOTrainer
from trainer.launch import leave_distributed
from trainer.recipe import load_recipe
from trainer.typed_config import ConfigError
rank, answers = int(os.environ["RANK"]), []
for output_dir in sys.argv[4:6]:
    recipe = load_recipe(sys.argv[1], [*sys.argv[6:], f"train.output_dir={output_dir.format(rank=rank)}"])
    trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
    try:
        trainer.setup()
        answers.append({"refused": None, "world": trainer.world})
    except ConfigError as e:
        answers.append({"refused": str(e)})
Path(sys.argv[3], f"rank{rank}.json").write_text(json.dumps(answers))
leave_distributed()
"""


def test_ranks_start_in_a_shared_run_directory_and_are_refused_at_start_in_one_they_do_not_share(
    tmp_path, tiny_base, tiny_data
):
    """Two real gloo trainer ranks set up twice: in one run directory (they start, and the check leaves no
    file behind), then each in its own, emulating two hosts whose `train.output_dir` is the same path on
    local disks: rank 1 cannot see the file rank 0 wrote, and both ranks stop before reading a checkpoint,
    with one message naming the directory."""
    (tmp_path / "setup.py").write_text(_placement_SETUP)
    (tmp_path / "answers").mkdir()
    shared, own = tmp_path / "run", tmp_path / "host{rank}" / "run"
    overrides = [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        "rollout.train_devices=[0, 1]",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(tmp_path / "setup.py"),
            str(TINY),
            tiny_base["path"],
            str(tmp_path / "answers"),
            str(shared),
            str(own),
            *overrides,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in _placement_LAUNCHER_VARS},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (shared_0, own_0), (shared_1, own_1) = (
        json.loads((tmp_path / "answers" / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    assert shared_0 == shared_1 == {"refused": None, "world": 2}
    assert not [p.name for p in shared.iterdir() if p.name.startswith(".shared")]

    host0, host1 = tmp_path / "host0" / "run", tmp_path / "host1" / "run"
    message = own_0["refused"]
    assert message is not None and own_1["refused"] == message  # every rank stops, with one message
    assert message.startswith(f"train.output_dir {host0} is not one directory shared by the trainer ranks")
    blind = message.split(" there, and ")[1]  # the ranks that do not see rank 0's file
    assert blind.startswith("rank 1 (") and f": {host1})" in blind and "rank 0" not in blind
    assert not host1.exists()  # rank 1 made nothing on its own disk
    assert not [p.name for p in host0.iterdir() if p.name.startswith(".shared")]  # the marker is removed
