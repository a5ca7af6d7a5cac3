"""From prepared rows to what a model and the rewards get: chat-templated prompt tokens, and the other
columns.

One encoding for training, held-out evaluation and the model server, so a served checkpoint sees exactly the
prompts it was trained on.
"""

from __future__ import annotations


def encode_prompts(tokenizer, rows: list[dict], max_prompt_length: int | None = None) -> list[list[int]]:
    """Chat-template each row's `prompt` messages (with the tool schemas of its `tools` column) and tokenize;
    left-truncate to `max_prompt_length`. A text prompt carries its row (`RowPrompt`).

    A row with `images` becomes a `trainer.vision.PromptIds` carrying its vision inputs (a vision model's
    tokenizer has its `trainer.vision.VisionEncoder` as `tokenizer.vision`); image placeholders are never cut:
    a prompt longer than `max_prompt_length` with its images is a ValueError naming the row."""
    vision = getattr(tokenizer, "vision", None)
    if vision is None and not any(r.get("images") or r.get("videos") or r.get("audios") for r in rows):
        return _encode_text(tokenizer, rows, max_prompt_length)
    from trainer.vision import check_media

    ids = []
    for row in rows:
        check_media(row, vision)
        if not row.get("images"):
            ids += _encode_text(tokenizer, [row], max_prompt_length)
            continue
        ids.append(vision.encode(tokenizer, row))
        if max_prompt_length and len(ids[-1]) > max_prompt_length:
            raise ValueError(
                f"row {row.get('id')!r}: its prompt is {len(ids[-1])} tokens with its images, over "
                f"train.max_prompt_length {max_prompt_length}; image tokens cannot be cut: raise the "
                "limit or lower the image processor's max_pixels"
            )
    return ids


def _encode_text(tokenizer, rows: list[dict], max_prompt_length: int | None) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(
            r["prompt"],
            tokenize=False,
            add_generation_prompt=True,
            **({"tools": r["tools"]} if r.get("tools") else {}),
        )
        for r in rows
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if max_prompt_length:
        ids = [s[-max_prompt_length:] for s in ids]
    return [RowPrompt(s, r) for s, r in zip(ids, rows, strict=True)]


class RowPrompt(list):
    """A text prompt's token ids, with the row it was encoded from (`row`): a multi-turn environment starts
    its episode from it (`trainer.multiturn`)."""

    def __init__(self, ids=(), row: dict | None = None):
        super().__init__(ids)
        self.row = row

    def __reduce__(self):
        return RowPrompt, (list(self), self.row)


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Every column other than `prompt`, as keyword lists for reward functions."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}
