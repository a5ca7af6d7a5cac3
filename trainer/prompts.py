"""From prepared rows to what a model and the rewards get: chat-templated prompt tokens, and the other columns.

One encoding for training, held-out evaluation and the model server, so a served checkpoint sees exactly the
prompts it was trained on.
"""

from __future__ import annotations


def encode_prompts(tokenizer, rows: list[dict], max_prompt_length: int | None = None) -> list[list[int]]:
    """Chat-template each row's `prompt` messages and tokenize; left-truncate to `max_prompt_length`."""
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if max_prompt_length:
        ids = [s[-max_prompt_length:] for s in ids]
    return ids


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Every column other than `prompt`, as keyword lists for reward functions."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}
