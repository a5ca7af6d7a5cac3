"""The one answer reader (`data.answers`), for gold solutions and model completions alike.

Until it existed, `data/adapters.py` and `trainer/rewards/parsing.py` each had a `last_boxed`, and they
disagreed on the first group of cases below: the data side read `\\boxed {12}` as 12 while the reward side
found nothing, so a gold answer and a model answer written the same way were read differently.
"""

from __future__ import annotations

import pytest

from data import adapters
from data.answers import extract_answer, final_answer, last_boxed
from trainer import rewards
from trainer.rewards import math_rewards

DISAGREED = [
    ("\\boxed {12}", "12"),  # space before the brace: LaTeX reads it as \boxed{12}
    ("\\boxed\t{12}", "12"),
    ("\\fbox{12}", "12"),  # MATH writes some answers with \fbox
    ("\\boxed{\\}} and more", "\\}"),  # an escaped brace is content, not grouping
    ("\\boxed{a \\{ b}", "a \\{ b"),
    ("\\boxed{7} then \\boxed {8", "7"),  # last box cut off: the earlier complete one counts
]


@pytest.mark.parametrize("text, expected", DISAGREED + [
    ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{1} then \\boxed{ {a}{b} }", "{a}{b}"),  # several boxes: the last; nested groups kept
    ("\\boxed{1} and \\fbox{2}", "2"),
    ("\\boxed{\\boxed{3}}", "3"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxedfoo{5}", None),  # not the \boxed command
    ("\\boxed{unclosed", None),
    ("no box here", None),
    ("", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_data_and_rewards_use_the_same_reader():
    # One function object, not two copies that can drift apart again.
    assert adapters.last_boxed is last_boxed
    assert rewards.last_boxed is last_boxed and rewards.final_answer is final_answer
    assert math_rewards.final_answer is final_answer


@pytest.mark.parametrize("text", [t for t, _ in DISAGREED])
def test_gold_and_model_answers_read_alike(text):
    gold = adapters.math({"problem": "p", "solution": text}).answer
    assert gold == final_answer(text) == last_boxed(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>18</answer>", "18"),
        ("<answer> 18 \n</answer>", "18"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last block is the final word
        ("<answer>a<answer>b</answer>", "b"),  # innermost well-formed block
        ("<answer>18", None),  # truncated: no answer
        ("18", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>5</answer> \\boxed{6}", "5"),  # an answer block wins over a box
        ("reasoning \\boxed {6}", "6"),  # no block: the last box
        ("<answer>5", None),
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected
