"""Trainer options beyond configs/tiny-cpu.yaml, on the real tiny model: the KL term (beta > 0), the four loss
normalisations, the three reward scalings, dynamic sampling, truncated-completion masking, learning-rate
schedules with warm-up, weight decay, AdamW's betas, gradient clipping and checkpoint pruning.

Each test drives the real GRPOTrainer (setup, a rollout batch, `optimize`; `train` for pruning) and checks
what the option does against a second computation made here: the loss written out on the same completions and
differentiated with autograd, k3 from the policy's and the reference's log-probs, the schedule's formula,
AdamW's update rule. A reward plugin that scores completion i of a batch with a fixed number makes the
advantages known in advance, whatever the sampled text says.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from test_trainer import small_recipe

from trainer.grpo import GRPOTrainer
from trainer.logprobs import activation_checkpointing, completion_logps

# Two groups of four: group 0 = [0, 1, 3, 4] (mean 2, unbiased var 10/3, std 1.825742),
# group 1 = [2, 2, 2, 6] (mean 3, var 12/3 = 4, std 2); the batch: mean 2.5, var 24/7, std 1.851640.
REWARDS = [0.0, 1.0, 3.0, 4.0, 2.0, 2.0, 2.0, 6.0]
DEVIATIONS = torch.tensor([-2.0, -1.0, 1.0, 2.0, -1.0, -1.0, -1.0, 3.0])  # r_i - its group's mean
EPS = 1e-4  # the advantage denominator's epsilon, as in TRL
ALL_KEPT = torch.ones(8)


def reward_plugin(tmp_path: Path, rewards: list[float]) -> str:
    """The `rewards=` override of one reward function that gives completion i of a batch `rewards[i]`."""
    path = tmp_path / "fixed_rewards.py"
    path.write_text(
        f"REWARDS = {rewards!r}\n\n\ndef fixed(prompts, completions, **kw):\n"
        "    return REWARDS[:len(completions)]\n"
    )
    return f"rewards=[{{name: '{path}:fixed'}}]"


def ready_trainer(tmp_path: Path, tiny_base: dict, tiny_data: Path, *overrides: str) -> GRPOTrainer:
    recipe = small_recipe(tmp_path, tiny_base, tiny_data, "train.eval_heldout=0", *overrides)
    trainer = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False)
    trainer.setup()
    return trainer


def record_updates(trainer: GRPOTrainer) -> list[tuple[torch.Tensor, float]]:
    """(gradient the optimizer applies, flattened, after clipping; its learning rate) for each update to
    come."""
    seen = []

    def before_step(optimizer, args, kwargs):
        params = optimizer.param_groups[0]["params"]
        seen.append((flat([p.grad for p in params], params), optimizer.param_groups[0]["lr"]))

    trainer.strategy.optimizer.register_step_pre_hook(before_step)
    return seen


def flat(grads, params) -> torch.Tensor:
    """One float64 vector: a float32 norm over ~1M entries can be off by 1e-4 on CPU."""
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g.detach()).reshape(-1).double()
            for g, p in zip(grads, params, strict=True)
        ]
    )


def token_weights(
    batch, loss_type: str, kept: torch.Tensor, max_completion_length: int, sequences: int | None = None
) -> torch.Tensor:
    """[B, C]: each completion token's weight in the loss, as reduce_loss's docstring defines the four types
    (0 for padding and for the completions not `kept`); `sequences`: the batch's count (default: all of
    it)."""
    sequences = len(batch) if sequences is None else sequences
    lengths = torch.tensor([len(c.token_ids) for c in batch.completions])
    tokens = (torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]).float() * kept[:, None]
    if loss_type == "grpo":  # mean over each sequence's tokens, then over all B sequences
        return tokens / (lengths.clamp(min=1)[:, None] * sequences)
    if loss_type == "dr_grpo":
        return tokens / (sequences * max_completion_length)
    return tokens / tokens.sum()  # bnpo, dapo: one mean over the tokens in the loss


def first_pass_loss_and_gradient(
    trainer: GRPOTrainer, batch, weights: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """The loss of an on-policy batch before its update, written out: there
    ratio = exp(logp - logp.detach()) = 1, nothing is clipped, and -min(ratio * A, clip(ratio) * A) has value
    -A and the gradient of -A * logp."""
    mb = batch.micro_batch(torch.arange(len(batch)), trainer.tokenizer.pad_token_id)
    # the whole batch in one plain forward: another path than the trainer's micro-batches with shared prompts
    logps, _ = completion_logps(trainer.model, mb, trainer.cfg.temperature)
    advantages = batch.advantages[:, None]
    params = list(trainer.model.parameters())
    grads = torch.autograd.grad(-(advantages * logps * weights).sum(), params, allow_unused=True)
    return -(advantages * weights).sum().item(), flat(grads, params)


def batch_where(rollouts, wanted, what: str):
    """The first of the next few batches (and its metrics) for which `wanted(batch)` holds; sampling is
    seeded, so it is the same batch every run on this machine."""
    for step in range(8):
        batch, metrics = rollouts.next(step)
        if wanted(batch):
            return batch, metrics
    raise AssertionError(f"none of 8 batches {what}")


def lengths_differ(batch) -> bool:
    return len({len(c.token_ids) for c in batch.completions}) > 1


def truncated(batch) -> list[bool]:
    return [c.finish_reason == "length" for c in batch.completions]


def assert_same_direction_and_size(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert expected.norm() > 0
    assert (actual - expected).norm() <= 1e-4 * expected.norm(), ((actual - expected).norm(), expected.norm())


# ---------------------------------------------------------------------------------------- KL to the reference
def test_beta_loads_the_reference_and_its_k3_kl_reaches_the_loss(tmp_path, tiny_base, tiny_data):
    beta = 0.1
    trainer = ready_trainer(tmp_path, tiny_base, tiny_data, f"train.beta={beta}", "train.learning_rate=1e-3")
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    rollouts = trainer.rollout_source()
    batch, _ = rollouts.next(0)
    # the KL gradient is 0 where policy == reference: advantages of both signs make the first update move away
    batch.advantages = torch.linspace(-1, 1, len(batch))
    assert trainer.optimize(batch)["kl"] == 0.0  # k3 >= 0, so a mean of 0: 0 on every token, same weights

    batch, _ = rollouts.next(1)
    kl_sum, tokens, policy_term = 0.0, 0.0, 0.0
    for rows in torch.arange(len(batch)).split(trainer.cfg.micro_batch_size):  # the trainer's micro-batches
        mb = batch.micro_batch(rows, trainer.tokenizer.pad_token_id)
        with torch.no_grad():
            p = completion_logps(trainer.model, mb, trainer.cfg.temperature, share_prompts=True)[0]
            r = completion_logps(trainer.ref_model, mb, trainer.cfg.temperature, share_prompts=True)[0]
        k3 = torch.exp(r - p) - (r - p) - 1
        kl_sum += (k3 * mb.completion_mask).sum().item()
        tokens += mb.completion_mask.sum().item()
        policy_term += -(mb.advantages[:, None] * mb.completion_mask).sum().item()
    expected_kl = kl_sum / tokens  # dapo: one mean over all tokens of the batch; ratio 1 on the first pass
    metrics = trainer.optimize(batch)
    assert expected_kl > 0
    assert metrics["kl"] == pytest.approx(expected_kl, rel=1e-4)
    assert metrics["loss"] == pytest.approx(policy_term / tokens + beta * expected_kl, rel=1e-4, abs=1e-7)


# -------------------------------------------------------------------------- advantages and loss normalisation
@pytest.mark.parametrize(
    ("scale_rewards", "expected"),
    [
        ("group", DEVIATIONS / torch.tensor([1.825742 + EPS] * 4 + [2.0 + EPS] * 4)),
        ("batch", DEVIATIONS / (1.851640 + EPS)),
        ("none", DEVIATIONS),
    ],
)
def test_scale_rewards_sets_the_advantages_the_update_follows(
    tmp_path, tiny_base, tiny_data, scale_rewards, expected
):
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        reward_plugin(tmp_path, REWARDS),
        f"train.scale_rewards={scale_rewards}",
        "train.max_grad_norm=0",
    )
    batch, metrics = trainer.rollout_source().next(0)
    torch.testing.assert_close(batch.advantages, expected, atol=1e-5, rtol=0)
    assert metrics["reward"] == pytest.approx(2.5) and metrics["reward_std"] == pytest.approx(
        1.851640, abs=1e-6
    )
    loss, gradient = first_pass_loss_and_gradient(
        trainer, batch, token_weights(batch, "dapo", ALL_KEPT, trainer.cfg.max_completion_length)
    )
    applied = record_updates(trainer)
    assert trainer.optimize(batch)["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-7)
    assert_same_direction_and_size(applied[0][0], gradient)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_type_sets_each_tokens_weight_in_the_loss_and_gradient(
    tmp_path, tiny_base, tiny_data, loss_type
):
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        reward_plugin(tmp_path, REWARDS),
        f"train.loss_type={loss_type}",
        "train.max_grad_norm=0",
    )
    # with equal lengths grpo's per-sequence means would weigh tokens as dapo's one token mean does
    batch, _ = batch_where(trainer.rollout_source(), lengths_differ, "has completions of different lengths")
    # group advantages sum to 0 in each group, which would make the grpo loss 0 whatever its weights
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.5, 0.75, -0.25, 0.5])
    weights = token_weights(batch, loss_type, ALL_KEPT, trainer.cfg.max_completion_length)
    loss, gradient = first_pass_loss_and_gradient(trainer, batch, weights)
    applied = record_updates(trainer)
    assert trainer.optimize(batch)["loss"] == pytest.approx(loss, rel=1e-4)
    assert_same_direction_and_size(applied[0][0], gradient)


# ------------------------------------------------------------------------------- what is left out of the loss
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_dynamic_sampling_leaves_groups_with_equal_rewards_out_of_the_loss(
    tmp_path, tiny_base, tiny_data, loss_type
):
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        reward_plugin(tmp_path, [1.0] * 4 + [0, 1, 2, 3]),
        "train.dynamic_sampling=true",
        "train.scale_rewards=group",  # the advantages below are divided by the group's std
        "train.max_grad_norm=0",
        f"train.loss_type={loss_type}",
    )
    batch, metrics = trainer.rollout_source().next(0)
    assert metrics["frac_reward_zero_std"] == 0.5
    kept = torch.tensor([0.0] * 4 + [1.0] * 4)  # group 1 alone: [0, 1, 2, 3], mean 1.5, std sqrt(5/3)
    torch.testing.assert_close(batch.loss_mask, kept)
    assert batch.sampled_out == 4
    torch.testing.assert_close(
        batch.advantages, torch.tensor([0.0] * 4 + [-1.5, -0.5, 0.5, 1.5]) / (1.290994 + EPS)
    )
    # the dropped group's advantages are 0 already: what dropping changes is that the group leaves the batch,
    # its tokens the token mean (dapo) and its sequences the sequence count (grpo, dr_grpo: 4 sequences, not
    # 8)
    weights = token_weights(batch, loss_type, kept, trainer.cfg.max_completion_length, sequences=4)
    loss, gradient = first_pass_loss_and_gradient(trainer, batch, weights)
    applied = record_updates(trainer)
    assert trainer.optimize(batch)["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-7)
    assert_same_direction_and_size(applied[0][0], gradient)


def test_completions_with_zero_advantage_get_no_forward_and_leave_the_update_as_it_was(
    tmp_path, tiny_base, tiny_data
):
    """Group 0's rewards all match (advantages 0, rewards unscaled), group 1's differ: with
    skip_zero_advantages the forward takes group 1's 4 rows alone, and the loss, the gradient the optimizer
    applies and the weights after the update are those of the whole batch (up to float summation order). A
    batch with no advantage at all still runs one (stand-in) row: the weights move on AdamW's moments as
    they do on the whole batch's zero gradient. With a KL term every row has a gradient: none is left out."""
    rewards = reward_plugin(tmp_path, [1.0] * 4 + [0, 1, 2, 3])
    trainers, rows, applied = {}, {}, {}
    for skip in (True, False):
        (tmp_path / str(skip)).mkdir()
        trainer = ready_trainer(
            tmp_path / str(skip),
            tiny_base,
            tiny_data,
            rewards,
            "train.scale_rewards=none",
            "train.max_grad_norm=0",
            "train.learning_rate=1e-3",
            f"train.skip_zero_advantages={str(skip).lower()}",
        )
        forward, seen = trainer.strategy.logps, []
        trainer.strategy.logps = lambda mb, *a, _f=forward, _seen=seen, **k: (
            _seen.append(mb.input_ids.shape[0]) or _f(mb, *a, **k)
        )
        trainers[skip], rows[skip], applied[skip] = trainer, seen, record_updates(trainer)
    batch, metrics = trainers[True].rollout_source().next(0)
    assert metrics["frac_reward_zero_std"] == 0.5
    torch.testing.assert_close(batch.advantages, torch.tensor([0.0] * 4 + [-1.5, -0.5, 0.5, 1.5]))
    nothing = dataclasses.replace(batch, advantages=torch.zeros(8))
    results, after_first = {}, {}
    for skip, trainer in trainers.items():
        results[skip] = [trainer.optimize(batch)]
        after_first[skip] = [p.detach().clone() for p in trainer.model.parameters()]
        results[skip].append(trainer.optimize(nothing))
    assert rows == {True: [4, 1], False: [4, 4, 4, 4]}  # micro-batches of 4
    assert results[True][0]["loss"] == pytest.approx(results[False][0]["loss"], rel=1e-5)
    for (skipped, _), (whole, _) in zip(applied[True], applied[False], strict=True):
        torch.testing.assert_close(skipped, whole, rtol=1e-5, atol=1e-9)
    assert applied[True][1][0].abs().max() == 0  # no advantage: a zero gradient, and yet an update
    second = [
        (p - q).abs().max() for p, q in zip(trainers[True].model.parameters(), after_first[True], strict=True)
    ]
    assert max(second) > 5e-4  # lr 1e-3 on the first update's moments
    moved = [
        (a - b).abs().max()
        for a, b in zip(trainers[True].model.parameters(), trainers[False].model.parameters(), strict=True)
    ]
    assert max(moved) < 1e-6  # the same weights after both updates
    trainer = ready_trainer(tmp_path, tiny_base, tiny_data, rewards, "train.beta=0.04")
    assert trainer.rows_in_forward(batch).tolist() == list(range(8))


