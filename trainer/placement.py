"""Where each process of a training run computes: the trainer ranks' GPUs, each rollout engine's GPUs, and the
CUDA_VISIBLE_DEVICES every process starts with. Plain functions of the recipe's `rollout` section and the
node's GPUs; nothing here initialises CUDA.

Device ids in a recipe index the node's GPUs as the launching process sees them (its CUDA_VISIBLE_DEVICES, or
every GPU when unset). The plan:
- trainer ranks: `train_devices` in rank order; empty means every GPU that is not a rollout device (colocated:
  every GPU);
- engines: `rollout_devices` cut into slices of `tensor_parallel_size`, one per engine. Colocated, and for a
  synchronous in-process engine without rollout devices, each engine runs on the trainer ranks' own GPUs
  (a tensor-parallel one on `tensor_parallel_size` consecutive ranks' GPUs);
- each process sees its devices at the ordinals where the code in it looks. Trainer ranks share one
  CUDA_VISIBLE_DEVICES (torchrun gives every rank the same environment): the train devices in rank order, then
  the rollout devices. Rank r computes on ordinal r = LOCAL_RANK, which is also the GPU vLLM's external
  launcher gives the rank's own engine. A rollout worker sees only its engine's GPUs (vLLM's single-process
  executor uses ordinal 0, a tensor-parallel one 0..tp-1). A lone trainer whose in-process engine has GPUs of
  its own sees those first and its training GPU after them, for the same reason: its LOCAL_RANK 0 is then
  the engine's GPU, so what trains is told the trainer's device (`Process.device`), never LOCAL_RANK's.
LMDeploy's engine is placed by its own Ray, not by this plan: in-process on several trainer ranks, or
colocated, it is refused (`_check_engine`) until that is handled.
Inside a process, a device's ordinal is its position in that process's CUDA_VISIBLE_DEVICES; the node's list
travels in GRPOFLOW_GPUS so that every process computes the same plan. Without GPUs everything runs on the CPU
(`train_devices` then only counts the trainer ranks) and no variable is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from trainer.recipe import RolloutConfig
from trainer.typed_config import ConfigError

GPUS_ENV = "GRPOFLOW_GPUS"  # the node's GPUs as recipe ids index them, set by the launcher for its processes


class PlacementError(ConfigError):
    """The recipe's devices do not fit the node or the rollout mode; the message names the field."""


@dataclass(frozen=True)
class Process:
    name: str  # "trainer rank 0", "rollout worker 1"
    role: str  # "trainer" or "rollout"
    devices: list[int]  # recipe device ids it computes on (empty on CPU)
    cuda_visible_devices: str | None  # what it is started with (None: inherited, no GPU)
    device: str  # the torch device it computes on, an ordinal of its own CUDA_VISIBLE_DEVICES
    engine_device: str | None = None  # trainer ranks: where their in-process rollout engine runs

    def to_dict(self) -> dict:
        out = asdict(self)
        out["CUDA_VISIBLE_DEVICES"] = out.pop("cuda_visible_devices")
        return out


@dataclass(frozen=True)
class Placement:
    gpus: list[str]  # the node's GPUs (CUDA_VISIBLE_DEVICES entries), indexed by recipe device ids
    mode: str  # in-process | colocated | workers | server
    colocate: bool
    train_devices: list[int]  # one per trainer rank, rank order
    rollout_devices: list[list[int]]  # one list per engine
    processes: list[Process] = field(default_factory=list)
    executor: str | None = (
        None  # vLLM's distributed_executor_backend for the trainer ranks' in-process engines
    )
    node: int = 0  # which node of rollout.nodes this plan is for
    first_rank: int = 0  # the global rank of this node's first trainer rank

    @property
    def trainers(self) -> list[Process]:
        return [p for p in self.processes if p.role == "trainer"]

    @property
    def workers(self) -> list[Process]:
        return [p for p in self.processes if p.role == "rollout"]

    @property
    def ranks_through(self) -> int:
        """The trainer ranks of this node and every node before it (on the last node: the whole run's)."""
        return self.first_rank + len(self.trainers)

    def to_dict(self) -> dict:
        return {
            "node": self.node,
            "gpus": len(self.gpus),
            "mode": self.mode,
            "colocate": self.colocate,
            "trainer_ranks": len(self.trainers),
            "train_devices": self.train_devices,
            "rollout_devices": self.rollout_devices,
            "executor": self.executor,
            "processes": [p.to_dict() for p in self.processes],
        }


