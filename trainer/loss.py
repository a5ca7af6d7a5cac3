"""The GRPO maths: group advantages, the clipped surrogate with its KL and importance-weight terms, and the
loss normalisations, as short pure-torch functions whose numbers can be checked by hand.

Definitions follow TRL 1.16 (`GRPOTrainer._generate_and_score_completions` and `_compute_loss`), with these
deliberate differences, each explained where it lives:
- a group with fewer than two valid rewards has std 0 here (TRL's `nanstd` gives nan); the advantages agree
  (0 either way) but such groups count in `frac_reward_zero_std` and in `zero_std_groups`, since they carry
  no learning signal;
- a group "has zero std" when its valid rewards are all equal, tested exactly, and its advantages are
  exactly 0. TRL tests `isclose(std, 0)`, whose default atol of 1e-8 a float32 std of equal rewards can miss:
  eight rewards of 0.2 have a computed std of ~3e-8, so TRL counts that group as informative and gives it
  advantages of ~1e-4 made of rounding error;
- `reduce_loss` returns each micro-batch's exact share of the full-batch loss, so that the sum over
  micro-batches equals the one-shot value even when micro-batches differ in size or token count;
- `cispo` caps its weight at 1 + epsilon_high, as MiniMax-M1 writes it (clip(r, 1 - eps_low, 1 + eps_high),
  with no lower bound in practice); TRL caps it at epsilon_high itself (ScaleRL's eps_max = 5), which with
  TRL's default epsilon_high = epsilon = 0.2 would cap every weight at 0.2;
- the clip fractions of a sequence-level ratio (GSPO), the engine correction's per-sequence weights and
  their metrics count the sequences with a token in the loss; TRL counts every row of the batch, a
  sequence left out of the loss (weight 1, never clipped) included.

Shapes: B completions (grouped consecutively, `group_size` per prompt), T completion tokens (padded);
`mask` is 1 on the completion tokens that count in the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the clipped surrogate under TRL's four normalisations
ALL_LOSS_TYPES = (*LOSS_TYPES, "cispo")  # cispo: its own objective, normalised as dapo (TRL)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IMPORTANCE_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALE_REWARDS = ("group", "batch", "none")


def _valid_mean_std(x: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise mean and unbiased (n - 1) std of the non-nan entries of a 2-D tensor.

    A row with no valid entry has mean 0; a row with fewer than two has std 0 (not nan, as TRL's `nanstd`).
    """
    valid = ~torch.isnan(x)
    count = valid.sum(dim=1)
    mean = torch.where(valid, x, 0.0).sum(dim=1) / count.clamp(min=1)
    squares = torch.where(valid, (x - mean[:, None]) ** 2, 0.0).sum(dim=1)
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), 0.0)
    return mean, std


def _all_equal(x: Tensor) -> Tensor:
    """Row-wise: True where the non-nan entries of a 2-D tensor are all equal (or fewer than two)."""
    valid = ~torch.isnan(x)
    high = torch.where(valid, x, -torch.inf).amax(dim=1)
    low = torch.where(valid, x, torch.inf).amin(dim=1)
    return (valid.sum(dim=1) < 2) | (high == low)


