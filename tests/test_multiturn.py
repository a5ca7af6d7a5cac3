"""Multi-turn, tool-using rollouts (`trainer.multiturn`): tool calls read from Qwen's `<tool_call>` blocks,
every failed call an observation the model reads, trajectories that keep the model's tokens and the
environment's apart, a loss that never sees a token the model did not write, and the tiny calculator demo.

The trajectories here are the tiny tools model's (`configs/tiny-tools-cpu.yaml`'s base: warmed up so that a
fifth of its answers call the calculator); the vLLM cases are in tests/test_vllm.py (the vLLM suite)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, clean_env, grpoflow_run, last_json, rollout_workers_once
from trainer.multiturn.environment import ToolEnvironment
from trainer.multiturn.rollout import MultiTurnEngine, observation_text
from trainer.multiturn.tools import CALCULATOR, Tool, ToolCall, calculate, parse_tool_calls
from trainer.rollout.base import SamplingParams

TOOLS = REPO_ROOT / "configs" / "tiny-tools-cpu.yaml"


@pytest.fixture(scope="module")
def tools_recipe():
    from trainer.recipe import load_recipe

    return load_recipe(TOOLS)


@pytest.fixture(scope="module")
def tools_base(tools_recipe) -> dict:
    """The demo's base model, where `grpoflow run --config configs/tiny-tools-cpu.yaml` keeps it (`make test`
    makes it first, with all the cores, as that command does)."""
    from trainer.bootstrap import bootstrap

    r = tools_recipe
    return bootstrap(
        r.bootstrap, out=REPO_ROOT / r.bootstrap.out, system_prompt=r.data.system_prompt, progress=False
    )


@pytest.fixture(scope="module")
def tools_data(tmp_path_factory, tools_recipe) -> Path:
    from data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "multiplication"
    prepare(**{**tools_recipe.data.prepare_kwargs(), "out": out, "synthetic_rows": 600})
    return out


@pytest.fixture(scope="module")
def model_and_tokenizer(tools_base):
    from trainer.model_loading import load_model
    from trainer.recipe import ModelConfig

    model, tokenizer = load_model(tools_base["path"], ModelConfig(dtype="float32"), "cpu")
    return model.eval(), tokenizer


def heldout_prompts(tools_data, tokenizer, n: int = 16):
    from data.prepare import load_prepared
    from trainer.prompts import encode_prompts

    rows = load_prepared(tools_data, "heldout")[:n]
    return rows, encode_prompts(tokenizer, rows)


def tool_engine(model, tokenizer, max_turns: int = 3, tools=(CALCULATOR,), timeout_s: float = 5.0):
    from trainer.rollout.hf_engine import HFEngine

    return MultiTurnEngine(
        HFEngine(model, tokenizer), tokenizer, ToolEnvironment(list(tools), timeout_s), max_turns
    )


@pytest.fixture(scope="module")
def trajectories(model_and_tokenizer, tools_data):
    """Sampled trajectories of 16 held-out problems x 8 (seeded), with the rows they answer."""
    model, tokenizer = model_and_tokenizer
    rows, prompts = heldout_prompts(tools_data, tokenizer)
    groups = tool_engine(model, tokenizer).generate(prompts, 8, SamplingParams(64, 1.0, seed=3))
    return rows, prompts, groups


# ---- tool calls and observations --------------------------------------------------------------------------


def test_tool_calls_are_read_from_qwen_tool_call_blocks_and_bad_blocks_are_named():
    text = (
        'I will compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 48"}}\n'
        "</tool_call><tool_call>"
        '{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "37 * 48"}),
        ToolCall("calculator", {"expression": "2+2"}),  # arguments written as a JSON string
    ]
    assert parse_tool_calls("<think>no call</think><answer>5</answer>") == []
    bad = parse_tool_calls('<tool_call>{"name": calc</tool_call><tool_call>[1]</tool_call><tool_call>{"name"')
    assert [c.name for c in bad] == [None, None, None]
    assert bad[0].error.startswith("not JSON (Expecting value at character 9)")
    assert bad[1].error == 'expected a JSON object with a string "name"'
    assert bad[2].error == "<tool_call> is never closed by </tool_call>"
    assert parse_tool_calls('<tool_call>{"name": "x", "arguments": [1]}</tool_call>') == [
        ToolCall("x", error='"arguments" must be a JSON object')
    ]


def test_the_calculator_parses_arithmetic_and_never_executes_text():
    assert calculate("37 * 48") == "1776"
    assert calculate("(7 + 1) / 6") == "4/3"
    for text in ("__import__('os').system('true')", "2 ** 10", "1 / 0", "37 x 48"):
        with pytest.raises(ValueError):
            calculate(text)


def test_every_failed_call_becomes_the_documented_observation_and_none_raises():
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    def broken() -> str:
        raise RuntimeError("disk on fire")

    tools = [
        CALCULATOR,
        Tool("slow", "sleeps", {"type": "object", "required": ["seconds"]}, slow),
        Tool("broken", "raises", {"type": "object"}, broken),
    ]
    episode = ToolEnvironment(tools, tool_timeout_s=0.5).start({"id": "r1", "tools": [CALCULATOR.schema()]})

    def observe(*calls: str):
        return episode.observe("".join(f"<tool_call>{c}</tool_call>" for c in calls))

    obs = observe('{"name": "calculator", "arguments": {"expression": "6 * 7"}}')
    assert (obs.done, obs.tool_calls, obs.tool_errors) == (False, 1, 0)
    assert obs.messages == [{"role": "tool", "name": "calculator", "content": "42"}]
    started = time.monotonic()
    obs = observe(
        '{"name": "calculator", "arguments": {"expression": "6 *"}}',
        '{"name": "search", "arguments": {"q": "x"}}',
        '{"name": "slow", "arguments": {"seconds": 3}}',
        '{"name": "broken", "arguments": {}}',
        '{"name": "calculator", "arguments": {}}',
        '{"name": "calculator", "arguments": {"expr": "1"}, "x": 1',
    )
    assert time.monotonic() - started < 2.5  # the slow call was answered at its timeout, not waited out
    assert (obs.done, obs.tool_calls, obs.tool_errors) == (False, 6, 6)
    assert [m["content"] for m in obs.messages] == [
        "error: ValueError: cannot evaluate '6 *': expression ends too early",
        "error: unknown tool 'search' (tools: broken, calculator, slow)",
        "error: slow timed out after 0.5 s",
        "error: RuntimeError: disk on fire",
        "error: missing argument 'expression'",
        "error: malformed tool call: not JSON (Expecting ',' delimiter at character 57)",
    ]
    assert observe().done  # a turn without a call is the final answer
    with pytest.raises(
        ValueError, match="row 'r2' offers the tool 'search', which rollout.env.tools does not"
    ):
        ToolEnvironment([CALCULATOR]).start({"id": "r2", "tools": [{"function": {"name": "search"}}]})


# ---- trajectories -----------------------------------------------------------------------------------------


def test_a_trajectory_is_the_model_turns_and_the_rendered_tool_result_masked_out(
    trajectories, model_and_tokenizer
):
    _, tokenizer = model_and_tokenizer
    rows, _, groups = trajectories
    calls = [
        (row, c) for row, g in zip(rows, groups, strict=True) for c in g if c.trajectory["tool_calls"] == 1
    ]
    # a call written in the last tokens of the budget is cut there: no observation follows it, nothing masked
    cut = [c for _, c in calls if c.trajectory["cut"] == "max_tokens"]
    for c in cut:
        assert 0 not in c.token_mask and len(c.trajectory["messages"]) == 1 and c.finish_reason == "length"
    called = [(row, c) for row, c in calls if c.trajectory["cut"] is None]
    assert len(called) >= 8, "the base model should call the calculator in some samples"
    for _, c in called:
        mask = c.token_mask
        assert len(mask) == len(c.token_ids) == len(c.logprobs)
        first_gap = mask.index(0)
        gap_end = first_gap + mask[first_gap:].index(1) if 1 in mask[first_gap:] else len(mask)
        # the tool's answer as Qwen2.5's template writes it after an assistant turn; nothing else is masked
        result = c.trajectory["messages"][1]["content"]
        observed = tokenizer.decode(c.token_ids[first_gap:gap_end])
        assert observed == observation_text(
            tokenizer, [{"role": "tool", "name": "calculator", "content": result}]
        )
        assert (
            observed == f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert all(lp == 0.0 for lp in c.logprobs[first_gap:gap_end])
        assert all(
            lp < 0.0 or m == 0 for lp, m in zip(c.logprobs, mask, strict=True)
        )  # sampled tokens carry log-probs
        assert c.token_ids[first_gap - 1] == tokenizer.eos_token_id  # the model closed its turn itself
        assert c.text == tokenizer.decode(c.token_ids[gap_end:], skip_special_tokens=True)  # the final turn
    correct = [c for row, c in called if c.trajectory["cut"] is None and row["answer"] in c.text]
    assert correct, "some trajectories should copy the calculator's answer"


def test_max_turns_and_the_token_budget_cut_a_trajectory(model_and_tokenizer, tools_data):
    model, tokenizer = model_and_tokenizer
    _, prompts = heldout_prompts(tools_data, tokenizer)
    sampling = SamplingParams(64, 1.0, seed=3)
    full = [c for g in tool_engine(model, tokenizer).generate(prompts, 8, sampling) for c in g]
    one = [c for g in tool_engine(model, tokenizer, max_turns=1).generate(prompts, 8, sampling) for c in g]
    for a, b in zip(full, one, strict=True):
        if a.trajectory["tool_calls"]:  # the same first turn; with max_turns 1 nothing follows it
            assert b.trajectory["cut"] == "max_turns" and b.finish_reason == "length"
            assert b.token_mask == [1] * len(b.token_ids) and b.token_ids == a.token_ids[: len(b.token_ids)]
        else:
            assert b.token_ids == a.token_ids and b.trajectory["cut"] == a.trajectory["cut"]
    # a budget that leaves no room to answer the tool: cut when the observation would not fit
    called = next(i for i, a in enumerate(full) if a.trajectory["tool_calls"])
    first_turn = full[called].token_mask.index(0)
    tight = SamplingParams(first_turn + 5, 1.0, seed=3)
    cut = tool_engine(model, tokenizer).generate(prompts, 8, tight)[called // 8][called % 8]
    assert cut.trajectory["cut"] == "max_tokens" and len(cut.token_ids) == first_turn
    assert len(cut.token_ids) <= tight.max_tokens


def test_engine_log_probs_of_the_model_tokens_equal_the_trainers(trajectories, model_and_tokenizer):
    """The trainer's forward over [prompt | turn | tool result | turn] gives the sampled tokens the log-probs
    the engine sampled them with (each turn was sampled from the same token ids, not re-tokenized text)."""
    from trainer.logprobs import completion_logps
    from trainer.rollout.batch import RolloutBatch

    model, tokenizer = model_and_tokenizer
    _, prompts, groups = trajectories
    completions = [c for g in groups for c in g]
    batch = RolloutBatch(
        [p for p in prompts for _ in range(8)],
        completions,
        torch.zeros(len(completions)),
        torch.ones(len(completions)),
    )
    mb = batch.micro_batch(torch.arange(len(completions)), tokenizer.pad_token_id)
    with torch.no_grad():
        logps, _ = completion_logps(model, mb, 1.0)
    model_tokens = mb.completion_mask > 0
    assert int(model_tokens.sum()) == sum(sum(c.token_mask) for c in completions)
    assert mb.completion_mask.sum() < sum(len(c.token_ids) for c in completions)  # tool results are out
    gap = (logps - mb.behaviour_logps).abs()[model_tokens]
    assert gap.max().item() < 1e-4


def test_the_loss_gradient_is_exactly_zero_on_tool_and_environment_tokens(trajectories, model_and_tokenizer):
    from trainer import loss as L
    from trainer.logprobs import completion_logps
    from trainer.rollout.batch import RolloutBatch

    model, tokenizer = model_and_tokenizer
    _, prompts, groups = trajectories
    called = [(p, c) for p, g in zip(prompts, groups, strict=True) for c in g if c.trajectory["tool_calls"]][
        :8
    ]
    completions = [c for _, c in called]
    n = len(completions)
    advantages = torch.linspace(-1.0, 1.0, n)
    batch = RolloutBatch([p for p, _ in called], completions, advantages, torch.ones(n))
    mb = batch.micro_batch(torch.arange(n), tokenizer.pad_token_id)
    logps, _ = completion_logps(model, mb, 1.0)
    logps.retain_grad()
    per_token, _ = L.per_token_loss(
        logps, mb.behaviour_logps, mb.advantages, epsilon_low=0.2, epsilon_high=0.2, mask=mb.completion_mask
    )
    total = int(mb.completion_mask.sum())
    L.reduce_loss(
        per_token, mb.completion_mask, "dapo", total_sequences=n, total_tokens=total, max_completion_length=64
    ).backward()
    model.zero_grad(set_to_none=True)
    observed = torch.zeros_like(mb.completion_mask, dtype=torch.bool)
    for r, c in enumerate(completions):
        observed[r, : len(c.token_mask)] = torch.tensor(c.token_mask) == 0
    assert observed.sum() > 0
    assert torch.equal(logps.grad[observed], torch.zeros(int(observed.sum())))  # exactly zero
    assert (logps.grad[mb.completion_mask > 0] != 0).float().mean() > 0.9  # the model's tokens do move it
    # d loss / d logp = -ratio A / total_tokens on each model token, by hand, with ratio = 1 to within the
    # engine's numerics (< 1e-4: the log-prob test above)
    expected = (-advantages[:, None] / total).expand_as(logps)[mb.completion_mask > 0]
    assert torch.allclose(logps.grad[mb.completion_mask > 0], expected, rtol=2e-4, atol=0)


# ---- data -------------------------------------------------------------------------------------------------


def test_prep_keeps_a_rows_tools_offers_the_recipes_and_drops_malformed_ones_naming_the_row(tmp_path):
    from data.prepare import load_prepared, prepare
    from data.schema import CALCULATOR_SCHEMA

    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    src = tmp_path / "rows.jsonl"
    src.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"question": "What is 12 * 13?", "answer": "156#### 156", "tools": [search]},
                {"question": "What is 3 + 4?", "answer": "7\n#### 7"},
                {
                    "question": "What is 5 * 5?",
                    "answer": "25\n#### 25",
                    "tools": [{"function": {"nom": "x"}}],
                },
            )
        )
        + "\n"
    )
    out = prepare(
        "gsm8k",
        str(src),
        tmp_path / "out",
        heldout=0,
        skip_invalid=True,
        tools=["calculator"],
        system_prompt="brief",
    )
    rows = load_prepared(out["out"])
    assert [r["tools"] for r in rows] == [[search], [CALCULATOR_SCHEMA]]  # its own, else the recipe's
    assert out["dropped"] == {"invalid field 'tools[0]'": 1}
    manifest = json.loads(Path(out["manifest"]).read_text())
    assert manifest["tools"] == ["calculator"] and manifest["dropped_examples"][0]["where"].endswith(
        "rows.jsonl:3"
    )
    proc = grpoflow_run("prep", "--task", "gsm8k", "--source", str(src), "--out", str(tmp_path / "strict"))
    assert proc.returncode == 2 and "rows.jsonl:3" in proc.stderr and "tools[0]" in proc.stderr, proc.stderr


# ---- training ---------------------------------------------------------------------------------------------


def train_args(run: Path, tools_base: dict, data: Path, *overrides: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TOOLS),
        f"bootstrap.out={tools_base['path']}",
        f"data.out={data}",
        f"train.output_dir={run}",
        "train.prompts_per_step=4",
        "train.num_generations=4",
        "train.eval_heldout=16",
        "train.micro_batch_size=16",
        *overrides,
        "--json",
    ]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_multi_turn_training_run_reports_its_trajectories_and_samples_what_the_trainer_scores(
    tmp_path, tools_base, tools_data
):
    run = tmp_path / "run"
    proc = grpoflow_run(*train_args(run, tools_base, tools_data, "train.max_steps=3", "train.save_steps=3"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 1.0 <= r["multiturn/turns"] <= 3.0 and r["multiturn/tool_errors"] <= r["multiturn/tool_calls"]
        assert r["sampling/sampling_logp_difference/max"] < 1e-4  # the engine's own module: on-policy
        assert r["multiturn/model_tokens"] <= r["completions/mean_length"]
    assert sum(r["multiturn/tool_calls"] for r in rows) > 0
    # the held-out answers were given with the calculator at hand
    after = [json.loads(line) for line in (run / "heldout" / "after.jsonl").read_text().splitlines()]
    assert len(after) == 16 and last_json(proc)["heldout_after"]["n"] == 16


def test_a_killed_async_worker_mid_trajectory_fails_the_run_naming_it_and_a_rerun_resumes(
    tmp_path, tools_base, tools_data
):
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        *train_args(
            tmp_path / "run",
            tools_base,
            tools_data,
            "rollout.async=true",
            "rollout.sync_timeout_s=60",
            "train.max_steps=12",
            "train.save_steps=2",
            "train.eval_heldout=0",
        ),
    ]
    env = clean_env()
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    latest = tmp_path / "run" / "latest"
    workers = rollout_workers_once(proc, latest)
    os.kill(workers[0].pid, signal.SIGKILL)  # it is generating the next batch's trajectories
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "rollout worker 1" in err and f"pid {workers[0].pid}" in err and "died" in err

    checkpoint_step = int(latest.read_text().split("-")[1])
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == checkpoint_step >= 2 and summary["steps"] == 12
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all("multiturn/turns" in r for r in rows)


def test_the_calculator_demo_runs_the_whole_pipeline_and_gains_15_points_which_the_calculator_makes(
    tmp_path, tools_base
):
    """`grpoflow run --config configs/tiny-tools-cpu.yaml` as shipped (prepared, trained, registered, its
    held-out split evaluated in the same environment): held-out greedy accuracy rises by >= 15 points, and the
    trained model answering the same problems without the calculator stays low."""
    from mlflow import MlflowClient

    from trainer.heldout import evaluate_greedy
    from trainer.model_loading import load_model
    from trainer.multiturn.rollout import in_environment
    from trainer.recipe import EnvConfig, load_recipe
    from trainer.rewards import accuracy_reward, format_reward
    from trainer.rollout.hf_engine import HFEngine

    proc = grpoflow_run(
        "run",
        "--config",
        str(TOOLS),
        "--state-dir",
        str(tmp_path / "state"),
        "--json",
        f"bootstrap.out={tools_base['path']}",
        f"data.out={tmp_path / 'data'}",
        f"train.output_dir={tmp_path / 'runs'}",
        f"eval.out={tmp_path / 'eval'}",
        timeout=1500,  # about 3 minutes on 2 idle cores: a bound against a hang, not a speed check
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = last_json(proc)
    before, after = s["heldout_accuracy_before"], s["scores"]["heldout_accuracy"]
    assert after == pytest.approx(
        s["heldout_accuracy_after"]
    )  # the evaluation stage scored what training did
    print(f"tiny-tools-cpu: held-out {before:.3f} -> {after:.3f}")
    assert after >= before + 0.15, s
    uri = f"sqlite:///{tmp_path / 'state' / 'mlflow.db'}"
    [version] = MlflowClient(uri, registry_uri=uri).search_model_versions("name='grpoflow-tiny-tools'")
    assert version.tags["steps_trained"] == str(load_recipe(TOOLS).train.max_steps)

    # the same held-out problems, the trained model, no calculator (in the prompt or the environment): a call
    # it still makes is answered "unknown tool"
    from data.prepare import load_prepared

    rows = [{k: v for k, v in r.items() if k != "tools"} for r in load_prepared(tmp_path / "data", "heldout")]
    model, tokenizer = load_model(s["checkpoint"])
    engine = in_environment(HFEngine(model.eval(), tokenizer), tokenizer, EnvConfig(tools=[], max_turns=3))
    alone = evaluate_greedy(engine, tokenizer, rows, accuracy_reward, format_reward, max_tokens=64)
    print(f"tiny-tools-cpu without the calculator: {alone['accuracy']:.3f}")
    assert alone["accuracy"] <= before + 0.05 < after


def test_the_8gpu_tools_recipe_dry_run_shows_its_placement_environment_and_memory_plan():
    recipe = str(REPO_ROOT / "configs" / "qwen2.5-7b-tools-8gpu.yaml")
    proc = grpoflow_run("train", "--dry-run", "--json", "--config", recipe)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = last_json(proc)
    assert plan["train_devices"] == [0, 1, 2, 3, 4, 5] and plan["rollout_devices"] == [[6], [7]]
    assert plan["env"] == {"name": "tools", "tools": ["calculator"], "max_turns": 4, "tool_timeout_s": 5.0}
    assert all(d["fits"] for d in plan["memory"]["devices"])
    bad = grpoflow_run(
        "train", "--dry-run", "--json", "--config", recipe, "rollout.env.tools=[calculator, nope]"
    )
    assert bad.returncode == 2 and last_json(bad)["error"].startswith(
        "rollout.env.tools: unknown tool 'nope'"
    )
