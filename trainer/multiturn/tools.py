"""Tools a policy may call, and reading its calls out of what it wrote.

A tool is a name, a JSON schema of its arguments (the OpenAI / Qwen `tools` entry a chat template shows the
model) and a Python function of those arguments returning text. Calls are parsed from a model turn in
Qwen2.5's chat-template format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call. Nothing a model writes is ever executed: the built-in `calculator` parses arithmetic itself (the
countdown reward's parser: integers, + - * /, parentheses), and a user's tool receives the parsed JSON
arguments as keyword arguments.

Every way a call can go wrong (malformed JSON, an unknown tool, wrong arguments, the function raising, a call
outlasting its timeout) becomes a `ToolResult` with `error` set, whose text the model then reads as the tool's
answer; none of them raises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from data.schema import CALCULATOR_SCHEMA
from trainer.rewards.runner import call_with_timeout

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
UNCLOSED_CALL = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)
MAX_RESULT_CHARS = 2000  # a tool's answer is cut to this many characters before the model reads it


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments (type: object)
    fn: Callable[..., object]

    def schema(self) -> dict:
        """The tool as a chat template's `tools` entry (OpenAI / Qwen function format)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the block could not be read as a call (then `name` may be None)


@dataclass(frozen=True)
class ToolResult:
    name: str | None
    content: str  # what the model reads as the tool's answer
    error: str | None = None  # "malformed", "unknown tool", "bad arguments", "raised" or "timeout"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in one model turn, in order. A block that is not a JSON object with a string `name` and an
    object `arguments` (or an opened `<tool_call>` never closed) is a `ToolCall` with `error` set."""
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"not JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(None, error='expected a JSON object with a string "name"'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(data["name"], error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(data["name"], arguments))
    if UNCLOSED_CALL.search(text):
        calls.append(ToolCall(None, error="<tool_call> is never closed by </tool_call>"))
    return calls


class ToolRunner:
    """Runs calls against a set of tools, each within `timeout_s` (in a daemon thread: a call that outlasts
    it is answered with a timeout error and left to finish on its own, so a tool should not hold resources
    forever)."""

    def __init__(self, tools: list[Tool], timeout_s: float):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s

    def run(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.name, f"error: malformed tool call: {call.error}", "malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                call.name, f"error: unknown tool {call.name!r} (tools: {known})", "unknown tool"
            )
        missing = [k for k in tool.parameters.get("required", []) if k not in call.arguments]
        if missing:
            return ToolResult(call.name, f"error: missing argument {missing[0]!r}", "bad arguments")
        try:
            value = call_with_timeout(tool.fn, self.timeout_s, f"tool-{tool.name}", **call.arguments)
        except TimeoutError:
            return ToolResult(
                call.name, f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout"
            )
        except TypeError as e:  # unexpected keyword arguments and the like
            return ToolResult(call.name, f"error: {e}", "bad arguments")
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong, training goes on
            return ToolResult(call.name, f"error: {type(e).__name__}: {e}", "raised")
        return ToolResult(call.name, str(value)[:MAX_RESULT_CHARS])


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression over integers (+ - * /, parentheses): an integer, or a
    fraction in lowest terms. Raises ValueError on anything else (it parses, never executes)."""
    from trainer.rewards.countdown import CountdownRejected, evaluate_expression

    if not isinstance(expression, str):
        raise ValueError("expression must be text")
    try:
        value, _ = evaluate_expression(expression)
    except CountdownRejected as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


CALCULATOR = Tool(
    CALCULATOR_SCHEMA["function"]["name"],
    CALCULATOR_SCHEMA["function"]["description"],
    CALCULATOR_SCHEMA["function"]["parameters"],
    calculate,
)
BUILTIN_TOOLS = {CALCULATOR.name: CALCULATOR}


def load_tool(spec: str) -> Tool:
    """A built-in tool's name, or 'package.module:name' / 'path/to/file.py:name' naming a `Tool` (or a
    function returning one)."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown tool {spec!r}: built-in tools are {', '.join(sorted(BUILTIN_TOOLS))}; a tool of your "
            "own is 'package.module:name' or 'path/to/file.py:name'"
        )
    from trainer.plugins import load_plugin

    obj = load_plugin(spec, what="tool")
    tool = obj if isinstance(obj, Tool) else obj()
    if not isinstance(tool, Tool):
        raise TypeError(f"tool {spec!r} is a {type(tool).__name__}, not a trainer.multiturn.tools.Tool")
    return tool