def _mask(gpus: Sequence[str], ids: Sequence[int]) -> str:
    return ",".join(gpus[i] for i in ids)


def _check_ids(cfg: RolloutConfig, n: int) -> None:
    for name in ("train_devices", "rollout_devices"):
        bad = [d for d in getattr(cfg, name) if d >= n]
        if bad:
            raise PlacementError(
                f"rollout.{name}: device {bad[0]} does not exist, this node has {n} GPUs (ids 0-{n - 1})"
            )


def plan(
    cfg: RolloutConfig, gpus: int | Sequence[str], cpu_ranks: int | None = None, node: int = 0
) -> Placement:
    """The placement of every process for `cfg` on `node` (of rollout.nodes), a node with `gpus` (a count, or
    the CUDA_VISIBLE_DEVICES entries that recipe ids index). Without GPUs there are `cpu_ranks` trainer ranks
    per node (default: one per train_devices entry, at least one). Raises PlacementError for devices the node
    lacks or a mode they do not fit."""
    if not 0 <= node < cfg.nodes:
        raise PlacementError(
            f"node {node} is not one of rollout.nodes {cfg.nodes} (node ranks 0-{cfg.nodes - 1})"
        )
    first = _plan(cfg, gpus, cpu_ranks)
    if node == 0:
        return first
    if first.mode == "in-process" and first.rollout_devices:
        raise PlacementError(
            f"rollout.nodes {cfg.nodes} with a lone trainer rank's in-process engine on GPUs of its own "
            "(rollout.rollout_devices, synchronous): that is one trainer rank, on one node. Set "
            "rollout.async: true (rollout workers on node 0), rollout.colocate: true or rollout.server_url"
        )
    if first.mode == "workers":  # the rollout workers are node 0's; the other nodes train on every GPU
        every_gpu = replace(cfg, rollout_devices=[], train_devices=[], async_=False, engine="transformers")
        other = _plan(every_gpu, gpus, cpu_ranks)
        other = replace(
            first, train_devices=other.train_devices, rollout_devices=[], processes=other.trainers
        )
    else:
        other = first
    ranks = len(other.trainers)
    offset = len(first.trainers) + (node - 1) * ranks
    named = [replace(p, name=f"trainer rank {offset + r}") for r, p in enumerate(other.trainers)]
    return replace(other, node=node, first_rank=offset, processes=named)


def nodes_plan(
    cfg: RolloutConfig, gpus: int | Sequence[str], cpu_ranks: int | None = None
) -> list[Placement]:
    """Every node's placement, node 0 first (each node with the same `gpus`)."""
    return [plan(cfg, gpus, cpu_ranks, node) for node in range(cfg.nodes)]


def trainer_ranks(cfg: RolloutConfig, gpus: int | Sequence[str], cpu_ranks: int | None = None) -> int:
    """The trainer ranks of the whole run, over all its nodes (ZeRO shards over them, DDP averages them): the
    last node's `ranks_through`."""
    return plan(cfg, gpus, cpu_ranks, cfg.nodes - 1).ranks_through


