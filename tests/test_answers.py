"""The one answer reader, `data.answers.extract_answer`, for gold solutions and model completions alike.

Hand-written texts, read directly and through every place that reads an answer: data prep (the `math` and
`counting` adapters, via `data.prepare`), the `accuracy`, `counting` and `countdown` rewards, and the
thinking-efficiency scorer. Each case says what a reader must take out of the text.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from data import adapters, answers
from data.answers import extract_answer
from data.prepare import load_prepared, prepare
from evaluation import thinking
from trainer import rewards
from trainer.rewards import accuracy_reward, countdown, counting_reward, math_rewards

# Texts whose reading must be the same in prep, in the rewards and in evaluation.
TWO_BLOCKS = "<answer> 3 </answer> <answer> 4 </answer>"  # several blocks: the last one is the answer
SPACED_BOX = "\\boxed {12}"  # a space after \boxed, valid LaTeX for \boxed{12}


@pytest.mark.parametrize(
    "text, expected",
    [
        (SPACED_BOX, "12"),
        ("\\boxed\t{12}", "12"),
        ("\\boxed{ 12 }", "12"),
        ("\\fbox{12}", "12"),  # MATH writes some answers with \fbox
        ("\\boxed{\\}} and more", "\\}"),  # an escaped brace is content, not grouping
        ("\\boxed{a \\{ b}", "a \\{ b"),
        ("\\boxed{7} then \\boxed {8", "7"),  # last box cut off: the earlier complete one counts
        ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{1} then \\boxed{ {a}{b} }", "{a}{b}"),  # several boxes: the last; nested groups kept
        ("\\boxed{1} and \\fbox{2}", "2"),
        ("\\boxed{\\boxed{3}}", "3"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxedfoo{5}", None),  # not the \boxed command
        ("\\boxed{unclosed", None),
        ("no box here", None),
        ("", None),
    ],
)
def test_a_text_without_answer_tags_gives_its_last_complete_box(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>18</answer>", "18"),
        ("<answer> 18 \n</answer>", "18"),
        (TWO_BLOCKS, "4"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<answer>a<answer>b</answer>", "b"),  # the innermost well-formed block
        ("<answer>18", None),  # truncated: no block, and no box either
        ("<answer></answer>", ""),  # an empty answer is an answer (a wrong one), not a missing one
        ("18", None),
        ("<answer>5</answer> \\boxed{6}", "5"),  # a block wins over a box outside it
        ("<answer>5", None),
        ("reasoning <answer>18", None),
        ("<answer>\\boxed {12}</answer>", "12"),  # a box inside the block is unwrapped, spaces and all
        ("<answer>\\boxed{ 12 }</answer>", "12"),
        ("<answer>$\\boxed{\\frac{1}{2}}$</answer>", "\\frac{1}{2}"),
        (
            "<answer>\\boxed{12</answer>",
            "\\boxed{12",
        ),  # an unclosed box inside the block: the block as written
        ("<answer>$\\frac{1}{2}$</answer>", "$\\frac{1}{2}$"),  # other LaTeX stays for the grader to read
    ],
)
def test_the_last_answer_block_wins_and_a_box_inside_it_is_unwrapped(text, expected):
    assert extract_answer(text) == expected


def test_every_reader_is_the_one_function():
    # One function object everywhere: no second copy that can drift apart.
    assert adapters.extract_answer is extract_answer
    assert rewards.extract_answer is extract_answer
    assert math_rewards.extract_answer is extract_answer
    assert countdown.extract_answer is extract_answer
    assert thinking.extract_answer is extract_answer
    assert [
        name
        for name in vars(answers)
        if not name.startswith("_")
        and callable(vars(answers)[name])
        and getattr(vars(answers)[name], "__module__", None) == "data.answers"
    ] == ["extract_answer"]


def _prepared_answers(tmp_path, task: str, rows: list[dict]) -> list[str]:
    source = tmp_path / f"{task}.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    prepare(task, str(source), tmp_path / task, heldout=0)
    return [row["answer"] for row in load_prepared(tmp_path / task, "train")]


@pytest.mark.parametrize("text, expected", [(TWO_BLOCKS, "4"), (SPACED_BOX, "12")])
def test_prep_reads_a_gold_answer_as_the_rewards_read_a_model_answer(tmp_path, text, expected):
    assert _prepared_answers(tmp_path, "math", [{"problem": "p", "solution": text}]) == [expected]
    assert _prepared_answers(tmp_path, "math", [{"problem": "p", "answer": text}]) == [expected]


def test_prep_reads_a_counting_row_in_tags_or_a_box(tmp_path):
    images = [tmp_path / f"{color}.png" for color in ("red", "green", "blue")]  # distinct rows, kept apart
    for image in images:
        Image.new("RGB", (4, 4), image.stem).save(image)
    counts = [{"solution": TWO_BLOCKS}, {"answer": SPACED_BOX}, {"count": "5"}]
    rows = [{"image": str(image), **count} for image, count in zip(images, counts, strict=True)]
    assert sorted(_prepared_answers(tmp_path, "counting", rows)) == ["12", "4", "5"]


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        (SPACED_BOX, "12", 1.0),
        ("<answer>\\boxed {12}</answer>", "12", 1.0),
        ("<answer>\\boxed{ 12 }</answer>", "12", 1.0),
        (TWO_BLOCKS, "4", 1.0),
        (TWO_BLOCKS, "3", 0.0),
        ("<answer>12</answer>", SPACED_BOX, 1.0),  # a gold answer in a box is read like the model's
        ("<answer>4</answer>", TWO_BLOCKS, 1.0),
    ],
)
def test_the_accuracy_and_counting_rewards_read_answers_alike(completion, gold, expected):
    assert accuracy_reward(["p"], [completion], answer=[gold]) == [expected]
    assert counting_reward(["p"], [completion], answer=[gold]) == [expected]


def test_the_countdown_reward_reads_the_same_final_answer():
    nums, target = [[30, 100, 93]], [23]
    for completion, expected in [
        ("<answer>1</answer><answer>30 - (100 - 93)</answer>", 1.0),
        ("<answer>30 - (100 - 93)</answer><answer>1</answer>", 0.0),
        ("so \\boxed {30 - (100 - 93)}", 1.0),
        ("<answer>\\boxed{30 - (100 - 93)}</answer>", 1.0),
    ]:
        assert countdown.countdown_reward(["p"], [completion], nums=nums, target=target) == [expected], (
            completion
        )


class Words:
    """A tokenizer whose tokens are the whitespace-separated words."""

    def encode(self, text):
        return text.split()


@pytest.mark.parametrize(
    "output, gold, correct",
    [
        (f"<think>I add.</think>{SPACED_BOX}", "12", True),
        (f"<think>I add.</think><answer>{SPACED_BOX}</answer>", "12", True),
        (f"<think>I add.</think>{TWO_BLOCKS}", "4", True),
        (f"<think>I add.</think>{TWO_BLOCKS}", "3", False),
    ],
)
def test_the_thinking_scorer_reads_answers_as_the_rewards_do(output, gold, correct):
    row = thinking.sample_metrics(output, gold, thinking.token_counter(Words()))
    assert row["correct"] is correct


def test_the_thinking_scorer_finds_a_spaced_box_in_the_reasoning():
    # "x = \boxed {12}" is the first paragraph: the answer was there from the start.
    row = thinking.sample_metrics(
        "<think>x = \\boxed {12}\n\nI check it.</think>\\boxed{12}", "12", thinking.token_counter(Words())
    )
    assert (row["correct"], row["first_correct_paragraph"], row["first_correct_tokens"]) == (True, 1, 4)
