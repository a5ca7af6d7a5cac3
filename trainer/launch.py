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
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

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


def launch_ranks(
    recipe: Recipe, cli_args: list[str], watch: Callable[[], None] | None = None, stdout: int | None = None
) -> int:
    """Re-run `grpoflow train <cli_args>` as the plan's trainer ranks under torchrun; returns its exit status.
    The run directory is held here for the whole run (a second run is refused before any rank starts) and
    handed down to the ranks, whose rank 0 would otherwise wait on this process's lock. `watch` is called
    every second while the ranks run, and once after; `stdout`: the descriptor the ranks' stdout goes to."""
    command = launch_command(recipe, cli_args)
    return _call_holding_run_dir(recipe, command, launch_env(recipe), watch=watch, stdout=stdout)


def _call_holding_run_dir(
    recipe: Recipe,
    command: list[str],
    env: dict[str, str],
    hold: bool = True,
    watch: Callable[[], None] | None = None,
    stdout: int | None = None,
) -> int:
    """`command`'s exit status, run with `env` while this process holds the recipe's run directory (when
    `hold`), the hold handed down to the ranks it starts; `watch()` every second meanwhile and once at the
    end; the command's stdout to the file descriptor `stdout` (default this process's). An error here (an
    interrupt, `watch` raising) stops the ranks first."""
    with claim_run_dir(recipe.train.output_dir) if hold else contextlib.nullcontext() as held:
        handed = held.child_env() if held is not None else {}
        with subprocess.Popen(command, env={**env, **handed}, stdout=stdout) as proc:
            try:
                while proc.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=WATCH_S)
                    if watch is not None:
                        watch()
            except BaseException:
                proc.terminate()  # torchrun stops its ranks on SIGTERM; killed, it would leave them running
                try:
                    proc.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise
        return proc.returncode


STOP_S = 30.0  # how long the ranks get to stop after SIGTERM
WATCH_S = 1.0  # how often a launcher's `watch` looks at the running ranks (the pipeline's metrics follower)


def launch_node(
    recipe: Recipe,
    cli_args: list[str],
    node: int,
    endpoint: str,
    watch: Callable[[], None] | None = None,
    stdout: int | None = None,
) -> int:
    """This node's trainer ranks of a `rollout.nodes` run: meet the other nodes at `endpoint` (node 0's
    HOST:PORT; `trainer.rendezvous`), then run `grpoflow train <cli_args>` as the node's ranks under torchrun
    (static rendezvous on PORT + 1, node 0 the master, ranks numbered node by node). Node 0 holds the run
    directory for the whole run, as `launch_ranks` does, and hands `cli_args` to the nodes that `join_node`
    without a recipe of their own; returns torchrun's exit status."""
    from trainer.rendezvous import meet, parse_endpoint

    host, port = parse_endpoint(endpoint)
    _check_node(recipe, node, "--node-rank")
    members, _ = meet(recipe.rollout.nodes, node, host, port, recipe.rollout.rendezvous_timeout_s, cli_args)
    return _run_node(recipe, cli_args, node, host, port, members, watch, stdout)


def join_node(
    node: int,
    endpoint: str,
    wait_s: float,
    still_wanted: Callable[[], str | None],
    recipe_of: Callable[[list[str]], Recipe],
) -> int:
    """Node `node` of a run that node 0 starts at `endpoint` with a recipe this node does not have (the
    pipeline's train stage on node 0; a pod of the multi-node pool template here). Waits for node 0's
    rendezvous for up to `wait_s` seconds and while `still_wanted()` is None (else it says why to stop: the
    flow run has ended), takes node 0's `grpoflow train` arguments from it (`recipe_of` reads them; the
    recipe file is on the shared disk), then starts this node's ranks as `launch_node` does.
    RendezvousError (exit 2) when node 0 never comes or is no longer wanted."""
    from trainer.rendezvous import NodeZeroUnreachable, RendezvousError, meet, parse_endpoint

    host, port = parse_endpoint(endpoint)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            try_s = min(JOIN_TRY_S, max(1.0, deadline - time.monotonic()))
            members, cli_args = meet(0, node, host, port, try_s, members_wait_s=wait_s)
            break
        except NodeZeroUnreachable:
            why = still_wanted()
            if why is not None:
                raise RendezvousError(
                    f"node {node}: stopped waiting for node 0 at {host}:{port}: {why}"
                ) from None
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"node {node}: node 0's rendezvous at {host}:{port} did not open within {wait_s:g} s "
                    "(--wait-s): node 0 opens it when its training starts"
                ) from None
    recipe = recipe_of(cli_args)
    _check_node(recipe, node, "--node-rank")
    return _run_node(recipe, cli_args, node, host, port, members, None, None)


JOIN_TRY_S = 10.0  # a joining node asks whether it is still wanted this often while node 0 is not up


def _check_node(recipe: Recipe, node: int, flag: str) -> None:
    nodes = recipe.rollout.nodes
    if not 0 <= node < nodes:
        raise ConfigError(f"{flag} {node}: rollout.nodes is {nodes}, so node ranks are 0-{nodes - 1}")


