"""Starting the right processes for a recipe: one command, one node.

- Several trainer ranks (`rollout.train_devices`): `grpoflow train` re-runs itself as N torchrun ranks (DDP),
  started with the CUDA_VISIBLE_DEVICES of `trainer.placement` (the train devices in rank order, then the
  rollout devices: rank r trains on ordinal r = LOCAL_RANK, and the rollout GPUs stay visible). A single rank
  whose GPUs are not where the plan wants them (a lone trainer with an in-process engine on another GPU) is
  started the same way, as one rank.
- The trainer ranks' process group has gloo for CPU tensors (metrics, `broadcast_object_list`) and, on GPUs,
  NCCL for CUDA tensors (`cpu:gloo,cuda:nccl`); each rank selects its own GPU before the group is made, so
  NCCL never puts two ranks on one device.
- The launching process holds the run directory (`trainer.checkpoint.claim_run_dir`) and hands it down to
  the ranks it starts.
- `rollout.async`: rank 0 spawns the rollout workers itself (trainer/rollout/worker_processes.py), each
  with its engine's CUDA_VISIBLE_DEVICES.
- Several nodes (`rollout.nodes`): `grpoflow train --node-rank K --rendezvous HOST:PORT` on each node meets
  the others (`trainer.rendezvous`, bounded, naming who is missing), then starts the node's ranks under
  torchrun (`launch_node`). Under a launcher of one's own (WORLD_SIZE set) the trainer picks its rank from the
  environment (`init_distributed`) and does not relaunch. `train.output_dir` must be one directory that
  every node mounts at the same path: the ranks check it as they start
  (`trainer.checkpoint.check_shared_run_dir`) and refuse one they do not share.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Mapping

import torch

from trainer.checkpoint import claim_run_dir
from trainer.placement import node_gpus, plan, trainer_device, trainer_env, visible_gpus
from trainer.recipe import Recipe, RolloutConfig
from trainer.typed_config import ConfigError


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_launch(recipe: Recipe, environ: Mapping[str, str] | None = None, count: int | None = None) -> bool:
    """True unless this process already is the (only) trainer rank the plan asks for, with the GPUs it wants.
    `count`: the GPUs torch sees (default: asks torch)."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" in environ:  # under a launcher already
        return False
    placement = plan(recipe.rollout, node_gpus(environ, count))
    if len(placement.trainers) > 1:
        return True
    wanted = placement.trainers[0].cuda_visible_devices
    return bool(placement.gpus) and visible_gpus(environ, count) != wanted.split(",")


def launch_command(recipe: Recipe, cli_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={len(plan(recipe.rollout, node_gpus()).trainers)}",
        "-m",
        "flows.cli",
        "train",
        *cli_args,
    ]


def launch_env(
    recipe: Recipe, environ: Mapping[str, str] | None = None, count: int | None = None
) -> dict[str, str]:
    """The environment the trainer ranks are started with (see `trainer.placement.trainer_env`)."""
    environ = os.environ if environ is None else environ
    return trainer_env(plan(recipe.rollout, node_gpus(environ, count)), environ)


def launch_ranks(recipe: Recipe, cli_args: list[str]) -> int:
    """Re-run `grpoflow train <cli_args>` as the plan's trainer ranks under torchrun; returns its exit status.
    The run directory is held here for the whole run (a second run is refused before any rank starts) and
    handed down to the ranks, whose rank 0 would otherwise wait on this process's lock."""
    return _call_holding_run_dir(recipe, launch_command(recipe, cli_args), launch_env(recipe))


def _call_holding_run_dir(recipe: Recipe, command: list[str], env: dict[str, str], hold: bool = True) -> int:
    """`command`'s exit status, run with `env` while this process holds the recipe's run directory (when
    `hold`), the hold handed down to the ranks it starts."""
    with claim_run_dir(recipe.train.output_dir) if hold else contextlib.nullcontext() as held:
        handed = held.child_env() if held is not None else {}
        return subprocess.call(command, env={**env, **handed})


