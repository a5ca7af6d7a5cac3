"""Starting the right processes for a recipe: one command, one node.

- `rollout.train_devices` with more than one device: trainer ranks under torchrun (DDP; gloo on CPU,
  NCCL on GPU), one per device (CUDA_VISIBLE_DEVICES restricted to them on GPU).
- `rollout.async`: rank 0 spawns the rollout workers itself (trainer/rollout/remote.py).
Multi-node: run the same `grpoflow train` command under your own launcher, e.g.
`torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m flows.cli train ...`;
the trainer picks its rank from the environment (`init_distributed`) and does not relaunch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from trainer.recipe import Recipe


def trainer_ranks(recipe: Recipe) -> int:
    return max(1, len(recipe.rollout.train_devices))


def needs_launch(recipe: Recipe) -> bool:
    return trainer_ranks(recipe) > 1 and "WORLD_SIZE" not in os.environ


def launch_ranks(recipe: Recipe, cli_args: list[str]) -> int:
    """Re-run `grpoflow train <cli_args>` as N torchrun ranks; returns torchrun's exit status."""
    env = dict(os.environ)
    if torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in recipe.rollout.train_devices)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={trainer_ranks(recipe)}", "-m", "flows.cli", "train", *cli_args]
    return subprocess.call(cmd, env=env)


def init_distributed(timeout_s: float) -> tuple[int, int]:
    """(rank, world size) of the trainer ranks; (0, 1) unless launched by torchrun with WORLD_SIZE > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
