"""DeepSpeed ZeRO for the trainer ranks: the config, the engine around our optimizer and schedule, checkpoint
shards, and whole parameters out of ZeRO-3 shards. The one home of DeepSpeed's specifics: the ZeRO training
strategy (`trainer.strategy.zero`) drives the engine with them, and the rollout's weight sync gathers ZeRO-3
shards with `gathered` / `whole_parameters` (no-ops for a module ZeRO-3 does not shard).

`train.deepspeed` names a preset (`zero1`, `zero2`, `zero3`) or a user's ds_config.json. Either way the recipe
stays the one source of truth for what it owns: micro-batch size, gradient clipping and bf16 are written over
whatever the JSON says (a differing value is logged), and gradient accumulation is the trainer's own (it marks
the boundary of each optimizer update itself, so `gradient_accumulation_steps` is 1).

With `model.dtype: bfloat16` DeepSpeed computes in bf16 and its ZeRO optimizer keeps fp32 master weights and
Adam states (at lr 7e-5 most bf16-only updates would round away). The optimizer is torch's AdamW handed to
DeepSpeed (`zero_allow_untested_optimizer`), so nothing is compiled: DeepSpeed's fused Adam builds a CUDA
extension on first use. Stage 2 shards optimizer state and gradients; stage 3 also shards the parameters, so
whatever needs whole weights (a weight sync to an engine, a checkpoint, generation with the policy itself)
gathers them here, collectively: every trainer rank must take part.

DeepSpeed is the `deepspeed` extra, imported only when a recipe asks for it. On CPU it runs with its CPU
accelerator and gloo (`DS_ACCELERATOR=cpu`, set here when no GPU is visible).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from data.errors import MissingPathError
from trainer.extras import import_extra
from trainer.recipe import ZERO_PRESETS, Recipe
from trainer.typed_config import ConfigError

log = logging.getLogger("grpoflow.train")


def zero_config(
    stage: int = 2,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    max_grad_norm: float = 1.0,
    bf16: bool = True,
) -> dict:
    """A DeepSpeed config dict for ZeRO `stage` (1, 2 or 3): bf16 compute with fp32 master weights when
    `bf16`."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def recipe_config(spec: str, *, micro_batch_size: int, max_grad_norm: float, bf16: bool) -> dict:
    """The DeepSpeed config for `train.deepspeed` = `spec`, with the recipe's own values written over it."""
    if spec in ZERO_PRESETS:
        return zero_config(int(spec[-1]), micro_batch_size, 1, max_grad_norm, bf16)
    path = Path(spec)
    if not path.is_file():
        raise MissingPathError(
            f"train.deepspeed: {path} is not a file (expected zero1, zero2, zero3 or a DeepSpeed "
            "ds_config.json)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"train.deepspeed: {path} is not readable JSON: {e}") from e
    if not isinstance(config, dict) or not isinstance(config.get("zero_optimization", {}), dict):
        raise ConfigError(
            f"train.deepspeed: {path} must hold a JSON object with a 'zero_optimization' object"
        )
    ours = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
    }
    for key, value in ours.items():
        if config.get(key, "auto") not in ("auto", value):
            log.warning(
                "train.deepspeed: %s sets %s = %r; the recipe's %r is used", path, key, config[key], value
            )
    config.pop("train_batch_size", None)  # derived from the two above and the world size
    for key in ("optimizer", "scheduler"):
        if key in config:
            log.warning(
                "train.deepspeed: %s has an %r section; the recipe's AdamW and schedule are used", path, key
            )
            del config[key]
    config.update(ours)
    config["bf16"] = {**config.get("bf16", {}), "enabled": bf16}
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10**9)
    return config


def trainer_config(recipe: Recipe) -> dict:
    """The DeepSpeed config of a recipe with `train.deepspeed` set (its ZeRO stage checked against the
    rollout)."""
    cfg = recipe.train
    config = recipe_config(
        cfg.deepspeed,
        micro_batch_size=cfg.micro_batch_size,
        max_grad_norm=cfg.max_grad_norm,
        bf16=recipe.model.dtype == "bfloat16",
    )
    check_stage(int(config.get("zero_optimization", {}).get("stage", 0)), recipe)  # a JSON config's own stage
    return config


def check_stage(stage: int, recipe: Recipe) -> None:
    """ZeRO-3 gathers whole weights collectively (every trainer rank takes part). The async workers are synced
    by rank 0 with the other ranks gathering alongside (tested with 2 gloo ranks); a rollout server's sync has
    the same shape but has not run under ZeRO-3 anywhere yet (the vLLM venv has no DeepSpeed), so it is
    refused."""
    if stage == 3 and recipe.rollout.server_url:
        raise ConfigError(
            "train.deepspeed: ZeRO stage 3 with rollout.server_url is not supported yet: the server's "
            "weight sync under ZeRO-3 has never run. Use zero2 (weights whole on every rank), or "
            "rollout.async / synchronous in-process rollout with zero3."
        )


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict,
    lr_lambda: Callable[[int], float] | None = None,
    device: str = "cpu",
):
    """The DeepSpeed engine for `model` (its optimizer steps the LambdaLR `lr_lambda` at every update) on
    `device`, the trainer rank's own in the placement plan; a single process without torchrun gets a world of
    one."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_extra("deepspeed", "DeepSpeed ZeRO training")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from trainer.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    scheduler = None if lr_lambda is None else (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    engine, _, _, _ = deepspeed.initialize(
        args=device_args(device), model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    offload = getattr(
        engine.optimizer, "parameter_offload", None
    )  # ZeRO-3 only: the owner of the module hooks
    if offload is not None:
        _ZERO3_HOOKS[model] = offload
    return engine


def device_args(device: str) -> argparse.Namespace | None:
    """The `args` that make DeepSpeed's engine compute on `device`. DeepSpeed makes ordinal `args.device_rank`
    the current device and moves the module there, else ordinal LOCAL_RANK (`DeepSpeedEngine.
    _set_distributed_vars`, 0.19), and its ZeRO optimizer allocates on the current device. LOCAL_RANK is the
    trainer's ordinal in most plans, but a lone trainer whose in-process engine has GPUs of its own sees those
    first (`trainer.placement`): there LOCAL_RANK 0 is the engine's GPU."""
    where = torch.device(device)
    if where.type != "cuda" or where.index is None:
        return None
    return argparse.Namespace(device_rank=where.index)


