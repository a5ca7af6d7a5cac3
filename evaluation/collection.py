"""R1-Distill-Math-Test: MATH-500, GPQA-Diamond and AIME 2024 as one EvalScope collection, built and
evaluated.

EvalScope evaluates a mix of benchmarks as one "collection": a JSONL whose every row is a sample already
rendered by its own benchmark's adapter, plus where it came from (EvalScope's `DatasetEntry`):

    index         the row's number in the collection
    prompt        the benchmark's `Sample` (input messages with the prompt template applied, target,
                  choices for multiple choice, subset_key, metadata)
    dataset_name  the benchmark that scores the row (math_500, gpqa_diamond, aime24)
    subset_name   its subset there ("Level 1".."Level 5" for MATH-500, "default" otherwise)
    task_type, tags, categories (the schema's names from the root down), weight (the benchmark's share
                  of the collection divided by its rows)

EvalScope's `data_collection` benchmark reads it (`dataset_args={'data_collection': {'local_path': <dir
with test.jsonl>}}`, or `dataset_id` for one on the hub) and scores every row with its own benchmark's
adapter. The online R1 collection is `evalscope/R1-Distill-Math-Test-v2` (the older
`modelscope/R1-Distill-Math-Test` predates EvalScope 1.0's format).

- `build_local_collection` builds the same collection offline from local copies of the three benchmarks,
  with EvalScope's own schema, sampler and benchmark loaders (in a child process, like every EvalScope run).
- `evaluate_collection` evaluates a model on it, offline from local benchmark copies or on the hub's.
- A recipe asks for it as the benchmark `r1_distill_math_test` (`COLLECTION_NAME`, on its own); the
  evaluation entry point (`evaluation.entry_point`) turns that into `evaluate_collection`.
- `evaluation.evalscope_reports.read_collection_report` reads the scores back from EvalScope's collection
  report: the collection's mean over all its samples, and each benchmark's.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from importlib.metadata import version
from pathlib import Path

from data.errors import MissingPathError
from data.manifest import (
    MANIFEST,
    atomic_dir,
    code_version,
    read_manifest,
    sha256_dir,
    sha256_file,
    write_json_atomic,
)
from evaluation.eval_inputs import EvalInputError
from evaluation.evalscope_child import launch, log_tail
from evaluation.evalscope_runner import COLLECTION, REPORT, EvalResult, run_evalscope

R1_DISTILL_MATH_TEST = ("math_500", "gpqa_diamond", "aime24")
R1_DISTILL_MATH_TEST_ID = (
    "evalscope/R1-Distill-Math-Test-v2"  # the collection on EvalScope's (ModelScope) hub
)
NAME = "R1-Distill-Math-Test"
COLLECTION_NAME = "r1_distill_math_test"  # how a recipe's eval.benchmarks names the collection
COLLECTION_FILE = "test.jsonl"  # the name EvalScope's data_collection loader looks for in its local_path
SCHEMA_FILE = "schema.json"  # the CollectionSchema it was sampled from, in EvalScope's own JSON form
KIND = "evalscope_collection"
_ALL = 10**9  # a sample count above any benchmark's size: every row of every benchmark


def r1_distill_math_test_schema(local_paths: dict[str, str]) -> dict:
    """EvalScope's CollectionSchema (as a dict) of R1-Distill-Math-Test over local copies of its benchmarks:
    one level, the three benchmarks weighted equally, zero-shot as in the R1 report."""
    return {
        "name": NAME,
        "weight": 1.0,
        "datasets": [
            {
                "name": bench,
                "weight": 1.0,
                "task_type": "math",
                "tags": ["en"],
                "args": {"few_shot_num": 0, "local_path": local_paths[bench]},
                "hierarchy": [],
            }
            for bench in R1_DISTILL_MATH_TEST
        ],
    }


def build_local_collection(
    local_paths: dict[str, str],
    out: str | os.PathLike,
    *,
    per_benchmark_limit: int | None = None,
    seed: int = 0,
) -> Path:
    """Build R1-Distill-Math-Test offline into the directory `out`; returns the path of its `test.jsonl`.

    `local_paths` maps each of math_500, gpqa_diamond, aime24 to its directory (the same `local_path`
    EvalScope reads for the benchmark alone). EvalScope's uniform sampler takes `per_benchmark_limit`
    problems from each benchmark at random (seeded; across MATH-500's levels, not per level), or all of
    them when None. `out` then holds `test.jsonl` (EvalScope's `local_path` for `data_collection`),
    `schema.json` and a `manifest.json`; it is written atomically and replaced whole. Raises
    FileNotFoundError naming a benchmark whose directory is missing, ValueError for other bad inputs and
    RuntimeError quoting EvalScope's log when it cannot load a benchmark.
    """
    paths = check_local_paths(local_paths)
    limit = per_benchmark_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise EvalInputError(
            f"per_benchmark_limit must be a positive integer or None, got {per_benchmark_limit!r}"
        )
    schema = r1_distill_math_test_schema(paths)
    # The uniform sampler gives each benchmark count // 3 rows (all of them, when it has fewer).
    count = _ALL if per_benchmark_limit is None else per_benchmark_limit * len(R1_DISTILL_MATH_TEST)
    with atomic_dir(out) as tmp:
        sampled = tmp / "sampled.jsonl"
        _build_in_child(tmp, {"schema": schema, "count": count, "seed": seed, "out": str(sampled)})
        lines = sampled.read_text(encoding="utf-8").splitlines()
        rows = [_without_message_ids(json.loads(line)) for line in lines if line.strip()]
        sampled.unlink()
        counts = Counter(row["dataset_name"] for row in rows)
        empty = [b for b in R1_DISTILL_MATH_TEST if not counts[b]]
        if empty:
            raise ValueError(
                f"no problems of {empty} in the collection: their local directories "
                f"{[paths[b] for b in empty]} hold no rows EvalScope could load"
            )
        with open(tmp / COLLECTION_FILE, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        write_json_atomic(tmp / SCHEMA_FILE, schema)
        write_json_atomic(
            tmp / MANIFEST,
            {
                "kind": KIND,
                "name": NAME,
                "sha256": sha256_file(tmp / COLLECTION_FILE),
                "rows": len(rows),
                "rows_per_benchmark": {b: counts[b] for b in R1_DISTILL_MATH_TEST},
                "config": _build_config(paths, per_benchmark_limit, seed),
                "inputs": {b: sha256_dir(paths[b]) for b in R1_DISTILL_MATH_TEST},
                "evalscope_version": version("evalscope"),
                "code_version": code_version(),
            },
        )
    return Path(out).resolve() / COLLECTION_FILE


def evaluate_collection(
    model: str,
    work_dir: str | os.PathLike,
    *,
    local_paths: dict[str, str] | None = None,
    per_benchmark_limit: int | None = None,
    seed: int = 0,
    **run_kwargs,
) -> EvalResult:
    """Evaluate `model` on R1-Distill-Math-Test with EvalScope's `data_collection` benchmark.

    With `local_paths` (math_500, gpqa_diamond, aime24 -> directory) the collection is built offline into
    `work_dir/collection` (see `build_local_collection`) and nothing touches the network; without, EvalScope
    loads `evalscope/R1-Distill-Math-Test-v2` from its hub (all 728 problems; `per_benchmark_limit` needs
    local data). `run_kwargs` go to `run_evalscope` (max_tokens, temperature, repeats, api_url, ...); its
    `limit` would take the first rows of the collection file, which are grouped by benchmark.

    The result is keyed `data_collection`: `scores` holds the mean over all the collection's samples,
    `subsets` each benchmark's mean, `num_samples` the problems scored, as EvalScope's collection report
    states them (rounded to 4 places there). A finished `work_dir` is returned as recorded when asked the
    same again and refused (FileExistsError) when asked with another collection or other settings.
    """
    work_dir = Path(work_dir).resolve()
    if local_paths is None:
        if per_benchmark_limit is not None:
            raise EvalInputError(
                "per_benchmark_limit samples a locally built collection: it needs local_paths "
                f"(the hub's {R1_DISTILL_MATH_TEST_ID} is evaluated whole)"
            )
        return run_evalscope(
            model,
            [COLLECTION],
            work_dir=work_dir,
            seed=seed,
            dataset_ids={COLLECTION: R1_DISTILL_MATH_TEST_ID},
            **run_kwargs,
        )
    collection = work_dir / "collection"
    config = _build_config(check_local_paths(local_paths), per_benchmark_limit, seed)
    if (work_dir / REPORT).is_file():  # finished: never rebuild the collection it was scored on
        built = read_manifest(collection)["config"] if (collection / MANIFEST).is_file() else {}
        differs = "; ".join(
            f"{k}: {built.get(k)!r} there, {v!r} now" for k, v in config.items() if built.get(k) != v
        )
        if differs:
            raise FileExistsError(
                f"{work_dir} already holds an evaluation of another collection ({differs}); "
                "use a new work_dir"
            )
    else:
        build_local_collection(local_paths, collection, per_benchmark_limit=per_benchmark_limit, seed=seed)
    return run_evalscope(
        model,
        [COLLECTION],
        work_dir=work_dir,
        seed=seed,
        local_paths={COLLECTION: str(collection)},
        **run_kwargs,
    )


def collection_paths(benchmarks: list[str], local_paths: dict[str, str] | None) -> dict[str, str] | None:
    """The local paths of the collection's benchmarks when a recipe lists `COLLECTION_NAME` (None: the hub's
    collection); the collection is evaluated on its own."""
    if benchmarks != [COLLECTION_NAME]:
        raise EvalInputError(
            f"'{COLLECTION_NAME}' is the combined collection of {', '.join(R1_DISTILL_MATH_TEST)}: "
            "evaluate it on its own, or list the benchmarks individually"
        )
    return {b: p for b, p in (local_paths or {}).items() if b in R1_DISTILL_MATH_TEST} or None


def check_local_paths(local_paths: dict[str, str]) -> dict[str, str]:
    """Each of the collection's benchmark directories, resolved; names the benchmark whose directory is
    missing."""
    extra = sorted(set(local_paths) - set(R1_DISTILL_MATH_TEST))
    if extra:
        raise EvalInputError(
            f"local_paths names {extra}, which are not in R1-Distill-Math-Test {list(R1_DISTILL_MATH_TEST)}"
        )
    paths = {}
    for bench in R1_DISTILL_MATH_TEST:
        if bench not in local_paths:
            raise MissingPathError(
                f"no local path for benchmark {bench!r}: R1-Distill-Math-Test needs a "
                f"directory for each of {list(R1_DISTILL_MATH_TEST)}"
            )
        path = Path(local_paths[bench]).expanduser().resolve()
        if not path.is_dir():
            what = "is a file, not a directory" if path.exists() else "not found"
            raise MissingPathError(f"local path for benchmark {bench!r} {what}: {path}")
        paths[bench] = str(path)
    return paths


def _build_config(paths: dict[str, str], per_benchmark_limit: int | None, seed: int) -> dict:
    return {"local_paths": paths, "per_benchmark_limit": per_benchmark_limit, "seed": seed}


def _without_message_ids(row: dict) -> dict:
    """Drop the input messages' ids: EvalScope draws them at random and draws new ones when it reads the
    row, so without them the same inputs always make the same file."""
    for message in row.get("prompt", {}).get("input", []):
        if isinstance(message, dict):
            message.pop("id", None)
    return row


def _build_in_child(tmp: Path, build: dict) -> None:
    """Sample the collection in EvalScope's worker process, offline; its output goes to a log."""
    log = tmp / "build.log"
    _, result = launch({"build_collection": build}, tmp, log, offline=True, name="build_spec")
    if not result.get("ok"):
        what = f"{result['error']}: {result['message']}" if result else "the worker ended without a status"
        raise RuntimeError(
            f"EvalScope could not build {NAME} from {build['schema']['datasets']}: {what}" + log_tail(log)
        )
    for path in (tmp / "build_spec.json", tmp / "build_status.json", log):
        path.unlink()