def _plan(cfg: RolloutConfig, gpus: int | Sequence[str], cpu_ranks: int | None = None) -> Placement:
    gpus = [str(i) for i in range(gpus)] if isinstance(gpus, int) else [str(g).strip() for g in gpus]
    mode = (
        "server"
        if cfg.server_url
        else "colocated"
        if cfg.colocate
        else "workers"
        if cfg.async_
        else "in-process"
    )
    if not gpus:
        ranks = cpu_ranks or max(1, len(cfg.train_devices))
        _check_engine(cfg, mode, ranks)
        return _cpu_plan(cfg, mode, ranks)
    n, tp = len(gpus), cfg.tensor_parallel_size
    _check_ids(cfg, n)
    rollout = list(cfg.rollout_devices)
    train = list(cfg.train_devices) or [d for d in range(n) if cfg.colocate or d not in rollout]
    _check_engine(cfg, mode, len(train))
    if not train:
        raise PlacementError(
            f"rollout.rollout_devices takes all {n} GPUs: none is left for training "
            "(set rollout.train_devices, or rollout.colocate: true to share them)"
        )
    own_engines = mode == "colocated" or (
        mode == "in-process" and not rollout and cfg.engine != "transformers"
    )
    if own_engines:  # each trainer rank's engine on the ranks' own GPUs, tp consecutive ranks per engine
        if len(train) % tp:
            raise PlacementError(
                f"rollout.tensor_parallel_size {tp} does not divide the {len(train)} trainer "
                "ranks' GPUs that the engines share"
            )
        engines = [train[i : i + tp] for i in range(0, len(train), tp)]
        if tp > 1 and len(train) > 1:
            raise PlacementError(
                f"rollout.tensor_parallel_size {tp} with in-process engines on {len(train)} trainer "
                "ranks is not supported: the ranks of one engine would have to generate the same "
                "prompts together, while each rank generates its own share. Use tensor_parallel_size 1, "
                "or rollout workers (rollout.async with rollout_devices)"
            )
        if mode == "colocated" and cfg.num_engines != len(engines):
            raise PlacementError(
                f"rollout.num_engines is {cfg.num_engines}, but colocated on {len(train)} trainer "
                f"GPUs with tensor_parallel_size {tp} there are {len(engines)} engines"
            )
    else:
        engines = [rollout[i : i + tp] for i in range(0, len(rollout), tp)] if mode != "server" else []
    _check_mode(cfg, mode, train, rollout)
    separate = mode == "in-process" and bool(rollout)  # a lone trainer's engine on GPUs of its own
    order = (engines[0] + train) if separate else train + [d for d in rollout if d not in train]
    trainer_mask = _mask(gpus, order)
    executor = "external_launcher" if own_engines and len(train) > 1 and cfg.engine == "vllm" else None
    processes = []
    for rank, d in enumerate(train):
        device = f"cuda:{order.index(d)}"
        engine = (
            None
            if _engine_here(cfg, mode) is None
            else f"cuda:{order.index(engines[0][0])}"
            if separate
            else device
        )
        processes.append(Process(f"trainer rank {rank}", "trainer", [d], trainer_mask, device, engine))
    if mode == "workers":
        processes += [
            Process(f"rollout worker {k}", "rollout", e, _mask(gpus, e), "cuda:0")
            for k, e in enumerate(engines, start=1)
        ]
    return Placement(
        gpus, mode, cfg.colocate, train, engines if mode != "server" else [], processes, executor
    )


def _check_mode(cfg: RolloutConfig, mode: str, train: list[int], rollout: list[int]) -> None:
    if mode == "workers" and not rollout:
        raise PlacementError(
            "rollout.async on GPUs needs rollout.rollout_devices: the rollout workers' GPUs "
            "(num_engines x tensor_parallel_size of them)"
        )
    if mode == "in-process" and rollout:
        if cfg.engine == "transformers":
            raise PlacementError(
                "rollout.rollout_devices with the synchronous transformers engine: it generates "
                "with the trainer's own module, on the trainer's GPU; leave rollout_devices empty "
                "or set rollout.async: true (rollout workers on those GPUs)"
            )
        if len(train) > 1 or cfg.num_engines > 1:
            raise PlacementError(
                f"rollout.rollout_devices with {len(train)} trainer ranks and {cfg.num_engines} "
                "engines, synchronous: an in-process engine on GPUs of its own is supported for one "
                "trainer rank and one engine. Set rollout.async: true (rollout workers on those GPUs), "
                "rollout.colocate: true, or rollout.server_url"
            )


def _check_engine(cfg: RolloutConfig, mode: str, ranks: int) -> None:
    """LMDeploy's engine is a Ray worker that LMDeploy places itself (no device is passed to it) on a GPU its
    process sees. A rollout worker sees only its engine's GPUs and a lone trainer its own, but trainer ranks
    share one CUDA_VISIBLE_DEVICES: each rank's engine could land on any rank's GPU. Colocated, the worker is
    a second process on the trainer's GPU, asleep between rollouts, which nothing here handles. Both are
    refused until they are handled (trainer/rollout/lmdeploy_engine.py)."""
    if cfg.engine != "lmdeploy":
        return
    in_ranks = mode == "colocated" or (mode == "in-process" and not cfg.rollout_devices)
    reasons = []
    if in_ranks and ranks > 1:
        reasons.append(
            f"its {ranks} trainer ranks would each start an engine that LMDeploy's Ray places on any GPU the "
            "ranks see (no device is passed to it), not on the rank's own"
        )
    if mode == "colocated":
        reasons.append(
            "a colocated LMDeploy engine (a Ray worker process sharing the trainer's GPU, asleep between "
            "rollouts) is not handled"
        )
    if reasons:
        where = "rollout.colocate: true" if mode == "colocated" else "an in-process engine per trainer rank"
        raise PlacementError(
            f"rollout.engine: lmdeploy with {where} is not supported yet: {'; '.join(reasons)}. Use "
            "rollout.async: true with rollout.rollout_devices (each rollout worker sees only its engine's "
            "GPUs), one trainer rank (one rollout.train_devices id) without rollout.colocate, or "
            "rollout.engine: vllm"
        )


