"""Which training rows each step takes: the seeded data order, and a curriculum by the rollout's own accuracy.

The data order is consecutive slices of per-epoch seeded permutations (`prompt_indices`): the rows of any step
follow from (seed, step) alone. With `train.skip_solved_prompts` k > 0, a row whose completions all earned
at least `train.solved_reward` the last time it was trained on passes over its next k turns in that order,
so a step's prompts come more often from the problems the policy does not yet solve: a group whose rewards
all match has advantage 0 and teaches nothing, and late in a run most groups of solved problems are such
groups. A skipped turn is not lost: the order moves on to the next row, so every step still has
`prompts_per_step` prompts, and a row comes back after its k turns (a problem it has forgotten is met again).

Determinism: the prompts of step t are chosen from what steps up to t - 2 taught, whether rollout is
synchronous or asynchronous (an asynchronous run chooses step t's prompts while step t - 1 is still being
generated, before its rewards exist). The state is the record of solved rows per step (`state()`), saved
with each checkpoint; a resumed run replays the choice from it and takes the same prompts as a run that was
never interrupted.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence

# the steps between a batch and the first step whose choice of prompts it informs (see the docstring)
LAG = 2


def prompt_indices(step: int, n_rows: int, per_step: int, seed: int) -> list[int]:
    """The rows of `step` (0-based): consecutive slices of per-epoch seeded permutations."""
    return [order_position(k, n_rows, seed) for k in range(step * per_step, (step + 1) * per_step)]


def order_position(k: int, n_rows: int, seed: int) -> int:
    """The row at position `k` of the endless data order (epoch after epoch)."""
    epoch, pos = divmod(k, n_rows)
    return _epoch_order(n_rows, seed, epoch)[pos]


@functools.lru_cache(maxsize=4)
def _epoch_order(n_rows: int, seed: int, epoch: int) -> tuple[int, ...]:
    """One epoch's seeded permutation, shuffled once rather than once per prompt per step."""
    perm = list(range(n_rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return tuple(perm)


class PromptOrder:
    """The training rows of each step, in step order.

    `indices(step)` gives the rows of `step`; `observe(step, rewards)` tells it the total reward of each of
    that step's completions (grouped per row, in the order `indices` gave them; NaN where a reward is
    missing). Without a curriculum (`skip_turns` 0) the rows are `prompt_indices` and nothing is recorded."""

    def __init__(
        self,
        n_rows: int,
        per_step: int,
        seed: int,
        skip_turns: int = 0,
        solved_reward: float | None = None,
        state: dict | None = None,
    ):
        if n_rows < 1:
            raise ValueError("the training data has no rows")
        if skip_turns and solved_reward is None:
            raise ValueError(
                "skip_solved_prompts needs solved_reward: the total reward that counts as solved"
            )
        self.n_rows, self.per_step, self.seed = n_rows, per_step, seed
        self.skip_turns, self.solved_reward = skip_turns, solved_reward
        # step -> rows whose completions all reached solved_reward on that step
        self.solved: dict[int, list[int]] = {int(k): list(v) for k, v in (state or {}).items()}
        self._chosen: dict[int, list[int]] = {}
        self._skipped: dict[int, int] = {}
        self._next_step, self._position = 0, 0
        self._turns_left: dict[int, int] = {}

    def indices(self, step: int) -> list[int]:
        if not self.skip_turns:
            return prompt_indices(step, self.n_rows, self.per_step, self.seed)
        while self._next_step <= step:
            self._choose(self._next_step)
        return self._chosen[step]

    def skipped(self, step: int) -> int:
        """How many solved rows the order passed over to fill `step`."""
        self.indices(step)
        return self._skipped.get(step, 0)

    def observe(self, step: int, rewards: Sequence[float]) -> None:
        """Record which rows of `step` were solved: every one of their completions' total rewards (NaN for
        a missing one) reached `solved_reward`."""
        if not self.skip_turns:
            return
        rewards = [float(r) for r in rewards]
        rows = self.indices(step)
        if len(rewards) % len(rows):
            raise ValueError(f"step {step}: {len(rewards)} rewards for {len(rows)} prompts")
        size = len(rewards) // len(rows)
        # a float tolerance: a sum of weighted rewards may land a rounding below the weights' sum
        floor = self.solved_reward - 1e-6 * max(1.0, abs(self.solved_reward))
        self.solved[step] = [
            row
            for i, row in enumerate(rows)
            if all(not math.isnan(r) and r >= floor for r in rewards[i * size : (i + 1) * size])
        ]
        for old in [k for k in self._chosen if k < step]:  # no step before this one is asked for again
            del self._chosen[old], self._skipped[old]

    def state(self) -> dict:
        """What a checkpoint keeps to choose the same prompts after resuming (the solved rows per step)."""
        return {str(k): v for k, v in sorted(self.solved.items())}

    def _choose(self, step: int) -> None:
        learned = step - LAG
        if learned >= 0:
            if learned not in self.solved:
                raise RuntimeError(
                    f"the prompts of step {step} need the rewards of step {learned}, which were not observed"
                )
            for row in self.solved[learned]:
                self._turns_left[row] = self.skip_turns
        chosen, skipped = [], 0
        while len(chosen) < self.per_step:
            row = order_position(self._position, self.n_rows, self.seed)
            self._position += 1
            if self._turns_left.get(row, 0) > 0:
                self._turns_left[row] -= 1
                skipped += 1
                continue
            chosen.append(row)
        self._chosen[step], self._skipped[step] = chosen, skipped
        self._next_step = step + 1


__all__ = ["PromptOrder", "order_position", "prompt_indices"]
