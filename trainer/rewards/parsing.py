"""Turning a completion into text and finding the final answer in it.

Every reward reads completions through this module, so "what counts as the model's answer" is decided once:

- `completion_text` accepts a plain string or TRL's conversational form (a list of messages, each
  `{"role": ..., "content": ...}`, where content may itself be a list of `{"type": "text", "text": ...}` parts)
  and returns the concatenated text.
- `extract_answer` returns the content of the LAST well-formed `<answer>…</answer>` block: an opening tag, then
  text containing no `<answer>` or `</answer>`, then the closing tag. The last block wins because it is the model's
  final word; grading only one block means repeating the tag cannot buy extra guesses (and `format` gives 0.0 to
  any completion with more than one). An unclosed block (a truncated completion) is no answer.
- `last_boxed` returns the content of the last `\\boxed{…}` whose braces balance (escaped `\\{ \\}` are not counted).
- `final_answer` is `extract_answer`, falling back to `last_boxed` only when there is no answer block at all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# Tempered dot: the block's content may not contain another answer tag, so `<answer>a<answer>b</answer>`
# yields "b" (the innermost well-formed block), never "a<answer>b".
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
_BOXED = "\\boxed{"


def completion_text(completion: object) -> str:
    """The text of one completion, given as a string or as a TRL conversational list of messages."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        return "".join(completion_text(message) for message in completion)
    raise TypeError(
        f"completion must be a string or a list of {{'role', 'content'}} messages, got {type(completion).__name__}"
    )


def _content_text(content: object) -> str:
    # Message content is a string, or (multimodal chat templates) a list of typed parts of which only text counts.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            part.get("text") or "" for part in content if isinstance(part, Mapping) and part.get("type") == "text"
        )
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def completion_texts(completions: Sequence[object]) -> list[str]:
    """`completion_text` for a batch."""
    return [completion_text(c) for c in completions]


def extract_answer(text: str) -> str | None:
    """Stripped content of the last well-formed `<answer>…</answer>` block, or None if there is none."""
    last = None
    for match in _ANSWER_BLOCK.finditer(text):
        last = match
    return None if last is None else last.group(1).strip()


def last_boxed(text: str) -> str | None:
    """Stripped content of the last `\\boxed{…}` with balanced braces, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        content = _balanced_group(text, start + len(_BOXED))
        if content is not None:
            return content.strip()
        # Unbalanced (typically a truncated completion): an earlier, complete box is still an answer.
        start = text.rfind(_BOXED, 0, start)
    return None


def _balanced_group(text: str, begin: int) -> str | None:
    """The text from `begin` up to the brace closing the one just before it, or None if it never closes."""
    depth, i = 1, begin
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character, `\{` or `\}` included, does not open or close the group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def final_answer(text: str) -> str | None:
    """The answer to grade: the last `<answer>` block, else the last `\\boxed{}`, else None."""
    answer = extract_answer(text)
    return answer if answer is not None else last_boxed(text)