def _engine_here(cfg: RolloutConfig, mode: str) -> str | None:
    """The engine a trainer rank holds in its own process: the recipe's (synchronous or colocated), the
    transformers engine over the trainer's module (asynchronous: held-out evaluation only; the recipe's engine
    runs in the rollout workers), or none (server: rank 0 talks to the server)."""
    if mode == "server" and cfg.engine != "transformers":
        return None
    return "transformers" if mode == "workers" else cfg.engine


def _cpu_plan(cfg: RolloutConfig, mode: str, ranks: int) -> Placement:
    engine = None if _engine_here(cfg, mode) is None else "cpu"
    processes = [Process(f"trainer rank {r}", "trainer", [], None, "cpu", engine) for r in range(ranks)]
    if mode == "workers":
        processes += [
            Process(f"rollout worker {k}", "rollout", [], None, "cpu") for k in range(1, cfg.num_engines + 1)
        ]
    executor = (
        "external_launcher"
        if ranks > 1 and cfg.engine == "vllm" and mode in ("colocated", "in-process")
        else None
    )
    return Placement([], mode, cfg.colocate, [], [], processes, executor)


# ---- the environment of a process --------------------------------------------------------------------------


def visible_gpus(environ: Mapping[str, str] | None = None, count: int | None = None) -> list[str]:
    """This process's GPUs in ordinal order: its CUDA_VISIBLE_DEVICES, or all `count` GPUs (default: as many
    as torch counts, through NVML, which does not initialise CUDA)."""
    environ = os.environ if environ is None else environ
    if count is None:
        import torch

        count = torch.cuda.device_count()
    if not count:
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()][:count]
    return [str(i) for i in range(count)]


def node_gpus(environ: Mapping[str, str] | None = None, count: int | None = None) -> list[str]:
    """The GPUs recipe ids index: what the launcher recorded in GRPOFLOW_GPUS, else this process's own."""
    environ = os.environ if environ is None else environ
    visible = visible_gpus(environ, count)
    if visible and environ.get(GPUS_ENV):
        return [g.strip() for g in environ[GPUS_ENV].split(",") if g.strip()]
    return visible


def trainer_env(placement: Placement, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment trainer ranks are started with: `environ` plus their CUDA_VISIBLE_DEVICES and the
    node's GPU list (unchanged on CPU)."""
    env = dict(environ)
    if placement.gpus:
        env["CUDA_VISIBLE_DEVICES"] = placement.trainers[0].cuda_visible_devices
        env[GPUS_ENV] = ",".join(placement.gpus)
    return env


def this_trainer(
    cfg: RolloutConfig, environ: Mapping[str, str] | None = None, count: int | None = None
) -> tuple[Placement, Process]:
    """The plan, and the trainer rank this process is (LOCAL_RANK), checked against its CUDA_VISIBLE_DEVICES:
    each device must be visible, and vLLM's engines must find theirs where they look. `count`: the GPUs torch
    sees (default: asks torch)."""
    environ = os.environ if environ is None else environ
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    node = int(environ.get("GROUP_RANK", "0")) if cfg.nodes > 1 else 0  # torchrun's node rank
    ranks = int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "0")))
    placement = plan(cfg, node_gpus(environ, count), cpu_ranks=ranks or None, node=node)
    if not placement.gpus:  # on CPU the launcher decides the number of ranks
        return placement, placement.trainers[min(local_rank, len(placement.trainers) - 1)]
    if local_rank >= len(placement.trainers):
        raise PlacementError(
            f"this is trainer rank {local_rank} on its node, but the recipe places "
            f"{len(placement.trainers)} (rollout.train_devices)"
        )
    me = placement.trainers[local_rank]
    visible, wanted = visible_gpus(environ, count), me.cuda_visible_devices
    if visible == wanted.split(","):
        return placement, me
    # started some other way (a Prefect task, one's own torchrun): address the devices where they are
    where = (
        f"this process has CUDA_VISIBLE_DEVICES={','.join(visible)}; "
        f"start it with CUDA_VISIBLE_DEVICES={wanted}, "
        "as `grpoflow train` does"
    )
    mine = placement.gpus[me.devices[0]]
    if mine not in visible:
        raise PlacementError(f"{me.name} trains on GPU {me.devices[0]}, which it does not see: {where}")
    device = f"cuda:{visible.index(mine)}"
    if placement.executor and visible.index(mine) != local_rank:
        raise PlacementError(
            f"{me.name}'s vLLM engine (external launcher) runs on ordinal LOCAL_RANK = {local_rank}, "
            f"not on its training GPU: {where}"
        )
    if me.engine_device not in (None, me.device):  # vLLM's single-process engine computes on ordinal 0..tp-1
        engine = [placement.gpus[d] for d in placement.rollout_devices[0]]
        if visible[: len(engine)] != engine:
            raise PlacementError(
                f"{me.name}'s in-process engine runs on GPUs {placement.rollout_devices[0]}, which "
                f"vLLM looks for at the first ordinals: {where}"
            )
        return placement, Process(me.name, me.role, me.devices, ",".join(visible), device, "cuda:0")
    return placement, Process(
        me.name, me.role, me.devices, ",".join(visible), device, None if me.engine_device is None else device
    )


