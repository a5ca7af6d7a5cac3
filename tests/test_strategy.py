"""The training strategies (trainer/strategy/) on the real tiny model: which one a recipe gets, and the fp32
master weights a bf16 policy is stepped through, in memory and through a checkpoint's training state.

That a two-rank DDP update equals the one-rank update is checked in tests/test_async.py, the same for ZeRO-2/3
in tests/test_deepspeed.py (with DeepSpeed's own master weights); exact resume in tests/test_trainer.py.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from test_trainer import TINY, small_recipe

from trainer.grpo import GRPOTrainer
from trainer.model_loading import load_model
from trainer.recipe import load_recipe
from trainer.strategy import DDPStrategy, SingleProcessStrategy, ZeroStrategy, strategy_class
from trainer.strategy.precision import MasterWeights


def test_a_recipe_gets_one_process_ddp_or_zero_by_its_world_size_and_train_deepspeed(tiny_recipe):
    assert strategy_class(tiny_recipe, 1) is SingleProcessStrategy
    assert strategy_class(tiny_recipe, 2) is DDPStrategy
    zero = load_recipe(TINY, ["train.deepspeed=zero2"])
    assert strategy_class(zero, 1) is strategy_class(zero, 2) is ZeroStrategy
    # only one process may run a prompt's prefill once for its whole group: DDP needs one forward per
    # backward, and DeepSpeed's engine wraps `forward` alone
    assert SingleProcessStrategy.share_prompts and not DDPStrategy.share_prompts
    assert not ZeroStrategy.share_prompts


def test_a_float32_module_is_stepped_directly_without_master_copies():
    module = torch.nn.Linear(3, 2)
    weights = MasterWeights(module)
    assert weights.masters is None and weights.params == list(module.parameters())
    assert weights.state_dict() == {}


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def test_bf16_policy_is_stepped_through_fp32_master_weights_that_a_checkpoint_keeps(
    tmp_path, tiny_base, tiny_data
):
    # Adam's first step moves each weight by about lr; bf16 keeps ~3 digits, so |w| ~ 0.02 has an ulp ~1e-4
    lr = 1e-5
    recipe = small_recipe(
        tmp_path,
        tiny_base,
        tiny_data,
        "train.eval_heldout=0",
        f"train.learning_rate={lr}",
        "model.dtype=bfloat16",
    )
    trainer = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False)
    trainer.setup()
    strategy = trainer.strategy
    masters = strategy.weights.masters
    assert isinstance(strategy, SingleProcessStrategy) and masters is not None
    assert {m.dtype for m in masters} == {torch.float32}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert [id(p) for p in strategy.optimizer.param_groups[0]["params"]] == [id(m) for m in masters]
    master_before, module_before = flat(masters).clone(), flat(trainer.model.parameters()).clone()

    batch, _ = trainer.rollout_source().next(0)
    batch.advantages = torch.linspace(-1, 1, len(batch))
    metrics = trainer.optimize(batch)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    moved = (flat(masters) - master_before).abs()
    assert (moved > 0).float().mean() > 0.95  # the fp32 copies took the update...
    assert 0.5 * lr < moved.median().item() < 1.5 * lr
    # ...which mostly rounds away in the bf16 module: below half an ulp
    assert (flat(trainer.model.parameters()) != module_before).float().mean() < 0.5
    for p, m in zip(trainer.model.parameters(), masters, strict=True):  # the forward runs the copies rounded
        assert torch.equal(p, m.to(torch.bfloat16))

    # the training state a checkpoint gets holds the copies; a fresh strategy on rounded weights takes them
    written = {}
    strategy.save(tmp_path, {"step": 1}, lambda state, extra: written.update(state) or tmp_path)
    assert written["step"] == 1 and {"optimizer", "scheduler", "master_weights"} <= written.keys()
    fresh_model, _ = load_model(tiny_base["path"], recipe.model, "cpu", verify=False)
    fresh = SingleProcessStrategy(recipe)
    fresh.wrap(fresh_model, functools.partial(torch.optim.AdamW, lr=lr), lambda update: 1.0)
    fresh.load(written, Path(tmp_path))
    assert torch.equal(flat(fresh.weights.masters), flat(masters))
    assert torch.equal(flat(fresh_model.parameters()), flat(trainer.model.parameters()))
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1