def launch_node(recipe: Recipe, cli_args: list[str], node: int, endpoint: str) -> int:
    """This node's trainer ranks of a `rollout.nodes` run: meet the other nodes at `endpoint` (node 0's
    HOST:PORT; `trainer.rendezvous`), then run `grpoflow train <cli_args>` as the node's ranks under torchrun
    (static rendezvous on PORT + 1, node 0 the master, ranks numbered node by node). Node 0 holds the run
    directory for the whole run, as `launch_ranks` does; returns torchrun's exit status."""
    from trainer.rendezvous import interface_of, meet, parse_endpoint

    host, port = parse_endpoint(endpoint)
    cfg = recipe.rollout
    if not 0 <= node < cfg.nodes:
        raise ConfigError(
            f"--node-rank {node}: rollout.nodes is {cfg.nodes}, so node ranks are 0-{cfg.nodes - 1}"
        )
    placement = plan(cfg, node_gpus(), node=node)
    members = meet(cfg.nodes, node, host, port, cfg.rendezvous_timeout_s)
    env = trainer_env(placement, os.environ)
    if "GLOO_SOCKET_IFNAME" not in env:
        interface = interface_of(members[node].address)
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cfg.nodes}",
        f"--node_rank={node}",
        f"--nproc_per_node={len(placement.trainers)}",
        f"--master_addr={host}",
        f"--master_port={port + 1}",
        "-m",
        "flows.cli",
        "train",
        *cli_args,
    ]
    return _call_holding_run_dir(recipe, command, env, hold=node == 0)


def process_group_backend(cuda: bool) -> str:
    """The trainer ranks' backends: gloo for CPU tensors always (the metrics all-reduce, object broadcasts),
    NCCL for CUDA tensors on GPUs (DDP's gradients)."""
    return "cpu:gloo,cuda:nccl" if cuda else "cpu:gloo"


def init_distributed(timeout_s: float, rollout: RolloutConfig | None = None) -> tuple[int, int]:
    """(rank, world size) of the trainer ranks; (0, 1) unless launched by torchrun with WORLD_SIZE > 1.

    On GPUs the rank's own device (from the placement of `rollout`, else ordinal LOCAL_RANK) becomes the
    current device first: NCCL and the object collectives use the current device."""
    cuda = torch.cuda.is_available()
    if cuda:
        device = (
            trainer_device(rollout) if rollout is not None else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        )
        torch.cuda.set_device(torch.device(device))
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(process_group_backend(cuda), timeout=timedelta(seconds=timeout_s))
        global _PEERS
        _PEERS = [None] * dist.get_world_size()  # where each rank runs, to name a host that is lost later
        dist.all_gather_object(_PEERS, (socket.gethostname(), own_address(os.environ.get("MASTER_ADDR"))))
    return dist.get_rank(), dist.get_world_size()


_PEERS: list[tuple[str, str]] | None = None  # (hostname, address) of every trainer rank, by rank
# gloo's words when a peer went away mid-collective ("Connection closed by peer [10.0.0.2]:45736", "Read error
# [10.0.0.2]:45736: Connection reset by peer"): then the message's address is the lost peer's
_LOST_PEER_WORDS = re.compile(
    r"closed by peer|reset by peer|Connection refused|Broken pipe|Read error|Write error"
)
_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")


def own_address(master: str | None) -> str:
    """This rank's address on the network it shares with the rendezvous host `master` (the local end of a
    route to it; nothing is sent); 127.0.0.1 on one node."""
    from trainer.rendezvous import address_towards

    return address_towards(master) if master else "127.0.0.1"


def lost_peer(error: BaseException) -> str | None:
    """What to say when `error` is a collective failing because another trainer rank's host went away: the
    host (name and address) and its ranks; None for any other error."""
    text = str(error)
    if _PEERS is None or not _LOST_PEER_WORDS.search(text):
        return None
    known = {a for _, a in _PEERS}
    address = next((a for a in _ADDRESS.findall(text) if a in known), None)
    if address is None:
        return None
    ranks = [r for r, (_, a) in enumerate(_PEERS) if a == address]
    host = _PEERS[ranks[0]][0]
    which = ", ".join(map(str, ranks))
    return (
        f"lost trainer rank{'s' if len(ranks) > 1 else ''} {which} on host {host} ({address}) mid-run: "
        f"{str(error).splitlines()[0][:200]}. Rerun the same command on every node: it resumes from the "
        "last checkpoint"
    )


@contextlib.contextmanager
def distributed_exit():
    """Leave the process group (`leave_distributed`) when the block ends: cleanly after a success, at once
    after an error. An error that is another trainer rank's host going away is raised again naming that host
    (`lost_peer`)."""
    try:
        yield
    except BaseException as e:
        leave_distributed(clean=False)
        if (message := lost_peer(e)) is not None:  # another node is gone: say which, not gloo's socket error
            raise RuntimeError(message) from e
        raise
    leave_distributed()


def leave_distributed(clean: bool = True) -> None:
    """Destroy the trainer ranks' process group, if any, before the process exits.

    Left to the interpreter's exit, gloo's threads are torn down in no set order: a rank died of SIGABRT
    ("terminate called without an active exception") after its work was done, failing a run that had
    succeeded (seen once on CI, torch 2.13). `clean`: wait for every rank first (after a success; after a
    failure the others may never arrive, so it only destroys)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()
