"""In-domain evaluation: greedy held-out accuracy, format rate and completion length.

Used by the bootstrap (is the base model in its target band?) and by `grpoflow train` (before and after).
Scoring goes through the same reward functions as training, so "accuracy" means one thing everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.prompts import columns_of, encode_prompts
from trainer.rollout.base import SamplingParams


def evaluate_greedy(engine, tokenizer, rows: list[dict], accuracy_fn: Callable, format_fn: Callable | None = None,
                    max_tokens: int = 64, batch_size: int = 256, max_prompt_length: int | None = None,
                    return_samples: bool = False) -> dict:
    """Greedy-decode every row once; return accuracy, format_rate and mean_length (tokens)."""
    correct = formatted = length = 0.0
    samples = []
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = encode_prompts(tokenizer, chunk, max_prompt_length)
        outs = [g[0] for g in engine.generate(prompts, 1, greedy)]
        texts = [c.text for c in outs]
        cols = columns_of(chunk)
        acc = accuracy_fn([r["prompt"] for r in chunk], texts, **cols)
        fmt = format_fn([r["prompt"] for r in chunk], texts, **cols) if format_fn else [0.0] * len(chunk)
        correct += sum(a or 0.0 for a in acc)
        formatted += sum(f or 0.0 for f in fmt)
        length += sum(len(c.token_ids) for c in outs)
        if return_samples:
            samples += [{"id": r.get("id"), "completion": t, "answer": r.get("answer"), "correct": a}
                        for r, t, a in zip(chunk, texts, acc, strict=False)]
    n = max(len(rows), 1)
    result = {"accuracy": correct / n, "format_rate": formatted / n, "mean_length": length / n, "n": len(rows)}
    if return_samples:
        result["samples"] = samples
    return result