def test_mask_truncated_completions_leaves_cut_off_completions_out_of_the_loss(
    tmp_path, tiny_base, tiny_data
):
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        "train.mask_truncated_completions=true",
        "train.max_completion_length=16",
        "train.max_grad_norm=0",
    )
    # the tiny model writes "<think>a+b=c</think><answer>c</answer>" in 14 to 17 tokens: some are cut at 16
    batch, metrics = batch_where(
        trainer.rollout_source(),
        lambda b: 0 < sum(truncated(b)) < len(b),
        "mixes truncated and finished completions",
    )
    cut = torch.tensor(truncated(batch))
    assert all(len(c.token_ids) == 16 for c, is_cut in zip(batch.completions, cut, strict=True) if is_cut)
    assert metrics["completions/clipped_ratio"] == cut.float().mean().item()
    kept = (~cut).float()
    torch.testing.assert_close(batch.loss_mask, kept)
    batch.advantages = torch.linspace(
        -1, 1.5, len(batch)
    )  # truncated completions too: the mask must drop them
    loss, gradient = first_pass_loss_and_gradient(
        trainer, batch, token_weights(batch, "dapo", kept, trainer.cfg.max_completion_length)
    )
    applied = record_updates(trainer)
    assert trainer.optimize(batch)["loss"] == pytest.approx(loss, rel=1e-4)
    assert_same_direction_and_size(applied[0][0], gradient)


