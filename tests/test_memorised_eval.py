"""A real evaluation whose every score is known: the memorising model (`memorised_model`) through EvalScope
scores 1 on each problem it memorised and 0 on the others, with the prompts EvalScope sends and the outputs
it was taught; `compare` pairs it with the plain tiny model's evaluation problem by problem, by id."""

from __future__ import annotations

import json
import shutil

import pytest
from memorised_model import MAX_TOKENS, completion, evaluated_problems, reviews, text_of

from conftest import shared
from evaluation.compare import compare, load_samples


def test_memorising_model_scores_one_on_what_it_memorised_and_zero_elsewhere(
    memorised_eval, memorising_model
):
    from transformers import AutoTokenizer

    problems = evaluated_problems(shared())
    assert sum(p.memorised for p in problems) == 5 and len(problems) == 12
    assert len({p.answer for p in problems}) == 12  # so no problem is right with another's answer
    assert memorised_eval.num_samples == {"math_500": 10, "aime24": 2}
    assert memorised_eval.scores == {"math_500": 4 / 10, "aime24": 1 / 2}
    assert memorised_eval.subsets == {
        "math_500": {"Level 1": 0.5, "Level 2": 0.0, "Level 3": 0.5, "Level 4": 0.5, "Level 5": 0.5},
        "aime24": {"default": 0.5},
    }

    found = reviews(memorised_eval)
    assert set(found) == {
        (p.benchmark, p.key) for p in problems
    }  # EvalScope's limit: the first 2 of each subset
    tokenizer = AutoTokenizer.from_pretrained(memorising_model)
    predictions = {
        (bench, json.loads(line)["index"], path.stem): json.loads(line)
        for bench, paths in memorised_eval.predictions_paths.items()
        for path in paths
        for line in path.read_text().splitlines()
    }
    for p in problems:
        review = found[p.benchmark, p.key]
        value = review["sample_score"]["score"]["value"]
        assert (p.key, next(iter(value.values()))) == (p.key, float(p.memorised))
        # the model was taught the prompt EvalScope sends, and answers it word for word
        user, answer = review["messages"][0], review["messages"][-1]
        assert (user["role"], user["content"]) == ("user", p.prompt)
        if p.memorised:
            assert text_of(answer) == completion(p.answer)
            prediction = predictions[p.benchmark, review["index"], f"{p.benchmark}_{p.subset}"]
            # its length in the model's own tokens, and the end-of-sequence token that stopped it
            taught = len(tokenizer(completion(p.answer), add_special_tokens=False)["input_ids"]) + 1
            assert prediction["model_output"]["usage"]["output_tokens"] == taught < MAX_TOKENS


def test_compare_pairs_the_two_models_problem_by_problem(memorised_eval, plain_eval, tmp_path):
    problems = evaluated_problems(shared())
    memorised, plain = load_samples(memorised_eval.work_dir), load_samples(plain_eval.work_dir)
    for bench in ("math_500", "aime24"):
        # MATH-500 problems are paired by their unique_id, AIME problems by their place in the subset
        assert memorised[bench]["accuracy"] == {
            p.key: float(p.memorised) for p in problems if p.benchmark == bench
        }
        assert plain[bench]["accuracy"] == {p.key: 0.0 for p in problems if p.benchmark == bench}

    rows = {r.benchmark: r for r in compare(plain, memorised) if r.metric == "accuracy"}
    # MATH-500: 4 of 10 differences are +1; a resample's mean is Binomial(10, 0.4) / 10, whose 2.5% and 97.5%
    # quantiles (1 and 7: P(X <= 0) = 0.006, P(X <= 1) = 0.046; P(X <= 6) = 0.945, P(X <= 7) = 0.988) fall
    # inside the masses of 0.1 and 0.7. AIME: differences [0, 1] give 0, 0.5 or 1 with p = 1/4, 1/2, 1/4.
    assert {b: (r.a, r.b, r.diff, r.ci_low, r.ci_high, r.n, r.dropped) for b, r in rows.items()} == {
        "math_500": (0.0, 0.4, pytest.approx(0.4), pytest.approx(0.1), pytest.approx(0.7), 10, 0),
        "aime24": (0.0, 0.5, 0.5, 0.0, 1.0, 2, 0),
    }

    # pairing is by id, not by line: the same evaluation with every review file reversed is no different
    shuffled = shutil.copytree(memorised_eval.work_dir, tmp_path / "reversed")
    for path in (shuffled / "evalscope" / "reviews").rglob("*.jsonl"):
        path.write_text("".join(reversed(path.read_text().splitlines(keepends=True))))
    assert {
        (r.benchmark, r.diff, r.ci_low, r.ci_high, r.n)
        for r in compare(memorised, load_samples(shuffled))
        if r.metric == "accuracy"
    } == {("math_500", 0.0, 0.0, 0.0, 10), ("aime24", 0.0, 0.0, 0.0, 2)}
