"""Reward functions for GRPO, in TRL's signature `f(prompts, completions, **columns) -> list[float | None]`.

Built-ins by name (`resolve_reward`): format, accuracy, countdown, counting, cosine, repetition,
soft_overlong.
`model_reward`: a judge or reward model behind an OpenAI-compatible endpoint (a recipe's `kind: model` entry).
`RewardRunner` scores a batch with several weighted rewards, isolating errors and timeouts per completion.
This package is also the one answer checker `evaluation/` uses for scoring.
"""

from data.answers import extract_answer
from trainer.rewards.countdown import countdown_reward, evaluate_expression
from trainer.rewards.math_grader import grade_answer, parse_math
from trainer.rewards.math_rewards import accuracy_reward, counting_reward, format_reward, grade_math_answer
from trainer.rewards.model_reward import ModelRewardError, model_reward
from trainer.rewards.parsing import completion_text
from trainer.rewards.registry import REWARD_NAMES, RewardSpecError, available_rewards, resolve_reward
from trainer.rewards.runner import RewardResult, RewardRunner, reward_metrics
from trainer.rewards.shaping import cosine, repetition, soft_overlong

__all__ = [
    "REWARD_NAMES",
    "RewardResult",
    "RewardRunner",
    "ModelRewardError",
    "RewardSpecError",
    "accuracy_reward",
    "available_rewards",
    "completion_text",
    "cosine",
    "countdown_reward",
    "counting_reward",
    "evaluate_expression",
    "extract_answer",
    "format_reward",
    "grade_answer",
    "grade_math_answer",
    "model_reward",
    "parse_math",
    "repetition",
    "resolve_reward",
    "reward_metrics",
    "soft_overlong",
]