# --------------------------------------------------------------------------------------------- the optimizer
# f(u) for update u (0-based) of T = max_steps * num_iterations with w warm-up updates: (u + 1) / w while
# u < w, then with progress p = (u - w) / (T - w): linear 1 - p, cosine (1 + cos(pi p)) / 2.
@pytest.mark.parametrize(
    ("schedule", "max_steps", "mu", "factors"),
    [
        # T = 5, w = 2: p = 0, 1/3, 2/3 for u = 2, 3, 4
        ("linear", 5, 1, [0.5, 1.0, 1.0, 2 / 3, 1 / 3]),
        # T = 6, w = 2: p = 0, 1/4, 1/2, 3/4 for u = 2..5; two updates per step
        (
            "cosine",
            3,
            2,
            [0.5, 1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2],
        ),
    ],
)
def test_learning_rate_follows_the_schedule_after_warmup(
    tmp_path, tiny_base, tiny_data, schedule, max_steps, mu, factors
):
    lr = 1e-3
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        f"train.lr_scheduler_type={schedule}",
        "train.warmup_steps=2",
        f"train.max_steps={max_steps}",
        f"train.num_iterations={mu}",
        f"train.learning_rate={lr}",
        "train.max_completion_length=8",
    )
    updates = record_updates(trainer)
    rollouts, logged = trainer.rollout_source(), []
    for step in range(max_steps):
        batch, _ = rollouts.next(step)
        logged.append(trainer.optimize(batch)["learning_rate"])
    assert [rate for _, rate in updates] == pytest.approx([lr * f for f in factors], rel=1e-6)
    # a step logs the rate its (last) update applied, as TRL does: not the next update's
    assert logged == pytest.approx([lr * f for f in factors[mu - 1 :: mu]], rel=1e-6)


