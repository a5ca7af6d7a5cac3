"""Multi-GPU correctness without a GPU: where each process computes, the trainer ranks' process group, and who
talks to a rollout server, checked with plain functions and real gloo ranks.

- placement: trainer and engine GPUs, each process's CUDA_VISIBLE_DEVICES (8 GPUs split 6+2, 4+4,
  colocated 8), `grpoflow train --dry-run --json` on every GPU recipe, the environment spawned rollout
  workers really get;
- backends: the GPU ranks' composite backend (gloo for CPU tensors, NCCL for CUDA ones) as torch reads it
  and forms it; two torchrun ranks through `init_distributed` all-reduce a CPU tensor;
- vLLM (needs vLLM's CPU build, `.venv-vllm`): two trainer ranks each build their in-process engine under
  vLLM's external launcher, one per rank; in server mode only rank 0 syncs and generates, and both ranks get
  its batch.
What needs CUDA itself (NCCL, a GPU per rank) is for `infra/gpu/smoke.sh`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import psutil
import pytest

from conftest import REPO_ROOT, loopback_http, require_vllm
from flows.cli import main
from trainer.launch import launch_env, needs_launch, process_group_backend
from trainer.placement import GPUS_ENV, PlacementError, plan, this_trainer
from trainer.recipe import Recipe, RolloutConfig, load_recipe

if importlib.util.find_spec("vllm") is not None:
    from test_vllm import rollout_server  # noqa: F401 - the vLLM server of test_vllm, a fixture here too

CONFIGS = REPO_ROOT / "configs"
EIGHT = "0,1,2,3,4,5,6,7"
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def masks(placement) -> dict[str, str | None]:
    return {p.name: p.cuda_visible_devices for p in placement.processes}


def devices(placement) -> dict[str, str]:
    return {p.name: p.device for p in placement.processes}


# ---- placement: plain functions ----------------------------------------------------------------------------


def test_six_train_and_two_rollout_gpus():
    p = plan(
        RolloutConfig(
            engine="vllm",
            async_=True,
            train_devices=[0, 1, 2, 3, 4, 5],
            rollout_devices=[6, 7],
            num_engines=2,
        ),
        8,
    )
    assert (p.mode, p.train_devices, p.rollout_devices, p.colocate) == (
        "workers",
        [0, 1, 2, 3, 4, 5],
        [[6], [7]],
        False,
    )
    # every trainer rank sees all eight (rollout GPUs last) and trains on ordinal = its rank = LOCAL_RANK
    assert masks(p) == {
        **{f"trainer rank {r}": EIGHT for r in range(6)},
        "rollout worker 1": "6",
        "rollout worker 2": "7",
    }
    assert devices(p) == {
        **{f"trainer rank {r}": f"cuda:{r}" for r in range(6)},
        "rollout worker 1": "cuda:0",
        "rollout worker 2": "cuda:0",
    }
    assert p.executor is None  # the recipe's engine runs in the workers; vLLM's default executor there


def test_four_and_four_with_the_trainer_on_the_upper_gpus():
    p = plan(
        RolloutConfig(
            engine="vllm",
            async_=True,
            train_devices=[4, 5, 6, 7],
            rollout_devices=[0, 1, 2, 3],
            num_engines=4,
        ),
        8,
    )
    assert p.train_devices == [4, 5, 6, 7] and p.rollout_devices == [[0], [1], [2], [3]]
    assert masks(p) == {
        **{f"trainer rank {r}": "4,5,6,7,0,1,2,3" for r in range(4)},
        **{f"rollout worker {k}": str(k - 1) for k in range(1, 5)},
    }
    assert [t.device for t in p.trainers] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]  # physical 4, 5, 6, 7


def test_four_and_four_with_two_tensor_parallel_engines_and_train_devices_left_empty():
    p = plan(
        RolloutConfig(
            engine="vllm", async_=True, rollout_devices=[4, 5, 6, 7], num_engines=2, tensor_parallel_size=2
        ),
        8,
    )
    assert p.train_devices == [0, 1, 2, 3]  # empty: every GPU not used for rollout
    assert p.rollout_devices == [[4, 5], [6, 7]]
    assert {w.name: (w.cuda_visible_devices, w.device) for w in p.workers} == {
        "rollout worker 1": ("4,5", "cuda:0"),
        "rollout worker 2": ("6,7", "cuda:0"),
    }


def test_eight_colocated_ranks_each_with_its_engine_under_the_external_launcher():
    p = plan(load_recipe(CONFIGS / "countdown-qwen2.5-3b.yaml").rollout, 8)
    assert (p.mode, p.colocate, p.train_devices) == ("colocated", True, list(range(8)))
    assert p.rollout_devices == [[d] for d in range(8)] and p.executor == "external_launcher"
    assert masks(p) == {f"trainer rank {r}": EIGHT for r in range(8)}  # no rollout worker process
    assert [(t.device, t.engine_device) for t in p.trainers] == [(f"cuda:{r}", f"cuda:{r}") for r in range(8)]


def test_a_lone_trainer_sees_its_in_process_engines_gpu_first():
    p = plan(RolloutConfig(engine="vllm", train_devices=[0], rollout_devices=[1]), 2)
    # vLLM's single-process executor computes on ordinal 0: the rollout GPU goes there
    assert masks(p) == {"trainer rank 0": "1,0"}
    assert (p.trainers[0].device, p.trainers[0].engine_device) == ("cuda:1", "cuda:0")


def test_recipe_ids_index_the_launchers_own_cuda_visible_devices():
    p = plan(
        RolloutConfig(engine="vllm", async_=True, train_devices=[0, 1], rollout_devices=[2]),
        ["3", "5", "GPU-abc"],
    )
    assert masks(p) == {
        "trainer rank 0": "3,5,GPU-abc",
        "trainer rank 1": "3,5,GPU-abc",
        "rollout worker 1": "GPU-abc",
    }


def test_without_gpus_every_process_is_on_the_cpu():
    p = plan(RolloutConfig(async_=True, num_engines=2, train_devices=[0, 1]), 0)
    assert devices(p) == {
        "trainer rank 0": "cpu",
        "trainer rank 1": "cpu",
        "rollout worker 1": "cpu",
        "rollout worker 2": "cpu",
    }
    assert set(masks(p).values()) == {None}


@pytest.mark.parametrize(
    "cfg, gpus, message",
    [
        (
            RolloutConfig(train_devices=[0, 8]),
            8,
            "rollout.train_devices: device 8 does not exist, this node has 8 GPUs",
        ),
        (
            RolloutConfig(engine="vllm", async_=True, rollout_devices=[0, 1], num_engines=2),
            2,
            "none is left for training",
        ),
        (RolloutConfig(engine="vllm", async_=True, train_devices=[0, 1]), 4, "needs rollout.rollout_devices"),
        (
            RolloutConfig(engine="vllm", train_devices=[0, 1], rollout_devices=[2]),
            4,
            "Set rollout.async: true",
        ),
        (
            RolloutConfig(engine="vllm", colocate=True, num_engines=1),
            8,
            "rollout.num_engines is 1, but colocated",
        ),
        (
            RolloutConfig(engine="vllm", colocate=True, num_engines=4, tensor_parallel_size=2),
            8,
            "is not supported",
        ),
        (RolloutConfig(train_devices=[0], rollout_devices=[1]), 2, "the synchronous transformers engine"),
    ],
)
def test_placements_the_node_or_the_mode_cannot_give_are_refused_naming_the_field(cfg, gpus, message):
    with pytest.raises(PlacementError, match="rollout") as info:
        plan(cfg, gpus)
    assert message in str(info.value)


# ---- the environment each process gets ---------------------------------------------------------------------


def test_trainer_ranks_are_launched_with_the_plans_gpus_and_find_their_own():
    recipe = load_recipe(CONFIGS / "qwen2.5-7b-numina-8gpu.yaml")
    assert needs_launch(recipe, {}, count=8)  # six ranks
    env = launch_env(recipe, {"PATH": "/bin"}, count=8)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": EIGHT, GPUS_ENV: EIGHT}
    rank3 = {**env, "LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "6"}
    placement, me = this_trainer(recipe.rollout, rank3, count=8)
    assert (me.name, me.device) == ("trainer rank 3", "cuda:3") and len(placement.workers) == 2
    assert not needs_launch(recipe, rank3, count=8)  # a rank does not relaunch

    upper = Recipe(
        rollout=RolloutConfig(
            engine="vllm",
            async_=True,
            train_devices=[4, 5, 6, 7],
            rollout_devices=[0, 1, 2, 3],
            num_engines=4,
        )
    )
    env = launch_env(upper, {}, count=8)
    assert (env["CUDA_VISIBLE_DEVICES"], env[GPUS_ENV]) == ("4,5,6,7,0,1,2,3", EIGHT)
    assert (
        this_trainer(upper.rollout, {**env, "LOCAL_RANK": "1"}, count=8)[1].device == "cuda:1"
    )  # physical 5


def test_a_lone_trainer_is_relaunched_when_its_engines_gpu_is_not_at_ordinal_zero():
    recipe = Recipe(rollout=RolloutConfig(engine="vllm", train_devices=[0], rollout_devices=[1]))
    assert needs_launch(recipe, {}, count=2)
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES=1,0"):
        this_trainer(recipe.rollout, {}, count=2)  # e.g. a trainer started in-process by a Prefect task
    placed = launch_env(recipe, {}, count=2)
    assert placed["CUDA_VISIBLE_DEVICES"] == "1,0" and not needs_launch(recipe, placed, count=2)
    assert this_trainer(recipe.rollout, placed, count=2)[1].device == "cuda:1"
    single = Recipe(rollout=RolloutConfig(engine="vllm"))  # one GPU, the engine beside the trainer: as it is
    assert not needs_launch(single, {}, count=1)


def test_each_spawned_rollout_worker_starts_with_its_engines_gpus_and_no_trainer_rank(tiny_base, monkeypatch):
    from trainer.rollout.worker_processes import RolloutWorkers

    workers = plan(
        RolloutConfig(engine="transformers", async_=True, rollout_devices=[6, 7], num_engines=2), 8
    ).workers
    torchrun = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "6",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555",
        "CUDA_VISIBLE_DEVICES": EIGHT,
    }
    for name, value in torchrun.items():  # what trainer rank 0 has when it spawns its workers
        monkeypatch.setenv(name, value)
    # on this CPU machine the workers compute on the CPU; the variables are what a GPU node gives them
    started = RolloutWorkers(
        tiny_base["path"],
        devices=["cpu", "cpu"],
        timeout_s=300,
        cuda_visible_devices=[w.cuda_visible_devices for w in workers],
    )
    try:
        seen = [psutil.Process(p.pid).environ() for p in started.procs]  # as each process was started
    finally:
        started.close()
    assert [env.get("CUDA_VISIBLE_DEVICES") for env in seen] == ["6", "7"]
    assert all(name not in env for env in seen for name in LAUNCHER_VARS)
    assert {name: os.environ.get(name) for name in torchrun} == torchrun  # the trainer's own is as it was


# ---- grpoflow train --dry-run --json -----------------------------------------------------------------------

# recipe -> (mode, train_devices, rollout_devices, colocate, CUDA_VISIBLE_DEVICES of each process)
DRY_RUN = {
    "qwen2.5-7b-numina-8gpu": ("workers", [0, 1, 2, 3, 4, 5], [[6], [7]], False, [EIGHT] * 6 + ["6", "7"]),
    "qwen2.5-vl-3b-clevr-counting": (
        "workers",
        [0, 1, 2, 3, 4, 5],
        [[6], [7]],
        False,
        [EIGHT] * 6 + ["6", "7"],
    ),
    "countdown-qwen2.5-3b": ("colocated", list(range(8)), [[d] for d in range(8)], True, [EIGHT] * 8),
}
DRY_RUN["qwen2.5-7b-tools-8gpu"] = DRY_RUN["qwen2.5-7b-numina-8gpu"]  # multi-turn: the same 6 + 2 layout
# two nodes: node 0's processes (4 trainer ranks, two tensor-parallel workers); node 1: test_gpu_semantics.py
DRY_RUN["qwen2.5-32b-numina-2x8gpu"] = (
    "workers",
    [0, 1, 2, 3],
    [[4, 5], [6, 7]],
    False,
    [EIGHT] * 4 + ["4,5", "6,7"],
)


# as written, its DDP trainer (no DeepSpeed for images yet) needs more than 80 GiB: planned for an H200
NEEDS_141_GIB = {"qwen2.5-vl-3b-clevr-counting"}


def _gpu_recipes() -> list[Path]:
    return [
        p
        for p in sorted(CONFIGS.glob("*.yaml"))
        if (r := load_recipe(p).rollout).engine != "transformers" or r.train_devices or r.rollout_devices
    ]


def test_every_gpu_recipe_is_checked_below():
    assert sorted(p.stem for p in _gpu_recipes()) == sorted(DRY_RUN)


@pytest.mark.parametrize("path", _gpu_recipes(), ids=lambda p: p.stem)
def test_dry_run_prints_the_placement_of_every_gpu_recipe(path):
    # the command as a user types it; with no GPU in sight the node is as large as the recipe's device ids ask
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--dry-run", "--json"]
        + (["--gpu-memory-gib", "141"] if path.stem in NEEDS_141_GIB else []),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    mode, train, rollout, colocate, cuda_visible = DRY_RUN[path.stem]
    assert (out["dry_run"], out["mode"], out["gpus"], out["gpus_from"]) == (
        True,
        mode,
        8,
        "the recipe's device ids",
    )
    assert (out["train_devices"], out["rollout_devices"], out["colocate"]) == (train, rollout, colocate)
    assert [p["CUDA_VISIBLE_DEVICES"] for p in out["processes"]] == cuda_visible
    assert [p["device"] for p in out["processes"] if p["role"] == "trainer"] == [
        f"cuda:{r}" for r in range(len(train))
    ]


def test_dry_run_for_another_node_size_and_a_placement_that_does_not_fit(capsys):
    recipe = str(CONFIGS / "countdown-qwen2.5-3b.yaml")
    assert main(["train", "--config", recipe, "--dry-run", "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gpus_from"] == "--gpus"
    assert main(["train", "--config", recipe, "--dry-run", "--gpus", "4", "--json"]) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert "rollout.train_devices: device 4 does not exist, this node has 4 GPUs" in error
    assert main(["train", "--config", recipe, "--gpus", "8", "--json"]) == 2  # --gpus belongs to --dry-run
    assert "--dry-run" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]


# ---- the trainer ranks' process group ----------------------------------------------------------------------


# The trainer ranks' group on GPUs, formed as `init_distributed` forms it there. A CPU build of torch has no
# NCCL and stops at the cuda part (after parsing the whole string); a CUDA build forms the group, and a CPU
# tensor's all-reduce goes through gloo, a CUDA tensor's (one GPU per rank, where there are enough) NCCL.
COMPOSITE_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from trainer.launch import process_group_backend
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = {}
try:
    dist.init_process_group(process_group_backend(cuda=True))
except RuntimeError as e:
    out["error"] = str(e)
else:
    out["backend"] = str(dist.get_backend_config())
    metrics = torch.tensor([rank + 1.0], dtype=torch.float64)
    dist.all_reduce(metrics)
    out["cpu_sum"] = metrics.item()
    if torch.cuda.device_count() >= world:
        torch.cuda.set_device(rank)
        on_gpu = torch.tensor([rank + 1.0], device="cuda")
        dist.all_reduce(on_gpu)
        out["cuda_sum"] = on_gpu.item()
    dist.destroy_process_group()
json.dump(out, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
"""


