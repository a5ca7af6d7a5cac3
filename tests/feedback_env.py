"""A user environment for the multi-turn tests, loaded the way a user's is (`rollout.env.name:
tests/feedback_env.py:FeedbackEnvironment`): after a wrong answer the model is told so and answers again.

It needs no tool and no tool-calling model, so any model (the tiny addition base included) plays multi-turn
episodes in it: [prompt | answer | "Wrong, try again." | answer ...]."""

from __future__ import annotations

from data.answers import extract_answer
from trainer.multiturn.environment import Observation

FEEDBACK = "Wrong, try again."


class FeedbackEnvironment:
    def __init__(self, tools=(), tool_timeout_s: float = 10.0):
        pass

    def start(self, row: dict):
        return FeedbackEpisode(str(row.get("answer", "")))


class FeedbackEpisode:
    def __init__(self, answer: str):
        self.answer = answer

    def observe(self, turn_text: str) -> Observation:
        if extract_answer(turn_text) == self.answer:
            return Observation(done=True)
        return Observation([{"role": "user", "content": FEEDBACK}])
