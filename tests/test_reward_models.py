"""Rewards scored by a model over HTTP (`kind: model`): a scoring endpoint, a generative judge, and endpoints
that are slow, answer 500, drip their answer or never answer, all real HTTP servers on 127.0.0.1.

Most cases use a loopback OpenAI-compatible handler, which can answer exactly as each case needs (numbers,
verdicts out of order, 500, a drip); one uses `grpoflow serve-model` with the tiny base model as the judge
(a real server, its batched /completions and its API key check). `GRPOTrainer` builds its rewards with
`RewardSpec.reward_function` whatever their kind, which `test_trainer` covers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest
import yaml
from test_serving import serve_cli

from conftest import clean_env, loopback_http
from data.schema import SYSTEM_PROMPT
from trainer.recipe import load_recipe
from trainer.rewards import RewardRunner, model_reward
from trainer.typed_config import ConfigError

KEY = "sk-judge-3c1f9a77"  # the secret that must reach the server and nothing else


class OpenAIHandler(BaseHTTPRequestHandler):
    """Answers /v1/pooling with one score per input (the count of 'right' in it) and /v1/completions with a
    verdict per prompt ('Score: 1' when the response part says 42); records every request."""

    requests: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if self.path == "/v1/pooling":
            data = [{"index": i, "data": [float(t.count("right"))]} for i, t in enumerate(body["input"])]
            self.answer(200, {"data": data})
        elif self.path == "/v1/completions":
            choices = []
            for i, prompt in enumerate(body["prompt"]):
                response = prompt.split("Response:", 1)[1]
                text = "Score: 0. On reflection, Score: 1" if "42" in response else "I cannot tell."
                choices.append({"index": i, "text": text})
            self.answer(200, {"choices": choices[::-1]})  # out of order: the index decides
        else:
            self.answer(404, {"error": "no such route"})

    def answer(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def endpoint(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_scoring_endpoint_scores_each_completion_in_batches_sending_the_key_as_bearer_only(
    monkeypatch, caplog, capsys
):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    caplog.set_level(logging.DEBUG)

    class Handler(OpenAIHandler):
        requests = []

    completions = ["right", "wrong", "right right", "", [{"role": "assistant", "content": "right"}]]
    with loopback_http(Handler) as server:
        reward = model_reward(endpoint(server), mode="score", batch_size=2, api_key_env="JUDGE_KEY")
        result = RewardRunner([("rm", reward, 1.0)])(["q"] * 5, completions)
    assert result.per_function["rm"] == [1.0, 0.0, 2.0, 0.0, 1.0]
    assert result.errors == {"rm": 0}
    assert sorted(len(r["body"]["input"]) for r in Handler.requests) == [1, 2, 2]  # sent concurrently
    assert {r["auth"] for r in Handler.requests} == {f"Bearer {KEY}"}
    assert {r["path"] for r in Handler.requests} == {"/v1/pooling"}
    out = capsys.readouterr()
    assert KEY not in caplog.text + out.out + out.err + repr(reward.__closure__)


def test_generative_judge_reads_the_last_verdict_and_counts_an_unreadable_one_as_an_error(caplog):
    class Handler(OpenAIHandler):
        requests = []

    chat_prompt = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "What is 6*7?"}]
    prompts = [chat_prompt, "What is 6*7?", "What is 6*7?"]
    completions = ["It is 42.", "It is 41, not {answer}.", "42"]
    with loopback_http(Handler) as server:
        reward = model_reward(endpoint(server), model="judge-1", batch_size=8)
        result = RewardRunner([("judge", reward, 2.0)])(prompts, completions, answer=["42", "42", "42"])
    assert result.per_function["judge"] == [1.0, None, 1.0]
    assert result.total == [2.0, None, 2.0]
    assert result.metrics()["rewards/judge/errors"] == 1.0
    assert "no verdict in the judge's answer" in caplog.text
    [request] = Handler.requests
    assert request["body"]["model"] == "judge-1"
    # a chat prompt gives its user message; {answer} in the template is the reference, in model text it stays
    sent = request["body"]["prompt"]
    assert "\nQuestion: What is 6*7?\nReference answer: 42\nResponse: It is 42." in sent[0]
    assert "Reference answer: 42\nResponse: It is 41, not {answer}." in sent[1]


def test_endpoint_answering_500_gives_none_for_its_completions_after_its_retries():
    class Failing(OpenAIHandler):
        requests = []

        def do_POST(self):
            self.requests.append({})
            self.answer(500, {"error": "overloaded"})

    with loopback_http(Failing) as server:
        reward = model_reward(endpoint(server), mode="score", retries=2, batch_size=4)
        result = RewardRunner([("rm", reward, 1.0), ("const", lambda p, c: [0.5] * len(c), 1.0)])(
            ["q", "q"], ["a", "b"]
        )
    assert result.per_function["rm"] == [None, None]
    assert result.errors == {"rm": 2, "const": 0}
    assert result.total == [0.5, 0.5]
    assert len(Failing.requests) == 3  # one batch, tried 1 + retries times


@pytest.mark.parametrize("server", ["silent", "closed"])
def test_endpoint_that_never_answers_or_refuses_gives_none_and_returns(server, silent_port, closed_port):
    port = silent_port.getsockname()[1] if server == "silent" else closed_port
    reward = model_reward(f"http://127.0.0.1:{port}/v1", timeout_s=0.3, retries=1, batch_size=2)
    result = RewardRunner([("judge", reward, 1.0)], timeout_s=30)(["q"] * 3, ["a", "b", "c"])
    assert result.per_function["judge"] == [None, None, None]
    assert result.errors == {"judge": 3}


def test_an_answer_dripping_past_the_deadline_is_cut_off_while_a_slow_complete_one_is_read(caplog):
    release = threading.Event()

    class Dripping(OpenAIHandler):
        requests = []

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if "drip" in self.path:  # a byte at a time: each read succeeds, the whole never arrives
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                while not release.is_set():
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    release.wait(0.02)
                return
            time.sleep(0.3)  # slow, but well inside its deadline
            self.answer(200, {"data": [{"index": 0, "data": 0.25}]})

    try:
        with loopback_http(Dripping) as server:
            port = server.server_address[1]
            dripped = model_reward(f"http://127.0.0.1:{port}/drip", mode="score", timeout_s=0.5, retries=0)
            slow = model_reward(f"http://127.0.0.1:{port}/slow", mode="score", timeout_s=20)
            rewards = [("dripped", dripped, 1.0), ("slow", slow, 1.0)]
            result = RewardRunner(rewards, timeout_s=30)(["q"], ["a"])
    finally:
        release.set()
    assert result.per_function == {"dripped": [None], "slow": [0.25]}
    assert result.errors == {"dripped": 1, "slow": 0}
    # the reward's own deadline ended the request, not the runner abandoning the call
    assert "no complete answer within 0.5 s" in caplog.text
    assert "no result after" not in caplog.text


def write_recipe(tmp_path, reward: dict):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"rewards": [{"name": "format"}, reward]}))
    return path


def test_recipe_with_a_model_reward_loads_and_builds_its_function(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    entry = {"name": "judge", "kind": "model", "endpoint": "http://judge:8000/v1", "weight": 0.5}
    entry["args"] = {"api_key_env": "JUDGE_KEY", "timeout_s": 5, "verdict": r"VERDICT=(\d)"}
    recipe = load_recipe(write_recipe(tmp_path, entry))
    spec = recipe.rewards[1]
    assert (spec.label, spec.kind, spec.weight) == ("judge", "model", 0.5)
    assert callable(spec.reward_function())
    assert KEY not in repr(recipe) + json.dumps(recipe.to_dict())


def test_a_model_reward_whose_retries_outlast_the_reward_call_is_warned_about(tmp_path):
    from trainer.rewards.model_reward import outlasting_rewards

    entry = {"name": "judge", "kind": "model", "endpoint": "http://judge:8000/v1"}
    entry["args"] = {"timeout_s": 4, "retries": 2}  # 3 tries of 4 s, pauses of 0.1 and 0.2 s: 12.3 s
    recipe = load_recipe(write_recipe(tmp_path, entry))
    [warning] = outlasting_rewards(recipe.rewards, 10.0)
    assert (
        warning.startswith("rewards[1] (judge): one request may take 12.3 s")
        and "reward_timeout_s=10" in warning
    )
    assert outlasting_rewards(recipe.rewards, 12.3) == []  # within the call's bound: nothing to say


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"endpoint": "judge:8000/v1"}, r"rewards\[1\]: endpoint: expected an http\(s\) URL"),
        ({"endpoint": None}, r"rewards\[1\]: endpoint: required for a reward of kind 'model'"),
        ({"endpoint": "https://user:pw@judge/v1"}, r"endpoint: 'https://user:\*\*\*@judge/v1' carries"),
        ({"args": {"api_key_env": "JUDGE_KEY_UNSET"}}, r"args.api_key_env: .*'JUDGE_KEY_UNSET' is not set"),
        ({"args": {"verdict": "(a)(b)"}}, r"args.verdict: needs exactly one group"),
        ({"args": {"retries": -1}}, r"args.retries: expected a whole number from 0 to 10, got -1"),
        ({"args": {"temprature": 0}}, r"rewards\[1\]: args: .*temprature"),
        ({"args": {"concurrency": 100000}}, r"args.concurrency: expected a whole number from 1 to 256"),
        ({"args": {"timeout_s": 0}}, r"args.timeout_s: expected seconds in \(0, 3600\]"),
        ({"kind": "function"}, r"endpoint: only a reward of kind 'model' has an endpoint"),
    ],
    ids=[
        "endpoint-not-a-url",
        "endpoint-missing",
        "endpoint-with-a-key",
        "key-variable-unset",
        "verdict-with-two-groups",
        "retries-negative",
        "unknown-setting",
        "concurrency-huge",
        "timeout-zero",
        "endpoint-on-a-function",
    ],
)
def test_recipe_refuses_a_bad_model_reward_naming_the_field(tmp_path, monkeypatch, change, expected):
    monkeypatch.delenv("JUDGE_KEY_UNSET", raising=False)
    entry = {"name": "judge", "kind": "model", "endpoint": "https://judge/v1", **change}
    with pytest.raises(ConfigError, match=expected) as error:
        load_recipe(write_recipe(tmp_path, {k: v for k, v in entry.items() if v is not None}))
    assert "pw" not in str(error.value)


def test_generative_judge_served_by_grpoflow_serve_model_checks_the_bearer_key(
    tiny_base, monkeypatch, caplog, capsys
):
    """The tiny base model as a real judge behind `grpoflow serve-model --api-key-env`: asked an addition in
    its chat format it answers with digits, which the verdict reads (one request of three prompts, so the
    greedy answers do not depend on how the server batches); a wrong key is refused with 401, which fails
    only that reward's completions."""
    from transformers import AutoTokenizer

    chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "{prompt}"}]
    template = AutoTokenizer.from_pretrained(tiny_base["path"]).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    settings = {"template": template + "{completion}", "verdict": r"(\d+)", "max_tokens": 8, "batch_size": 3}
    serve = (tiny_base["path"], "--engine", "transformers", "--api-key-env", "JUDGE_KEY")
    with serve_cli(*serve, env=clean_env({"JUDGE_KEY": KEY})) as (_, ready):
        monkeypatch.setenv("JUDGE_KEY", KEY)
        judge = model_reward(ready["url"], model=ready["model"], api_key_env="JUDGE_KEY", **settings)
        monkeypatch.setenv("JUDGE_KEY", "sk-wrong")
        refused = model_reward(ready["url"], api_key_env="JUDGE_KEY", **settings)
        runner = RewardRunner([("judge", judge, 1.0), ("refused", refused, 1.0)], timeout_s=120)
        result = runner(["What is 2+3?", "What is 10+4?", "What is 7+8?"], ["", "", ""])
    assert result.errors == {"judge": 0, "refused": 3}
    assert all(isinstance(v, float) for v in result.per_function["judge"]), result.per_function
    assert "HTTP 401" in caplog.text
    out = capsys.readouterr()
    assert KEY not in caplog.text + out.out + out.err
