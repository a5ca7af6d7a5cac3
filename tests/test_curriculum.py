"""The rows each training step takes (trainer.curriculum): the seeded data order, and the curriculum that
passes over rows the rollout has solved (`train.skip_solved_prompts`)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from conftest import REPO_ROOT
from trainer.curriculum import PromptOrder, prompt_indices
from trainer.recipe import load_recipe
from trainer.typed_config import ConfigError

NAN = math.nan

# seed 7, 5 rows: random.Random(7 * 1_000_003 + epoch).shuffle gives these epochs
EPOCHS = [[3, 0, 2, 4, 1], [0, 2, 3, 4, 1], [1, 4, 0, 2, 3]]


def test_the_data_order_is_the_seeded_epochs_in_slices():
    stream = [row for epoch in EPOCHS for row in epoch]
    assert [prompt_indices(s, 5, 2, seed=7) for s in range(7)] == [
        stream[2 * s : 2 * s + 2] for s in range(7)
    ]
    plain = PromptOrder(5, 2, seed=7)
    plain.observe(0, [1.2] * 4)  # without a curriculum nothing is recorded
    assert [plain.indices(s) for s in range(7)] == [prompt_indices(s, 5, 2, seed=7) for s in range(7)]
    assert plain.state() == {}


def test_a_solved_row_passes_over_its_next_turn_two_steps_after_it_was_solved():
    """Worked by hand from EPOCHS (2 prompts a step, 2 completions a prompt, solved at a total of 1.2)."""
    order = PromptOrder(5, 2, seed=7, skip_turns=1, solved_reward=1.2)
    assert order.indices(0) == [3, 0] and order.indices(1) == [2, 4]
    order.observe(0, [1.2, 1.2, 1.2, 0.2])  # row 3 solved; row 0 not (one completion at 0.2)
    # row 2 not (a missing reward is not a solve); row 4 solved: 1.1999999 is a sum's rounding of 1.2
    order.observe(1, [1.2, NAN, 1.2, 1.1999999])
    assert order.solved == {0: [3], 1: [4]}
    # step 2 knows what step 0 taught: row 3 waits one turn. Positions 4, 5 are rows 1, 0: nothing skipped
    assert order.indices(2) == [1, 0] and order.skipped(2) == 0
    order.observe(2, [0.0, 0.0, 1.2, 0.2])
    # step 3 knows step 1 too: row 4 waits. Positions 6..9 are rows 2, 3 (its turn passed), 4 (passed), 1
    assert order.indices(3) == [2, 1] and order.skipped(3) == 2
    order.observe(3, [1.2, 1.2, 0.2, 0.2])  # row 2 solved
    # positions 10, 11: rows 1 and 4, whose one turn is spent
    assert order.indices(4) == [1, 4] and order.skipped(4) == 0
    order.observe(4, [0.0] * 4)
    # positions 12..14: row 0, row 2 (solved at step 3: passed), row 3
    assert order.indices(5) == [0, 3] and order.skipped(5) == 1
    # the plain order would have given steps 2..5 these
    assert [prompt_indices(s, 5, 2, seed=7) for s in range(2, 6)] == [[1, 0], [2, 3], [4, 1], [1, 4]]


def test_a_resumed_order_chooses_what_the_uninterrupted_one_chose():
    """A run resumed from a checkpoint's state at step 20 takes the same rows from then on, asked in the
    asynchronous order too (step t + 1's rows chosen before step t's rewards are known)."""
    rng = random.Random(0)
    rewards = {s: [rng.choice([1.2, 1.2, 0.2, 0.0]) for _ in range(3 * 2)] for s in range(40)}
    straight = PromptOrder(7, 3, seed=1, skip_turns=2, solved_reward=1.2)
    chosen = []
    for step in range(40):
        chosen.append(straight.indices(step))
        straight.observe(step, rewards[step])
        if step == 19:
            saved = straight.state()
    assert chosen != [prompt_indices(s, 7, 3, seed=1) for s in range(40)], "the curriculum skipped nothing"

    resumed = PromptOrder(7, 3, seed=1, skip_turns=2, solved_reward=1.2, state=saved)
    again = [resumed.indices(20)]
    for step in range(20, 40):
        if step + 1 < 40:
            again.append(resumed.indices(step + 1))  # asynchronous: the next batch is asked for first
        resumed.observe(step, rewards[step])
    assert again == chosen[20:]
    assert resumed.state() == straight.state()


def test_a_step_whose_rewards_were_never_observed_stops_the_choice():
    order = PromptOrder(5, 2, seed=7, skip_turns=1, solved_reward=1.2)
    order.indices(1)
    with pytest.raises(RuntimeError, match="step 2 need the rewards of step 0"):
        order.indices(2)
    with pytest.raises(ValueError, match="step 1: 3 rewards for 2 prompts"):
        order.observe(1, [1.0, 1.0, 1.0])


def test_skip_solved_prompts_without_solved_reward_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train: {skip_solved_prompts: 1}\n")
    with pytest.raises(ConfigError, match="skip_solved_prompts needs solved_reward"):
        load_recipe(recipe)


def test_training_takes_the_rows_the_curriculum_chooses_and_resumes_it(tmp_path, tiny_base, tiny_recipe):
    """The trainer on the real tiny model, 10 training rows, a reward that solves exactly the rows with an
    even answer: the rows each step trained on are those a `PromptOrder` chooses when told those rewards,
    the checkpoint keeps its record, and a run resumed from step 8 to 12 goes on choosing the same."""
    from data.prepare import prepare
    from trainer.checkpoint import TRAINER_STATE
    from trainer.grpo import GRPOTrainer

    data = tmp_path / "data"
    prepare(**{**tiny_recipe.data.prepare_kwargs(), "out": data, "synthetic_rows": 12})
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 10
    seen = tmp_path / "seen.jsonl"
    plugin = tmp_path / "even.py"
    plugin.write_text(
        "import json\n"
        "def even(prompts, completions, id, answer, **kw):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps(id) + '\\n')\n"
        "    return [1.0 if int(a) % 2 == 0 else 0.0 for a in answer]\n"
    )

    def recipe(steps: int):
        return load_recipe(
            REPO_ROOT / "configs" / "tiny-cpu.yaml",
            [
                f"bootstrap.out={tiny_base['path']}",
                f"data.out={data}",
                f"train.output_dir={tmp_path / 'run'}",
                f"train.max_steps={steps}",
                "train.save_steps=4",
                "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
                "train.lr_scheduler_type=constant",  # so that max_steps may grow on resume
                "train.prompts_per_step=2",
                "train.num_generations=2",
                "train.max_completion_length=4",
                "train.eval_heldout=0",
                "train.skip_solved_prompts=1",
                "train.solved_reward=1.0",
                f"rewards=[{{name: '{plugin}:even', weight: 1.0}}]",
            ],
        )

    GRPOTrainer(recipe(8), tiny_base["path"], data, progress=False).train()
    resumed = GRPOTrainer(recipe(12), tiny_base["path"], data, progress=False)
    assert resumed.train().resumed_from == 8

    index = {r["id"]: i for i, r in enumerate(rows)}
    trained = [[index[i] for i in json.loads(line)[::2]] for line in seen.read_text().splitlines()]
    expected = PromptOrder(10, 2, seed=0, skip_turns=1, solved_reward=1.0)
    wanted, skipped = [], 0
    for step in range(12):
        wanted.append(expected.indices(step))
        skipped += expected.skipped(step)
        expected.observe(step, [float(int(rows[i]["answer"]) % 2 == 0) for i in wanted[-1] for _ in range(2)])
    assert trained == wanted
    assert skipped > 0 and wanted != [prompt_indices(s, 10, 2, seed=0) for s in range(12)]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["curriculum/skipped_prompts"] for m in metrics) == skipped
    state = torch.load(tmp_path / "run" / "checkpoint-12" / TRAINER_STATE, weights_only=False)
    assert state["curriculum"] == expected.state()
