"""In-domain evaluation: greedy held-out accuracy, format rate and completion length, and the answers scored.

`evaluate_greedy` is the one held-out scorer: the bootstrap (is the base model in its target band?), training
(before and after), the pipeline's held-out evaluation and `grpoflow eval`'s `heldout_accuracy` all score
through it, with the same reward functions as training, so "accuracy" means one thing everywhere.

Training keeps the answers it scored in its run directory (`write_samples`: `heldout/before.jsonl`,
`heldout/after.jsonl`, named with their sha256 in the scores it returns), so that what comes after it (the
before/after answers plot, the pipeline's held-out evaluation) reads them instead of generating them again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from data.manifest import sha256_file, write_jsonl_atomic
from trainer.prompts import columns_of, encode_prompts
from trainer.rollout.base import SamplingParams


def evaluate_greedy(
    engine,
    tokenizer,
    rows: list[dict],
    accuracy_fn: Callable,
    format_fn: Callable | None = None,
    max_tokens: int = 64,
    batch_size: int = 256,
    max_prompt_length: int | None = None,
    return_samples: bool = False,
) -> dict:
    """Greedy-decode every row once; return accuracy, format_rate and mean_length (tokens), and with
    `return_samples` each row's `samples` entry (id, completion, answer, correct)."""
    correct = formatted = length = 0.0
    samples = []
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
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
            samples += [
                {"id": r.get("id"), "completion": t, "answer": r.get("answer"), "correct": a}
                for r, t, a in zip(chunk, texts, acc, strict=False)
            ]
    n = max(len(rows), 1)
    result = {
        "accuracy": correct / n,
        "format_rate": formatted / n,
        "mean_length": length / n,
        "n": len(rows),
    }
    if return_samples:
        result["samples"] = samples
    return result


SAMPLES_DIR = "heldout"  # in a run directory: the held-out answers training scored, one file per moment


def write_samples(run_dir: str | os.PathLike, name: str, result: dict) -> dict:
    """`result` (`evaluate_greedy`'s, with its samples) with the samples written to
    `<run_dir>/heldout/<name>.jsonl` and named instead of held: `samples_path` and `samples_sha256`."""
    path = Path(run_dir) / SAMPLES_DIR / f"{name}.jsonl"
    write_jsonl_atomic(path, result["samples"])
    scores = {k: v for k, v in result.items() if k != "samples"}
    return {**scores, "samples_path": str(path), "samples_sha256": sha256_file(path)}


def read_samples(scores: dict) -> list[dict] | None:
    """The samples that `scores` (a `write_samples` result) name, or None when it names none or the file is
    no longer the one written (gone, or rewritten by a later run in the same directory)."""
    path = scores.get("samples_path")
    if not path or not Path(path).is_file() or sha256_file(path) != scores.get("samples_sha256"):
        return None
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
