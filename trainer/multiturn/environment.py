"""Environments: what a trajectory starts from, and what the model sees after each of its turns.

An `Environment` starts one `Episode` per trajectory from its data row (the row's `prompt` messages are the
first messages; the episode may keep whatever state of the row it needs). After each model turn the episode
returns an `Observation`: the messages the model reads next (tool results as `tool` messages, feedback as
`user` messages) and whether the episode is over. The rewards apply to the final model turn, as in
single-turn training; a reward function that wants the whole trajectory reads its `trajectory` keyword
(turns, tool calls, errors, the messages), which is how an environment's own reward parts are written.

Built in: `tools` (`ToolEnvironment`): the model may call the recipe's tools; a turn without a call is the
final answer. A user's environment is 'package.module:Class' or 'path/to/file.py:Class' in `rollout.env.name`,
constructed with the recipe's `rollout.env` settings (`tools` as `Tool` objects, `tool_timeout_s`, `args`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from trainer.multiturn.tools import Tool, ToolRunner, load_tool, parse_tool_calls


@dataclass
class Observation:
    messages: list[dict] = field(default_factory=list)  # what the model reads before its next turn
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Episode(Protocol):
    def observe(self, turn_text: str) -> Observation:
        """The environment's answer to one model turn (the turn's text, special tokens removed)."""


class Environment(Protocol):
    def start(self, row: dict) -> Episode:
        """A new episode for the data row `row` (its `prompt` is already the model's first input)."""


class ToolEnvironment:
    """The model calls tools until it writes a turn without a call, which is its final answer.

    A row's `tools` column (the schemas its prompt shows) must name only tools this environment has; each
    call is answered by the tool (or by an error message the model reads) as a `tool` message."""

    def __init__(self, tools: list[Tool], tool_timeout_s: float = 10.0, **args):
        if args:
            raise ValueError(f"rollout.env.args: the tools environment takes none, got {sorted(args)}")
        self.runner = ToolRunner(tools, tool_timeout_s)

    def start(self, row: dict) -> ToolEpisode:
        for entry in row.get("tools") or []:
            name = (entry.get("function") or entry).get("name") if isinstance(entry, dict) else None
            if name not in self.runner.tools:
                raise ValueError(
                    f"row {row.get('id')!r} offers the tool {name!r}, which rollout.env.tools does not have "
                    f"({', '.join(sorted(self.runner.tools)) or 'none'})"
                )
        return ToolEpisode(self.runner)


class ToolEpisode:
    def __init__(self, runner: ToolRunner):
        self.runner = runner

    def observe(self, turn_text: str) -> Observation:
        calls = parse_tool_calls(turn_text)
        if not calls:
            return Observation(done=True)
        results = [self.runner.run(c) for c in calls]
        return Observation(
            [{"role": "tool", "name": r.name or "unknown", "content": r.content} for r in results],
            done=False,
            tool_calls=len(calls),
            tool_errors=sum(r.error is not None for r in results),
        )


def make_environment(cfg) -> Environment:
    """The environment `cfg` (a recipe's `rollout.env`, `trainer.recipe.EnvConfig`) names."""
    tools = [load_tool(spec) for spec in cfg.tools]
    if cfg.name == "tools":
        return ToolEnvironment(tools, cfg.tool_timeout_s, **cfg.args)
    from trainer.plugins import load_plugin

    return load_plugin(cfg.name, what="environment")(
        tools=tools, tool_timeout_s=cfg.tool_timeout_s, **cfg.args
    )
