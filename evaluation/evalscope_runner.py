"""Evaluate a model with EvalScope: a local checkpoint (`llm_ckpt`) or a served model (`openai_api`).

`run_evalscope` checks its inputs (`eval_inputs`), runs EvalScope in a child process (`evalscope_worker.py`)
whose output goes to a log file, reads the scores back from EvalScope's own report files and writes
`report.json`. Layout of `work_dir` after a successful run:

    report.json     grpoflow's summary: scores, subsets, counts, paths, and the settings that made them.
                    Written last and atomically: a work_dir without it holds no finished evaluation.
    evalscope/      EvalScope's outputs (see `evalscope_reports`), plus `run.log` (the child's whole
                    output), `spec.json` (the TaskConfig it ran; never the API key) and `status.json`.

An endpoint's credentials (the API key, userinfo and secret query parameters of `api_url`) reach the child
through its environment only: EvalScope is given the bare URL, `report.json` the masked one (`data.redact`).

Calling it again on a finished `work_dir` with the same settings returns the recorded result (a retried
task does not evaluate twice); with other settings it raises `FileExistsError` (`eval_settings` decides
what "the same" is: the port of a loopback `api_url` is no setting, a model served for one evaluation gets
a fresh port each time). Raises `ValueError`
/ `FileNotFoundError` / `NotADirectoryError` for bad inputs (a missing checkpoint, a missing local dataset
directory, an unknown benchmark), `ServiceUnavailable` / `EndpointAnswerTooLarge` for an endpoint that does
not answer in time or answers too much, and `RuntimeError` naming the benchmark, the error and the log when
EvalScope fails: one line each, the traceback left in the log.

An endpoint's requests are each bounded whole (`bounded_http`, installed by the worker): `request_timeout_s`
from sending to the last byte of the answer, and an answer of at most `response_limit(max_tokens)` bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from data.errors import GrpoflowUserError, MissingPathError, ServiceUnavailable
from data.manifest import write_json_atomic
from data.progress import progress_enabled
from data.redact import mask_uri, strip_credentials
from evaluation.eval_inputs import (
    EvalInputError,
    check_dataset_ids,
    check_endpoint,
    check_model_and_paths,
    check_settings,
    unknown_benchmark_error,
)
from evaluation.eval_settings import setting_differences
from evaluation.evalscope_child import launch, log_tail, one_line
from evaluation.evalscope_reports import (
    BenchmarkReport,
    read_collection_report,
    read_report,
    report_path,
    sample_paths,
)

REPORT = "report.json"
OUTPUTS = "evalscope"
COLLECTION = "data_collection"  # EvalScope's benchmark for a collection JSONL (see `evaluation.collection`)
# The child's environment variable with an endpoint's credentials: {"headers": {...}, "query": {...}}.
CREDENTIALS_ENV = "GRPOFLOW_EVAL_CREDENTIALS"
# An endpoint's answer may hold this many bytes a requested token (a streamed answer spends a few hundred
# a token on JSON framing, reasoning and log-probabilities add more), and never less than the floor.
RESPONSE_BYTES_PER_TOKEN = 1024
MIN_RESPONSE_BYTES = 4 * 1024 * 1024


class EndpointAnswerTooLarge(GrpoflowUserError):
    """An evaluation endpoint answered with more bytes than `response_limit` allows: it is not answering
    the request it was sent (`max_tokens`)."""


@dataclass
class EvalResult:
    """Scores of one EvalScope run, as EvalScope's report files state them."""

    scores: dict[str, float]  # benchmark -> primary metric (mean accuracy over all generations)
    subsets: dict[str, dict[str, float]]  # benchmark -> subset -> score (MATH-500: "Level 1".."Level 5")
    num_samples: dict[str, int]  # benchmark -> problems scored (generations / repeats)
    pass_at_k: dict[str, dict[int, float]]  # benchmark -> k -> pass@k; empty unless repeats > 1
    report_paths: dict[str, Path]  # benchmark -> EvalScope's report JSON
    predictions_paths: dict[
        str, list[Path]
    ]  # benchmark -> EvalScope's per-sample predictions, one per subset
    review_paths: dict[str, list[Path]]  # benchmark -> the same samples scored by EvalScope, one per subset
    work_dir: Path
    log_path: Path

    @property
    def report_json(self) -> Path:
        return self.work_dir / REPORT