def _run_node(recipe, cli_args, node, host, port, members, watch, stdout) -> int:
    """This node's ranks under torchrun once the nodes have met (`launch_node`, `join_node`)."""
    from trainer.rendezvous import interface_of

    cfg = recipe.rollout
    placement = plan(cfg, node_gpus(), node=node)
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
    return _call_holding_run_dir(recipe, command, env, hold=node == 0, watch=watch, stdout=stdout)


def in_processes_of_their_own(recipe: Recipe) -> bool:
    """Whether the recipe's trainer ranks must be started as processes (several ranks, GPUs placed apart,
    several nodes) rather than trained in the calling process."""
    return recipe.rollout.nodes > 1 or needs_launch(recipe)


def run_ranks(recipe: Recipe, on_step: Callable[[int, dict], None], endpoint: str | None = None) -> dict:
    """Train `recipe` as its trainer ranks in processes of their own, from a caller that wants the in-process
    trainer's results (the pipeline's train stage): `on_step(step, metrics)` for each step rank 0 writes to
    metrics.jsonl while they run, and rank 0's summary at the end. The recipe goes to the ranks as a YAML file
    in its run directory (shared by every node). With `rollout.nodes > 1` this is node 0, meeting the others
    at `endpoint` (HOST:PORT); they run `grpoflow join`. RuntimeError naming the exit status when the ranks
    fail (a retry resumes from the last checkpoint)."""
    import yaml

    from data.manifest import write_text_atomic
    from trainer.metrics import SUMMARY, MetricsFile

    check_endpoint(recipe, endpoint)
    out = Path(recipe.train.output_dir)
    config = out.resolve() / LAUNCH_RECIPE
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(config, yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    (out / SUMMARY).unlink(missing_ok=True)  # a finished earlier run's: the summary read below is this one's
    metrics = MetricsFile(out / "metrics.jsonl")
    seen = len(metrics.read())  # logged by an earlier attempt

    def follow() -> None:
        nonlocal seen
        rows, seen = metrics.rows_after(seen)
        for row in rows:
            on_step(row["step"], {k: v for k, v in row.items() if k != "step"})

    cli_args = ["--config", str(config)]
    if recipe.rollout.nodes > 1:
        code = launch_node(recipe, cli_args, 0, endpoint, watch=follow, stdout=STDERR)
    else:
        code = launch_ranks(recipe, cli_args, watch=follow, stdout=STDERR)
    if code:
        raise RuntimeError(f"the trainer ranks exited with status {code} (their output is above)")
    return json.loads((out / SUMMARY).read_text())


def check_endpoint(recipe: Recipe, endpoint: str | None) -> None:
    """A multi-node recipe run by the pipeline needs node 0's rendezvous HOST:PORT (ConfigError without it,
    or with one that is not HOST:PORT)."""
    from trainer.rendezvous import parse_endpoint

    if recipe.rollout.nodes <= 1:
        return
    if not endpoint:
        raise ConfigError(
            f"rollout.nodes is {recipe.rollout.nodes}: the pipeline trains it from node 0, which needs its "
            f"rendezvous HOST:PORT in {RENDEZVOUS_ENV} (the multi-node pool template sets it), with "
            "`grpoflow join --node-rank K --rendezvous HOST:PORT` on each other node"
        )
    parse_endpoint(endpoint)


STDERR = 2  # the ranks' stdout goes to the caller's stderr: its stdout may be a summary alone (`--json`)
LAUNCH_RECIPE = "launch-recipe.yaml"  # the recipe as the ranks that run_ranks starts read it
RENDEZVOUS_ENV = "GRPOFLOW_RENDEZVOUS"  # node 0's HOST:PORT for a multi-node recipe run by the pipeline


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


def joined_a_group() -> bool:
    """Whether this process made the trainer ranks' process group (`init_distributed`)."""
    return _PEERS is not None


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

    A collective cannot be left half-done by a rank that exits first. `clean`: wait for every rank first
    (after a success; after a failure the others may never arrive, so it only destroys). The groups' C++
    objects may outlive this (see `end_rank`, how a trainer rank's process ends)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def end_rank(code: int = 0) -> NoReturn:
    """End a trainer rank's process with `code`, without the interpreter's finalization.

    `leave_distributed` takes the groups out of torch's registry, but the trainer and DeepSpeed keep Python
    references to them, so gloo's C++ objects outlive it and would be freed while the interpreter finalizes:
    a gloo worker thread then asking for the GIL is ended inside a destructor, and the rank dies of SIGABRT
    ("terminate called without an active exception") after its work was done, failing a run that succeeded
    (seen twice on CI, torch 2.13, the second time after `leave_distributed`). So the group is left, the
    exit handlers run (logging's shutdown, the math-verify worker) while everything is alive, the streams
    are flushed, and the process ends at once."""
    import atexit

    try:
        leave_distributed(clean=code == 0)
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
