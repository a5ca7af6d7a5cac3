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
