"""Thinking-efficiency metrics: each metric on hand-written reasoning traces with hand-counted numbers (a
whitespace tokenizer, so every count can be checked by eye), then the `grpoflow thinking` command with the
tiny model's real tokenizer, and the metrics of a real EvalScope run of the memorising model (right on purpose
on 5 of 12 problems) checked against EvalScope's own scores and against counts made here from the model's
output text."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from memorised_model import MAX_TOKENS, reasoning_of
from test_evaluation import stub_chat_endpoint

from conftest import REPO_ROOT
from data.errors import DataError
from evaluation import load_result
from evaluation.thinking import (
    OpenAIJudge,
    analyze,
    count_thought_switches,
    paragraph_prefixes,
    sample_metrics,
    split_reasoning,
    summarize,
    token_counter,
)


class Words:
    """A tokenizer whose tokens are the whitespace-separated words."""

    def encode(self, text):
        return text.split()


def metrics(output, gold="4", judge=None):
    return sample_metrics(output, gold, token_counter(Words()), judge)


# Hand-counted traces. Tokens are words: "x = \boxed{4}" is 3, "Check: 2+2 is 4 indeed" is 5.
FIRST_PARAGRAPH = "<think>\nx = \\boxed{4}\n\nCheck: 2+2 is 4 indeed\n</think>\n<answer>4</answer>"
NEVER = "<think>Maybe \\boxed{5}.\n\nBut wait, \\boxed{6}.</think>\\boxed{6}"
ABANDONED = "<think>\\boxed{4}\n\nAlternatively it is \\boxed{5}</think>\\boxed{5}"
AFTER_THINK = "<think>I add two and two.</think><answer>4</answer>"
EMPTY = "<think></think>\\boxed{4}"
SECOND = "First try \\boxed{3}\n\nFix: \\boxed{4}\n\nDone, \\boxed{4} stands"  # 3 + 2 + 3 words


def test_correct_in_first_paragraph_counts_at_paragraph_one():
    row = metrics(FIRST_PARAGRAPH)
    assert row == {
        "reasoning_source": "think_tag",
        "paragraphs": 2,
        "reasoning_tokens": 8,
        "thought_num": 0,
        "correct": True,
        "first_correct_paragraph": 1,
        "first_correct_tokens": 3,
        "reflection_tokens": 5,
        "token_efficiency": 3 / 8,
    }


def test_never_correct_leaves_first_correct_metrics_undefined():
    row = metrics(NEVER)
    assert (row["reasoning_tokens"], row["thought_num"], row["paragraphs"]) == (5, 1, 2)
    assert row["correct"] is False and row["first_correct_paragraph"] is None
    assert row["first_correct_tokens"] is row["reflection_tokens"] is row["token_efficiency"] is None


def test_wrong_answer_that_once_had_the_right_one_records_where():
    row = metrics(ABANDONED)
    assert row["correct"] is False and row["first_correct_paragraph"] == 1
    assert row["reasoning_tokens"] == 5 and row["thought_num"] == 1 and row["first_correct_tokens"] is None


def test_answer_only_after_the_reasoning_takes_all_of_it():
    row = metrics(AFTER_THINK)
    assert row["correct"] is True and row["first_correct_paragraph"] is None
    assert (row["reasoning_tokens"], row["first_correct_tokens"], row["reflection_tokens"]) == (5, 5, 0)
    assert row["token_efficiency"] == 1.0


def test_empty_reasoning():
    row = metrics(EMPTY)
    assert row["reasoning_tokens"] == row["paragraphs"] == row["thought_num"] == 0
    assert row["correct"] is True and row["first_correct_tokens"] == row["reflection_tokens"] == 0
    assert row["token_efficiency"] is None  # 0 / 0
    assert metrics("")["correct"] is False and metrics("")["reasoning_source"] == "whole_output"


def test_reasoning_content_field_think_tag_and_evalscope_block_give_the_same_numbers():
    field = metrics({"reasoning_content": SECOND, "content": "The answer is \\boxed{4}."})
    blocks = metrics(
        {
            "content": [
                {"type": "reasoning", "reasoning": SECOND},
                {"type": "text", "text": "The answer is \\boxed{4}."},
            ]
        }
    )
    tagged = metrics(f"<think>{SECOND}</think>The answer is \\boxed{{4}}.")
    assert field["reasoning_source"] == blocks["reasoning_source"] == "reasoning_content"
    assert tagged["reasoning_source"] == "think_tag"
    for row in (field, blocks, tagged):
        assert (row["paragraphs"], row["reasoning_tokens"], row["first_correct_paragraph"]) == (3, 8, 2)
        assert (row["first_correct_tokens"], row["reflection_tokens"], row["token_efficiency"]) == (
            5,
            3,
            5 / 8,
        )


def test_split_reasoning_sources():
    # the LAST </think> ends the reasoning; a leading <think> tag is dropped, the text is stripped
    assert split_reasoning({"content": "<think> a </think> b </think> \\boxed{4}"})[:1] == ("a </think> b",)
    assert split_reasoning({"content": "all of it"}) == ("all of it", "all of it", "whole_output")
    reasoning, output, source = split_reasoning({"content": "\\boxed{4}", "reasoning_content": "r"})
    assert (reasoning, output, source) == ("r", "r\n\n\\boxed{4}", "reasoning_content")
    # an empty reasoning field is no reasoning: the content is split instead
    assert split_reasoning({"content": "x</think>y", "reasoning_content": ""})[2] == "think_tag"


def test_whole_output_paragraphs_split_at_blank_lines_with_spaces():
    text = "Let me see.\n\n \n\nSo \\boxed{4}.\n\nDouble-check: yes"
    assert paragraph_prefixes(text) == ["Let me see.", "Let me see.\n\n \n\nSo \\boxed{4}.", text]
    assert paragraph_prefixes("") == paragraph_prefixes(" \n\n ") == []
    row = metrics(text)
    assert row["reasoning_source"] == "whole_output" and row["correct"] is True
    assert (row["paragraphs"], row["reasoning_tokens"], row["first_correct_tokens"]) == (3, 7, 5)


def test_thought_switches_are_case_insensitive():
    text = "Alternatively, x. BUT WAIT, y. but wait z. Another Approach: w. butwait. alternative. another"
    assert count_thought_switches(text) == 4
    assert count_thought_switches("Let me reconsider; another way, another method, another angle") == 4
    assert count_thought_switches("") == 0


def test_token_counter_takes_encode_or_a_count_function():
    assert token_counter(Words())("a b  c") == 3
    assert token_counter(len)("abc") == 3
    with pytest.raises(TypeError):
        token_counter(42)


def test_judge_hook_decides_the_prefixes():
    calls = []

    def judge(prefix, gold):
        calls.append((prefix, gold))
        return "forty-two" in prefix

    trace = "<think>First, forty\n\nthen forty-two\n\nso forty-two it is</think>\\boxed{42}"
    row = metrics(trace, gold="42", judge=judge)
    assert calls == [("First, forty", "42"), ("First, forty\n\nthen forty-two", "42")]
    assert (row["first_correct_paragraph"], row["first_correct_tokens"], row["reasoning_tokens"]) == (2, 4, 8)
    assert row["token_efficiency"] == 0.5


def test_summary_means_and_over_and_underthinking():
    rows = [metrics(t) for t in (FIRST_PARAGRAPH, NEVER, ABANDONED, AFTER_THINK, EMPTY, f"{SECOND}</think>")]
    # reasoning tokens 8, 5, 5, 5, 0, 8; switches 0, 1, 1, 0, 0, 0; correct: all but NEVER and ABANDONED
    summary = summarize(rows)
    assert summary["samples"] == summary["graded"] == 6 and summary["correct"] == 4
    assert summary["accuracy"] == pytest.approx(4 / 6)
    assert summary["reasoning_tokens"] == pytest.approx(31 / 6) and summary["thought_num"] == pytest.approx(
        2 / 6
    )
    assert (
        summary["first_correct_tokens"] == (3 + 5 + 0 + 5) / 4 and summary["reflection_tokens"] == (5 + 3) / 4
    )
    assert summary["token_efficiency"] == pytest.approx((3 / 8 + 1 + 5 / 8) / 3)  # EMPTY has no efficiency
    # overthinking: FIRST_PARAGRAPH (5 of 8 after) and SECOND (3 of 8 after) had the answer early
    assert summary["overthinking"] == {"samples": 2, "reflection_tokens": 4.0, "reflection_fraction": 0.5}
    assert summary["underthinking"] == {"samples": 2, "thought_num": 1.0, "abandoned_correct": 1}
    assert summary["evalscope_accuracy"] is None
    # an ungradable sample (gold unreadable) counts as a sample but not in accuracy
    assert summarize([*rows, {**rows[1], "correct": None}])["accuracy"] == pytest.approx(4 / 6)
    empty = summarize([])
    assert empty["samples"] == 0 and empty["accuracy"] is empty["reasoning_tokens"] is None


def test_openai_judge_asks_the_endpoint(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sekret")
    answer = lambda prompt: "YES" if "forty-two" in prompt.split("</solution>")[0] else "No."  # noqa: E731
    with stub_chat_endpoint(answer) as (url, requests):
        judge = OpenAIJudge(url, "judge-model", api_key_env="JUDGE_KEY")
        assert judge("so forty-two", "42") is True and judge("so forty", "42") is False
    assert [r["auth"] for r in requests] == ["Bearer sekret"] * 2
    assert requests[0]["model"] == "judge-model" and requests[0]["temperature"] == 0.0
    assert "Correct final answer: 42" in requests[0]["messages"][0]["content"]
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ValueError, match="JUDGE_KEY"):
        OpenAIJudge(url, "judge-model", api_key_env="JUDGE_KEY")


# ---- inputs and the command --------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    good = {"id": 1, "output": "\\boxed{4}", "answer": "4"}
    bad = write_jsonl(tmp_path / "bad.jsonl", [good, '{"id": 2, "output": '])
    with pytest.raises(DataError, match=rf"{bad}:2: not valid JSON"):
        analyze(bad, Words())
    missing = write_jsonl(tmp_path / "missing.jsonl", [good, {"id": 2, "answer": "4"}])
    with pytest.raises(DataError, match=rf"{missing}:2: missing field 'output'"):
        analyze(missing, Words())
    with pytest.raises(FileNotFoundError, match="no such"):
        analyze(tmp_path / "nowhere.jsonl", Words())
    with pytest.raises(FileNotFoundError, match="without report.json"):
        analyze(tmp_path, Words())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "missing.jsonl"]  # nothing written


def grpoflow(*args):
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )


def test_cli_on_a_jsonl_with_the_tiny_models_tokenizer(tiny_base, tmp_path):
    rows = [
        {"id": "a", "output": FIRST_PARAGRAPH, "answer": "4"},
        {"id": "b", "output": NEVER, "answer": 4},
        {"id": "c", "output": "2+2", "reasoning_content": SECOND, "answer": ["4"]},
    ]
    source = write_jsonl(tmp_path / "outs.jsonl", rows)
    proc = grpoflow("thinking", str(source), "--tokenizer", tiny_base["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {
        "reasoning_tokens",
        "thought_num",
        "first_correct_tokens",
        "reflection_tokens",
        "token_efficiency",
        "accuracy",
        "samples",
        "per_benchmark",
        "samples_path",
    } <= set(summary)
    assert summary["samples"] == 3 and summary["accuracy"] == pytest.approx(2 / 3)
    assert summary["samples_path"] == str(tmp_path / "outs.thinking.jsonl")
    assert list(summary["per_benchmark"]) == ["outs"] and list(
        summary["per_benchmark"]["outs"]["subsets"]
    ) == ["default"]
    out = [json.loads(line) for line in open(summary["samples_path"])]
    assert [r["id"] for r in out] == ["a", "b", "c"] and [r["correct"] for r in out] == [True, False, True]
    assert [r["first_correct_paragraph"] for r in out] == [1, None, 2]
    for r in out[0], out[2]:  # real subword counts: only their relations are hand-checkable
        assert 0 < r["first_correct_tokens"] < r["reasoning_tokens"]
        assert r["reflection_tokens"] == r["reasoning_tokens"] - r["first_correct_tokens"]
        assert r["token_efficiency"] == pytest.approx(r["first_correct_tokens"] / r["reasoning_tokens"])
    assert summary["reasoning_tokens"] == pytest.approx(sum(r["reasoning_tokens"] for r in out) / 3)
    assert summary["reflection_tokens"] == pytest.approx(
        (out[0]["reflection_tokens"] + out[2]["reflection_tokens"]) / 2
    )

    # the table, and --out
    proc = grpoflow(
        "thinking", str(source), "--tokenizer", tiny_base["path"], "--out", str(tmp_path / "x.jsonl")
    )
    assert proc.returncode == 0, proc.stderr
    assert "overall" in proc.stdout and "outs" in proc.stdout and (tmp_path / "x.jsonl").is_file()

    # bad input: exit 2, the file and line named
    write_jsonl(source, [rows[0], {"id": "b", "output": "x"}])
    proc = grpoflow("thinking", str(source), "--tokenizer", tiny_base["path"], "--json")
    assert proc.returncode == 2 and f"{source}:2: missing field 'answer'" in proc.stderr
    proc = grpoflow("thinking", str(tmp_path / "nowhere"), "--tokenizer", tiny_base["path"], "--json")
    assert proc.returncode == 2 and json.loads(proc.stdout.strip().splitlines()[-1])["exit_code"] == 2


def test_real_evalscope_work_dir(memorised_eval, memorising_model, tmp_path):
    from transformers import AutoTokenizer

    work_dir = shutil.copytree(
        memorised_eval.work_dir, tmp_path / "eval"
    )  # the session's evaluation stays as it is
    result = load_result(work_dir)
    report = analyze(work_dir, memorising_model)
    summary = report.summary
    assert report.samples_path == work_dir / "thinking" / "samples.jsonl" and report.samples_path.is_file()
    assert {b: s["samples"] for b, s in summary["per_benchmark"].items()} == result.num_samples
    assert {b: set(s["subsets"]) for b, s in summary["per_benchmark"].items()} == {
        b: set(subsets) for b, subsets in result.subsets.items()
    }
    for bench, s in summary["per_benchmark"].items():
        # EvalScope's own per-sample verdicts, carried along, average to its report's score; ours agree with
        # them
        assert s["evalscope_accuracy"] == pytest.approx(result.scores[bench])
        assert s["accuracy"] == pytest.approx(result.scores[bench]) == {"math_500": 0.4, "aime24": 0.5}[bench]

    # the right answers' numbers, counted here from the model's own output text with its own tokenizer: the
    # reasoning up to the paragraph holding the first \boxed{} (the second of three) is the first correct
    # prefix
    tokenizer = AutoTokenizer.from_pretrained(memorising_model)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    outputs = {
        (bench, path.stem.removeprefix(f"{bench}_"), line["index"]): line["model_output"]["choices"][0][
            "message"
        ]
        for bench, paths in result.predictions_paths.items()
        for path in paths
        for line in map(json.loads, path.read_text().splitlines())
    }
    right = [r for r in report.rows if r["correct"]]
    assert len(right) == 5 and all(r["evalscope_score"] == 1.0 for r in right)
    firsts, reflections = [], []
    for row in right:
        text = reasoning_of(outputs[row["benchmark"], row["subset"], row["id"]])
        first = text[: text.index("\n\n", text.index("\\boxed{"))]
        assert first == f"I think.\n\nThe answer is \\boxed{{{row['gold'][0]}}}."  # what it was taught
        assert (row["paragraphs"], row["first_correct_paragraph"]) == (3, 2)
        assert (row["reasoning_tokens"], row["first_correct_tokens"]) == (count(text), count(first))
        assert row["reflection_tokens"] == count(text) - count(first) > 0
        assert row["token_efficiency"] == pytest.approx(count(first) / count(text))
        firsts.append(count(first))
        reflections.append(count(text) - count(first))
    assert (
        summary["first_correct_tokens"] == pytest.approx(sum(firsts) / 5)
        and summary["first_correct_tokens"] > 0
    )
    assert summary["overthinking"]["samples"] == 5
    assert summary["overthinking"]["reflection_tokens"] == pytest.approx(sum(reflections) / 5)
    # the other 7 are wrong, with no first-correct numbers, and none stated the right answer along the way
    wrong = [r for r in report.rows if not r["correct"]]
    assert len(wrong) == 7 and all(
        r["first_correct_tokens"] is None and r["evalscope_score"] == 0.0 for r in wrong
    )
    assert summary["underthinking"]["samples"] == 7 and summary["underthinking"]["abandoned_correct"] == 0
    assert all(0 < r["reasoning_tokens"] <= MAX_TOKENS for r in report.rows)
