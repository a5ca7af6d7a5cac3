"""Serving a checkpoint: the transformers server in a real subprocess on loopback, called with the real
`openai` client; `grpoflow serve-model` and `grpoflow eval --serve` as a user runs them.

vLLM cannot run here (no GPU, not installed): its adapter is checked against a fake `vllm` module that
only records its command line and answers `/health`; the test says so in its name.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from memorised_model import completion, eval_overrides, evaluated_problems, reviews, text_of

from conftest import REPO_ROOT, shared
from evaluation import load_result
from evaluation.serving import ServingInputError, get_json, served_model

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]


def grpoflow(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def ready_line(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    """The first stdout line of a `serve-model --json` process (its ready announcement)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not (box and box[0].strip()):
        proc.kill()  # its stderr ends only with it: read while it runs, the failure would hang instead
        raise AssertionError(f"no ready line within {timeout_s} s; stderr:\n{proc.communicate()[1]}")
    return json.loads(box[0])


@contextmanager
def serve_cli(*args: str, env=None):
    """`grpoflow serve-model ... --json` as a user runs it; yields (its process, its ready line)."""
    proc = grpoflow("serve-model", *args, "--json", env=env)
    try:
        yield proc, ready_line(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def stop_cleanly(proc: subprocess.Popen, sig: int) -> dict:
    """Send `sig`; the server must exit 0 and print its summary as the last line."""
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server(tiny_base):
    with served_model(tiny_base["path"], max_batch_size=8) as served:
        yield served
    assert served.process.returncode == 0, "the server did not shut down cleanly on SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_engine(tiny_base):
    """The same checkpoint in this process, as the trainer's HFEngine sees it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.rollout.hf_engine import HFEngine
    tokenizer = AutoTokenizer.from_pretrained(tiny_base["path"])
    return HFEngine(AutoModelForCausalLM.from_pretrained(tiny_base["path"]), tokenizer), tokenizer


def test_models_and_health(server, client):
    assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
    assert [m.id for m in client.models.list().data] == [server.model_name] == ["tiny-base"]
    health = server.health()
    assert health["status"] == "ok" and health["engine"] == "transformers"
    assert {"batches", "requests"} <= set(health)


def test_greedy_is_deterministic_and_equals_hf_engine(server, client, local_engine):
    from trainer.prompts import encode_prompts
    from trainer.rollout.base import SamplingParams

    replies = [client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=32,
                                              temperature=0) for _ in range(2)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    engine, tokenizer = local_engine
    [prompt] = encode_prompts(tokenizer, [{"prompt": QUESTION}])
    [[expected]] = engine.generate([prompt], 1, SamplingParams(max_tokens=32, temperature=0.0))
    choice, usage = replies[0].choices[0], replies[0].usage
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_samples_and_their_usage(server, client, local_engine):
    _, tokenizer = local_engine
    reply = client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=24,
                                           temperature=1.0, top_p=0.95, n=3, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.message.role == "assistant" for c in reply.choices)
    # completion tokens are summed over the choices; each choice is at most max_tokens long
    assert 3 <= reply.usage.completion_tokens <= 3 * 24
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    again = client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=24,
                                           temperature=1.0, top_p=0.95, n=3, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_completions_with_stop_and_errors(server, client):
    import openai

    reply = client.completions.create(model=server.model_name, prompt=["<think>", "1+1"], max_tokens=16,
                                      temperature=0, stop=["</think>"])
    assert len(reply.choices) == 2 and all("</think>" not in c.text for c in reply.choices)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other-model", messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.chat.completions.create(model=server.model_name, messages=QUESTION, max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=server.model_name, messages=[], max_tokens=4)


def test_concurrent_requests_are_batched(server, client, local_engine):
    from trainer.prompts import encode_prompts
    from trainer.rollout.base import SamplingParams

    before = server.health()
    start = threading.Barrier(8)
    replies, errors = {}, []
    # 1 to 3 digits: prompts of different lengths, padded to share a batch
    questions = [[{"role": "user", "content": f"What is {10 ** (i % 3) + i} + 5?"}] for i in range(8)]

    def ask(i: int) -> None:
        start.wait()
        try:
            replies[i] = client.chat.completions.create(model=server.model_name, messages=questions[i],
                                                        max_tokens=16, temperature=0)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(replies) == 8
    after = server.health()
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == 8 and 1 <= batches < requests
    # batched or not, each answer is the one the same checkpoint gives that question alone, greedily, in this process
    engine, tokenizer = local_engine
    for i, question in enumerate(questions):
        [[alone]] = engine.generate(encode_prompts(tokenizer, [{"prompt": question}]), 1,
                                    SamplingParams(max_tokens=16, temperature=0.0))
        assert replies[i].choices[0].message.content == alone.text and alone.text


def test_vllm_without_vllm_names_the_vllm_extra(tiny_base):
    if _has_vllm():
        pytest.skip("vLLM is installed here")
    with pytest.raises(ServingInputError, match=r"pip install \.\[vllm\]"):
        with served_model(tiny_base["path"], engine="vllm"):
            pass
    proc = grpoflow("serve-model", tiny_base["path"], "--engine", "vllm", "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "pip install .[vllm]" in err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2


def test_a_server_dying_at_start_is_reported_with_the_checkpoint(tiny_base, tmp_path):
    broken = tmp_path / "broken-ckpt"
    shutil.copytree(tiny_base["path"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code") as info:
        with served_model(broken, startup_timeout_s=90):
            pass
    assert str(broken) in str(info.value) and "stderr" in str(info.value)
    assert time.monotonic() - started < 90


def test_serve_model_cli_prints_its_url_and_stops_cleanly_on_sigint(tiny_base):
    with serve_cli(tiny_base["path"], "--served-model-name", "tiny") as (proc, ready):
        assert set(ready) == {"url", "model", "pid", "engine"} and ready["pid"] == proc.pid
        assert ready["model"] == "tiny" and ready["engine"] == "transformers"
        assert get_json(ready["url"] + "/models")["data"][0]["id"] == "tiny"
        assert stop_cleanly(proc, signal.SIGINT) == {**ready, "batches": 0, "requests": 0}


def test_eval_serve_scores_through_the_endpoint_like_a_direct_run(memorising_model, memorised_eval, tmp_path):
    """`grpoflow eval --serve` on the memorising model, with the settings of the session's direct evaluation of it
    (`memorised_model.eval_overrides`): the same verdict on every problem, and the same answers where it knows them."""
    proc = grpoflow("eval", memorising_model, *eval_overrides(shared()), f"eval.out={tmp_path / 'eval'}",
                    f"data.out={tmp_path / 'no-prepared-data'}", "--serve", "--concurrency", "4",
                    "--state-dir", str(tmp_path / "state"), "--json")
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    served = json.loads(out.strip().splitlines()[-1])
    assert served["served_by"] == "transformers" and served["num_samples"] == memorised_eval.num_samples
    assert served["scores"] == memorised_eval.scores == {"math_500": 0.4, "aime24": 0.5}
    report = json.loads(open(served["report"]).read())
    assert report["eval_type"] == "openai_api" and report["model"] == "memorising"
    assert report["api_url"].startswith("http://127.0.0.1:") and report["eval_batch_size"] == 4

    through_endpoint, direct = reviews(load_result(served["work_dir"])), reviews(memorised_eval)
    assert {k: r["sample_score"]["score"]["value"] for k, r in through_endpoint.items()} == \
        {k: r["sample_score"]["score"]["value"] for k, r in direct.items()}
    for p in evaluated_problems(shared()):
        if p.memorised:
            answers = {text_of(r[p.benchmark, p.key]["messages"][-1]) for r in (through_endpoint, direct)}
            assert answers == {completion(p.answer)}


def _has_vllm() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None
