"""The contract every training strategy keeps: how the policy is wrapped, run, differentiated, stepped, saved
and handed out whole, for one distributed mode.

The trainer (`trainer.grpo`) holds one strategy and calls only these methods, so its loop reads the same for a
single process, DDP and DeepSpeed ZeRO; a new mode (FSDP2, say) is one new subclass in its own file.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from trainer.logprobs import completion_logps
from trainer.recipe import Recipe
from trainer.rollout.batch import MicroBatch

MakeOptimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
# a non-finite check of named values; raises NonFiniteError (every rank together) when one is not finite
Check = Callable[[dict[str, torch.Tensor]], None]
# writes a checkpoint of a training state (and a directory of more state: ZeRO's shards); returns its path
Write = Callable[[dict, Path | None], Path]


class TrainingStrategy(ABC):
    """One distributed mode of the trainer ranks. Rank facts (rank, world, the torch `device` the placement
    plan gives this rank) are known from construction; `wrap` then takes the plain policy module, already on
    `device`, and builds its optimizer and schedule.

    Attributes after `wrap`: `model` (the plain module: engines, checkpoints, weight syncs read it), `policy`
    (what the loss's forward runs through: the module itself or its wrapper), `optimizer`, `scheduler`."""

    share_prompts = False  # whether the policy forward may run each distinct prompt once (trainer.logprobs)

    def __init__(self, recipe: Recipe, rank: int = 0, world: int = 1, device: str = "cpu"):
        self.recipe, self.rank, self.world, self.device = recipe, rank, world, device
        self.model: torch.nn.Module | None = None
        self.policy: torch.nn.Module | None = None

    # ------------------------------------------------------------------------------------------ setup
    @abstractmethod
    def wrap(
        self, model: torch.nn.Module, make_optimizer: MakeOptimizer, lr_lambda: Callable[[int], float]
    ) -> None:
        """Take `model` for training: its wrapper, its optimizer (from `make_optimizer`) and the LambdaLR
        schedule `lr_lambda`, stepped once per update."""

    # ------------------------------------------------------------------------------------------- loop
    def shard(self, size: int) -> torch.Tensor:
        """The rows of a batch of `size` this rank trains on: every world-th one. The loss is normalised by
        the whole batch's totals, so the ranks' shares add up to the single-process loss."""
        return torch.arange(size)[self.rank :: self.world]

    def micro_batches(self, size: int, micro_batch_size: int) -> list[torch.Tensor]:
        """This rank's rows (`shard`) of a batch of `size`, cut into micro-batches of `micro_batch_size`, as
        many on every rank: each backward of DDP and ZeRO is collective, so a rank with fewer rows than
        another pads its list with empty ones (`RolloutBatch.micro_batch` makes them a stand-in with no
        loss)."""
        mine = list(self.shard(size).split(micro_batch_size))
        most = math.ceil(math.ceil(size / self.world) / micro_batch_size)  # rank 0's share is the largest
        return mine + [torch.zeros(0, dtype=torch.long)] * (most - len(mine))

    def logps(
        self, mb: MicroBatch, temperature: float, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion log-probs and logits of `mb` under the policy (or `model`, e.g. the frozen reference,
        run the same way)."""
        return completion_logps(
            self.policy if model is None else model, mb, temperature, share_prompts=self.share_prompts
        )

    @abstractmethod
    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradient of this rank's share `loss` of the pass's loss; `last`: the pass's last
        micro-batch, where the update's accumulation ends."""

    @abstractmethod
    def step(self, loss: torch.Tensor | None, check: Check) -> float:
        """One optimizer update and one schedule step, `check`ed for non-finite values before it is applied;
        returns the gradient norm before clipping (nan where the mode cannot tell)."""

    def learning_rate(self) -> float:
        """The learning rate the next update applies."""
        return self.scheduler.get_last_lr()[0]

    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps (AdamW's moments and step counts, over the parameters it
        steps: a LoRA policy's adapters alone): `memory/optimizer_bytes`."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # DeepSpeed's wraps torch's
        return sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the trainer ranks (the ranks' shares of the batch metrics add up)."""
        if self.world > 1:
            torch.distributed.all_reduce(values)
        return values

    def all_gather_objects(self, obj: object) -> list:
        """Every trainer rank's `obj`, in rank order (pickled: small results such as scores)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    # ------------------------------------------------------------------------------- weights and state
    def whole_weights(self) -> contextlib.AbstractContextManager:
        """A block in which every parameter of `model` is whole on this rank. Collective: all ranks enter."""
        return contextlib.nullcontext()

    @abstractmethod
    def save(self, output_dir: Path, state: dict, write: Write) -> Path | None:
        """Checkpoint the training state into `output_dir`; every rank calls it. `state` is the trainer's own
        (its `step`, ...); the strategy adds its optimizer and schedule, and rank 0 `write`s the checkpoint.
        Returns the checkpoint on rank 0, None elsewhere."""

    @abstractmethod
    def load(self, state: dict, checkpoint: Path) -> None:
        """Restore the optimizer and schedule that `save` wrote into `checkpoint` (whose trainer state is
        `state`)."""


__all__ = ["Check", "MakeOptimizer", "TrainingStrategy", "Write"]
