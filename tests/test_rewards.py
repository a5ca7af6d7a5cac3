"""Reward library: every built-in on hand-written completions with hand-computed rewards, the registry, the
runner."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import threading
from fractions import Fraction

import pytest

from trainer.rewards import (
    REWARD_NAMES,
    RewardRunner,
    RewardSpecError,
    accuracy_reward,
    available_rewards,
    completion_text,
    cosine,
    countdown_reward,
    counting_reward,
    evaluate_expression,
    format_reward,
    math_grader,
    repetition,
    resolve_reward,
    reward_metrics,
    soft_overlong,
)
from trainer.rewards.countdown import CountdownRejected
from trainer.rewards.runner import bounds_own_work


def chat(text: str) -> list[dict]:
    """A TRL conversational completion."""
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------- parsing


def test_completion_text_accepts_strings_messages_and_parts():
    assert completion_text("hi") == "hi"
    assert completion_text(chat("hi")) == "hi"
    assert (
        completion_text(
            [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]
        )
        == "a"
    )
    assert completion_text(None) == ""
    with pytest.raises(TypeError, match="int"):
        completion_text(42)


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>reason</think><answer>42</answer>", 1.0),
        ("  <think>\nreason\n</think>\n\n<answer>\n42\n</answer>\n", 1.0),
        (chat("<think>r</think> <answer>42</answer>"), 1.0),
        ("<think>r</think>", 0.0),
        ("<answer>42</answer>", 0.0),
        ("<think>r</think><answer>1</answer><answer>2</answer>", 0.0),  # repeated answer
        ("<think>r</think><think>s</think><answer>1</answer>", 0.0),  # repeated think
        ("<think>a<think>b</think></think><answer>1</answer>", 0.0),  # nested think
        ("<think>r<answer>1</answer></think><answer>1</answer>", 0.0),  # answer tag inside think
        ("Sure! <think>r</think><answer>1</answer>", 0.0),  # text before
        ("<think>r</think> so <answer>1</answer>", 0.0),  # text between
        ("<think>r</think><answer>1</answer> done", 0.0),  # text after
        ("<answer>1</answer><think>r</think>", 0.0),  # wrong order
        ("<think>r</think><answer>  </answer>", 0.0),  # empty answer
        ("<think></think><answer>1</answer>", 0.0),  # empty think
        ("<THINK>r</THINK><ANSWER>1</ANSWER>", 0.0),  # tags are lower case
        ("<think>r</think><answer>1</answer", 0.0),  # unclosed
        ("", 0.0),
    ],
)
def test_format(completion, expected):
    assert format_reward(["p"], [completion]) == [expected]


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    "gold, completion, expected",
    [
        ("18", "<think>6*3</think><answer>18</answer>", 1.0),
        ("025", "<answer>25</answer>", 1.0),  # AIME zero padding
        ("25", "<answer>025</answer>", 1.0),
        ("\\frac{1}{2}", "<answer>0.5</answer>", 1.0),
        ("\\frac{1}{2}", "<answer>$\\frac{1}{2}$</answer>", 1.0),
        ("3\\sqrt{2}", "<answer>\\sqrt{18}</answer>", 1.0),
        ("18", "<answer>19</answer>", 0.0),
        ("18", "The answer is \\boxed{18}.", 1.0),  # no answer block: the last box counts
        ("18", "<answer>17</answer> \\boxed{18}", 0.0),  # an answer block wins over a box
        ("18", "<answer>18</answer><answer>17</answer>", 0.0),  # the last block is graded
        ("18", "<answer>17</answer><answer>18</answer>", 1.0),
        ("18", "<answer>17 or 18</answer>", 0.0),  # hedging is wrong
        ("18", "I am sure it is 18", 0.0),  # an answer outside the tags does not count
        ("18", "<answer>18", 0.0),  # unclosed
        ("18", "<answer></answer>", 0.0),
        ("18", "", 0.0),
        ("18", "<answer>__import__('os').system('x')</answer>", 0.0),
        ("18", "<answer>" + "1" * 2000 + "</answer>", 0.0),  # too long to grade
        ("18", chat("<think>r</think><answer>18</answer>"), 1.0),
        ("", "<answer>18</answer>", None),  # the gold answer's fault, not the model's
        (None, "<answer>18</answer>", None),
    ],
)
def test_accuracy(gold, completion, expected):
    assert accuracy_reward(["p"], [completion], answer=[gold], nums=[[1]]) == [expected]


def test_grader_gives_up_on_an_answer_too_costly_to_check(monkeypatch):
    # 2^(2^30) makes sympy build a billion-bit integer in one C call: no signal or thread timeout can stop it.
    monkeypatch.setattr(math_grader, "GRADE_TIMEOUT_S", 1.0)
    killed = math_grader._WORKER.killed
    assert accuracy_reward(["p"], ["<answer>2^{2^{30}}</answer>"], answer=["18"]) == [0.0]
    assert math_grader._WORKER.killed == killed + 1
    assert accuracy_reward(["p"], ["<answer>18</answer>"], answer=["18"]) == [1.0]  # a fresh worker took over


def test_grade_in_process_outside_the_main_thread():
    # math-verify's signal-based timeout raises outside the main thread unless it is switched off there.
    results = []
    thread = threading.Thread(target=lambda: results.append(math_grader.grade_in_process("025", "25")))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_accuracy_columns_must_line_up():
    completions = ["<answer>1</answer>", "<answer>2</answer>"]
    message = "accuracy: 2 completions but 1 'answer' value: the reward needs one 'answer' per completion"
    with pytest.raises(ValueError) as e:
        accuracy_reward(["p", "q"], completions, answer=["1"])
    assert str(e.value) == message
    with pytest.raises(ValueError, match="counting: 2 completions but 3 'answer' values"):
        counting_reward(["p", "q"], completions, answer=["1", "2", "3"])
    assert accuracy_reward(["p", "q"], completions, answer=["1", "3"]) == [1.0, 0.0]  # lined up: graded


# ---------------------------------------------------------------- counting


@pytest.mark.parametrize(
    "gold, completion, expected",
    [
        ("3", "<answer>3</answer>", 1.0),
        ("3", "<answer>4</answer>", 0.0),
        (3, "<answer>3</answer>", 1.0),  # an integer gold column
        ("3", "<answer>3.0</answer>", 1.0),
        ("3", "<answer>03</answer>", 1.0),
        ("3", "<answer>three</answer>", 0.0),
        ("three", "<answer>three</answer>", 1.0),  # string fallback when math-verify cannot read the gold
        ("three", "<answer>four</answer>", 0.0),
        ("3", "<answer>3 or 4</answer>", 0.0),
        ("3", "There are 3", 0.0),
        ("3", "so \\boxed{3}", 1.0),
        ("3", "<answer>3</answer><answer>4</answer>", 0.0),
        ("3", "", 0.0),
        ("3", chat("<answer>3</answer>"), 1.0),
        ("", "<answer>3</answer>", None),
    ],
)
def test_counting(gold, completion, expected):
    assert counting_reward(["p"], [completion], answer=[gold]) == [expected]


# ---------------------------------------------------------------- countdown

NUMS, TARGET = [30, 100, 93], 23  # 30 - (100 - 93) = 23


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>t</think><answer>30 - (100 - 93)</answer>", 1.0),
        ("<answer>30-(100-93)</answer>", 1.0),
        ("<answer>30 - (100 - 93) = 23</answer>", 1.0),
        ("<answer>(30 + 93) - 100</answer>", 1.0),
        ("<answer>30 - (100 - 93) = 24</answer>", 0.0),  # the right-hand side must be the target
        ("<answer>30 - 100 - 93</answer>", 0.0),  # -163
        ("<answer>30 - (100 - 93) + 0</answer>", 0.0),  # a number that was not given
        ("<answer>30 - (100 - 93) + 30 - 30</answer>", 0.0),  # a number used twice
        ("<answer>30 + 100</answer>", 0.0),  # a number not used
        ("<answer>__import__('os').system('x')</answer>", 0.0),
        ("<answer>9**9**9</answer>", 0.0),
        ("<answer>(1/0)</answer>", 0.0),
        ("<answer>30 - (100 - 93) + 100 / (93 - 93)</answer>", 0.0),  # division by zero
        ("<answer>٣0 - (100 - 93)</answer>", 0.0),  # Arabic-Indic digit
        ("<answer>３0 - (100 - 93)</answer>", 0.0),  # full-width digit
        ("<answer>-(100 - 93) + 30</answer>", 0.0),  # no unary minus
        ("<answer>30 - (100 - 93.0)</answer>", 0.0),
        ("<answer>30 - (100 - 93</answer>", 0.0),  # unbalanced
        ("<answer>30 (100 - 93)</answer>", 0.0),  # no implicit product
        ("<answer>" + "(" * 200 + "30" + ")" * 200 + "</answer>", 0.0),  # too long
        ("30 - (100 - 93)", 0.0),  # no answer block
        ("<answer>1</answer><answer>30 - (100 - 93)</answer>", 1.0),  # the last block counts
        ("", 0.0),
        (chat("<answer>30 - (100 - 93)</answer>"), 1.0),
    ],
)
def test_countdown(completion, expected):
    assert countdown_reward(["p"], [completion], nums=[NUMS], target=[TARGET], answer=["23"]) == [expected]


def test_countdown_uses_exact_fractions():
    # 8 / (3 - 8/3) = 8 / (1/3) = 24: only exact rational arithmetic gets this right.
    assert countdown_reward(
        ["p"], ["<answer>8 / (3 - 8 / 3)</answer>"], nums=[[3, 3, 8, 8]], target=[24]
    ) == [1.0]
    assert countdown_reward(["p"], ["<answer>8 / (3 - 8 / 3)</answer>"], nums=[[3, 8, 8]], target=[24]) == [
        0.0
    ]
    assert evaluate_expression("8 / (3 - 8 / 3)") == (Fraction(24), [8, 3, 8, 3])


def test_countdown_bounds_values_and_sizes():
    with pytest.raises(CountdownRejected, match="intermediate"):
        evaluate_expression("1000000 * 1000000 * 1000000")
    with pytest.raises(CountdownRejected, match="more than 32 numbers"):
        evaluate_expression("+".join(["1"] * 33))
    with pytest.raises(CountdownRejected, match="nested deeper"):
        evaluate_expression("(" * 33 + "1" + ")" * 33)


def test_countdown_gold_columns_read_from_json_or_bad():
    completions = ["<answer>30 - (100 - 93)</answer>"] * 3
    nums = [["30", "100", "93"], [30.0, 100, 93], ["a", 100, 93]]
    assert countdown_reward(["p"] * 3, completions, nums=nums, target=["23", 23, 23]) == [1.0, 1.0, None]


# ---------------------------------------------------------------- cosine

R2 = math.sqrt(2) / 2  # cos(pi / 4)


@pytest.mark.parametrize(
    "completion, length, expected",
    [
        ("<answer>18</answer>", 0, 1.0),
        ("<answer>18</answer>", 25, 0.5 + 0.25 * (1 + R2)),
        ("<answer>18</answer>", 50, 0.75),
        ("<answer>18</answer>", 100, 0.5),
        ("<answer>18</answer>", 200, 0.5),  # clipped at max_len
        ("<answer>17</answer>", 0, -1.0),
        ("<answer>17</answer>", 25, -0.5 - 0.25 * (1 + R2)),
        ("<answer>17</answer>", 50, -0.75),
        ("<answer>17</answer>", 100, -0.5),
        ("no answer", 100, -0.5),
        (chat("<answer>18</answer>"), 50, 0.75),
    ],
)
def test_cosine_token_lengths(completion, length, expected):
    reward = cosine(max_len=100)
    got = reward(["p"], [completion], answer=["18"], completion_ids=[[7] * length])
    assert got == [pytest.approx(expected)]


def test_cosine_character_lengths_params_and_bad_gold():
    text = "<answer>18</answer>"  # 19 characters
    assert cosine(max_len=19)(["p"], [text], answer=["18"]) == [pytest.approx(0.5)]
    assert cosine(max_len=38, min_value_correct=0.0, max_value_correct=2.0)(["p"], [text], answer=["18"]) == [
        pytest.approx(1.0)
    ]
    assert cosine(max_len=10)(["p"], [text], answer=[""]) == [None]
    assert cosine().__name__ == "cosine"
    with pytest.raises(ValueError, match="max_len"):
        cosine(max_len=0)


# ---------------------------------------------------------------- repetition


@pytest.mark.parametrize(
    "completion, kwargs, expected",
    [
        ("", {}, 0.0),
        ("a b", {}, 0.0),  # fewer words than the n-gram size
        ("a b c", {}, 0.0),
        ("a b c a b c", {}, -0.25),  # abc bca cab abc: 3 unique of 4
        ("a a a a", {}, -0.5),  # aaa aaa: 1 of 2
        ("A a A a", {}, -0.5),  # lower-cased
        ("a\nb\tc  a b c", {}, -0.25),  # any whitespace splits words
        ("x x x x x x", {}, -0.75),  # 1 of 4
        ("the cat sat on the mat", {}, 0.0),
        ("a b a b", {"ngram_size": 2}, -1 / 3),  # ab ba ab: 2 of 3
        ("a a a a", {"max_penalty": -2.0}, -1.0),
        (chat("a a a a"), {}, -0.5),
    ],
)
def test_repetition(completion, kwargs, expected):
    assert repetition(**kwargs)(["p"], [completion]) == [pytest.approx(expected)]


def test_repetition_rejects_a_bonus():
    with pytest.raises(ValueError, match="max_penalty"):
        repetition(max_penalty=0.5)


# ---------------------------------------------------------------- soft_overlong


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (50, 0.0),
        (80, 0.0),
        (81, -0.05),
        (90, -0.5),
        (99, -0.95),
        (100, -1.0),
        (101, -1.0),
        (500, -1.0),
    ],
)
def test_soft_overlong_token_lengths(length, expected):
    reward = soft_overlong(max_len=100, cache_len=20)
    assert reward(["p"], ["x"], completion_ids=[[1] * length]) == [pytest.approx(expected)]


def test_soft_overlong_character_lengths_and_params():
    assert soft_overlong(max_len=4, cache_len=2)(["p"] * 3, ["ab", "abc", chat("abcde")]) == [0.0, -0.5, -1.0]
    assert soft_overlong(max_len=100, cache_len=100)(["p"], ["x"], completion_ids=[[1] * 50]) == [-0.5]
    for bad in ({"max_len": 10, "cache_len": 0}, {"max_len": 10, "cache_len": 11}):
        with pytest.raises(ValueError, match="cache_len"):
            soft_overlong(**bad)
    with pytest.raises(ValueError, match="completion_ids"):
        soft_overlong(max_len=4, cache_len=2)(["p"], ["x"], completion_ids=[[1], [2]])


# ---------------------------------------------------------------- registry


def test_registry_names():
    expected = {"format", "accuracy", "countdown", "counting", "cosine", "repetition", "soft_overlong"}
    assert set(REWARD_NAMES) == set(available_rewards()) == expected


def test_resolve_builtins_with_and_without_args():
    assert resolve_reward("format") is format_reward
    assert resolve_reward("accuracy")(["p"], ["<answer>2</answer>"], answer=["2"]) == [1.0]
    overlong = resolve_reward("soft_overlong", {"max_len": 4, "cache_len": 2})
    assert overlong.__name__ == "soft_overlong"
    assert overlong(["p"], ["abc"]) == [-0.5]


@pytest.mark.parametrize(
    "spec, args, message",
    [
        (
            "nope",
            None,
            "unknown reward 'nope'; valid names are format, accuracy, countdown, counting, cosine",
        ),
        ("format", {"x": 1}, "reward 'format': bad args"),
        ("soft_overlong", {"max_len": 4}, "cache_len"),
        ("cosine", {"max_len": 0}, "max_len must be positive"),
        ("", None, "non-empty"),
        ("no_such_module_xyz:fn", None, "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_function", None, "module 'os.path' has no attribute 'no_such_function'"),
        ("os:sep", None, "is not callable"),
        (":fn", None, "must look like"),
        ("missing_dir/missing.py:fn", None, "missing.py' does not exist"),
    ],
)
def test_resolve_errors_say_what_is_wrong(spec, args, message):
    with pytest.raises(RewardSpecError, match=message.replace("(", r"\(").replace(".", r"\.")) as caught:
        resolve_reward(spec, args)
    assert isinstance(caught.value, ValueError)


def test_resolve_module_plugin():
    assert resolve_reward("trainer.rewards.math_rewards:format_reward") is format_reward


def test_resolve_file_plugin(tmp_path):
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(
        "def bonus(prompts, completions, scale=1.0, **columns):\n"
        "    return [scale * len(c) for c in completions]\n"
    )
    assert resolve_reward(f"{plugin}:bonus")(["p", "q"], ["ab", "c"]) == [2.0, 1.0]
    scaled = resolve_reward("my_rewards.py:bonus", {"scale": 0.5}, base_dir=tmp_path)
    assert scaled.__name__ == "bonus"
    assert scaled(["p"], ["abcd"]) == [2.0]

    with pytest.raises(RewardSpecError, match="my_rewards.py' has no attribute 'missing'"):
        resolve_reward(f"{plugin}:missing")
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(RewardSpecError, match="broken.py' failed to load \\(SyntaxError"):
        resolve_reward(f"{broken}:oops")


def test_trainer_rewards_imports_no_orchestration_packages():
    code = (
        "import sys, trainer.rewards\n"
        "bad = [m for m in ('prefect', 'mlflow', 'flows', 'tasks', 'evaluation') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- runner


def constant(value):
    def reward(prompts, completions, **columns):
        return [value] * len(completions)

    return reward


def fails_on_bad(prompts, completions, **columns):
    if "bad" in completions:
        raise ValueError("cannot score 'bad'")
    return [1.0] * len(completions)


def runner_records(caplog):
    return [r for r in caplog.records if r.name == "grpoflow.rewards"]


def test_runner_isolates_a_failing_completion_and_logs_once(caplog):
    caplog.set_level(logging.WARNING, logger="grpoflow.rewards")
    runner = RewardRunner([("fragile", fails_on_bad, 1.0), ("steady", constant(0.5), 2.0)], timeout_s=5)
    result = runner(["p"] * 3, ["a", "bad", "c"])
    assert result.per_function == {"fragile": [1.0, None, 1.0], "steady": [0.5] * 3}
    assert result.errors == {"fragile": 1, "steady": 0}
    assert result.total == [2.0, 1.0, 2.0]  # 1*1 + 2*0.5, then the failed reward is left out
    again = runner(["p"] * 2, ["bad", "bad"])
    assert again.errors["fragile"] == 2
    records = runner_records(caplog)
    assert len(records) == 1
    assert "fragile" in records[0].getMessage() and "cannot score 'bad'" in records[0].getMessage()


def test_runner_times_out_a_slow_function(caplog):
    caplog.set_level(logging.WARNING, logger="grpoflow.rewards")
    release = threading.Event()

    def slow(prompts, completions, **columns):
        release.wait(10)
        return [1.0] * len(completions)

    runner = RewardRunner([("slow", slow, 1.0), ("fast", constant(1.0), 1.0)], timeout_s=0.2)
    try:
        result = runner(["p"] * 2, ["a", "b"])
    finally:
        release.set()
    assert result.per_function == {"slow": [None, None], "fast": [1.0, 1.0]}
    assert result.errors == {"slow": 2, "fast": 0}
    assert result.total == [1.0, 1.0]
    assert "RewardTimeout" in runner_records(caplog)[0].getMessage()


def test_runner_weighted_totals():
    runner = RewardRunner(
        [("a", lambda p, c, **k: [1.0, 0.0, None], 2.0), ("b", lambda p, c, **k: [0.5, None, None], -1.0)]
    )
    result = runner(["p"] * 3, ["x", "y", "z"])
    assert result.total == [1.5, 0.0, None]  # 2*1 - 0.5; 2*0; no value at all
    assert result.errors == {"a": 0, "b": 0}  # returning None is not an error


def test_runner_counts_bad_outputs():
    runner = RewardRunner(
        [("values", lambda p, c, **k: ["x", 1, float("inf")], 1.0), ("length", lambda p, c, **k: [], 1.0)]
    )
    result = runner(["p"] * 3, ["x", "y", "z"])
    assert result.per_function == {"values": [None, 1.0, None], "length": [None, None, None]}
    assert result.errors == {"values": 2, "length": 3}


def test_runner_passes_each_sample_its_own_columns():
    seen = []

    def picky(prompts, completions, answer, trainer_state=None, **columns):
        if len(completions) > 1:
            raise RuntimeError("one at a time")
        seen.append((answer, trainer_state))
        return [float(answer[0])]

    result = RewardRunner([("picky", picky, 1.0)])(
        ["p"] * 2, ["x", "y"], answer=["1", "2"], trainer_state="S"
    )
    assert result.per_function["picky"] == [1.0, 2.0]
    assert seen == [(["1"], "S"), (["2"], "S")]


def test_runner_scores_math_in_worker_threads():
    # The runner calls a plug-in in a worker thread; the math rewards must work there when a plug-in calls
    # them (they grade in a subprocess).
    def plug_in(prompts, completions, **columns):
        return resolve_reward("accuracy")(prompts, completions, **columns)

    runner = RewardRunner([("accuracy", plug_in, 1.0)], timeout_s=30)
    result = runner(["p"] * 2, ["<answer>\\frac{1}{2}</answer>", "<answer>3</answer>"], answer=["0.5", "2"])
    assert result.per_function["accuracy"] == [1.0, 0.0]
    assert result.errors == {"accuracy": 0}


def test_rewards_that_bound_their_own_work_run_in_the_callers_thread():
    # Every built-in is marked: the timeout's thread could not stop them, and costs the step its handoff.
    threads = {}

    def recording(name):
        def reward(prompts, completions, **columns):
            threads[name] = threading.current_thread()
            return [1.0] * len(completions)

        return reward

    runner = RewardRunner(
        [("marked", bounds_own_work(recording("marked")), 1.0), ("plug_in", recording("plug_in"), 1.0)],
        timeout_s=5,
    )
    assert runner(["p"], ["x"]).total == [2.0]
    assert threads["marked"] is threading.current_thread()
    assert threads["plug_in"] is not threading.current_thread() and threads["plug_in"].name == "reward-reward"
    args = {"soft_overlong": {"max_len": 24, "cache_len": 4}}
    for name in REWARD_NAMES:
        assert getattr(resolve_reward(name, args.get(name)), "bounds_own_work", False), name


def test_runner_rejects_bad_specs():
    with pytest.raises(ValueError, match="twice"):
        RewardRunner([("a", format_reward, 1.0), ("a", format_reward, 1.0)])
    with pytest.raises(ValueError, match="weight"):
        RewardRunner([("a", format_reward, float("nan"))])
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        RewardRunner([("a", format_reward, 1.0)])(["p", "q"], ["x"])


def test_reward_metrics():
    result = RewardRunner([("a", lambda p, c, **k: [1.0, None, 3.0], 1.0), ("b", constant(None), 1.0)])(
        ["p"] * 3, ["x", "y", "z"]
    )
    assert reward_metrics(result) == {
        "rewards/a/mean": 2.0,
        "rewards/a/std": pytest.approx(math.sqrt(2)),  # sample std of 1 and 3
        "rewards/a/errors": 0.0,
        "rewards/b/errors": 0.0,
    }
    assert result.metrics() == reward_metrics(result)
