"""The one chat schema every prepared row follows, and the prompt that asks for the reasoning format.

A prepared row is a JSON object:

    {"id": "gsm8k-00042",                      # unique within the prepared set
     "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "<the problem>"}],
     "answer": "18",                           # gold answer, a non-empty string
     "task": "gsm8k",                          # adapter name
     ... task columns ...                      # e.g. nums/target for countdown, images for counting
    }

`prompt` is TRL's conversational format, so a row can be fed to TRL's GRPOTrainer unchanged, and every
column other than `prompt` reaches reward functions as a keyword list (`answer=[...]`, `nums=[...]`).
"""

from __future__ import annotations

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think>"
    "<answer> answer here </answer>"
)

# The same request in few tokens: for tiny models, where a 90-token system prompt would be most of the
# compute.
BRIEF_SYSTEM_PROMPT = "Think in <think> </think>, then answer in <answer> </answer>."
SYSTEM_PROMPTS = {"r1": SYSTEM_PROMPT, "brief": BRIEF_SYSTEM_PROMPT, "none": ""}

REQUIRED_FIELDS = ("id", "prompt", "answer", "task")

# The calculator as the `tools` column of a row offers it (OpenAI / Qwen function schema); the tool itself is
# `trainer.multiturn.tools.CALCULATOR`, built from this.
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression over integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37 * 48"}},
            "required": ["expression"],
        },
    },
}
TOOL_SCHEMAS = {"calculator": CALCULATOR_SCHEMA}  # the built-in tools' schemas, by name


def resolve_system_prompt(name_or_text: str | None) -> str:
    """A preset name (`r1`, the default; `brief`; `none`) or the literal system prompt text."""
    if name_or_text is None:
        return SYSTEM_PROMPT
    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def make_row(
    row_id: str, question: str, answer: str, task: str, system_prompt: str = SYSTEM_PROMPT, **columns
) -> dict:
    """Build a prepared row in the chat schema; `columns` are task-specific extras."""
    prompt = []
    if system_prompt:
        prompt.append({"role": "system", "content": system_prompt})
    prompt.append({"role": "user", "content": question})
    return {"id": row_id, "prompt": prompt, "answer": answer, "task": task, **columns}


def user_text(row: dict) -> str:
    """The user turn of a prepared row (the problem statement)."""
    return next(m["content"] for m in reversed(row["prompt"]) if m["role"] == "user")


TOOLS_EXPECTED = (
    'a list of tool schemas, each {"type": "function", "function": {"name": ..., "parameters": {...}}} '
    '(or the bare {"name": ..., "parameters": {...}})'
)


def check_tools(value: object) -> list[dict]:
    """A row's `tools` column (the tools its prompt offers) in the OpenAI / Qwen function format, each entry
    as `{"type": "function", "function": {...}}`; raises `FieldError` naming what is wrong."""
    from data.errors import FieldError

    if isinstance(value, str):  # a CSV / Parquet column may hold the JSON as text
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise FieldError("tools", TOOLS_EXPECTED, value) from None
    if not isinstance(value, list) or not value:
        raise FieldError("tools", TOOLS_EXPECTED, value)
    tools = []
    for i, entry in enumerate(value):
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"].strip()
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise FieldError(f"tools[{i}]", TOOLS_EXPECTED, entry)
        tools.append({"type": "function", "function": function})
    return tools


def resolve_tools(specs: list[str]) -> list[dict]:
    """The tool schemas `specs` name (`data.tools`): a built-in tool's name (`TOOL_SCHEMAS`) or a JSON file
    holding a list of schemas."""
    import json
    from pathlib import Path

    from data.errors import DataError, FieldError

    tools = []
    for spec in specs:
        if spec in TOOL_SCHEMAS:
            tools.append(TOOL_SCHEMAS[spec])
            continue
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DataError(
                f"data.tools: {spec!r} is neither a built-in tool ({', '.join(sorted(TOOL_SCHEMAS))}) nor a "
                "JSON file of tool schemas"
            )
        try:
            tools += check_tools(json.loads(path.read_text()))
        except (json.JSONDecodeError, FieldError) as e:
            raise DataError(f"data.tools: {path}: {e}") from None
    return tools