def test_weight_decay_shrinks_weights_that_get_no_gradient_by_lr_times_decay(tmp_path, tiny_base, tiny_data):
    lr, decay = 1e-2, 0.1
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        f"train.learning_rate={lr}",
        f"train.weight_decay={decay}",
        "train.max_completion_length=8",
    )
    batch, _ = trainer.rollout_source().next(0)
    batch.advantages = torch.zeros(len(batch))  # no gradient anywhere: Adam's own step is 0 / (0 + eps) = 0
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert trainer.optimize(batch)["grad_norm"] == 0.0
    for old, new in zip(before, trainer.model.parameters(), strict=True):  # AdamW: w <- w - lr * decay * w
        torch.testing.assert_close(new.detach(), old * (1 - lr * decay), rtol=1e-6, atol=0)


def test_adam_betas_set_how_the_second_update_weighs_the_first_gradient(tmp_path, tiny_base, tiny_data):
    beta1, beta2, eps = 0.5, 0.9, 1e-8
    trainer = ready_trainer(
        tmp_path,
        tiny_base,
        tiny_data,
        "train.learning_rate=1e-3",
        f"train.adam_beta1={beta1}",
        f"train.adam_beta2={beta2}",
        "train.max_grad_norm=0",
        "train.max_completion_length=8",
    )
    batch, _ = trainer.rollout_source().next(0)
    batch.advantages = torch.linspace(-1, 1, len(batch))
    applied = record_updates(trainer)
    params = list(trainer.model.parameters())
    trainer.optimize(batch)
    before = flat(params, params)
    trainer.optimize(batch)
    (g1, _), (g2, lr) = applied

    def second_step(b1: float, b2: float) -> torch.Tensor:
        # AdamW, no weight decay, after two gradients: bias-corrected moments of g1 then g2
        m = (b1 * (1 - b1) * g1 + (1 - b1) * g2) / (1 - b1**2)
        v = (b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2) / (1 - b2**2)
        return -lr * m / (v.sqrt() + eps)

    expected = second_step(beta1, beta2)
    assert_same_direction_and_size(flat(params, params) - before, expected)
    # torch's defaults (0.9, 0.999) would have moved the weights otherwise: the betas reached AdamW
    assert (second_step(0.9, 0.999) - expected).norm() > 0.05 * expected.norm()


