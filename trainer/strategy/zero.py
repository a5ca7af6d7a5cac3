"""DeepSpeed ZeRO 1/2/3 for the trainer ranks (`train.deepspeed`): DeepSpeed's engine wraps the policy and our
AdamW and schedule, keeps fp32 master weights under bf16, reduces and clips the gradients and, from stage 3,
shards the parameters. The DeepSpeed specifics (config, engine, checkpoint shards, gathering whole weights)
live in `trainer.deepspeed_setup`, which the rollout's weight sync also uses to gather ZeRO-3 shards."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch

from trainer import deepspeed_setup as ds
from trainer.recipe import ZERO_PRESETS, Recipe
from trainer.strategy.base import Check, MakeOptimizer, TrainingStrategy, Write
from trainer.typed_config import ConfigError


class ZeroStrategy(TrainingStrategy):
    """The trainer accumulates its micro-batches itself and marks each update's boundary; DeepSpeed reduces
    and steps there. The policy forward runs whole sequences (DeepSpeed wraps `forward` only). Checkpoints:
    every rank writes its shard of the optimizer state; the model is saved whole (gathered under ZeRO-3)."""

    share_prompts = False

    @staticmethod
    def check(recipe: Recipe) -> None:
        """Refuse, before any work, a recipe ZeRO would get wrong."""
        if recipe.model.modality == "vision":  # the images would not reach the ZeRO ranks' forward
            raise ConfigError(
                "model.modality: vision trains with rollout.engine: transformers and without "
                "DeepSpeed for now; images do not reach ZeRO ranks yet"
            )
        if recipe.model.lora is not None:  # its adapters' checkpoints and merged syncs are untested there
            raise ConfigError(
                "model.lora trains in one process or on DDP ranks for now, not under train.deepspeed "
                f"({recipe.train.deepspeed}): unset one of them"
            )
        if recipe.train.deepspeed in ZERO_PRESETS:  # a JSON config's stage is checked at setup
            ds.check_stage(int(recipe.train.deepspeed[-1]), recipe)

    def wrap(
        self, model: torch.nn.Module, make_optimizer: MakeOptimizer, lr_lambda: Callable[[int], float]
    ) -> None:
        self.model = model
        # DeepSpeed's optimizer wraps ours (fp32 master weights) and steps our schedule, on this rank's device
        self.engine = ds.initialize(
            model, make_optimizer(model.parameters()), ds.trainer_config(self.recipe), lr_lambda, self.device
        )
        self.policy, self.optimizer = self.engine, self.engine.optimizer
        self.scheduler = self.engine.lr_scheduler

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        # DeepSpeed averages the ranks' gradients; each rank's loss is its share of the batch's sum: * world
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self, loss: torch.Tensor | None, check: Check) -> float:
        # DeepSpeed clips and steps (gradients are sharded under ZeRO-2/3: their norm is its to compute); a
        # non-finite gradient then shows in the weights, which the trainer's check after the update refuses
        if loss is not None:
            check({"loss": loss})
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def whole_weights(self) -> contextlib.AbstractContextManager:
        return ds.whole_parameters(self.model)

    def save(self, output_dir: Path, state: dict, write: Write) -> Path | None:
        return ds.save(self.engine, output_dir, state["step"], self.rank, lambda extra: write(state, extra))

    def load(self, state: dict, checkpoint: Path) -> None:
        ds.load_state(self.engine, checkpoint)  # every rank reads its own shard


__all__ = ["ZeroStrategy"]
