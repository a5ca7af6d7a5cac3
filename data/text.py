"""Text that no UTF-8 output can hold. JSON's `\\ud800` escape reads as a lone UTF-16 surrogate, which Python
keeps in a `str` until the first write or tokenizer call fails on it; every reader of user JSON (the prepare
stage's sources, the model server's requests) refuses it where it is read, naming the field."""

from __future__ import annotations

SURROGATE_PROBLEM = "text with an unpaired surrogate escape (\\ud800-\\udfff), which is not a character"


def unpaired_surrogate(value: object, where: str = "") -> str | None:
    """Where the first text of `value` with a lone surrogate is (`problem`, `messages[0].content`, a key as
    `videos.<key>`), or None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "<text>"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if unpaired_surrogate(key) is not None:
                return f"{where}.<key>" if where else "<key>"
            if (found := unpaired_surrogate(item, inner)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := unpaired_surrogate(item, f"{where}[{i}]")) is not None:
                return found
    return None
