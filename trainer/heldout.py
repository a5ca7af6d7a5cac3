"""In-domain evaluation: greedy held-out accuracy, format rate and completion length, and the answers scored.

`evaluate_greedy` is the one held-out scorer: the bootstrap (is the base model in its target band?), training
(before and after), the pipeline's held-out evaluation and `grpoflow eval`'s `heldout_accuracy` all score
through it, with the same reward functions as training, so "accuracy" means one thing everywhere. Under
several trainer ranks they share the rows, each generating its part with its own engine.

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
from trainer.rollout.base import SamplingParams, contiguous_shares

HELDOUT_BATCH_SIZE = 256  # rows a process generates at once unless its caller sizes it (e.g. to its memory)


def evaluate_greedy(
    engine,
    tokenizer,
    rows: list[dict],
    accuracy_fn: Callable,
    format_fn: Callable | None = None,
    max_tokens: int = 64,
    batch_size: int = HELDOUT_BATCH_SIZE,
    max_prompt_length: int | None = None,
    return_samples: bool = False,
    *,
    rank: int = 0,
    world: int = 1,
    gather: Callable[[object], list] | None = None,
    alone: bool = False,
) -> dict:
    """Greedy-decode every row once; return accuracy, format_rate and mean_length (tokens), and with
    `return_samples` each row's `samples` entry (id, completion, answer, correct).

    Shared by `world` processes (trainer ranks, each calling with its `rank` and its own engine): the rows go
    in rounds of `batch_size` rows per process, each process generating its consecutive part of a round;
    `gather(part)` (every process's part, in rank order: `all_gather_object`) follows each round, so no
    process waits on another for longer than one batch's generation, and each returns the scores of all rows,
    the same as one process generating them in the same batches. `alone`: rank 0 generates every round by
    itself (the others' `engine` cannot generate: a rollout server that rank 0 alone drives)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def score(chunk: list[dict]) -> tuple[tuple[float, float, float], list[dict]]:
        """(correct, formatted, completion tokens) summed over `chunk`, generated at once, and its samples."""
        if not chunk:
            return (0.0, 0.0, 0.0), []
        outs = [g[0] for g in engine.generate(encode_prompts(tokenizer, chunk, max_prompt_length), 1, greedy)]
        texts = [c.text for c in outs]
        cols = columns_of(chunk)
        acc = accuracy_fn([r["prompt"] for r in chunk], texts, **cols)
        fmt = format_fn([r["prompt"] for r in chunk], texts, **cols) if format_fn else [0.0] * len(chunk)
        sums = (sum(a or 0.0 for a in acc), sum(f or 0.0 for f in fmt), sum(len(c.token_ids) for c in outs))
        if not return_samples:
            return sums, []
        return sums, [
            {"id": r.get("id"), "completion": t, "answer": r.get("answer"), "correct": a}
            for r, t, a in zip(chunk, texts, acc, strict=False)
        ]

    correct = formatted = length = 0.0
    samples = []
    per_round = batch_size if alone or world == 1 else batch_size * world
    for start in range(0, len(rows), per_round):
        chunk = rows[start : start + per_round]
        lo, hi = (0, len(chunk)) if alone or world == 1 else contiguous_shares(len(chunk), world)[rank]
        part = score(chunk[lo:hi] if rank == 0 or not alone else [])
        for sums, scored in gather(part) if world > 1 else [part]:
            correct, formatted, length = correct + sums[0], formatted + sums[1], length + sums[2]
            samples += scored
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
