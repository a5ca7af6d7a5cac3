"""One trainer process: the policy module trained as it is, with torch's AdamW (on fp32 master weights when
the module computes in bf16, see `trainer.strategy.precision`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from trainer.strategy.base import Check, MakeOptimizer, TrainingStrategy, Write
from trainer.strategy.precision import MasterWeights


class SingleProcessStrategy(TrainingStrategy):
    """The whole batch on one process; gradients accumulate over the micro-batches of a pass, then one clipped
    update. The policy forward shares each prompt's prefill among its completions (one forward feeds one
    backward here, so nothing needs the plain way)."""

    share_prompts = True

    def wrap(
        self, model: torch.nn.Module, make_optimizer: MakeOptimizer, lr_lambda: Callable[[int], float]
    ) -> None:
        self.model = self.policy = model
        self.weights = MasterWeights(model)
        self.optimizer = make_optimizer(self.weights.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def step(self, loss: torch.Tensor | None, check: Check) -> float:
        max_norm = self.recipe.train.max_grad_norm if self.recipe.train.max_grad_norm > 0 else float("inf")
        self.weights.gradients_to_masters()
        norm = torch.nn.utils.clip_grad_norm_(self.weights.params, max_norm)
        check(
            {"gradient norm": norm} if loss is None else {"loss": loss.to(norm.device), "gradient norm": norm}
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights.masters_to_module()
        return float(norm)

    def optimizer_bytes(self) -> int:
        """The moments and step counts, and the fp32 master copies of a policy computing in bf16."""
        masters = self.weights.masters or []
        return super().optimizer_bytes() + sum(m.numel() * m.element_size() for m in masters)

    def save(self, output_dir: Path, state: dict, write: Write) -> Path | None:
        if self.rank != 0:  # every rank holds the same optimizer state: rank 0 writes it
            return None
        return write(
            {
                **state,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                **self.weights.state_dict(),
            },
            None,
        )

    def load(self, state: dict, checkpoint: Path) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weights.load_state_dict(state)


__all__ = ["SingleProcessStrategy"]
