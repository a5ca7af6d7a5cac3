"""How the trainer ranks train the policy: one `TrainingStrategy` per distributed mode, chosen once per run.

- `single`: one process (no torchrun, or a world of one);
- `ddp`: torchrun ranks with torch's DistributedDataParallel;
- `zero`: DeepSpeed ZeRO 1/2/3 (`train.deepspeed`), one process or torchrun ranks.

The interface (`base.TrainingStrategy`) covers wrapping the model and optimizer, the log-prob forward,
backward, the update at its accumulation boundary, the checkpointed training state, whole weights and the rank
facts; `precision` holds the fp32 master weights of the strategies that step torch's optimizer themselves.
"""

from __future__ import annotations

from trainer.launch import init_distributed
from trainer.placement import trainer_device
from trainer.recipe import Recipe
from trainer.strategy.base import TrainingStrategy
from trainer.strategy.ddp import DDPStrategy
from trainer.strategy.single import SingleProcessStrategy
from trainer.strategy.zero import ZeroStrategy


def strategy_class(recipe: Recipe, world: int) -> type[TrainingStrategy]:
    """The strategy of a recipe run by `world` trainer ranks."""
    if recipe.train.deepspeed:
        return ZeroStrategy
    return DDPStrategy if world > 1 else SingleProcessStrategy


def make_strategy(recipe: Recipe) -> TrainingStrategy:
    """This process's strategy on its device in the placement plan ("cpu" without GPUs); joins the trainer
    ranks' process group first when launched as one of them."""
    rank, world = init_distributed(recipe.rollout.sync_timeout_s, recipe.rollout)
    return strategy_class(recipe, world)(recipe, rank, world, device=trainer_device(recipe.rollout))


def check_recipe(recipe: Recipe) -> None:
    """Refuse, before any work, a recipe the strategy it will get cannot train (e.g. ZeRO-3 with a rollout
    server)."""
    if recipe.train.deepspeed:
        ZeroStrategy.check(recipe)


__all__ = [
    "DDPStrategy",
    "SingleProcessStrategy",
    "TrainingStrategy",
    "ZeroStrategy",
    "check_recipe",
    "make_strategy",
    "strategy_class",
]
