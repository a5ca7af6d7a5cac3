"""R1-Distill-Math-Test as an EvalScope collection: built offline from ../shared/data plus made-up GPQA rows,
evaluated by real EvalScope (the tiny checkpoint, and a stub endpoint whose answers are known), its scores
read back independently from EvalScope's own reports."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from test_evaluation import stub_chat_endpoint

from conftest import shared
from evaluation import load_result, run_evalscope
from evaluation.collection import (
    R1_DISTILL_MATH_TEST,
    R1_DISTILL_MATH_TEST_ID,
    build_local_collection,
    evaluate_collection,
)
from evaluation.eval_settings import comparable
from evaluation.evalscope_runner import _dataset_args

# GPQA-Diamond is not shipped (its authors ask that it stay out of plain text): these rows are made up, in its
# format (EvalScope reads split `train` with these fields).
GPQA_ROWS = [
    {
        "Question": "A made-up particle, the flumon, decays only into two photons. What is its spin?",
        "Correct Answer": "0 or 2",
        "Incorrect Answer 1": "1",
        "Incorrect Answer 2": "1/2",
        "Incorrect Answer 3": "3/2",
    },
    {
        "Question": "In the made-up reaction A + B -> C, doubling [A] doubles the rate and doubling [B] does "
        "nothing. What is the rate law?",
        "Correct Answer": "rate = k[A]",
        "Incorrect Answer 1": "rate = k[A][B]",
        "Incorrect Answer 2": "rate = k[B]",
        "Incorrect Answer 3": "rate = k[A]^2",
    },
    {
        "Question": "A made-up enzyme, quuxase, loses all activity when its only cysteine is mutated. What "
        "does the cysteine most likely do?",
        "Correct Answer": "It acts as the catalytic nucleophile",
        "Incorrect Answer 1": "It binds the cofactor",
        "Incorrect Answer 2": "It anchors the enzyme in the membrane",
        "Incorrect Answer 3": "It is a glycosylation site",
    },
]
ENTRY_FIELDS = {"index", "prompt", "tags", "categories", "task_type", "weight", "dataset_name", "subset_name"}
LEVELS = [f"Level {i}" for i in range(1, 6)]


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def local_paths(tmp_path) -> dict[str, str]:
    gpqa = tmp_path / "gpqa_diamond"
    gpqa.mkdir()
    (gpqa / "gpqa_diamond.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GPQA_ROWS))
    return {"math_500": str(shared("math_500")), "gpqa_diamond": str(gpqa), "aime24": str(shared("aime24"))}


def _detailed(result, bench="data_collection"):
    """EvalScope's collection report, read straight from the file it writes next to the report."""
    return json.loads(result.report_paths[bench].with_name("collection_detailed_report.json").read_text())


# ---- building ----------------------------------------------------------------------------------------------


def test_built_collection_holds_every_benchmark_in_evalscopes_entry_format(local_paths, tmp_path):
    path = build_local_collection(local_paths, tmp_path / "r1", per_benchmark_limit=2)
    assert path == (tmp_path / "r1" / "test.jsonl").resolve()
    rows = _lines(path)
    assert len(rows) == 6 and [r["index"] for r in rows] == list(range(6))
    assert all(set(r) == ENTRY_FIELDS for r in rows)
    by_bench = defaultdict(list)
    for r in rows:
        by_bench[r["dataset_name"]].append(r)
    assert {b: len(rs) for b, rs in by_bench.items()} == {b: 2 for b in R1_DISTILL_MATH_TEST}
    assert all(
        r["categories"] == ["R1-Distill-Math-Test"] and r["task_type"] == "math" and r["tags"] == ["en"]
        for r in rows
    )
    # each benchmark is a third of the collection, shared among its rows
    assert all(r["weight"] == pytest.approx(1 / 6) for r in rows)

    # the prompt is the benchmark's own sample, rendered by its adapter: user message, target, subset
    for r in rows:
        [message] = r["prompt"]["input"]
        assert message["role"] == "user" and message["content"] and "id" not in message
        assert r["prompt"]["target"]
    math_problems = {row["problem"]: row["answer"] for row in _lines(shared("math_500", "test.jsonl"))}
    for r in by_bench["math_500"]:
        assert r["subset_name"] in LEVELS
        [problem] = [p for p in math_problems if p in r["prompt"]["input"][0]["content"]]
        assert r["prompt"]["target"] == math_problems[problem]
    aime_answers = {row["problem"]: row["answer"] for row in _lines(shared("aime24", "test.jsonl"))}
    for r in by_bench["aime24"]:
        [problem] = [p for p in aime_answers if p in r["prompt"]["input"][0]["content"]]
        assert r["subset_name"] == "default" and r["prompt"]["target"] == aime_answers[problem]
    correct = {g["Question"]: g["Correct Answer"] for g in GPQA_ROWS}
    for r in by_bench["gpqa_diamond"]:
        [question] = [q for q in correct if q in r["prompt"]["input"][0]["content"]]
        choices, target = r["prompt"]["choices"], r["prompt"]["target"]
        assert len(choices) == 4 and choices["ABCD".index(target)] == correct[question]

    manifest = json.loads((tmp_path / "r1" / "manifest.json").read_text())
    assert manifest["rows"] == 6 and manifest["rows_per_benchmark"] == {b: 2 for b in R1_DISTILL_MATH_TEST}
    assert manifest["config"]["per_benchmark_limit"] == 2 and manifest["config"]["seed"] == 0
    schema = json.loads((tmp_path / "r1" / "schema.json").read_text())
    assert [d["name"] for d in schema["datasets"]] == list(R1_DISTILL_MATH_TEST)

    # seeded: the same inputs make the same bytes; another seed draws other problems
    again = build_local_collection(local_paths, tmp_path / "again", per_benchmark_limit=2)
    assert again.read_bytes() == path.read_bytes()
    other = build_local_collection(local_paths, tmp_path / "other", per_benchmark_limit=2, seed=1)
    assert other.read_bytes() != path.read_bytes()


