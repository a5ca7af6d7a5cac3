"""What an evaluation's inputs must be, checked before any model is loaded or any process started.

The settings (limit, repeats, token budget, temperature, batch size, dtype), the benchmark names (against
EvalScope's own registry), local dataset directories, hub dataset ids, an API key variable, and whether an
endpoint answers at all. `run_evalscope` checks all of it for its run; `check_inputs` checks what does not
need the model, so that a command refuses a bad recipe before it resolves, downloads or serves one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from data.errors import GrpoflowUserError, MissingPathError
from data.redact import mask_uri
from evaluation.evalscope_child import OFFLINE_ENV, WORKER
from trainer.lora import is_adapter_dir

DTYPES = ("float32", "bfloat16", "float16", "auto")
ENDPOINT_PROBE_TIMEOUT_S = 15.0  # the check before EvalScope starts (never longer than request_timeout_s)


class EvalInputError(GrpoflowUserError, ValueError):
    """An evaluation input that cannot work (a setting, a benchmark name, a local path, a missing API key);
    raised before any model is loaded or any process started."""


def check_model_and_paths(
    model, benchmarks, local_paths: dict, api_url, api_key_env
) -> tuple[str, dict[str, str]]:
    """Fail before any process starts; returns the model (absolute path for a checkpoint) and local paths.
    `model=None` checks the rest before the model is at hand."""
    if isinstance(benchmarks, str) or not benchmarks or not all(isinstance(b, str) and b for b in benchmarks):
        raise EvalInputError(
            f"benchmarks must be a non-empty list of EvalScope benchmark names, got {benchmarks!r}"
        )
    if len(set(benchmarks)) != len(benchmarks):
        raise EvalInputError(f"benchmarks lists a name twice: {benchmarks}")
    if api_url is None and model is not None:
        path = Path(model).expanduser().resolve()
        if not path.exists():
            raise MissingPathError(
                f"model checkpoint directory not found: {path} (pass a save_pretrained "
                "directory, or api_url=... to evaluate a served model)"
            )
        if not (path / "config.json").is_file() and not is_adapter_dir(path):
            raise EvalInputError(
                f"model {path} is not a save_pretrained checkpoint directory: no config.json in it (nor a "
                "LoRA adapter's adapter_config.json)"
            )
        model = str(path)
    elif api_url is not None and not re.match(r"https?://", api_url):
        raise EvalInputError(
            f"api_url must be an http(s) URL such as http://host:8000/v1, got {mask_uri(api_url)!r}"
        )
    if api_key_env is not None:
        if api_url is None:
            raise EvalInputError("api_key_env is only used with api_url (a served model)")
        if not os.environ.get(api_key_env):
            raise EvalInputError(
                f"api_key_env={api_key_env!r}: the environment variable {api_key_env} is not set"
            )
    resolved = {}
    for bench, raw in local_paths.items():
        if bench not in benchmarks:
            raise EvalInputError(f"local_paths names benchmark {bench!r}, which is not among {benchmarks}")
        path = Path(raw).expanduser().resolve()
        if not path.exists():
            raise MissingPathError(f"local_path for benchmark {bench!r} not found: {path}")
        if not path.is_dir():
            raise EvalInputError(
                f"local_path for benchmark {bench!r} must be a directory holding its "
                f"data file (e.g. test.jsonl), got the file {path}"
            )
        resolved[bench] = str(path)
    return model, resolved


def check_dataset_ids(dataset_ids: dict, benchmarks, local_paths: dict) -> dict[str, str]:
    for bench, dataset_id in dataset_ids.items():
        if bench not in benchmarks:
            raise EvalInputError(f"dataset_ids names benchmark {bench!r}, which is not among {benchmarks}")
        if bench in local_paths:
            raise EvalInputError(f"benchmark {bench!r} has both a local path and a dataset id; give one")
        if not isinstance(dataset_id, str) or not dataset_id:
            raise EvalInputError(
                f"dataset_ids[{bench!r}] must be a hub dataset id such as 'owner/name', got {dataset_id!r}"
            )
    return dataset_ids


def check_settings(limit, repeats, max_tokens, temperature, eval_batch_size, dtype) -> None:
    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EvalInputError(f"{name} must be a positive integer, got {value!r}")

    if limit is not None:
        positive_int("limit", limit)
    positive_int("repeats", repeats)
    positive_int("max_tokens", max_tokens)
    positive_int("eval_batch_size", eval_batch_size)
    if temperature < 0:
        raise EvalInputError(f"temperature must be >= 0, got {temperature}")
    if repeats > 1 and temperature == 0:
        raise EvalInputError(
            f"repeats={repeats} with temperature=0 (greedy) would score identical answers; "
            "set temperature > 0"
        )
    if dtype not in DTYPES:
        raise EvalInputError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def check_inputs(
    benchmarks,
    *,
    local_paths: dict[str, str] | None = None,
    limit: int | None = None,
    repeats: int = 1,
    max_tokens: int = 1024,
    temperature: float = 0.0,
    api_url: str | None = None,
    api_key_env: str | None = None,
    eval_batch_size: int = 1,
) -> None:
    """Everything `run_evalscope` checks that does not need the model, benchmark names included: a command
    calls this before it resolves, downloads or serves a model. Raises
    `EvalInputError`/`FileNotFoundError`."""
    check_model_and_paths(None, benchmarks, dict(local_paths or {}), api_url, api_key_env)
    check_settings(limit, repeats, max_tokens, temperature, eval_batch_size, "float32")
    check_benchmark_names(benchmarks)


def check_benchmark_names(names: list[str]) -> None:
    """Raise `EvalInputError` for a name EvalScope has no benchmark of, with the closest names.

    EvalScope's generated index (`evalscope/benchmarks/_index.json`) answers without importing EvalScope; a
    name it lacks is looked up in EvalScope's full registry in a child process, as the worker does it (the
    index may be stale)."""
    missing = [n for n in names if n not in _indexed_benchmarks()]
    if not missing:
        return
    code = (
        "import json, sys; from evalscope_worker import _unknown_benchmark; "
        "print(json.dumps(_unknown_benchmark(json.loads(sys.argv[1])) or {}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(missing)],
        cwd=WORKER.parent,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE_ENV},
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"could not read EvalScope's benchmark registry (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}"
        )
    status = json.loads(lines[-1])
    if status:
        raise unknown_benchmark_error(status)


def _indexed_benchmarks() -> set[str]:
    import importlib.util

    spec = importlib.util.find_spec("evalscope")  # finds the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        index = Path(root) / "benchmarks" / "_index.json"
        if index.is_file():
            try:
                return set(json.loads(index.read_text()))
            except (OSError, ValueError):
                break
    return set()


def unknown_benchmark_error(status: dict) -> EvalInputError:
    """The error for the worker's `{"unknown_benchmark": name, "suggestions": [...]}` status."""
    close = " or ".join(map(repr, status.get("suggestions", [])))
    hint = f"; did you mean {close}?" if close else ""
    return EvalInputError(
        f"unknown benchmark {status['unknown_benchmark']!r}: EvalScope {version('evalscope')} "
        f"has no benchmark of that name{hint}"
    )


def check_endpoint(api_url: str, request_timeout_s: float = 600.0) -> None:
    """Raise `ServiceUnavailable` unless the endpoint answers `GET <api_url>/models` (any HTTP status counts;
    credentials are never sent) within `ENDPOINT_PROBE_TIMEOUT_S`, or `request_timeout_s` when shorter."""
    from data.reachability import require_reachable

    parts = urlsplit(api_url)
    models = urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/models"))
    require_reachable(models, "the evaluation endpoint", min(ENDPOINT_PROBE_TIMEOUT_S, request_timeout_s))