def test_gradient_is_clipped_to_max_grad_norm_and_its_norm_before_clipping_logged(
    tmp_path, tiny_base, tiny_data
):
    max_norm = 1e-3
    trainer = ready_trainer(
        tmp_path, tiny_base, tiny_data, reward_plugin(tmp_path, REWARDS), f"train.max_grad_norm={max_norm}"
    )
    batch, _ = trainer.rollout_source().next(0)
    _, gradient = first_pass_loss_and_gradient(
        trainer, batch, token_weights(batch, "dapo", ALL_KEPT, trainer.cfg.max_completion_length)
    )
    assert gradient.norm() > 10 * max_norm
    applied = record_updates(trainer)
    metrics = trainer.optimize(batch)
    assert metrics["grad_norm"] == pytest.approx(gradient.norm().item(), rel=1e-5)
    # torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6)
    assert_same_direction_and_size(applied[0][0], gradient * max_norm / (gradient.norm() + 1e-6))


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(("limit", "kept"), [(2, [3, 4]), (0, [1, 2, 3, 4])])
def test_save_total_limit_prunes_the_oldest_checkpoints(tmp_path, tiny_base, tiny_data, limit, kept):
    recipe = small_recipe(
        tmp_path,
        tiny_base,
        tiny_data,
        "train.eval_heldout=0",
        "train.max_steps=4",
        "train.save_steps=1",
        f"train.save_total_limit={limit}",
        "train.max_completion_length=8",
    )
    result = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False).train()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in kept]
    assert (run / "latest").read_text().strip() == "checkpoint-4"
    assert Path(result.checkpoint).name == "checkpoint-4"


