"""Turning a completion into text. The final answer in that text is read by `data.answers`, the same reader
the data adapters use for gold solutions, so "what counts as the model's answer" is decided once.

`completion_text` accepts a plain string or TRL's conversational form (a list of messages, each
  `{"role": ..., "content": ...}`, where content may itself be a list of `{"type": "text", "text": ...}`
  parts) and returns the concatenated text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def completion_text(completion: object) -> str:
    """The text of one completion, given as a string or as a TRL conversational list of messages."""
    if (text := _plain_text(completion)) is not None:
        return text
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        return "".join(completion_text(message) for message in completion)
    raise TypeError(
        f"completion must be a string or a list of {{'role', 'content'}} messages, "
        f"got {type(completion).__name__}"
    )


def _plain_text(value: object) -> str | None:
    """The empty string for None, a string as it is; None for anything that still has to be taken apart."""
    if value is None:
        return ""
    return value if isinstance(value, str) else None


def _content_text(content: object) -> str:
    # Message content is a string, or (multimodal chat templates) a list of typed parts of which only text
    # counts.
    if (text := _plain_text(content)) is not None:
        return text
    if isinstance(content, Sequence):
        return "".join(
            part.get("text") or ""
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def completion_texts(completions: Sequence[object]) -> list[str]:
    """`completion_text` for a batch."""
    return [completion_text(c) for c in completions]


def with_column(reward: str, completions: Sequence[object], **column: Sequence) -> list[tuple[str, object]]:
    """(completion text, column value) pairs; a column that is not one value per completion is the caller's
    mistake, named (`accuracy: 2 completions but 1 'answer' value`), not a bare zip error."""
    [(name, values)] = column.items()
    if len(values) != len(completions):
        raise ValueError(
            f"{reward}: {len(completions)} completions but {len(values)} {name!r} value"
            f"{'' if len(values) == 1 else 's'}: the reward needs one {name!r} per completion"
        )
    return list(zip(completion_texts(completions), values, strict=True))