def test_a_missing_benchmark_directory_is_named(local_paths, tmp_path):
    out = tmp_path / "r1"
    without_gpqa = {b: p for b, p in local_paths.items() if b != "gpqa_diamond"}
    with pytest.raises(FileNotFoundError, match="no local path for benchmark 'gpqa_diamond'"):
        build_local_collection(without_gpqa, out)
    with pytest.raises(FileNotFoundError, match="local path for benchmark 'aime24' not found: .*nowhere"):
        build_local_collection({**local_paths, "aime24": str(tmp_path / "nowhere")}, out)
    with pytest.raises(
        ValueError, match=r"local_paths names \['gsm8k'\], which are not in R1-Distill-Math-Test"
    ):
        build_local_collection({**local_paths, "gsm8k": str(tmp_path)}, out)
    with pytest.raises(ValueError, match="per_benchmark_limit must be a positive integer or None, got 0"):
        build_local_collection(local_paths, out, per_benchmark_limit=0)
    assert not out.exists()
    with pytest.raises(ValueError, match="per_benchmark_limit .* needs local_paths"):
        evaluate_collection("some/model", tmp_path / "eval", per_benchmark_limit=2, api_url="http://x/v1")


# ---- evaluating --------------------------------------------------------------------------------------------


def test_tiny_checkpoint_on_the_offline_collection_reports_evalscopes_numbers(
    tiny_base, local_paths, tmp_path
):
    work_dir = tmp_path / "eval"
    result = evaluate_collection(
        tiny_base["path"], work_dir, local_paths=local_paths, per_benchmark_limit=2, max_tokens=16
    )
    ours = json.loads(result.report_json.read_text())
    assert ours["offline"] is True and ours["benchmarks"] == ["data_collection"]
    assert ours["local_paths"] == {"data_collection": str(work_dir / "collection")}
    assert "from modelscope" not in result.log_path.read_text()

    # a score per benchmark and one for the whole collection, each as EvalScope's collection report says
    detailed = _detailed(result)
    assert set(result.subsets["data_collection"]) == set(R1_DISTILL_MATH_TEST)
    per_dataset = {r["dataset_name"]: r["micro_avg."] for r in detailed["dataset_level"]}
    assert result.subsets["data_collection"] == per_dataset
    [overall] = detailed["category_level"]
    assert result.scores == {"data_collection": overall["micro_avg."]}
    assert result.num_samples == {"data_collection": 6} and overall["count"] == 6
    assert ours["scores"] == result.scores and ours["subsets"] == result.subsets

    # EvalScope's per-sample reviews, one per problem, agree with its report
    [reviews_path] = result.review_paths["data_collection"]
    reviews = _lines(reviews_path)
    assert len(reviews) == 6 == len(_lines(result.predictions_paths["data_collection"][0]))
    scores = defaultdict(list)
    for r in reviews:
        value = r["sample_score"]["score"][
            "value"
        ]  # each adapter's spelling: aime24 "acc", math_500 "accuracy"
        scores[r["sample_score"]["sample_metadata"]["collection_info"]["dataset_name"]].append(
            value["accuracy"] if "accuracy" in value else value["acc"]
        )
    for bench, values in scores.items():
        assert result.subsets["data_collection"][bench] == pytest.approx(sum(values) / len(values), abs=1e-4)
    assert all(
        p["model_output"]["usage"]["output_tokens"] <= 16
        for p in _lines(result.predictions_paths["data_collection"][0])
    )

    # finished: the same request returns the record; another collection is refused
    assert load_result(work_dir) == result
    assert (
        evaluate_collection(
            tiny_base["path"], work_dir, local_paths=local_paths, per_benchmark_limit=2, max_tokens=16
        )
        == result
    )
    with pytest.raises(FileExistsError, match="another collection .*per_benchmark_limit: 2 there, 1 now"):
        evaluate_collection(
            tiny_base["path"], work_dir, local_paths=local_paths, per_benchmark_limit=1, max_tokens=16
        )


