"""The format reward and the math-verify based correctness rewards (`format`, `accuracy`, `counting`).

All three follow TRL's reward signature, `f(prompts, completions, **columns) -> list[float | None]`, read the
gold answer from the `answer` column, and ignore every other column. The model's answer, and a gold answer
written in tags or a box, are read by `data.answers.extract_answer` (last `<answer>` block, else last
`\\boxed{}`).

`accuracy` and `counting` return None only when the gold answer is missing or unparseable (the row's fault,
not the model's); a missing, empty, unparseable or too costly model answer is 0.0. The math-verify comparison
itself runs in `math_grader`'s worker process, so that no answer can hang training.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from data.answers import extract_answer
from trainer.rewards.math_grader import grade_answer
from trainer.rewards.parsing import completion_texts, with_column
from trainer.rewards.runner import bounds_own_work

# Longer "answers" are not graded (0.0): no gold answer is this long, and each costs a trip to the worker.
MAX_ANSWER_CHARS = 1000

_TAG_FREE = r"(?:(?!</?think>|</?answer>).)*"
_FORMAT = re.compile(rf"\s*<think>({_TAG_FREE})</think>\s*<answer>({_TAG_FREE})</answer>\s*", re.DOTALL)


@bounds_own_work
def format_reward(prompts: Sequence, completions: Sequence, **_columns) -> list[float]:
    """1.0 iff the completion is exactly `<think>…</think><answer>…</answer>`, whitespace aside; else 0.0.

    Each tag appears exactly once, neither block contains another think/answer tag, both blocks have
    non-whitespace content, and there is no text before, between or after them.
    """
    rewards = []
    for text in completion_texts(completions):
        match = _FORMAT.fullmatch(text)
        ok = match is not None and match.group(1).strip() != "" and match.group(2).strip() != ""
        rewards.append(1.0 if ok else 0.0)
    return rewards


@bounds_own_work
def accuracy_reward(
    prompts: Sequence, completions: Sequence, answer: Sequence, **_columns
) -> list[float | None]:
    """1.0 if the final answer (last `<answer>` block, else last `\\boxed{}`) equals the gold `answer`
    under math-verify; 0.0 otherwise; None if the gold answer cannot be parsed."""
    return [
        grade_math_answer(text, gold) for text, gold in with_column("accuracy", completions, answer=answer)
    ]


@bounds_own_work
def counting_reward(
    prompts: Sequence, completions: Sequence, answer: Sequence, **_columns
) -> list[float | None]:
    """1.0 if the final answer equals the gold count, by math-verify or, failing that, as the same stripped
    string (so a gold answer math-verify cannot read is still gradable); None only if the gold is empty."""
    rewards: list[float | None] = []
    for text, gold in with_column("counting", completions, answer=answer):
        gold_text = _gold_text(gold)
        if not gold_text:
            rewards.append(None)
            continue
        predicted = extract_answer(text)
        if not predicted or len(predicted) > MAX_ANSWER_CHARS:
            rewards.append(0.0)
        elif predicted == gold_text:
            rewards.append(1.0)
        else:
            rewards.append(1.0 if grade_answer(gold_text, predicted) == 1.0 else 0.0)
    return rewards


def grade_math_answer(text: str, gold: object) -> float | None:
    """Correctness of one completion's final answer against one gold answer: 1.0, 0.0, or None (bad gold)."""
    gold_text = _gold_text(gold)
    if not gold_text:
        return None
    predicted = extract_answer(text) or ""
    if len(predicted) > MAX_ANSWER_CHARS:
        predicted = ""
    # Even with no answer the grader is asked: it alone tells 0.0 (no answer) from None (unreadable gold).
    return grade_answer(gold_text, predicted)


def _gold_text(gold: object) -> str:
    """The gold answer as text; one written in `<answer>` tags or a `\\boxed{}` is read like a model's."""
    text = "" if gold is None else str(gold).strip()
    answer = extract_answer(text)
    return text if answer is None else answer
