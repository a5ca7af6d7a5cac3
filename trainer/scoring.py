"""Scoring generated groups: rewards -> group-relative advantages -> loss mask -> the batch's metrics.

Synchronous and asynchronous rollout both end here, so a batch is scored the same way wherever it was
generated. The rewards (`reward_groups`) may be computed share by share (each trainer rank its own) and the
whole batch then scored from them (`score_rewarded`). Completions whose reward is missing (a reward function
raised or timed out) stay out of the loss; so do, when the recipe asks, groups whose rewards all match (DAPO's
dynamic sampling) and completions cut off at `max_completion_length`.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from trainer import loss as L
from trainer.multiturn.rollout import multiturn_metrics
from trainer.prompts import columns_of
from trainer.recipe import TrainConfig
from trainer.rewards import RewardResult, RewardRunner
from trainer.rollout.batch import RolloutBatch


def score_groups(
    rewards: RewardRunner,
    cfg: TrainConfig,
    rows: list[dict],
    prompt_ids: list[list[int]],
    groups: list,
    metrics: dict,
) -> tuple[RolloutBatch, dict]:
    """The scored batch of `groups` (one group of `cfg.num_generations` completions per row of `rows`), and
    `metrics` with the reward, advantage and completion-length figures added."""
    t1 = time.perf_counter()
    result = reward_groups(rewards, cfg, rows, groups)
    return score_rewarded(cfg, prompt_ids, groups, result, metrics, started=t1)


def reward_groups(rewards: RewardRunner, cfg: TrainConfig, rows: list[dict], groups: list) -> RewardResult:
    """The rewards of every completion of `groups`, in order (a batch's or one trainer rank's share of it)."""
    G = cfg.num_generations
    expanded = [r for r in rows for _ in range(G)]
    completions = [c for g in groups for c in g]
    # a multi-turn batch: reward functions may also read each whole trajectory (the text is its last turn)
    trajectories = (
        {"trajectory": [c.trajectory for c in completions]} if any(c.trajectory for c in completions) else {}
    )
    return rewards(
        [r["prompt"] for r in expanded],
        [c.text for c in completions],
        completion_ids=[c.token_ids for c in completions],
        **columns_of(expanded),
        **trajectories,
    )


def score_rewarded(
    cfg: TrainConfig,
    prompt_ids: list[list[int]],
    groups: list,
    result: RewardResult,
    metrics: dict,
    started: float | None = None,
) -> tuple[RolloutBatch, dict]:
    """`score_groups` from the batch's rewards `result` (`reward_groups`); `started`: when scoring began
    (`timing/reward_s` counts from there; when None, `metrics` holds it already)."""
    G = cfg.num_generations
    completions = [c for g in groups for c in g]
    total = torch.tensor([math.nan if r is None else r for r in result.total])
    advantages, valid, stats = L.group_advantages(total, G, cfg.scale_rewards)
    loss_mask = valid.clone()
    sampled_out = 0
    if cfg.dynamic_sampling:
        dropped = L.zero_std_groups(total, G)
        loss_mask &= ~dropped
        sampled_out = int(dropped.sum())
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    if cfg.mask_truncated_completions:
        loss_mask &= ~truncated
    lengths = [len(c.token_ids) for c in completions]
    metrics = {
        **metrics,
        **stats,
        **result.metrics(),
        "completions/mean_length": statistics.fmean(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "reward_errors": float(sum(result.errors.values())),
        **multiturn_metrics(completions),
    }
    if started is not None:
        metrics["timing/reward_s"] = time.perf_counter() - started
    batch = RolloutBatch(
        [p for p in prompt_ids for _ in range(G)],
        completions,
        advantages,
        loss_mask.float(),
        policy_version=min(c.policy_version for c in completions),
        sampled_out=sampled_out,
        rewards=total,
    )
    return batch, metrics


__all__ = ["reward_groups", "score_groups", "score_rewarded"]