def _check_groups(rewards: Tensor, group_size: int) -> None:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Per completion: True where its group's valid rewards are all equal (tested exactly, see the module
    docstring), the groups DAPO's dynamic sampling drops. A group with fewer than two valid rewards counts as
    matching."""
    _check_groups(rewards, group_size)
    return _all_equal(rewards.view(-1, group_size)).repeat_interleave(group_size)


def group_advantages(
    rewards: Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """A_i = (r_i - mean_g) / (std + eps) over the valid (non-nan) rewards of completion i's group g.

    std is the group's unbiased std ("group"), the std of all valid rewards of the batch ("batch"), or the
    division is skipped ("none"). nan marks a missing reward: it is left out of mean and std, and gets A = 0
    and valid = False so the caller can mask it out of the loss.

    Stats, as TRL logs them: `reward` = mean of the valid rewards; `reward_std` = unbiased std of all valid
    rewards of the batch (TRL's `nanstd(rewards)`: a batch std, not a mean of group stds);
    `frac_reward_zero_std` = fraction of groups whose valid rewards all match. TRL computes the latter from
    the std it divides by, so under "batch" it can only be 0 or 1; here it is always the group fraction.
    """
    _check_groups(rewards, group_size)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    valid = ~torch.isnan(rewards)
    group_mean, group_std = _valid_mean_std(rewards.view(-1, group_size))
    _, batch_std = _valid_mean_std(rewards.view(1, -1))
    advantages = rewards - group_mean.repeat_interleave(group_size)
    if scale_rewards == "group":
        advantages = advantages / (group_std.repeat_interleave(group_size) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_std + eps)
    flat = zero_std_groups(rewards, group_size)  # exactly 0 there, not rounding residue over (std + eps)
    advantages = torch.where(valid & ~flat, advantages, 0.0)
    stats = {
        "reward": rewards[valid].mean().item() if valid.any() else float("nan"),
        "reward_std": batch_std.item(),
        "frac_reward_zero_std": flat.float()
        .mean()
        .item(),  # groups are equal-sized: per completion = per group
    }
    return advantages, valid, stats


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1, >= 0, 0 where
    equal."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def truncated_importance_weights(old_logps: Tensor, behaviour_logps: Tensor, cap: float) -> Tensor:
    """Per-token min(exp(old - behaviour), cap): TRL's `token_truncate` vLLM importance-sampling correction.

    `behaviour_logps` are the sampler's log-probs (vLLM, an older policy in async rollout), `old_logps` the
    trainer's at the start of this step. A nan behaviour log-prob (not reported) gives weight 1, as in TRL.
    """
    log_w = torch.nan_to_num(old_logps - behaviour_logps, nan=0.0)
    return torch.clamp(torch.exp(log_w), max=cap)


def importance_weights(
    old_logps: Tensor, behaviour_logps: Tensor, mask: Tensor, mode: str, cap: float
) -> Tensor:
    """The weights that correct the loss for the sampler (`behaviour_logps`: the engine's log-probs, of an
    older policy in async rollout) differing from the trainer (`old_logps`), TRL's
    `vllm_importance_sampling_mode` with `vllm_importance_sampling_clip_max` = `cap`:

        token_truncate     per token  min(exp(old - behaviour), cap)                          [B, T]
        token_mask         per token  exp(old - behaviour), or 0 where that exceeds cap         [B, T]
        sequence_truncate  per sequence  min(exp(sum over its tokens of (old - behaviour)), cap)  [B, 1]
        sequence_mask      per sequence  exp(sum ...), or 0 where that exceeds cap               [B, 1]

    A sequence's ratio is the product of its tokens' (TRL's choice; GSPO's loss ratio is a geometric mean,
    see `per_token_loss`). `mask` [B, T] marks the tokens in the loss: padding adds nothing to a sum. A nan
    behaviour log-prob (not reported) counts as agreement (log-ratio 0), as in TRL. There is no lower bound
    (TRL's `vllm_importance_sampling_clip_min`, None by default).
    """
    if mode not in IMPORTANCE_CORRECTIONS:
        raise ValueError(
            f"importance correction must be one of {', '.join(IMPORTANCE_CORRECTIONS)}, got {mode!r}"
        )
    if mode == "token_truncate":
        return truncated_importance_weights(old_logps, behaviour_logps, cap)
    log_w = torch.nan_to_num(old_logps - behaviour_logps, nan=0.0) * mask.to(old_logps.dtype)
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True)
    weights = torch.exp(log_w)
    if mode.endswith("truncate"):
        return torch.clamp(weights, max=cap)
    return weights.masked_fill(weights > cap, 0.0)


def weight_units(weights: Tensor, mask: Tensor) -> Tensor:
    """The values TRL summarises in `sampling/importance_sampling_ratio/*`, flat: a per-token correction's
    weights on the tokens in the loss, a per-sequence ([B, 1]) one's on the sequences with a token in it."""
    if weights.shape[-1] == 1 and mask.shape[-1] != 1:
        return weights[:, 0][mask.sum(-1) > 0]
    return weights[mask > 0]


def per_token_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    is_weights: Tensor | None = None,
    use_bias_correction_kl: bool = True,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss per token, [B, T], TRL's `_compute_loss` before its normalisation:

        ratio = exp(logp - old_logp) per token, or per sequence at importance_sampling_level "sequence"
                (GSPO: exp of the sequence's masked mean of logp - old_logp, one ratio for all its tokens)
        surrogate (grpo, bnpo, dr_grpo, dapo):
                loss = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
        cispo:  loss = -sg(min(ratio, 1 + epsilon_high)) * A * logp   (MiniMax-M1: the weight is a constant,
                the gradient flows through logp only, so no token's gradient is clipped away)
        then    loss = loss * is_weight  +  beta * KL

    A is one advantage per sequence ([B], broadcast over tokens) or per token ([B, T]). KL is `k3_kl` against
    `ref_logps`, multiplied by `ratio` when `use_bias_correction_kl` (TRL 1.16's default: it makes the KL
    gradient unbiased when the batch is off-policy; with ratio = 1 it changes nothing). As in TRL the
    importance weights (`importance_weights`, [B, T] or [B, 1]) scale the policy term only, not the KL.
    `mask` (the tokens in the loss) is needed by the sequence level's mean.

    Stats (detached): `ratio` ([B, T], or [B, 1] per sequence), `kl` ([B, T], the KL term divided by beta, as
    TRL logs it; zeros if beta == 0) and TRL's clip flags, shaped like `ratio`: for the surrogate
    `low_clipped` = ratio < 1 - eps_low and A < 0, `high_clipped` = ratio > 1 + eps_high and A > 0,
    `region_clipped` = either; for cispo `cispo_clipped` = ratio > 1 + eps_high and A > 0.
    """
    if logps.shape != old_logps.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and old_logps {tuple(old_logps.shape)} differ in shape")
    if loss_type not in ALL_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(ALL_LOSS_TYPES)}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, "
            f"got {importance_sampling_level!r}"
        )
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        if mask is None:
            raise ValueError("importance_sampling_level 'sequence' needs the mask of the tokens in the loss")
        m = mask.to(logps.dtype)
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=1 + epsilon_high).detach() * adv * logps
        flags = {"cispo_clipped": (ratio > 1 + epsilon_high) & (adv > 0)}
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        loss = -torch.min(ratio * adv, clipped * adv)
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        flags = {"low_clipped": low, "high_clipped": high, "region_clipped": low | high}
    if is_weights is not None:
        loss = loss * is_weights
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps (the reference model's per-token log-probs)")
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + beta * kl
    return loss.expand_as(logps), {"ratio": ratio.detach(), "kl": kl.detach(), **flags}


def reduce_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    total_sequences: int,
    total_tokens: int,
    max_completion_length: int,
) -> Tensor:
    """This micro-batch's share of the full-batch loss: summed over the micro-batches of a batch, the values
    equal the loss of the whole batch at once, so gradient accumulation adds no bias. With S = sum of masked
    per-token losses of this micro-batch and the totals counted over the full batch:

        grpo     sum over its sequences of (masked mean over tokens) / total_sequences
        bnpo     S / total_tokens
        dr_grpo  S / (total_sequences * max_completion_length)
        dapo     S / total_tokens
        cispo    S / total_tokens   (TRL normalises cispo as dapo)

    A sequence with no active token adds 0 but still counts in total_sequences (TRL clamps its length to 1).

    Against TRL 1.16: its grpo and dr_grpo take per-micro-batch means and divide by the accumulation steps,
    which is the same when micro-batches have equal sizes. Its bnpo divides by the micro-batch's *own* token
    count, so with accumulation it averages micro-batch token-means; here bnpo is the full-batch token mean
    (TRL's value on a single micro-batch) and so coincides with dapo. TRL's dapo divides by
    `num_items_in_batch`, the active tokens of the generation batch over all processes, divided by the
    number of processes (DDP averages gradients over them): on one process that is `total_tokens`; with P
    data-parallel ranks that average gradients, pass total_tokens = global token count / P.
    """
    if loss_type not in ALL_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(ALL_LOSS_TYPES)}, got {loss_type!r}")
    if total_sequences < 1 or max_completion_length < 1:
        raise ValueError(
            f"need total_sequences >= 1 and max_completion_length >= 1, got {total_sequences} "
            f"and {max_completion_length}"
        )
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / total_sequences
    if loss_type == "dr_grpo":
        return masked.sum() / (total_sequences * max_completion_length)
    return masked.sum() / max(total_tokens, 1)  # bnpo, dapo, cispo


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / sum(mask); 0 when the mask is empty."""
    mask = mask.to(x.dtype if x.is_floating_point() else torch.float32)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


CLIP_METRICS = {  # TRL's metric name -> the `per_token_loss` flag it averages
    "clip_ratio/low_mean": "low_clipped",
    "clip_ratio/high_mean": "high_clipped",
    "clip_ratio/region_mean": "region_clipped",
    "cispo_clip_ratio": "cispo_clipped",
}


def clip_metrics(stats: dict[str, Tensor], mask: Tensor) -> dict[str, float]:
    """TRL's `clip_ratio/{low,high,region}_mean` (or cispo's `cispo_clip_ratio`) and `kl` for one micro-batch:
    masked means of `per_token_loss`'s stats over its tokens in the loss (TRL pools tokens over processes;
    pool over micro-batches likewise). Per-sequence flags (a sequence-level ratio) are averaged over the
    sequences with a token in the loss instead: GSPO's clip fraction is a fraction of sequences, as in TRL."""
    out = {}
    for name, flag in CLIP_METRICS.items():
        if flag not in stats:
            continue
        flags = stats[flag].float()
        if flags.shape[-1] == 1 and mask.shape[-1] != 1:
            out[name] = masked_mean(flags[:, 0], mask.sum(-1) > 0).item()
        else:
            out[name] = masked_mean(flags, mask).item()
    out["kl"] = masked_mean(stats["kl"], mask).item()
    return out


def sequence_logps(
    model_logits: Tensor, target_ids: Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """log_softmax(logits / temperature)[target] per token, in float32: x_t - logsumexp(x) with
    x = logits / T.

    Alignment is the caller's: logits[:, i] of a causal LM predicts token i + 1, so for input_ids =
    prompt (P tokens) + completion pass `logits[:, P - 1:-1]` with `input_ids[:, P:]`. The temperature must be
    the sampling temperature, so these log-probs match the rollout engine's. Positions are processed
    `chunk_size` at a time (upcast to float32 per chunk) so no full-vocabulary float32 copy of all logits is
    made in the forward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if model_logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits {tuple(model_logits.shape)} do not align with targets {tuple(target_ids.shape)}"
        )
    flat_logits = model_logits.reshape(-1, model_logits.shape[-1])
    flat_ids = target_ids.reshape(-1)
    out = [torch.zeros(0, device=model_logits.device)]
    for logits, ids in zip(flat_logits.split(chunk_size), flat_ids.split(chunk_size), strict=True):
        x = logits.float() / temperature
        out.append(x.gather(-1, ids[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1))
    return torch.cat(out).view(target_ids.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Per-position entropy in nats of softmax(logits / temperature): -sum p log p, in float32, chunked."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])
    out = [torch.zeros(0, device=logits.device)]
    for chunk in flat.split(chunk_size):
        logp = F.log_softmax(chunk.float() / temperature, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).view(logits.shape[:-1])