# --------------------------------------------------------------------------------------- checkpoints
STATE_TAG = "state"


def save(engine, output_dir: Path, step: int, rank: int, write: Callable[[Path], Path]) -> Path | None:
    """Checkpoint `step` under ZeRO; every trainer rank calls this. Each rank writes its shard of the
    optimizer state (fp32 master weights, Adam moments) and the schedule into a staging directory with
    DeepSpeed's own `save_checkpoint` (one node, or a shared `output_dir`); then rank 0 calls
    `write(staging)`, which writes the model (whole: ZeRO-3 gathers it) and moves the staging directory into
    the checkpoint before its manifest is hashed. Returns the checkpoint on rank 0, None elsewhere."""
    import torch.distributed as dist

    staging = Path(output_dir) / f".zero-state-{step}"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a killed run's leftovers
        staging.parent.mkdir(parents=True, exist_ok=True)
    _barrier(dist)
    engine.save_checkpoint(str(staging), tag=STATE_TAG)
    _barrier(dist)
    with whole_parameters(engine.module):
        path = write(staging) if rank == 0 else None
    _barrier(dist)  # no rank moves on (and may be killed) before the checkpoint is complete
    return path


def load_state(engine, checkpoint: Path) -> None:
    """Every rank reads its shard of the optimizer state and the schedule from a checkpoint `save` wrote."""
    from trainer.checkpoint import ZERO_DIR

    state = Path(checkpoint) / ZERO_DIR
    if not (state / STATE_TAG).is_dir():
        raise MissingPathError(
            f"{checkpoint} has no DeepSpeed state ({state / STATE_TAG} is missing): it was not "
            "written by a run with train.deepspeed, or was cut short"
        )
    loaded, _ = engine.load_checkpoint(
        str(state),
        tag=STATE_TAG,
        load_module_strict=False,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if loaded is None:
        raise MissingPathError(f"DeepSpeed could not load its state from {state}")


def _barrier(dist) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------- whole parameters out of ZeRO-3
def is_sharded(model: torch.nn.Module) -> bool:
    """True when ZeRO-3 holds `model`'s parameters as shards (each rank keeps a slice of every tensor)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


_ZERO3_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its DeepSpeedZeRoOffload


@contextmanager
def whole_parameters(model: torch.nn.Module):
    """Every parameter of `model` whole on this rank for the block, and a plain module meanwhile; a no-op
    unless ZeRO-3 shards it, or inside another such block. Collective on entry: all trainer ranks enter
    together.

    ZeRO-3 hooks every submodule to fetch its shards before its forward and release them after, collectively.
    Inside the block the weights are whole already, and the forward may be one rank's alone (held-out on rank
    0, each rank's own generation, whose number of forwards differs between ranks): the hooks are taken off
    for the block and put back after (DeepSpeed re-traces its prefetching on the next forward)."""
    params = list(model.parameters())
    if not is_sharded(model) or all(p.ds_status.name == "AVAILABLE" for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        offload = _ZERO3_HOOKS.get(model)
        if offload is None:
            yield
            return
        for p in params:
            p.ds_active_sub_modules.clear()
        # the root module's start-of-forward hook (collective once its trace is recorded) and every
        # submodule's fetch/release hooks; the first is put back as it was, the others re-registered as
        # DeepSpeed does
        start = offload.module._forward_pre_hooks.get(offload.fwd_pre_hook.id)
        for hook in [offload.fwd_pre_hook, *offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            if start is not None:
                offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start)
            offload._register_deepspeed_module(offload.module)


def gathered(
    named: Iterable[tuple[str, torch.Tensor]], budget_mb: int = 512
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for each pair, in order. ZeRO-3 shards are gathered a group at a time (at most
    `budget_mb` of whole parameters at once, and at least one) and copied out, so a weight sync of a model
    larger than one device holds one group, not the model. Collective under ZeRO-3: every trainer rank
    iterates to the end, even those that drop what they get. Tied weights (one parameter under two names)
    are gathered once."""
    budget = budget_mb << 20
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        if not hasattr(t, "ds_id"):
            if group:  # keep the order: flush the sharded ones first
                yield from _gather_group(group)
                group, size = [], 0
            yield name, t.detach()
            continue
        nbytes = t.ds_numel * t.element_size()
        if group and size + nbytes > budget:
            yield from _gather_group(group)
            group, size = [], 0
        group.append((name, t))
        size += nbytes
    if group:
        yield from _gather_group(group)


def _gather_group(group: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    import deepspeed

    unique = list({id(p): p for _, p in group}.values())
    with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
        copies = [(name, p.detach().clone()) for name, p in group]
    yield from copies


__all__ = [
    "check_stage",
    "device_args",
    "gathered",
    "initialize",
    "is_sharded",
    "load_state",
    "recipe_config",
    "save",
    "trainer_config",
    "whole_parameters",
    "zero_config",
]
