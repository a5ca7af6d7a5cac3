"""Whether evaluations were made with the same settings: one answer for a retried run and for a comparison.

`run_evalscope` records in `report.json` every setting that decides the scores, and a finished work dir is
reused only when its recorded settings are the ones asked for: by `run_evalscope` itself (a retried task does
not evaluate twice, and two runs never mix in one folder) and by a comparison looking for an evaluation made
with a recipe's `eval` settings (`made_with`). Both ask `setting_differences`.

`EvalSettings` is what evaluation reads of a recipe's `eval` section (`trainer.recipe.EvalConfig`): it is read
by attribute, and its defaults live in that dataclass alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from data.manifest import sha256_json
from data.reachability import LOOPBACK


class EvalSettings(Protocol):
    """A recipe's `eval` section, as `evaluation.evaluate` and `made_with` read it."""

    benchmarks: list[str]
    local_paths: dict[str, str]
    limit: int | None
    repeats: int
    max_tokens: int
    temperature: float
    request_timeout_s: float
    out: str


def comparable(key: str, value):
    """A setting as compared between runs: a loopback `api_url` without its port, which is picked afresh
    each time a model is served for an evaluation and so decides nothing about the scores."""
    if key == "api_url" and isinstance(value, str):
        url = urlsplit(value)
        if url.hostname in LOOPBACK:
            return url._replace(netloc=url.hostname).geturl()
    return value


def setting_differences(recorded: dict, wanted: dict) -> dict[str, tuple]:
    """The settings of `wanted` that `recorded` (a finished evaluation's) holds another value of, as
    `{key: (recorded value, wanted value)}`; empty when the evaluation was made with `wanted`."""
    return {
        k: (recorded.get(k), v)
        for k, v in wanted.items()
        if comparable(k, recorded.get(k)) != comparable(k, v)
    }


def made_with(report: dict, settings: EvalSettings) -> bool:
    """Whether a finished evaluation (its report.json) can stand for one made with a recipe's eval `settings`:
    it scored at least their benchmarks, from the same local data, with the same limit, repeats, token
    budget and temperature."""
    if not set(settings.benchmarks) <= set(report.get("benchmarks", [])):
        return False
    generation = report.get("generation_config", {})
    recorded_paths = report.get("local_paths") or {}
    recorded = {
        "limit": report.get("limit"),
        "repeats": report.get("repeats"),
        "max_tokens": generation.get("max_tokens"),
        "temperature": float(generation.get("temperature", 0.0)),  # greedy on a checkpoint records none
        "local_paths": {b: recorded_paths.get(b) for b in settings.benchmarks},
    }
    wanted = {
        "limit": settings.limit,
        "repeats": settings.repeats,
        "max_tokens": settings.max_tokens,
        "temperature": float(settings.temperature),
        "local_paths": {
            b: str(Path(settings.local_paths[b]).expanduser().resolve())
            if b in settings.local_paths
            else None
            for b in settings.benchmarks
        },
    }
    return not setting_differences(recorded, wanted)


def settings_hash(settings: EvalSettings, model: str | Path | None = None) -> str:
    """Eight hex digits that name a work dir by what made it: the model and every eval setting but `out`
    (`settings` is the recipe's section, a dataclass)."""
    values = {k: v for k, v in dataclasses.asdict(settings).items() if k != "out"}
    return sha256_json([str(model), values])[:8]