def run_evalscope(
    model: str,
    benchmarks: list[str],
    *,
    work_dir: str | os.PathLike,
    local_paths: dict[str, str] | None = None,
    limit: int | None = None,
    repeats: int = 1,
    max_tokens: int = 1024,
    temperature: float = 0.0,
    api_url: str | None = None,
    api_key_env: str | None = None,
    dataset_ids: dict[str, str] | None = None,
    eval_batch_size: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    progress: bool | None = None,
    request_timeout_s: float = 600.0,
) -> EvalResult:
    """Evaluate `model` on EvalScope `benchmarks` (e.g. `math_500`, `aime24`, `gpqa_diamond`).

    - `model`: a `save_pretrained` checkpoint directory (EvalScope `llm_ckpt`, transformers on the local
      device, weights in `dtype`), or with `api_url` the model name an OpenAI-compatible endpoint serves
      (EvalScope `openai_api`; the key is read from the environment variable named by `api_key_env`).
    - `local_paths`: benchmark -> directory with its data (`test.jsonl` for math_500 / aime24; one CSV or
      JSONL file for gpqa_diamond). A benchmark without one is loaded from EvalScope's dataset hub.
    - `dataset_ids`: benchmark -> the dataset to load from the hub instead of the benchmark's own, e.g.
      `{"data_collection": "evalscope/R1-Distill-Math-Test-v2"}` (a collection has no dataset of its own).
    - `limit`: EvalScope's limit, which applies per subset: `limit=2` on math_500 scores 2 problems from
      each of its 5 levels. `repeats > 1` samples each problem that often (needs `temperature > 0`)
      and adds EvalScope's pass@k for k = 1..repeats.
    - `temperature=0` is greedy decoding; above 0 it is plain temperature sampling (top_p 1, no top_k).
    - `progress`: echo EvalScope's own log and progress bars to stderr; by default only in a terminal.
    - `request_timeout_s`: the deadline for one request to an endpoint, from sending it to the last byte of
      the answer; a request is made `ENDPOINT_ATTEMPTS` times, `ENDPOINT_RETRY_INTERVAL_S` apart. An answer
      over `response_limit(max_tokens)` bytes is refused (`EndpointAnswerTooLarge`). The endpoint is
      probed first (`eval_inputs.check_endpoint`): one that does not answer raises `ServiceUnavailable`
      before EvalScope starts.
    """
    checkpoint = api_url is None
    model, local_paths = check_model_and_paths(
        model, benchmarks, dict(local_paths or {}), api_url, api_key_env
    )
    dataset_ids = check_dataset_ids(dict(dataset_ids or {}), benchmarks, local_paths)
    check_settings(limit, repeats, max_tokens, temperature, eval_batch_size, dtype)
    if not isinstance(request_timeout_s, (int, float)) or not 0 < request_timeout_s < float("inf"):
        raise EvalInputError(
            f"request_timeout_s must be a positive number of seconds, got {request_timeout_s!r}"
        )
    model_id = _model_id(model, checkpoint)
    settings = {  # everything that decides the scores; report.json records it
        "model": model,
        "model_id": model_id,
        "eval_type": "llm_ckpt" if checkpoint else "openai_api",
        "api_url": mask_uri(api_url),
        "api_key_env": api_key_env,
        "benchmarks": list(benchmarks),
        "local_paths": local_paths,
        "dataset_ids": dataset_ids or None,
        "limit": limit,
        "repeats": repeats,
        "generation_config": _generation_config(max_tokens, temperature, checkpoint),
        "eval_batch_size": eval_batch_size,
        "dtype": dtype if checkpoint else None,
        "seed": seed,
        "offline": all(b in local_paths for b in benchmarks),
        "evalscope_version": version("evalscope"),
    }
    work_dir = Path(work_dir).resolve()
    if (work_dir / REPORT).exists():  # a retried pipeline task lands here: same settings, same answer
        return _finished(work_dir, settings)
    if not checkpoint:
        check_endpoint(api_url, request_timeout_s)
    bare_url, credentials = (None, None) if checkpoint else _endpoint_credentials(api_url)
    outputs = work_dir / OUTPUTS
    shutil.rmtree(outputs, ignore_errors=True)  # what a failed earlier attempt left
    outputs.mkdir(parents=True)

    task_config = {
        "model": model,
        "model_id": model_id,
        "eval_type": settings["eval_type"],
        "datasets": _hub_first(benchmarks, local_paths),
        "dataset_args": _dataset_args(benchmarks, local_paths, dataset_ids, repeats),
        "limit": limit,
        "repeats": repeats,
        "generation_config": {
            **settings["generation_config"],
            **({} if checkpoint else _endpoint_waits(request_timeout_s)),
        },
        "eval_batch_size": eval_batch_size,
        "seed": seed,
        "work_dir": str(outputs),
        "no_timestamp": True,
        # an endpoint's requests are retried by EvalScope (`_endpoint_waits`), not again inside its OpenAI
        # client
        **(
            {"model_args": {"precision": dtype}}
            if checkpoint
            else {"api_url": bare_url, "model_args": {"max_retries": 0}}
        ),
    }
    started = time.time()
    echo = progress_enabled(progress)
    spec = {
        "task_config": task_config,
        "api_key_env": api_key_env,
        "credentials_env": CREDENTIALS_ENV if credentials else None,
        "endpoint_limits": None
        if checkpoint
        else {"timeout_s": request_timeout_s, "max_bytes": response_limit(max_tokens)},
    }
    from trainer.checkpoint import plain_model_dir

    # a LoRA checkpoint is evaluated as its merged model, written beside the outputs for the run's length
    with plain_model_dir(model, scratch=work_dir) if checkpoint else contextlib.nullcontext(model) as loaded:
        task_config["model"] = str(loaded)
        log_path = _run_worker(
            outputs,
            spec,
            settings["offline"],
            echo,
            {CREDENTIALS_ENV: json.dumps(credentials)} if credentials else {},
        )
    reports = {}
    for bench in benchmarks:
        path = report_path(outputs, model_id, bench)
        if not path.is_file():
            raise RuntimeError(
                f"EvalScope finished without a report for benchmark {bench!r} (expected {path})"
                + log_tail(log_path)
            )
        reports[bench] = _read_report(bench, path)
    result = EvalResult(
        scores={b: r.score for b, r in reports.items()},
        subsets={b: r.subsets for b, r in reports.items()},
        num_samples={b: r.num_generations // repeats for b, r in reports.items()},
        pass_at_k={b: r.pass_at_k for b, r in reports.items() if r.pass_at_k},
        report_paths={b: report_path(outputs, model_id, b) for b in benchmarks},
        predictions_paths={
            b: sample_paths(outputs, "predictions", model_id, b, _sample_subsets(b, r))
            for b, r in reports.items()
        },
        review_paths={
            b: sample_paths(outputs, "reviews", model_id, b, _sample_subsets(b, r))
            for b, r in reports.items()
        },
        work_dir=work_dir,
        log_path=log_path,
    )
    write_json_atomic(
        work_dir / REPORT,
        {
            **settings,
            **_result_json(result),
            "wall_time_s": round(time.time() - started, 1),
            "primary_metric": {b: r.metric for b, r in reports.items()},
        },
    )
    return result


def _finished(work_dir: Path, settings: dict) -> EvalResult:
    """The finished evaluation in `work_dir` if it was made with `settings`; refuses to mix two runs."""
    differs = setting_differences(json.loads((work_dir / REPORT).read_text()), settings)
    if differs:
        detail = "; ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in differs.items())
        raise FileExistsError(
            f"{work_dir} already holds an evaluation made with other settings ({detail}); use a new work_dir"
        )
    return load_result(work_dir)


def _read_report(bench: str, path: Path) -> BenchmarkReport:
    if bench == COLLECTION:  # its scores are in EvalScope's collection report, per dataset of the collection
        return read_collection_report(path)
    return read_report(path)


def _sample_subsets(bench: str, report: BenchmarkReport) -> list[str]:
    """The subsets EvalScope writes sample files for: a collection's samples all go to its one subset."""
    return ["default"] if bench == COLLECTION else list(report.subsets)


def load_result(work_dir: str | os.PathLike) -> EvalResult:
    """The `EvalResult` of a finished evaluation, read back from its `report.json`."""
    work_dir = Path(work_dir).resolve()
    path = work_dir / REPORT
    if not path.is_file():
        raise MissingPathError(f"no {REPORT} in {work_dir}: not a finished evaluation")
    data = json.loads(path.read_text())
    return EvalResult(
        scores=data["scores"],
        subsets=data["subsets"],
        num_samples=data["num_samples"],
        pass_at_k={b: {int(k): v for k, v in ks.items()} for b, ks in data["pass_at_k"].items()},
        report_paths={b: work_dir / p for b, p in data["report_paths"].items()},
        predictions_paths={b: [work_dir / p for p in ps] for b, ps in data["predictions_paths"].items()},
        review_paths={b: [work_dir / p for p in ps] for b, ps in data["review_paths"].items()},
        work_dir=work_dir,
        log_path=work_dir / data["log_path"],
    )


def _result_json(result: EvalResult) -> dict:
    rel = lambda p: p.relative_to(result.work_dir).as_posix()  # noqa: E731
    return {
        "scores": result.scores,
        "subsets": result.subsets,
        "num_samples": result.num_samples,
        "pass_at_k": result.pass_at_k,
        "report_paths": {b: rel(p) for b, p in result.report_paths.items()},
        "predictions_paths": {b: [rel(p) for p in ps] for b, ps in result.predictions_paths.items()},
        "review_paths": {b: [rel(p) for p in ps] for b, ps in result.review_paths.items()},
        "log_path": rel(result.log_path),
    }


ENDPOINT_ATTEMPTS = 3  # EvalScope makes 5 attempts, 10 s apart, by default
# The OpenAI client's errors for an endpoint that did not answer (EvalScope gives up after ENDPOINT_ATTEMPTS)
ENDPOINT_GAVE_UP = ("APITimeoutError", "APIConnectionError")
ENDPOINT_RETRY_INTERVAL_S = 5


def response_limit(max_tokens: int) -> int:
    """The most bytes an endpoint's answer to one request may hold."""
    return max(MIN_RESPONSE_BYTES, RESPONSE_BYTES_PER_TOKEN * max_tokens)


def _endpoint_waits(request_timeout_s: float) -> dict:
    """EvalScope's generation settings that bound the wait on an endpoint (not scores: report.json omits
    them). EvalScope's `retries` counts attempts, the first included (its `retry_call`)."""
    return {
        "timeout": request_timeout_s,
        "retries": ENDPOINT_ATTEMPTS,
        "retry_interval": ENDPOINT_RETRY_INTERVAL_S,
    }


def _model_id(model: str, checkpoint: bool) -> str:
    """EvalScope's name for the model in its output paths: the checkpoint's folder or the served name."""
    name = Path(model).name if checkpoint else model
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def _generation_config(max_tokens: int, temperature: float, checkpoint: bool) -> dict:
    config: dict = {"max_tokens": max_tokens}
    if checkpoint:  # transformers' generate: greedy is do_sample=False, it rejects temperature=0
        config["do_sample"] = temperature > 0
    if temperature > 0:
        config.update(temperature=temperature, top_p=1.0)
        if checkpoint:
            config["top_k"] = 0  # no top-k cut, whatever the checkpoint's generation_config.json says
    elif not checkpoint:
        config["temperature"] = 0.0
    return config


def _hub_first(benchmarks, local_paths: dict[str, str]) -> list[str]:
    """Benchmarks that load from a hub run first: if the hub is unreachable, that fails before any
    local benchmark has spent its generation time."""
    return [b for b in benchmarks if b not in local_paths] + [b for b in benchmarks if b in local_paths]


def _dataset_args(benchmarks, local_paths: dict[str, str], dataset_ids: dict[str, str], repeats: int) -> dict:
    args: dict = {b: {} for b in benchmarks}
    for bench, path in local_paths.items():
        args[bench]["local_path"] = path
    for bench, dataset_id in dataset_ids.items():
        args[bench]["dataset_id"] = dataset_id
    if repeats > 1:
        for bench in benchmarks:
            args[bench]["aggregation"] = "mean_and_pass_at_k"
    return {b: a for b, a in args.items() if a}


def _endpoint_credentials(api_url: str) -> tuple[str, dict | None]:
    """(the bare URL EvalScope is given, the credentials its client must send, or None).

    Userinfo becomes HTTP Basic auth, as httpx makes of it (it wins over the API key's bearer header, as it
    did when the URL was passed whole); query parameters are sent with every request.
    """
    import base64
    from urllib.parse import unquote

    bare, userinfo, query = strip_credentials(api_url)
    headers = {}
    if userinfo is not None:
        user, _, password = userinfo.partition(":")
        basic = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
        headers["Authorization"] = f"Basic {basic}"
    return bare, ({"headers": headers, "query": query} if headers or query else None)


def _run_worker(outputs: Path, spec: dict, offline: bool, echo: bool, secret_env: dict | None = None) -> Path:
    """Run EvalScope in its child process; its whole output goes to `run.log` (and to stderr when `echo`).
    `secret_env`: variables for the child only (an endpoint's credentials), never written to a file."""
    log_path = outputs / "run.log"
    code, status = launch(spec, outputs, log_path, offline=offline, echo=echo, secret_env=secret_env)
    if status.get("ok"):
        return log_path
    if "unknown_benchmark" in status:
        shutil.rmtree(outputs, ignore_errors=True)
        raise unknown_benchmark_error(status)
    failed = _first_without_report(outputs, spec["task_config"])
    where = f"on benchmark {failed!r}" if failed else "after every benchmark had reported"
    url = spec["task_config"].get("api_url")
    if status.get("error") == "ResponseTooLarge" and url:
        limits = spec["endpoint_limits"]
        max_tokens = spec["task_config"]["generation_config"]["max_tokens"]
        raise EndpointAnswerTooLarge(
            f"the evaluation endpoint at {mask_uri(url)} answered {where} with more than "
            f"{limits['max_bytes']:,} bytes, the limit for eval.max_tokens={max_tokens} "
            f"({RESPONSE_BYTES_PER_TOKEN:,} bytes a token, at least {MIN_RESPONSE_BYTES:,})"
            + log_tail(log_path)
        )
    if status.get("error") in ENDPOINT_GAVE_UP and url:  # the endpoint, not us
        waits = spec["task_config"]["generation_config"]
        raise ServiceUnavailable(
            f"the evaluation endpoint at {mask_uri(url)} stopped answering {where}: {status['error']} after "
            f"{waits['retries']} attempts of up to {waits['timeout']:g} s (eval.request_timeout_s), "
            f"{waits['retry_interval']:g} s apart" + log_tail(log_path)
        )
    local = spec["task_config"].get("dataset_args", {}).get(failed, {}).get("local_path")
    hint = (
        ""
        if failed is None or local
        else (
            f" ({failed!r} has no local path, so EvalScope loads it from its dataset hub, "
            "ModelScope by default; "
            f"without network access pass local_paths={{{failed!r}: '<directory with its data>'}})"
        )
    )
    what = (
        f"{status['error']}: {one_line(status['message'])}"
        if status
        else f"the worker exited with code {code}"
    )
    raise RuntimeError(f"EvalScope failed {where}: {what}{hint}" + log_tail(log_path))


def _first_without_report(outputs: Path, task_config: dict) -> str | None:
    """EvalScope runs benchmarks in order, so the failing one is the first without a report."""
    for bench in task_config["datasets"]:
        if not report_path(outputs, task_config["model_id"], bench).is_file():
            return bench
    return None
