"""DDP for the trainer ranks under torchrun: each rank trains on its share of the batch and torch's
DistributedDataParallel averages the gradients during backward; optimizer, precision and checkpoints are the
single process's (every rank steps the same update, rank 0 saves it)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.strategy.base import MakeOptimizer
from trainer.strategy.single import SingleProcessStrategy


class DDPStrategy(SingleProcessStrategy):
    """`world` ranks, each backward through the DDP wrapper. DDP reduces gradients once per backward, which
    must follow exactly one forward of the wrapper: the policy forward runs whole sequences (no shared-prompt
    prefill, whose second forward would break that)."""

    share_prompts = False

    def wrap(
        self, model: torch.nn.Module, make_optimizer: MakeOptimizer, lr_lambda: Callable[[int], float]
    ) -> None:
        from torch.nn.parallel import DistributedDataParallel

        policy = DistributedDataParallel(model)  # rank 0's weights on every rank before any copy is taken
        super().wrap(model, make_optimizer, lr_lambda)
        self.policy = policy

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        # DDP averages the ranks' gradients; each rank's loss is its share of the batch's sum, hence * world
        (loss * self.world).backward()


__all__ = ["DDPStrategy"]