# ---------------------------------------------------------------- the engine-mismatch correction, GSPO, CISPO
class ShiftedLogprobsEngine:
    """The real transformers engine (`trainer.rollout.hf_engine.HFEngine`) with the log-probs it reports
    lowered by a known amount: token t of completion j of each prompt by `shift(j, t)`. It samples what the
    engine samples; only its log-probs are off, as those of an engine with other numerics (vLLM in bf16)."""

    def __init__(self, engine, shift):
        self.engine, self.shift = engine, shift

    @property
    def version(self) -> int:  # the policy version its completions carry is the engine's own
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def generate(self, prompts, n, sampling):
        groups = self.engine.generate(prompts, n, sampling)
        for group in groups:
            for j, c in enumerate(group):
                c.logprobs = [lp - self.shift(j, t) for t, lp in enumerate(c.logprobs)]
        return groups

    def __getattr__(self, name):
        return getattr(self.engine, name)


def engine_error(j: int, t: int) -> float:
    """How far the engine's log-prob of token t of completion j of a group is below the trainer's: the first
    token 1.0 (even j: a ratio e = 2.718 over the cap 2) or -0.1 (odd j: 0.904837), every later one 0.02
    (1.020201). A sequence's log-ratio is then 1 + 0.02 (n - 1) (even j: over the cap at any length n) or
    -0.1 + 0.02 (n - 1) (odd j: under it while n < 40, and max_completion_length is 24)."""
    return (1.0 if j % 2 == 0 else -0.1) if t == 0 else 0.02


