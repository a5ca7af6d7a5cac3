"""Shaping rewards that take parameters: `cosine`, `repetition` and `soft_overlong`.

Each is a factory: called with its parameters, it checks them and returns a TRL-signature reward function
whose `__name__` is the registry name. Lengths are in tokens, `len(completion_ids[i])`, when the trainer
passes `completion_ids`, and in characters of the completion text otherwise; set `max_len`/`cache_len` in the
same unit.

- `cosine` (open-r1's `get_cosine_scaled_reward`): correct answers earn more when short, wrong answers are
  penalised less when long. progress = min(length / max_len, 1) (clipped so that an over-long completion stays
  at the end of the curve instead of climbing back up the cosine), then
  reward = lo + (hi - lo) * (1 + cos(pi * progress)) / 2 with
  (lo, hi) = (min_value_correct, max_value_correct) if correct, else (max_value_wrong, min_value_wrong).
  Correctness is `accuracy`'s check; None where the gold answer is unreadable.
- `repetition` (open-r1's `get_repetition_penalty_reward`): max_penalty * (1 - unique / total) over the word
  n-grams of `text.lower().split()`; 0.0 with fewer than `ngram_size` words.
- `soft_overlong` (DAPO's soft overlong punishment): 0 up to max_len - cache_len, then a linear ramp
  down to -1 at max_len, and -1 beyond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainer.rewards.math_rewards import grade_math_answer
from trainer.rewards.parsing import completion_texts
from trainer.rewards.runner import RewardFn, bounds_own_work


def completion_lengths(completions: Sequence, completion_ids: Sequence | None = None) -> list[int]:
    """Token counts from `completion_ids` when given, else character counts of the completion texts."""
    if completion_ids is not None:
        if len(completion_ids) != len(completions):
            raise ValueError(
                f"completion_ids has {len(completion_ids)} rows for {len(completions)} completions"
            )
        return [len(ids) for ids in completion_ids]
    return [len(text) for text in completion_texts(completions)]


def cosine(
    max_len: int = 1000,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> RewardFn:
    """Length-scaled correctness reward; see the module docstring for the curve."""
    _require(max_len > 0, "cosine", f"max_len must be positive, got {max_len}")

    def cosine_reward(prompts, completions, answer, completion_ids=None, **_columns) -> list[float | None]:
        texts = completion_texts(completions)
        lengths = completion_lengths(completions, completion_ids)
        rewards: list[float | None] = []
        for text, gold, length in zip(texts, answer, lengths, strict=True):
            correct = grade_math_answer(text, gold)
            if correct is None:
                rewards.append(None)
                continue
            lo, hi = (min_value_correct, max_value_correct) if correct else (max_value_wrong, min_value_wrong)
            progress = min(length / max_len, 1.0)
            rewards.append(lo + 0.5 * (hi - lo) * (1.0 + math.cos(progress * math.pi)))
        return rewards

    return _named(cosine_reward, "cosine")


def repetition(ngram_size: int = 3, max_penalty: float = -1.0) -> RewardFn:
    """Penalty proportional to the share of repeated word n-grams."""
    _require(ngram_size >= 1, "repetition", f"ngram_size must be at least 1, got {ngram_size}")
    _require(max_penalty <= 0, "repetition", f"max_penalty must be <= 0 (it is a penalty), got {max_penalty}")

    def repetition_reward(prompts, completions, **_columns) -> list[float]:
        rewards = []
        for text in completion_texts(completions):
            words = text.lower().split()
            if len(words) < ngram_size:
                rewards.append(0.0)
                continue
            ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
            scaling = 1.0 - len(set(ngrams)) / len(ngrams)
            rewards.append(scaling * max_penalty)
        return rewards

    return _named(repetition_reward, "repetition")


def soft_overlong(max_len: int, cache_len: int) -> RewardFn:
    """DAPO's soft overlong punishment with L_max = max_len and L_cache = cache_len."""
    _require(
        0 < cache_len <= max_len,
        "soft_overlong",
        f"need 0 < cache_len <= max_len, got {cache_len}, {max_len}",
    )

    def soft_overlong_reward(prompts, completions, completion_ids=None, **_columns) -> list[float]:
        rewards = []
        for length in completion_lengths(completions, completion_ids):
            if length <= max_len - cache_len:
                rewards.append(0.0)
            elif length <= max_len:
                rewards.append((max_len - cache_len - length) / cache_len)
            else:
                rewards.append(-1.0)
        return rewards

    return _named(soft_overlong_reward, "soft_overlong")


def _require(ok: bool, reward: str, message: str) -> None:
    if not ok:
        raise ValueError(f"reward {reward!r}: {message}")


def _named(fn: RewardFn, name: str) -> RewardFn:
    # TRL labels reward metrics by `__name__` (rewards/<name>/mean): use the registry name, not the closure's.
    fn.__name__ = fn.__qualname__ = name
    return bounds_own_work(fn)
