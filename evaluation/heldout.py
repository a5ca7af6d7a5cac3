"""The held-out split as an evaluation: every held-out problem scored greedily, written as a work dir that
`evaluation.compare` pairs problem by problem, as it pairs EvalScope's reviews.

A recipe with `eval.benchmarks: []` (the vision demo) has no EvalScope run: its prepared held-out rows are its
evaluation. They are scored the way training scores them (`trainer.heldout.evaluate_greedy`: the first
`train.eval_heldout` rows, greedy, at most `train.max_completion_length` tokens, the `accuracy` reward), so
the score is the held-out accuracy training reports, kept here problem by problem. Layout of a work dir:

    heldout/samples.jsonl   one line per held-out row: id, answer, completion, correct (1.0 or 0.0)
    report.json             benchmarks ["heldout"], scores {"heldout": accuracy}, num_samples, and under
                            "heldout" the settings that made it (see `heldout_settings`) and the samples' path

`report.json` is written last: its presence means the evaluation finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from data.manifest import MANIFEST, read_manifest, write_json_atomic, write_jsonl_atomic

HELDOUT = "heldout"  # the benchmark name of the held-out evaluation in report.json and in comparisons
SAMPLES = f"{HELDOUT}/samples.jsonl"
# What decides the scores: the same rows (data and count), the same token budgets
SETTING_KEYS = ("data_sha256", "limit", "max_tokens", "max_prompt_length", "env")


def heldout_settings(recipe) -> dict:
    """The held-out evaluation a recipe asks for. `data_sha256` is None when the recipe's data is not prepared
    on this machine: an evaluation of any data then stands for it (a comparison still refuses to pair two
    evaluations of different data)."""
    data_dir = Path(recipe.data.out).expanduser().resolve()
    sha = read_manifest(data_dir).get("sha256") if (data_dir / MANIFEST).is_file() else None
    return {
        "data_dir": str(data_dir),
        "data_sha256": sha,
        "limit": recipe.train.eval_heldout,
        "max_tokens": recipe.train.max_completion_length,
        "max_prompt_length": recipe.train.max_prompt_length,
        # a multi-turn recipe's held-out problems are solved in its environment (with its tools)
        "env": None if recipe.rollout.env is None else dataclasses.asdict(recipe.rollout.env),
    }


def made_with_heldout(report: dict, wanted: dict) -> bool:
    """Whether a finished evaluation (its report.json) is a held-out one made with the `wanted` settings."""
    recorded = report.get(HELDOUT)
    if not isinstance(recorded, dict):
        return False
    return all(
        recorded.get(k) == wanted[k] for k in SETTING_KEYS if not (k == "data_sha256" and wanted[k] is None)
    )


def write_heldout_evaluation(
    work_dir: str | os.PathLike, model_path: str | os.PathLike, settings: dict, result: dict
) -> dict:
    """Write the held-out evaluation of `model_path` (`result`: `trainer.heldout.evaluate_greedy`'s, with its
    samples, over the rows `settings` name) into `work_dir`; returns the report written there."""
    data_dir = Path(settings["data_dir"])
    # an ungradable gold answer counts as wrong, as in the accuracy training reports
    samples = [
        {
            "id": s["id"],
            "answer": s["answer"],
            "completion": s["completion"],
            "correct": float(s["correct"] or 0),
        }
        for s in result["samples"]
    ]
    work_dir = Path(work_dir)
    write_jsonl_atomic(work_dir / SAMPLES, samples)
    report = {
        "model": str(model_path),
        "benchmarks": [HELDOUT],
        "scores": {HELDOUT: result["accuracy"]},
        "num_samples": {HELDOUT: len(samples)},
        HELDOUT: {
            **settings,
            "data_sha256": read_manifest(data_dir).get("sha256"),
            "samples": SAMPLES,
            "format_rate": result["format_rate"],
            "mean_length": result["mean_length"],
        },
    }
    write_json_atomic(work_dir / "report.json", report)
    return report


def heldout_samples(work_dir: Path, report: dict) -> dict[str, float]:
    """Problem id -> correctness, from the samples file a held-out report names; ValueError naming the file
    and line of a malformed one."""
    path = work_dir / report[HELDOUT]["samples"]
    if not path.is_file():
        raise FileNotFoundError(
            f"{work_dir / 'report.json'} names held-out samples {path}, which do not exist"
        )
    scores: dict[str, float] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key, value = str(rec["id"]), rec["correct"]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"'correct' is {value!r}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object with 'id' and a numeric 'correct' "
                f"({type(e).__name__}: {e})"
            ) from e
        if key in scores:
            raise ValueError(f"{path}:{lineno}: problem {key!r} appears twice")
        scores[key] = float(value)
    return scores