def expected_weights(mode: str | None, batch, group_size: int) -> torch.Tensor:
    """[B, C]: each token's importance weight (a sequence's weight on each of its tokens) for
    `engine_error`, cap 2; None: no correction."""
    lengths = [len(c.token_ids) for c in batch.completions]
    weights = torch.zeros(len(batch), max(lengths))
    for i, n in enumerate(lengths):
        even = i % group_size % 2 == 0
        if mode is None:
            weights[i, :n] = 1.0
        elif mode == "token_truncate":
            weights[i, :n] = torch.tensor([2.0 if even else 0.904837] + [1.020201] * (n - 1))
        elif mode == "token_mask":
            weights[i, :n] = torch.tensor([0.0 if even else 0.904837] + [1.020201] * (n - 1))
        elif even:  # sequence_truncate: 2, sequence_mask: 0
            weights[i, :n] = 2.0 if mode == "sequence_truncate" else 0.0
        else:
            weights[i, :n] = math.exp(-0.1 + 0.02 * (n - 1))
    return weights


def test_importance_correction_weights_the_loss_for_an_engines_known_log_prob_error(
    tmp_path, tiny_base, tiny_data
):
    """One trainer and one on-policy batch from the shifted engine; for each correction the policy is put
    back to where the batch was sampled, so the ratio of the first pass is exactly 1 and the weights are the
    engine's known error, capped or masked at importance_ratio_cap 2."""
    trainer = ready_trainer(
        tmp_path, tiny_base, tiny_data, "train.max_grad_norm=0", "rollout.importance_ratio_cap=2"
    )
    trainer.local_engine.engine = ShiftedLogprobsEngine(trainer.local_engine.engine, engine_error)
    batch, _ = trainer.rollout_source().next(0)
    group = trainer.cfg.num_generations
    assert batch.policy_version == trainer.version == 0 and len(batch) == 8
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.5, 0.75, -0.25, 0.5])
    lengths = torch.tensor([len(c.token_ids) for c in batch.completions])
    tokens = int(lengths.sum())
    errors = [engine_error(i % group, t) for i, n in enumerate(lengths.tolist()) for t in range(n)]
    start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    applied = record_updates(trainer)
    dapo = token_weights(batch, "dapo", ALL_KEPT, trainer.cfg.max_completion_length)
    # None: the default, importance_correction_on_policy false: an on-policy batch is not corrected
    for mode in [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]:
        trainer.model.load_state_dict(start)
        trainer.version = 0
        trainer.recipe.rollout.importance_correction_on_policy = mode is not None
        trainer.recipe.rollout.importance_correction = mode or "token_truncate"
        weights = expected_weights(mode, batch, group)
        loss, gradient = first_pass_loss_and_gradient(trainer, batch, dapo * weights)
        metrics = trainer.optimize(batch)
        assert metrics["loss"] == pytest.approx(loss, rel=1e-4), mode
        assert_same_direction_and_size(applied[-1][0], gradient)
        # TRL's metrics of the engine's error, with or without a correction
        assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(1.0, abs=1e-4)
        mean_error = sum(abs(e) for e in errors) / tokens
        assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(mean_error, abs=1e-4)
        if mode is None:
            assert not [k for k in metrics if "importance" in k], metrics
            continue
        per_token = weights[dapo > 0]
        # TRL's summary: the tokens' weights, or the sequences' in the sequence modes
        units = weights[:, 0] if mode.startswith("sequence") else per_token
        summary = {k: metrics[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")}
        expected = {"min": units.min().item(), "mean": units.mean().item(), "max": units.max().item()}
        assert summary == pytest.approx(expected, abs=1e-4), mode
        assert metrics["importance_ratio/mean"] == pytest.approx(per_token.mean().item(), abs=1e-4)
        assert (metrics["importance_ratio/min"], metrics["importance_ratio/max"]) == (
            summary["min"],
            summary["max"],
        )


def test_gspo_cispo_and_a_sequence_mask_train_end_to_end_and_log_trls_metrics(tmp_path, tiny_base, tiny_data):
    """A two-step run with a sequence-level ratio, the CISPO objective, two passes per batch (the second sees
    ratios off 1) and every batch corrected per sequence against the engine's log-probs."""
    recipe = small_recipe(
        tmp_path,
        tiny_base,
        tiny_data,
        reward_plugin(tmp_path, REWARDS),  # advantages of both signs, whatever the 8 tokens say
        "train.eval_heldout=0",
        "train.max_steps=2",
        "train.num_iterations=2",
        "train.learning_rate=1e-3",
        "train.importance_sampling_level=sequence",
        "train.loss_type=cispo",
        "train.epsilon_high=4e-4",
        "rollout.importance_correction=sequence_mask",
        "rollout.importance_correction_on_policy=true",
    )
    GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and "clip_ratio/region_mean" not in r
        # a fraction of the 8 sequences, as TRL counts a sequence-level ratio's clips
        assert r["cispo_clip_ratio"] * 8 == pytest.approx(round(r["cispo_clip_ratio"] * 8), abs=1e-9)
        # the engine here is the trainer's own module: only numerics differ, every weight is about 1
        ratios = [r[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
        assert ratios == pytest.approx([1.0] * 3, abs=1e-3) and ratios == sorted(ratios)
        assert 0 <= r["sampling/sampling_logp_difference/mean"] <= r["sampling/sampling_logp_difference/max"]
    assert any(r["cispo_clip_ratio"] > 0 for r in rows)  # the second pass moved some ratio past 1 + 4e-4


# ------------------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_gives_the_same_update_keeping_a_fraction_of_the_activations(
    tmp_path, tiny_base, tiny_data
):
    """train.gradient_checkpointing: the update equals the written-out loss's gradient (as without it), and
    a micro-batch's forward keeps several times fewer bytes for backward (autograd's saved tensors,
    counted with saved_tensors_hooks), as the memory plan's activation estimate says."""
    trainer = ready_trainer(
        tmp_path, tiny_base, tiny_data, reward_plugin(tmp_path, REWARDS), "train.gradient_checkpointing=true"
    )
    assert activation_checkpointing(trainer.model)
    batch, _ = trainer.rollout_source().next(0)
    mb = batch.micro_batch(torch.arange(len(batch)), trainer.tokenizer.pad_token_id)

    def saved_bytes() -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        # reading whether the model checkpoints uses no deprecated transformers name (it warned at every step)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            completion_logps(trainer.model, mb, trainer.cfg.temperature)
        return sum(sizes)

    checkpointed = saved_bytes()
    trainer.model.gradient_checkpointing_disable()
    whole = saved_bytes()
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed * 3 < whole, (checkpointed, whole)
    _, gradient = first_pass_loss_and_gradient(
        trainer, batch, token_weights(batch, "dapo", ALL_KEPT, trainer.cfg.max_completion_length)
    )
    applied = record_updates(trainer)
    trainer.optimize(batch)
    assert_same_direction_and_size(applied[0][0], gradient * min(1.0, 1.0 / (gradient.norm().item() + 1e-6)))


def test_a_lora_policy_is_seen_checkpointing_through_its_wrapper(tiny_base):
    """PEFT's LoRA model forwards attribute reads to the model it wraps, so its checkpointing is seen and the
    forward takes the plain way (shared prompts would run the completions without their prompt's cache,
    which transformers turns off under checkpointing); no deprecated transformers name is read."""
    from trainer.lora import attach
    from trainer.model_loading import load_model
    from trainer.recipe import LoraConfig

    base, _ = load_model(tiny_base["path"])
    policy = attach(base, LoraConfig(r=2, alpha=4.0), tiny_base["path"])
    seen = []
    for enable in (False, True):
        if enable:  # as the trainer turns it on (trainer/grpo.py)
            policy.get_base_model().gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            seen.append((activation_checkpointing(policy), activation_checkpointing(policy.get_base_model())))
    assert seen == [(False, False), (True, True)]
