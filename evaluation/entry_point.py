"""The one evaluation entry point: a model evaluated with a recipe's `eval` settings, and their checks.

`evaluate(model, settings)` runs the settings' benchmarks with EvalScope (`run_evalscope`), or R1-Distill-
Math-Test when they name the collection (`evaluation.collection`). `check_evaluation` refuses, before any
model is at hand, what `evaluate` would refuse, and probes an endpoint. `settings` is the recipe's eval
section (`EvalSettings`), read whole: no caller unpacks it, and no default is declared here.
"""

from __future__ import annotations

import os

from evaluation.collection import (
    COLLECTION_NAME,
    NAME,
    R1_DISTILL_MATH_TEST,
    R1_DISTILL_MATH_TEST_ID,
    check_local_paths,
    collection_paths,
    evaluate_collection,
)
from evaluation.eval_inputs import EvalInputError, check_endpoint, check_inputs
from evaluation.eval_settings import EvalSettings
from evaluation.evalscope_runner import COLLECTION, EvalResult, run_evalscope


def evaluate(
    model: str,
    settings: EvalSettings,
    *,
    work_dir: str | os.PathLike,
    api_url: str | None = None,
    api_key_env: str | None = None,
    eval_batch_size: int = 1,
    progress: bool | None = None,
) -> EvalResult:
    """Evaluate `model` (a checkpoint directory, or with `api_url` the name an endpoint serves it under) on
    the benchmarks of `settings`, into `work_dir`; see `run_evalscope` for the rest."""
    return run_benchmarks(
        model,
        settings.benchmarks,
        work_dir=work_dir,
        local_paths=settings.local_paths or None,
        limit=settings.limit,
        repeats=settings.repeats,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        api_url=api_url,
        api_key_env=api_key_env,
        eval_batch_size=eval_batch_size,
        request_timeout_s=settings.request_timeout_s,
        progress=progress,
    )


def check_evaluation(
    settings: EvalSettings,
    *,
    api_url: str | None = None,
    api_key_env: str | None = None,
    eval_batch_size: int = 1,
) -> None:
    """What `evaluate` would refuse with these arguments, checked before any model is resolved, downloaded,
    trained or served (benchmark names, local paths, an API key variable), then whether `api_url` answers.
    Raises `EvalInputError` or `FileNotFoundError` naming the benchmark or setting, `ServiceUnavailable`.
    A recipe without benchmarks (its held-out split is its evaluation) has nothing here to check."""
    if not settings.benchmarks and api_url is None:
        return
    check_benchmarks(
        settings.benchmarks,
        local_paths=settings.local_paths or None,
        limit=settings.limit,
        repeats=settings.repeats,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        api_url=api_url,
        api_key_env=api_key_env,
        eval_batch_size=eval_batch_size,
    )
    if api_url:
        check_endpoint(api_url, settings.request_timeout_s)


def run_benchmarks(
    model: str,
    benchmarks: list[str],
    *,
    work_dir,
    local_paths: dict[str, str] | None = None,
    limit: int | None = None,
    **run_kwargs,
) -> EvalResult:
    """`run_evalscope` for individual benchmarks, or the combined collection when `benchmarks` is
    `["r1_distill_math_test"]` (then `limit` is taken per benchmark of the collection)."""
    if COLLECTION_NAME not in benchmarks:
        return run_evalscope(
            model, benchmarks, work_dir=work_dir, local_paths=local_paths, limit=limit, **run_kwargs
        )
    paths = collection_paths(benchmarks, local_paths)
    return evaluate_collection(model, work_dir, local_paths=paths, per_benchmark_limit=limit, **run_kwargs)


def check_benchmarks(
    benchmarks: list[str], *, local_paths: dict[str, str] | None = None, limit: int | None = None, **settings
) -> None:
    """What `run_benchmarks` would refuse, checked before any model is at hand: settings, benchmark names,
    local paths, an API key variable (`settings`: repeats, max_tokens, temperature, api_url, api_key_env,
    eval_batch_size). Raises `EvalInputError` or `FileNotFoundError` naming the benchmark or setting."""
    if COLLECTION_NAME not in benchmarks:
        return check_inputs(benchmarks, local_paths=local_paths, limit=limit, **settings)
    paths = collection_paths(benchmarks, local_paths)
    if paths is not None:
        check_local_paths(paths)
    elif limit is not None:
        raise EvalInputError(
            f"limit={limit} samples a locally built {NAME}: it needs local_paths for "
            f"{', '.join(R1_DISTILL_MATH_TEST)} (the hub's {R1_DISTILL_MATH_TEST_ID} is "
            "evaluated whole)"
        )
    check_inputs([COLLECTION], limit=limit, **settings)
