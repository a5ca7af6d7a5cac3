"""`MultiTurnEngine`: any rollout engine made to generate whole multi-turn trajectories.

A trajectory is [prompt | model turn | observation | model turn | ...], kept as token ids from start to end:
each model turn is sampled by the wrapped engine from the ids so far (never from re-tokenized text, so the
trainer's forward sees exactly the tokens the engine conditioned on), and each observation (the
environment's messages, rendered by the tokenizer's chat template as the text that follows an assistant turn)
is tokenized and appended. The returned `Completion` holds every token after the prompt, with the engine's
log-probs on the model's tokens and 0 on the observation's, and `token_mask` 1 on the model's tokens only:
the loss never sees a token the model did not write.

Limits: `max_turns` model turns, and `sampling.max_tokens` tokens after the prompt in all (model and
observation tokens together, so that a trajectory fits the trainer's max_completion_length). A trajectory
that reaches either is cut: `finish_reason` "length" and `trajectory["cut"]` "max_turns" or "max_tokens".

The first turn samples `n` completions per prompt in one call (one prefill per prompt); each later turn
samples one continuation per trajectory still going, all in one call, seeded from the batch's seed and the
turn. A call that generates one share of a batch (`SamplingParams.share`) samples its first turn as the whole
batch would; its later turns are seeded by their share, so trainer ranks' trajectories are not those of one
rank generating the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainer.multiturn.environment import Environment, Episode
from trainer.rollout.base import Completion, SamplingParams

CONTENT_MARK = "\u2063grpoflow-turn\u2063"  # stands for a model turn when the template renders what follows


def row_of(prompt) -> dict:
    """The data row a prompt was encoded from (`trainer.prompts.encode_prompts` attaches it), or {}."""
    return getattr(prompt, "row", None) or {}


def observation_text(tokenizer, messages: list[dict]) -> str:
    """The text the chat template puts after a finished assistant turn (after its end-of-turn token) when
    `messages` follow it, up to and including the next assistant turn's opening."""
    history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": CONTENT_MARK}]
    full = tokenizer.apply_chat_template(history + messages, tokenize=False, add_generation_prompt=True)
    after = full[full.index(CONTENT_MARK) + len(CONTENT_MARK) :]
    eos = tokenizer.eos_token or ""
    return after[len(eos) :] if eos and after.startswith(eos) else after


@dataclass
class Trajectory:
    prompt: list[int]
    episode: Episode
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut: str | None = None
    done: bool = False
    last: Completion | None = None
    version: int | None = None

    def add_turn(self, c: Completion, budget: int) -> None:
        room = budget - len(self.token_ids)
        ids, logps = c.token_ids[:room], c.logprobs[:room]
        self.token_ids += ids
        self.logprobs += logps
        self.mask += [1] * len(ids)
        self.turns += 1
        self.version = c.policy_version if self.version is None else min(self.version, c.policy_version)
        self.last = c if len(ids) == len(c.token_ids) else replace(c, finish_reason="length")
        self.messages.append({"role": "assistant", "content": c.text})

    def completion(self) -> Completion:
        cut = self.cut
        return Completion(
            self.token_ids,
            self.logprobs,
            "length" if cut else self.last.finish_reason,
            self.version or 0,
            self.last.text,
            token_mask=self.mask,
            trajectory={
                "turns": self.turns,
                "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors,
                "cut": cut,
                "messages": self.messages,
            },
        )


class MultiTurnEngine:
    """`engine` generating trajectories in `env` (see the module docstring); everything else is the
    engine's own (weights, sleep, version)."""

    def __init__(self, engine, tokenizer, env: Environment, max_turns: int):
        self.inner, self.tokenizer, self.env, self.max_turns = engine, tokenizer, env, max_turns

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def __getattr__(self, name):  # update_weights, sleep, wake_up, model, ... are the engine's
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        budget = sampling.max_tokens
        groups = [[Trajectory(list(p), self.env.start(row_of(p))) for _ in range(n)] for p in prompts]
        firsts = self.inner.generate(prompts, n, sampling)
        for group, outs in zip(groups, firsts, strict=True):
            for t, c in zip(group, outs, strict=True):
                self._after_turn(t, c, budget)
        turn = 1
        while active := [t for g in groups for t in g if not t.done]:
            seed = (
                None
                if sampling.seed is None
                else sampling.seed + 7919 * turn + 104729 * sampling.first_prompt
            )
            room = max(budget - len(t.token_ids) for t in active)
            nexts = self.inner.generate(
                [t.prompt + t.token_ids for t in active],
                1,
                replace(sampling, max_tokens=room, seed=seed, share=None),
            )
            for t, (c,) in zip(active, nexts, strict=True):
                self._after_turn(t, c, budget)
            turn += 1
        return [[t.completion() for t in g] for g in groups]

    def _after_turn(self, t: Trajectory, c: Completion, budget: int) -> None:
        t.add_turn(c, budget)
        if t.last.finish_reason == "length":  # the turn did not end: no observation can follow it
            t.cut, t.done = "max_tokens", True
            return
        obs = t.episode.observe(c.text)
        t.tool_calls += obs.tool_calls
        t.tool_errors += obs.tool_errors
        if obs.done:
            t.done = True
            return
        if t.turns >= self.max_turns:
            t.cut, t.done = "max_turns", True
            return
        ids = self.tokenizer(observation_text(self.tokenizer, obs.messages), add_special_tokens=False)[
            "input_ids"
        ]
        if len(t.token_ids) + len(ids) >= budget:  # no room left for the model to answer it
            t.cut, t.done = "max_tokens", True
            return
        t.messages += obs.messages
        t.token_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.mask += [0] * len(ids)


def multiturn_metrics(completions: list[Completion]) -> dict:
    """Turns, tool calls and errors per trajectory, and the fraction cut by each limit (multi-turn batches
    only: {} when no completion is a trajectory)."""
    infos = [c.trajectory for c in completions if c.trajectory is not None]
    if not infos:
        return {}
    k = len(infos)
    return {
        "multiturn/turns": sum(i["turns"] for i in infos) / k,
        "multiturn/tool_calls": sum(i["tool_calls"] for i in infos) / k,
        "multiturn/tool_errors": sum(i["tool_errors"] for i in infos) / k,
        "multiturn/cut_max_turns": sum(i["cut"] == "max_turns" for i in infos) / k,
        "multiturn/cut_max_tokens": sum(i["cut"] == "max_tokens" for i in infos) / k,
        "multiturn/model_tokens": sum(sum(c.token_mask) for c in completions if c.trajectory) / k,
    }


def in_environment(engine, tokenizer, env_cfg):
    """`engine` generating trajectories in the environment `env_cfg` (a recipe's `rollout.env`, `EnvConfig`)
    names; `engine` itself when that is None (single-turn)."""
    if env_cfg is None:
        return engine
    from trainer.multiturn.environment import make_environment

    return MultiTurnEngine(engine, tokenizer, make_environment(env_cfg), env_cfg.max_turns)
