"""The GRPO maths on tensors small enough to check by hand; every expected number is worked out in a
comment."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (
    ALL_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    clip_metrics,
    entropy_from_logits,
    group_advantages,
    importance_weights,
    k3_kl,
    masked_mean,
    per_token_loss,
    reduce_loss,
    sequence_logps,
    truncated_importance_weights,
    weight_units,
    zero_std_groups,
)

NAN = float("nan")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0
    )


# --- advantages ---------------------------------------------------------------------------------------------

# Group 1 = [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.577350.
# Group 2 = [1, 1, 1, 1]: mean 1, std 0, advantages 0.
# Batch: mean 0.75, squared deviations 2 * 0.5625 + 6 * 0.0625 = 1.5, var = 1.5 / 7, std = 0.462910.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_group_scaling_divides_by_group_std():
    adv, valid, stats = group_advantages(REWARDS, group_size=4, scale_rewards="group")
    a = 0.5 / (0.577350 + 1e-4)  # 0.865875
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])
    assert valid.all()
    close(stats["reward"], 0.75)  # 6 / 8
    close(stats["reward_std"], 0.462910)  # TRL logs the batch std, not a mean of group stds
    assert stats["frac_reward_zero_std"] == 0.5  # group 2 of 2


def test_batch_scaling_divides_by_batch_std():
    adv, _, stats = group_advantages(REWARDS, group_size=4, scale_rewards="batch")
    a = 0.5 / (0.462910 + 1e-4)  # 1.079890: centred on the group mean, scaled by the batch std
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])
    assert stats["frac_reward_zero_std"] == 0.5  # still the group fraction (TRL would log 0 here)


def test_no_scaling_only_centres():
    adv, _, _ = group_advantages(REWARDS, group_size=4, scale_rewards="none")
    close(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_missing_rewards_are_left_out_and_get_zero_advantage():
    # Groups of 3: [1, nan, 0] -> valid [1, 0]: mean 0.5, var (0.25 + 0.25) / 1 = 0.5, std 0.707107;
    # [2, 2, nan] -> std 0; [nan, 3, nan] -> one valid reward, std 0 (no signal), advantage 0.
    rewards = torch.tensor([1.0, NAN, 0.0, 2.0, 2.0, NAN, NAN, 3.0, NAN])
    adv, valid, stats = group_advantages(rewards, group_size=3)
    a = 0.5 / (0.707107 + 1e-4)  # 0.707007
    close(adv, [a, 0, -a, 0, 0, 0, 0, 0, 0])
    assert valid.tolist() == [True, False, True, True, True, False, False, True, False]
    close(stats["reward"], 1.6)  # (1 + 0 + 2 + 2 + 3) / 5
    # deviations from 1.6: 0.36 + 2.56 + 0.16 + 0.16 + 1.96 = 5.2, var 5.2 / 4 = 1.3, std 1.140175
    close(stats["reward_std"], 1.140175)
    close(stats["frac_reward_zero_std"], 2 / 3)


def test_a_group_with_every_reward_missing_gives_zeros_not_nan():
    adv, valid, _ = group_advantages(torch.tensor([NAN, NAN, 1.0, 0.0]), group_size=2)
    a = 0.5 / (0.707107 + 1e-4)
    close(adv, [0, 0, a, -a])
    assert valid.tolist() == [False, False, True, True]


def test_zero_std_groups_marks_every_completion_of_a_flat_group():
    assert zero_std_groups(REWARDS, 4).tolist() == [False] * 4 + [True] * 4
    assert zero_std_groups(torch.tensor([0.5, 0.5, 0.0, 1.0]), 2).tolist() == [True, True, False, False]


def test_advantage_arguments_are_checked():
    with pytest.raises(ValueError, match="divisible by group_size=3"):
        group_advantages(REWARDS, group_size=3)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(REWARDS, group_size=4, scale_rewards="sequence")


# --- the clipped surrogate ----------------------------------------------------------------------------------


def clip_case():
    """Two sequences of two tokens, eps 0.2: ratios [[1.5, 0.5], [0.5, 1.5]], advantages [2, -2]."""
    old = torch.zeros(2, 2)
    logps = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(0.5), math.log(1.5)]])
    return per_token_loss(logps, old, torch.tensor([2.0, -2.0]), epsilon_low=0.2, epsilon_high=0.2)


def test_clipping_takes_the_pessimistic_side():
    loss, stats = clip_case()
    # A = 2:  ratio 1.5 -> min(3.0, 1.2 * 2 = 2.4) = 2.4 (clipped);
    #         ratio 0.5 -> min(1.0, 0.8 * 2 = 1.6) = 1.0
    # A = -2: ratio 0.5 -> min(-1.0, 0.8 * -2 = -1.6) = -1.6 (clipped);
    #         ratio 1.5 -> min(-3.0, -2.4) = -3.0
    close(loss, [[-2.4, -1.0], [1.6, 3.0]])
    close(stats["ratio"], [[1.5, 0.5], [0.5, 1.5]])
    assert stats["high_clipped"].tolist() == [[True, False], [False, False]]
    assert stats["low_clipped"].tolist() == [[False, False], [True, False]]
    assert stats["region_clipped"].tolist() == [[True, False], [True, False]]
    assert not stats["kl"].any()


def test_asymmetric_clip_bounds():
    # eps_low 0.1, eps_high 0.3: ratio 1.5 with A = 1 clips at 1.3; ratio 0.5 with A = -1 clips at 0.9.
    logps = torch.tensor([[math.log(1.5)], [math.log(0.5)]])
    loss, _ = per_token_loss(
        logps, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), epsilon_low=0.1, epsilon_high=0.3
    )
    close(loss, [[-1.3], [0.9]])


def test_on_policy_ratio_is_exactly_one_and_loss_is_minus_advantage():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.2]])
    loss, stats = per_token_loss(
        logps, logps.clone(), torch.tensor([0.7, -0.3]), epsilon_low=0.2, epsilon_high=0.28
    )
    assert torch.equal(stats["ratio"], torch.ones(2, 3))
    assert torch.equal(loss, torch.tensor([[-0.7] * 3, [0.3] * 3]))
    assert not stats["region_clipped"].any()


def test_clip_metrics_are_masked_means():
    _, stats = clip_case()
    metrics = clip_metrics(stats, torch.tensor([[1, 1], [1, 0]]))
    # three active tokens: one high-clipped, one low-clipped
    assert metrics == pytest.approx(
        {
            "clip_ratio/low_mean": 1 / 3,
            "clip_ratio/high_mean": 1 / 3,
            "clip_ratio/region_mean": 2 / 3,
            "kl": 0.0,
        }
    )


# --- KL and importance weights ------------------------------------------------------------------------------


def test_k3_kl_by_hand():
    # ref - logp = -0.5: exp(-0.5) + 0.5 - 1 = 0.606531 - 0.5 = 0.106531
    close(k3_kl(torch.tensor([-1.0]), torch.tensor([-1.5])), [0.106531])
    logps = torch.tensor([-0.3, -2.0])
    assert torch.equal(k3_kl(logps, logps.clone()), torch.zeros(2))


def test_beta_adds_the_kl_term():
    logps, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    loss, stats = per_token_loss(
        logps, logps.clone(), torch.tensor([1.0]), epsilon_low=0.2, epsilon_high=0.2, beta=0.1, ref_logps=ref
    )
    close(loss, [[-1.0 + 0.1 * 0.106531]])  # -0.989347
    close(stats["kl"], [[0.106531]])
    with pytest.raises(ValueError, match="ref_logps"):
        per_token_loss(logps, logps, torch.tensor([1.0]), epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


def test_kl_bias_correction_multiplies_by_the_ratio():
    # logp - old = 0.5, so ratio = exp(0.5) = 1.648721; A = 0 leaves only the KL term.
    logps, old, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[-1.5]])
    kwargs = dict(epsilon_low=0.2, epsilon_high=0.2, beta=0.1, ref_logps=ref)
    corrected, _ = per_token_loss(logps, old, torch.tensor([0.0]), **kwargs)
    plain, _ = per_token_loss(logps, old, torch.tensor([0.0]), use_bias_correction_kl=False, **kwargs)
    close(corrected, [[0.1 * 0.106531 * 1.648721]])  # 0.0175639
    close(plain, [[0.0106531]])


def test_importance_weights_are_one_on_policy_and_capped_off_policy():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    assert torch.equal(truncated_importance_weights(old, old.clone(), cap=2.0), torch.ones(1, 3))
    # old - behaviour = log 3 -> 3 capped to 2; log 0.5 -> 0.5; nan behaviour (not reported) -> 1
    behaviour = torch.tensor([[-1.0 - math.log(3.0), -2.0 - math.log(0.5), NAN]])
    close(truncated_importance_weights(old, behaviour, cap=2.0), [[2.0, 0.5, 1.0]])


def test_importance_weights_scale_the_policy_term_but_not_the_kl():
    logps, ref = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -1.5]])
    loss, _ = per_token_loss(
        logps,
        logps.clone(),
        torch.tensor([1.0]),
        epsilon_low=0.2,
        epsilon_high=0.2,
        beta=0.1,
        ref_logps=ref,
        is_weights=torch.tensor([[2.0, 0.5]]),
    )
    close(loss, [[-2.0 + 0.0106531, -0.5 + 0.0106531]])


# --- the engine-mismatch correction (rollout.importance_correction) ---------------------------------------

# old - behaviour per token: row 0 [log 3, log 0.5, nan (not reported)], all in the loss; row 1 [0.4, 0.5] and
# a padding token whose 9.0 must count nowhere. Cap 2.
OLD = torch.zeros(2, 3)
BEHAVIOUR = -torch.tensor([[math.log(3.0), math.log(0.5), NAN], [0.4, 0.5, 9.0]])
IN_LOSS = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # exp(0.4) = 1.491825, exp(0.5) = 1.648721; a nan counts as agreement (1), padding as 0 log-ratio
        ("token_mask", [[0.0, 0.5, 1.0], [1.491825, 1.648721, 1.0]]),  # 3 > 2: set to 0
        # row 0: log 3 + log 0.5 + 0 = log 1.5; row 1: 0.4 + 0.5 = 0.9, exp 2.459603 > 2
        ("sequence_truncate", [[1.5], [2.0]]),
        ("sequence_mask", [[1.5], [0.0]]),
    ],
)
def test_importance_weights_by_hand(mode, expected):
    close(importance_weights(OLD, BEHAVIOUR, IN_LOSS, mode, cap=2.0), expected)


def test_token_truncate_is_the_truncated_weight_of_every_token():
    weights = importance_weights(OLD, BEHAVIOUR, IN_LOSS, "token_truncate", cap=2.0)
    assert torch.equal(weights, truncated_importance_weights(OLD, BEHAVIOUR, cap=2.0))
    close(weights[IN_LOSS > 0], [2.0, 0.5, 1.0, 1.491825, 1.648721])
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        importance_weights(OLD, BEHAVIOUR, IN_LOSS, "sequence", cap=2.0)


def test_weight_units_are_the_tokens_or_the_sequences_in_the_loss():
    token = importance_weights(OLD, BEHAVIOUR, IN_LOSS, "token_mask", cap=2.0)
    close(weight_units(token, IN_LOSS), [0.0, 0.5, 1.0, 1.491825, 1.648721])
    sequence = importance_weights(OLD, BEHAVIOUR, IN_LOSS, "sequence_truncate", cap=2.0)
    close(weight_units(sequence, IN_LOSS), [1.5, 2.0])
    close(weight_units(sequence, torch.tensor([[0, 0, 0], [1, 1, 0]])), [2.0])  # row 0 is out of the loss


def test_sequence_importance_weights_scale_each_token_of_their_sequence():
    weights = importance_weights(OLD, BEHAVIOUR, IN_LOSS, "sequence_truncate", cap=2.0)  # [[1.5], [2.0]]
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.2]])
    loss, _ = per_token_loss(
        logps, logps.clone(), torch.tensor([1.0, -0.5]), epsilon_low=0.2, epsilon_high=0.2, is_weights=weights
    )
    close(loss, [[-1.5] * 3, [1.0] * 3])  # -A * 1.5 and -(-0.5) * 2.0 on every token


# --- GSPO: the sequence-level ratio (train.importance_sampling_level) ---------------------------------------

# logp - old per token; the third token of rows 1-3 is padding, and its 5.0 must not reach the mean.
GSPO_LOG_RATIOS = torch.tensor([[0.3, -0.1, 0.1], [-0.4, -0.2, 5.0], [0.0, 0.3, 5.0], [0.5, 0.5, 5.0]])
GSPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
GSPO_ADVANTAGES = torch.tensor([1.0, -1.0, -0.5, 2.0])


def gspo_case(mask=GSPO_MASK):
    logps = GSPO_LOG_RATIOS.clone().requires_grad_(True)
    loss, stats = per_token_loss(
        logps,
        torch.zeros(4, 3),
        GSPO_ADVANTAGES,
        epsilon_low=0.2,
        epsilon_high=0.2,
        importance_sampling_level="sequence",
        mask=mask,
    )
    return logps, loss, stats


def test_gspo_clips_one_ratio_per_sequence_by_hand():
    logps, loss, stats = gspo_case()
    # masked means 0.1, -0.3, 0.15, 0.5: s = exp(mean) = 1.105171, 0.740818, 1.161834, 1.648721
    close(stats["ratio"], [[1.105171], [0.740818], [1.161834], [1.648721]])
    # A = 1:    min(1.105171, clamp 1.105171) = 1.105171                   -> -1.105171
    # A = -1:   min(-0.740818, 0.8 * -1 = -0.8) = -0.8 (low-clipped)       -> 0.8
    # A = -0.5: min(-0.580917, -0.580917), inside [0.8, 1.2]               -> 0.580917
    # A = 2:    min(3.297443, 1.2 * 2 = 2.4) = 2.4 (high-clipped)          -> -2.4
    # (per token, 1.35 for row 0's first token would have been clipped: here the sequence decides)
    close(loss, [[-1.105171] * 3, [0.8] * 3, [0.580917] * 3, [-2.4] * 3])
    assert stats["low_clipped"].tolist() == [[False], [True], [False], [False]]
    assert stats["high_clipped"].tolist() == [[False], [False], [False], [True]]
    # d/d logp_t of the masked sum: row 0 sums 3 x -s, d s / d logp_t = s / 3 -> -s = -1.105171 per token;
    # row 2 sums 2 x 0.5 s, d s / d logp_t = s / 2 -> s / 2 = 0.580917 on its 2 tokens, 0 on its padding;
    # clipped rows 1 and 3 have no gradient
    (loss * GSPO_MASK).sum().backward()
    close(logps.grad, [[-1.105171] * 3, [0.0] * 3, [0.580917, 0.580917, 0.0], [0.0] * 3])


def test_gspo_clip_metrics_are_fractions_of_the_sequences_in_the_loss():
    _, _, stats = gspo_case()
    metrics = clip_metrics(stats, GSPO_MASK)
    assert metrics == pytest.approx(
        {
            "clip_ratio/low_mean": 1 / 4,
            "clip_ratio/high_mean": 1 / 4,
            "clip_ratio/region_mean": 2 / 4,
            "kl": 0,
        }
    )
    # row 1 out of the loss: 3 sequences are left, one of them (row 3) clipped; not 2 of 6 tokens
    out = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 1, 0]])
    _, _, stats = gspo_case(out)
    metrics = clip_metrics(stats, out)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/low_mean"] == 0.0


def test_sequence_level_needs_the_mask_and_a_known_level():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1))
    with pytest.raises(ValueError, match="needs the mask"):
        per_token_loss(*args, epsilon_low=0.2, epsilon_high=0.2, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="token, sequence"):
        per_token_loss(*args, epsilon_low=0.2, epsilon_high=0.2, importance_sampling_level="group")


# --- CISPO (train.loss_type cispo) --------------------------------------------------------------------------

CISPO_LOGPS = torch.tensor([[-0.5, -1.0], [-2.0, -0.25]])
CISPO_RATIOS = torch.tensor([[1.5, 0.9], [0.5, 1.5]])


def cispo_case(level="token"):
    logps = CISPO_LOGPS.clone().requires_grad_(True)
    old = CISPO_LOGPS - CISPO_RATIOS.log()  # exp(logp - old) = the ratios above
    loss, stats = per_token_loss(
        logps,
        old,
        torch.tensor([1.0, -2.0]),
        epsilon_low=0.2,
        epsilon_high=0.2,
        loss_type="cispo",
        importance_sampling_level=level,
        mask=torch.ones(2, 2),
    )
    loss.sum().backward()
    return logps.grad, loss, stats


def test_cispo_weights_the_log_prob_by_the_capped_ratio_without_its_gradient():
    grad, loss, stats = cispo_case()
    # weight = min(ratio, 1 + 0.2): [[1.2, 0.9], [0.5, 1.2]]; loss = -weight * A * logp
    # row 0 (A = 1):  -1.2 * -0.5 = 0.6,   -0.9 * -1.0 = 0.9
    # row 1 (A = -2): -(0.5 * -2) * -2.0 = -2.0,   -(1.2 * -2) * -0.25 = -0.6
    close(loss, [[0.6, 0.9], [-2.0, -0.6]])
    # the weight is a constant: d loss / d logp = -weight * A, also where the ratio was capped (no token
    # loses its gradient, unlike the clipped surrogate); through the ratio row 0's 0.9 would give -1.8
    close(grad, [[-1.2, -0.9], [1.0, 2.4]])
    assert stats["cispo_clipped"].tolist() == [[True, False], [False, False]]  # ratio > 1.2 with A > 0
    assert "region_clipped" not in stats
    assert clip_metrics(stats, torch.ones(2, 2)) == pytest.approx({"cispo_clip_ratio": 1 / 4, "kl": 0.0})


def test_cispo_at_the_sequence_level_weights_every_token_by_the_sequence_ratio():
    grad, loss, _ = cispo_case("sequence")
    # row 0: exp(mean(log 1.5, log 0.9)) = sqrt(1.35) = 1.161895 (under 1.2); row 1: sqrt(0.75) = 0.866025
    close(loss, [[1.161895 * 0.5, 1.161895 * 1.0], [-1.732051 * 2.0, -1.732051 * 0.25]])
    close(grad, [[-1.161895] * 2, [1.732051] * 2])


# --- gradient accumulation with the new objectives ----------------------------------------------------------


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("splits", [[1, 3], [2, 2], [1, 1, 1, 1]])
def test_micro_batches_add_up_to_the_full_batch_loss_and_gradient(loss_type, level, splits):
    """Each micro-batch trimmed to its longest row, as the trainer cuts them: per-sequence ratios and the
    shares of `reduce_loss` must still add up to the one-shot loss, value and gradient."""
    logps = torch.tensor([[-0.5, -1.0, -2.0], [-3.0, -0.25, -0.5], [-1.5, -1.0, -4.0], [-2.0, -0.75, -1.25]])
    old = logps + torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.0, 0.0], [0.25, 0.35, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.0])
    totals = dict(total_sequences=4, total_tokens=6, max_completion_length=3)

    def loss_of(rows: slice, leaf: torch.Tensor) -> torch.Tensor:
        width = max(int(mask[rows].sum(-1).max()), 1)
        per_token, _ = per_token_loss(
            leaf[rows, :width],
            old[rows, :width],
            advantages[rows],
            epsilon_low=0.2,
            epsilon_high=0.28,
            loss_type=loss_type,
            importance_sampling_level=level,
            mask=mask[rows, :width],
        )
        return reduce_loss(per_token, mask[rows, :width], loss_type, **totals)

    full_leaf = logps.clone().requires_grad_(True)
    full = loss_of(slice(None), full_leaf)
    full.backward()
    parts_leaf, parts, start = logps.clone().requires_grad_(True), 0.0, 0
    for size in splits:
        part = loss_of(slice(start, start + size), parts_leaf)
        part.backward()
        parts, start = parts + part.item(), start + size
    assert full.item() != 0.0
    assert parts == pytest.approx(full.item(), abs=1e-7)
    close(parts_leaf.grad, full_leaf.grad, atol=1e-7)


# --- normalisations -----------------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def reduce(loss_type, per_token=PER_TOKEN, mask=MASK, sequences=2, tokens=3, max_len=4):
    return reduce_loss(
        per_token,
        mask,
        loss_type,
        total_sequences=sequences,
        total_tokens=tokens,
        max_completion_length=max_len,
    ).item()


def test_each_loss_type_by_hand():
    assert reduce("grpo") == pytest.approx((1.5 + 4.0) / 2)  # sequence means (1+2)/2 and 4/1
    assert reduce("bnpo") == pytest.approx(7 / 3)  # (1 + 2 + 4) over 3 active tokens
    assert reduce("dapo") == pytest.approx(7 / 3)
    assert reduce("dr_grpo") == pytest.approx(7 / (2 * 4))  # 2 sequences x max_completion_length 4


def test_cispo_is_normalised_as_dapo():
    assert reduce("cispo") == pytest.approx(7 / 3)  # TRL: one mean over the batch's active tokens


def test_a_fully_masked_sequence_adds_zero_but_still_counts():
    assert reduce("grpo", mask=torch.tensor([[0, 0, 0], [1, 1, 0]])) == pytest.approx((0 + 4.5) / 2)


def test_unknown_loss_type_names_the_valid_ones():
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo"):
        reduce("ppo")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("splits", [[1, 3], [2, 2], [1, 1, 1, 1]])
def test_micro_batch_shares_sum_to_the_full_batch_loss(loss_type, splits):
    per_token = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.25, -0.5], [1.5, 1.0, 4.0], [-2.0, 0.75, 1.25]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    totals = dict(sequences=4, tokens=6, max_len=3)
    full = reduce(loss_type, per_token, mask, **totals)
    # one shot: grpo = mean(1.5/3, 3/1, 2.5/2, 0) = 4.75/4; masked sum 1.5 + 3 + 2.5 = 7 over 6 tokens or
    # 4 * 3
    assert full == pytest.approx(
        {"grpo": 4.75 / 4, "bnpo": 7 / 6, "dapo": 7 / 6, "dr_grpo": 7 / 12}[loss_type]
    )
    parts = [
        reduce(loss_type, p, m, **totals)
        for p, m in zip(per_token.split(splits), mask.split(splits), strict=True)
    ]
    assert sum(parts) == pytest.approx(full)


def test_masked_mean():
    close(masked_mean(PER_TOKEN, MASK), 7 / 3)
    close(masked_mean(PER_TOKEN, torch.zeros(2, 3)), 0.0)


# --- log-probs and entropy ----------------------------------------------------------------------------------

LOGITS = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]])  # one sequence, two positions, vocabulary of 3


def test_sequence_logps_match_a_manual_log_softmax_at_temperature():
    targets = torch.tensor([[1, 2]])
    got = sequence_logps(LOGITS, targets, temperature=0.7)
    manual = torch.log_softmax(LOGITS / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    close(got, manual, atol=1e-6)
    # x = [1, 2, 0.5] / 0.7 = [1.428571, 2.857143, 0.714286]; logsumexp 3.162397; 2.857143 - 3.162397
    close(got, [[-0.305254, -0.016918]])
    close(sequence_logps(LOGITS, targets, temperature=0.7, chunk_size=1), got, atol=0)


def test_sequence_logps_upcast_half_precision_and_check_alignment():
    targets = torch.tensor([[1, 2]])
    got = sequence_logps(LOGITS.bfloat16(), targets, temperature=0.7)
    assert got.dtype == torch.float32
    close(got, [[-0.305254, -0.016918]], atol=1e-2)
    with pytest.raises(ValueError, match="do not align"):
        sequence_logps(LOGITS, torch.tensor([[1, 2, 0]]), temperature=1.0)


def test_entropy_by_hand():
    # uniform over 2 -> ln 2; p = [1/4, 3/4] -> 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    close(entropy_from_logits(logits), [[0.693147, 0.562335]])
    p = torch.softmax(LOGITS / 0.7, dim=-1)
    close(entropy_from_logits(LOGITS, temperature=0.7), -(p * p.log()).sum(-1))


def test_a_group_of_equal_rewards_is_flat_even_where_float32_rounding_leaves_a_std():
    """Eight rewards of 0.2 (format only, every answer wrong: the common case of the tiny recipe) have a
    float32 std of ~3e-8, above isclose's atol of 1e-8. The group is flat: counted in frac_reward_zero_std,
    dropped by dynamic sampling, advantages exactly 0; the other group (one right answer at 1.2) is
    untouched."""
    rewards = torch.tensor([0.2] * 8 + [1.2] + [0.2] * 7)
    advantages, valid, stats = group_advantages(rewards, group_size=8)
    assert zero_std_groups(rewards, 8).tolist() == [True] * 8 + [False] * 8
    assert stats["frac_reward_zero_std"] == 0.5
    assert advantages[:8].tolist() == [0.0] * 8
    # group 2 by hand: mean 0.325, unbiased std sqrt((0.875^2 + 7 * 0.125^2) / 7) = sqrt(0.125) = 0.35355
    close(advantages[8].item(), 0.875 / (0.353553 + 1e-4), atol=1e-4)
    close(advantages[9].item(), -0.125 / (0.353553 + 1e-4), atol=1e-4)
    assert valid.all()