def test_served_model_scores_per_benchmark_and_a_new_loopback_port_reuses_the_record(
    local_paths, tmp_path, monkeypatch
):
    """A stub endpoint answers GPQA and AIME right and MATH-500 wrong, so each number is known."""
    aime = {row["problem"]: row["answer"] for row in _lines(shared("aime24", "test.jsonl"))}
    correct = {g["Correct Answer"] for g in GPQA_ROWS}

    def answer(prompt):
        for letter, text in re.findall(r"^([A-D])\) (.*)$", prompt, flags=re.M):
            if text.strip() in correct:
                return f"ANSWER: {letter}"
        solved = [a for problem, a in aime.items() if problem in prompt]
        return f"\\boxed{{{solved[0]}}}" if solved else "I do not know."

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    work_dir = tmp_path / "eval"
    with stub_chat_endpoint(answer) as (url, requests):
        result = evaluate_collection(
            "stub/model", work_dir, local_paths=local_paths, per_benchmark_limit=2, max_tokens=16, api_url=url
        )
    assert len(requests) == 6
    assert result.subsets == {"data_collection": {"aime24": 1.0, "gpqa_diamond": 1.0, "math_500": 0.0}}
    [overall] = _detailed(result)["category_level"]
    assert result.scores["data_collection"] == overall["micro_avg."] == pytest.approx(4 / 6, abs=1e-4)

    # the model is served again on another free port: same settings, so the recorded result comes back
    with stub_chat_endpoint(answer) as (other_url, other_requests):
        assert other_url != url
        again = evaluate_collection(
            "stub/model",
            work_dir,
            local_paths=local_paths,
            per_benchmark_limit=2,
            max_tokens=16,
            api_url=other_url,
        )
    assert again == result and other_requests == []
    with pytest.raises(FileExistsError, match="other settings .*max_tokens"):
        evaluate_collection(
            "stub/model",
            work_dir,
            local_paths=local_paths,
            per_benchmark_limit=2,
            max_tokens=8,
            api_url=other_url,
        )


def test_the_three_benchmarks_alone_report_evalscopes_numbers(tiny_base, local_paths, tmp_path):
    result = run_evalscope(
        tiny_base["path"],
        list(R1_DISTILL_MATH_TEST),
        work_dir=tmp_path / "eval",
        limit=1,
        max_tokens=16,
        local_paths=local_paths,
    )
    assert result.num_samples == {"math_500": 5, "gpqa_diamond": 1, "aime24": 1}  # limit is per subset
    for bench in R1_DISTILL_MATH_TEST:
        report = json.loads(result.report_paths[bench].read_text())
        [primary] = [m for m in report["metrics"] if m["identity"] == report["primary_metric_identity"]]
        assert result.scores[bench] == primary["score"]
        subsets = {s["name"]: s["score"] for c in primary["categories"] for s in c["subsets"]}
        assert result.subsets[bench] == subsets
    assert list(result.subsets["math_500"]) == LEVELS


# ---- settings ----------------------------------------------------------------------------------------------


def test_a_loopback_urls_port_is_not_a_setting():
    same = ("http://127.0.0.1:41234/v1", "http://127.0.0.1:52811/v1")
    assert comparable("api_url", same[0]) == comparable("api_url", same[1])
    assert comparable("api_url", "http://localhost:8000/v1") == comparable("api_url", "http://localhost:9/v1")
    # another host, path or scheme is another endpoint; elsewhere the port matters
    assert comparable("api_url", "http://127.0.0.1:1/v1") != comparable("api_url", "http://localhost:1/v1")
    assert comparable("api_url", "http://127.0.0.1:1/v1") != comparable("api_url", "http://127.0.0.1:1/v2")
    assert comparable("api_url", "http://gpu-node:8000/v1") != comparable(
        "api_url", "http://gpu-node:8001/v1"
    )
    assert comparable("api_url", None) is None
    assert comparable("model", "http://127.0.0.1:1/v1") == "http://127.0.0.1:1/v1"


def test_a_hub_collection_is_named_by_dataset_id(tmp_path):
    assert _dataset_args(["data_collection"], {}, {"data_collection": R1_DISTILL_MATH_TEST_ID}, 1) == {
        "data_collection": {"dataset_id": "evalscope/R1-Distill-Math-Test-v2"}
    }
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="both a local path and a dataset id"):
        run_evalscope(
            str(ckpt),
            ["data_collection"],
            work_dir=tmp_path / "eval",
            local_paths={"data_collection": str(tmp_path)},
            dataset_ids={"data_collection": "a/b"},
        )
    with pytest.raises(ValueError, match="dataset_ids names benchmark 'aime25', which is not among"):
        run_evalscope(
            str(ckpt), ["data_collection"], work_dir=tmp_path / "eval", dataset_ids={"aime25": "a/b"}
        )
