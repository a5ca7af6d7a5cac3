"""The child process that runs EvalScope: `python evalscope_worker.py <spec.json> <status.json>`.

EvalScope is run out of process on purpose: importing it reconfigures the root logger, it logs and draws
progress bars freely, the offline switches it must see are process-wide environment variables, and a
loaded checkpoint is only truly freed when its process ends. The parent (`evalscope_runner`) captures this
process's output into a log file and reads back what it wrote.

The spec is `{"task_config": {...TaskConfig fields...}, "api_key_env": name or null, "credentials_env": name
or null, "endpoint_limits": {"timeout_s": s, "max_bytes": n} or null}`. The API key is read here from the
named environment variable, so it is never written to a file; so are an endpoint's other credentials
(`{"headers": {...}, "query": {...}}`, from its URL's userinfo and query), which EvalScope's OpenAI client
sends with every request while the TaskConfig that EvalScope logs and saves holds only the bare URL. With
`endpoint_limits` that client's requests are each bounded whole (`bounded_http`): a deadline of
`timeout_s` and a body of at most `max_bytes`. A spec `{"build_collection":
{"schema": ..., "count": n, "seed": s, "out": path}}` instead samples a collection JSONL with EvalScope's own
collection machinery (see `evaluation.collection`). The status file receives
`{"ok": true}`, or `{"unknown_benchmark": name, "suggestions": [...]}` (exit code 2), or
`{"error": type, "message": text}` (exit code 1; an endpoint's answer over `max_bytes` is reported as
`ResponseTooLarge` whatever EvalScope wrapped it in). This module imports nothing from grpoflow
(`bounded_http`, its sibling, is imported as a top-level module: this file runs as a script).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import traceback

EXIT_FAILED, EXIT_UNKNOWN_BENCHMARK = 1, 2
_SECRETS: list[str] = []  # values no log line, traceback or status may show (see `_scrub_logs`)


def _write_status(path: str, status: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def _unknown_benchmark(names: list[str]) -> dict | None:
    """The first name EvalScope does not know, with close matches among the names it does."""
    import evalscope.benchmarks  # noqa: F401  (installs the registry's lazy resolvers)
    from evalscope.api.registry import BENCHMARK_REGISTRY

    for name in names:
        if name not in BENCHMARK_REGISTRY:
            known = list(BENCHMARK_REGISTRY.keys())
            return {"unknown_benchmark": name, "suggestions": difflib.get_close_matches(name, known, n=3)}
    return None


def _mean_selector(name: str):
    """The benchmark's headline metric, pinned to its mean over all attempts.

    With pass@k aggregation a report holds one identity per k besides the mean, and EvalScope refuses
    to pick the headline itself unless the benchmark declares one; JSON cannot carry the selector object.
    """
    from evalscope.api.metric.semantics import MetricSelector
    from evalscope.api.registry import BENCHMARK_REGISTRY

    meta = BENCHMARK_REGISTRY[name]
    if meta.primary_metric is not None:
        return MetricSelector(
            name=meta.primary_metric.name, aggregation="mean", dimensions=meta.primary_metric.dimensions
        )
    first = meta.metric_list[0]
    return MetricSelector(name=first if isinstance(first, str) else next(iter(first)), aggregation="mean")


def run(spec: dict) -> dict:
    from evalscope import TaskConfig, run_task

    task = dict(spec["task_config"])
    unknown = _unknown_benchmark(task["datasets"])
    if unknown:
        return unknown
    for name, args in task.get("dataset_args", {}).items():
        if args.get("aggregation") == "mean_and_pass_at_k" and "primary_metric" not in args:
            args["primary_metric"] = _mean_selector(name)
    secrets = []
    if spec.get("api_key_env"):
        task["api_key"] = os.environ[spec["api_key_env"]]
        secrets.append(task["api_key"])
    credentials = json.loads(os.environ[spec["credentials_env"]]) if spec.get("credentials_env") else None
    if credentials or spec.get("endpoint_limits"):
        secrets += _install_endpoint_client(
            credentials or {"headers": {}, "query": {}}, spec.get("endpoint_limits")
        )
    if secrets:
        _scrub_logs(secrets)
    run_task(TaskConfig(**task))
    return {"ok": True}


def _install_endpoint_client(credentials: dict, limits: dict | None) -> list[str]:
    """EvalScope's `openai_api` client, made to send `credentials` (headers and query parameters) itself and,
    with `limits`, to bound each request whole (`bounded_http`); returns the secret values, for `_scrub_logs`.

    Passing credentials as `model_args` would work too, but EvalScope logs its model_args and saves them in
    its config dump. Request log lines (httpx logs each URL, query included) are scrubbed of the values.
    EvalScope's evaluator calls the synchronous client, the one bounded here; should it ever build its
    asynchronous one, the OpenAI client refuses the synchronous HTTP client: no limit is lost quietly.
    """
    import evalscope.models  # noqa: F401  (registers the model APIs, `openai_api` among them)
    from evalscope.api.registry import MODEL_APIS, get_model_api

    base = get_model_api("openai_api")

    class EndpointOpenAIAPI(base):
        def __init__(self, *args, **model_args):
            model_args["default_headers"] = {
                **model_args.get("default_headers", {}),
                **credentials["headers"],
            }
            model_args["default_query"] = {**model_args.get("default_query", {}), **credentials["query"]}
            if limits:
                from bounded_http import bounded_client

                model_args["http_client"] = bounded_client(limits["timeout_s"], limits["max_bytes"])
            super().__init__(*args, **model_args)

    MODEL_APIS["openai_api"] = EndpointOpenAIAPI
    values = [v for v in (*credentials["headers"].values(), *credentials["query"].values()) if v]
    return values + [
        part for v in credentials["headers"].values() for part in v.split()[1:]
    ]  # "Basic <token>"


def _scrub_logs(values: list[str]) -> None:
    """Every log record made in this process, by any logger, with `values` (and their URL-quoted forms)
    replaced by `***` before any handler (console, EvalScope's log file) sees it."""
    import logging
    from urllib.parse import quote, quote_plus

    forms = {form for v in values if len(v) >= 4 for form in (v, quote(v, safe=""), quote_plus(v))}
    _SECRETS[:] = sorted(forms | set(_SECRETS), key=len, reverse=True)
    make_record = logging.getLogRecordFactory()

    def scrubbed_record(*args, **kwargs):
        record = make_record(*args, **kwargs)
        message = record.getMessage()
        clean = _scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[0] is not None:
            record.exc_text = _scrub("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        return record

    logging.setLogRecordFactory(scrubbed_record)


def _scrub(text: str) -> str:
    for secret in _SECRETS:
        text = text.replace(secret, "***")
    return text


def build_collection(spec: dict) -> dict:
    """Sample a collection with EvalScope's schema, sampler and benchmark loaders; write its JSONL."""
    import random

    from evalscope.collections import CollectionSchema, UniformSampler
    from evalscope.utils.io_utils import dump_jsonl_data

    random.seed(spec["seed"])  # EvalScope's samplers draw with the module-level generator
    rows = UniformSampler(CollectionSchema.from_dict(spec["schema"])).sample(spec["count"])
    dump_jsonl_data(rows, spec["out"])
    return {"ok": True, "rows": len(rows)}


def _too_large_within(exc: BaseException) -> BaseException | None:
    """The `ResponseTooLarge` that `exc` was raised from, if any: EvalScope may wrap what a request raised."""
    from bounded_http import ResponseTooLarge

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ResponseTooLarge):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def main(argv: list[str]) -> int:
    spec_path, status_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        status = build_collection(spec["build_collection"]) if "build_collection" in spec else run(spec)
    except BaseException as exc:  # the parent needs a status for every way this process can end
        print(_scrub(traceback.format_exc()), file=sys.stderr, flush=True)
        exc = _too_large_within(exc) or exc
        _write_status(status_path, {"error": type(exc).__name__, "message": _scrub(str(exc))[-2000:]})
        return EXIT_FAILED
    _write_status(status_path, status)
    return EXIT_UNKNOWN_BENCHMARK if "unknown_benchmark" in status else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