def test_the_gpu_backend_gives_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl(tmp_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    def device_backends(backend: str) -> dict:  # as init_process_group reads the string
        return BackendConfig(Backend(backend)).get_device_backend_map()

    assert device_backends(process_group_backend(cuda=True)) == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends(process_group_backend(cuda=False)) == {"cpu": "gloo"}

    (tmp_path / "composite.py").write_text(COMPOSITE_SCRIPT)
    proc = torchrun(tmp_path / "composite.py", 2, str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        if not dist.is_nccl_available():  # torch's CPU build: the whole string parsed, NCCL absent
            assert out == {"error": "Distributed package doesn't have NCCL built in"}, out
            continue
        assert out["backend"] == "cpu:gloo,cuda:nccl" and out["cpu_sum"] == 3.0, out
        assert out.get("cuda_sum") == (3.0 if torch.cuda.device_count() >= 2 else None), out


RANKS_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from trainer.launch import init_distributed
rank, world = init_distributed(120)
metrics = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)  \
# a CPU tensor, like the trainer's
dist.all_reduce(metrics)
box = [{"batch from": rank}]
dist.broadcast_object_list(box, src=0)
json.dump({"world": world, "backend": str(dist.get_backend_config()), "sum": metrics.tolist(), "box": box[0]},
          open(f"{sys.argv[1]}/rank{rank}.json", "w"))
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_two_ranks_all_reduce_a_cpu_tensor_on_the_composite_backend(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    proc = torchrun(tmp_path / "ranks.py", 2, str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out == {"world": 2, "backend": "cpu:gloo", "sum": [3.0, 30.0], "box": {"batch from": 0}}, out


# A trainer rank's last call: the group left, then the exit handlers (while the interpreter is whole), the
# streams flushed, and the process ended with the given status, skipping the interpreter's finalization.
END_RANK_SCRIPT = """
import atexit, os, sys, torch.distributed as dist
from trainer.launch import end_rank, init_distributed
rank, world = init_distributed(120)
def handler():
    open(f"{sys.argv[1]}/exit{rank}", "w").write(f"group alive: {dist.is_initialized()}")
atexit.register(handler)
sys.stdout.write(f"rank {rank} of {world}, unflushed")  # no newline: still buffered when end_rank is called
end_rank(int(sys.argv[2]))
open(f"{sys.argv[1]}/returned{rank}", "w").write("end_rank returned")
"""


def test_a_rank_ends_with_the_group_left_its_exit_handlers_run_its_output_flushed_and_its_status(tmp_path):
    script = tmp_path / "end.py"
    script.write_text(END_RANK_SCRIPT)
    proc = torchrun(script, 2, str(tmp_path), "0", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2, unflushed" in proc.stdout
        assert (tmp_path / f"exit{rank}").read_text() == "group alive: False"
        assert not (tmp_path / f"returned{rank}").exists()
    # one process, no group (WORLD_SIZE unset): the status it is given is the process's
    (tmp_path / "alone").mkdir()
    alone = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "alone"), "3"],
        cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 3, alone.stderr[-3000:]
    assert alone.stdout == "rank 0 of 1, unflushed"
    assert (tmp_path / "alone" / "exit0").read_text() == "group alive: False"


# ---- vLLM (its CPU build, .venv-vllm) ----------------------------------------------------------------------

ENGINE_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from trainer.launch import init_distributed
from trainer.recipe import ModelConfig, RolloutConfig
from trainer.rollout.base import SamplingParams
from trainer.rollout.engines import make_engine
cfg = RolloutConfig(engine="vllm", colocate=True, enforce_eager=True, train_devices=[0, 1], num_engines=2)
rank, world = init_distributed(600, cfg)
engine = make_engine(cfg, sys.argv[1], model_cfg=ModelConfig(dtype="float32"), seed=0, max_model_len=88)
[(vllm_rank, vllm_local_rank)] = engine.llm.collective_rpc(lambda worker: (worker.rank, worker.local_rank))
groups = engine.generate([[5, 6, 7], [8, 9, 10, 11]], 3, \
SamplingParams(max_tokens=8, temperature=1.0, seed=3))
json.dump({"executor": engine.settings.get("distributed_executor_backend"), "vllm_rank": vllm_rank,
           "vllm_local_rank": vllm_local_rank, "tokens": [[c.token_ids for c in g] for g in groups]},
          open(f"{sys.argv[2]}/rank{rank}.json", "w"))
"""


def test_each_trainer_rank_builds_its_own_vllm_engine_under_the_external_launcher(tiny_base, tmp_path):
    """Finding 1: vLLM's default executor gives every rank's engine local rank 0 (GPU 0 on a GPU node); under
    its external launcher rank r's engine is vLLM rank r on LOCAL_RANK r, the rank's own GPU in the plan."""
    require_vllm("`make test-vllm` runs this test in .venv-vllm")
    (tmp_path / "engines.py").write_text(ENGINE_SCRIPT)
    proc = torchrun(tmp_path / "engines.py", 2, tiny_base["path"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(o["executor"], o["vllm_rank"], o["vllm_local_rank"]) for o in out] == [
        ("external_launcher", 0, 0),
        ("external_launcher", 1, 1),
    ]
    assert out[0]["tokens"] == out[1]["tokens"]  # seeded requests: both ranks generate the same batch
    assert all(len(g) == 3 for g in out[0]["tokens"])


SERVER_SCRIPT = """
import json, sys
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe
recipe = load_recipe(sys.argv[1], sys.argv[4:])
trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
trainer.setup()
batches = []
with trainer.rollout_source() as source:
    for step in (0, 1):
        batch, _ = source.next(step)
        batches.append([[c.token_ids, c.logprobs] for c in batch.completions])
        trainer.version += 1  # as after an update: the next batch needs the server brought up to date first
json.dump({"engine": type(trainer.local_engine.engine).__name__, "batches": batches},
          open(f"{sys.argv[3]}/rank{trainer.rank}.json", "w"))
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


def counting_proxy(target: str, counts: dict[str, int]) -> type[BaseHTTPRequestHandler]:
    """A handler that forwards every request to `target` and counts them by method and path: what the server
    was asked, whichever process asked."""
    import threading

    lock = threading.Lock()

    class Forward(BaseHTTPRequestHandler):
        def forward(self):
            with lock:
                key = f"{self.command} {self.path.split('?')[0]}"
                counts[key] = counts.get(key, 0) + 1
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
            request = urllib.request.Request(
                target + self.path,
                data=body,
                method=self.command,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    status, payload = response.status, response.read()
            except urllib.error.HTTPError as e:
                status, payload = e.code, e.read()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = forward

        def log_message(self, *args):
            pass

    return Forward


def test_in_server_mode_only_rank_zero_syncs_and_generates_and_both_ranks_train_on_its_batch(
    rollout_server, tiny_base, tiny_data, tmp_path
):
    """Finding 5: two trainer ranks, one vLLM server. Rank 0 alone connects, sends the weights (reload sync)
    and asks for each batch; rank 1 holds no client and gets the batch from rank 0."""
    require_vllm("`make test-vllm` runs this test in .venv-vllm")
    (tmp_path / "server_ranks.py").write_text(SERVER_SCRIPT)
    counts: dict[str, int] = {}
    with loopback_http(counting_proxy(rollout_server, counts)) as proxy:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        proc = torchrun(
            tmp_path / "server_ranks.py",
            2,
            str(CONFIGS / "tiny-cpu.yaml"),
            tiny_base["path"],
            str(tmp_path),
            f"bootstrap.out={tiny_base['path']}",
            f"data.out={tiny_data}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.prompts_per_step=2",
            "train.num_generations=4",
            "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
            "rollout.engine=vllm",
            f"rollout.server_url={url}",
            "rollout.weight_sync=reload",
            f"rollout.weights_dir={tmp_path / 'weights'}",
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (rank0["engine"], rank1["engine"]) == ("VLLMServerEngine", "ServedByRankZero")
    assert rank0["batches"] == rank1["batches"] and len(rank0["batches"][0]) == 8  # 2 prompts x 4
    assert rank0["batches"][0] != rank0["batches"][1]
    # one client's requests, not two: connect once, two batches, two weight syncs (before the first batch:
    # a server may hold any weights when a run starts; before the second: the policy moved)
    assert counts == {
        "GET /health": 1,
        "GET /v1/models": 1,
        "GET /server_info": 1,
        "POST /v1/completions": 2,
        "POST /collective_rpc": 2,
        "POST /reset_prefix_cache": 2,
    }, counts