def trainer_device(
    cfg: RolloutConfig, environ: Mapping[str, str] | None = None, count: int | None = None
) -> str:
    """The torch device this trainer rank trains on ("cpu" without GPUs)."""
    return this_trainer(cfg, environ, count)[1].device


def planned_node(cfg: RolloutConfig, gpus: int | None = None) -> tuple[list[str], str]:
    """The node a dry run plans for (its GPUs, and where that count came from): `gpus` GPUs, else the GPUs
    this machine sees, else the fewest the recipe's device ids need."""
    if gpus is not None:
        return [str(i) for i in range(gpus)], "--gpus"
    if node_gpus():
        return node_gpus(), "this machine"
    node = [str(i) for i in range(max([*cfg.train_devices, *cfg.rollout_devices], default=-1) + 1)]
    return node, "the recipe's device ids" if node else "no GPU (CPU)"


def dry_run(cfg: RolloutConfig, gpus: int | None = None) -> tuple[dict, str]:
    """The plan as `grpoflow train --dry-run` shows it (JSON summary, text) for a node of `gpus` GPUs, else
    the GPUs this machine sees, else the fewest the recipe's device ids need. Touches no GPU."""
    node, source = planned_node(cfg, gpus)
    placements = nodes_plan(cfg, node)
    placement = placements[0]
    lines = [f"{len(node)} GPUs ({source}), rollout {placement.mode} ({cfg.engine})"]
    if cfg.nodes > 1:
        lines[0] = f"{cfg.nodes} nodes of " + lines[0]
    for each in placements:
        if cfg.nodes > 1:
            lines.append(f"  node {each.node}: {_node_command(each)}")
        lines += [
            f"  {p.name:<18} devices {p.devices} -> {p.device:<7} "
            f"CUDA_VISIBLE_DEVICES={p.cuda_visible_devices}"
            + (
                f", {_engine_here(cfg, placement.mode)} engine on {p.engine_device}"
                if p.engine_device
                else ""
            )
            for p in each.processes
        ]
    summary = {"engine": cfg.engine, "gpus_from": source, **placement.to_dict()}
    summary["trainer_ranks"] = placements[-1].ranks_through
    summary["nodes"] = [{**p.to_dict(), "command": _node_command(p)} for p in placements]
    return summary, "\n".join(lines)


def _node_command(placement: Placement) -> str:
    """What starts this node's processes (`grpoflow train` wraps torchrun for it)."""
    return (
        f"grpoflow train --config RECIPE --node-rank {placement.node} --rendezvous NODE0_HOST:PORT "
        f"(torchrun --node_rank {placement.node} --nproc_per_node {len(placement.trainers)})"
    )


__all__ = [
    "GPUS_ENV",
    "Placement",
    "PlacementError",
    "Process",
    "dry_run",
    "node_gpus",
    "plan",
    "planned_node",
    "nodes_plan",
    "this_trainer",
    "trainer_device",
    "trainer_ranks",
    "trainer_env",
    "visible_gpus",
]
