"""Choosing a rollout engine, what happens without the GPU extra, and the GPU smoke script on CPU.

vLLM, LMDeploy and DeepSpeed are not installed here, so their tests check the real behaviour of asking for
them on such a machine: a clear ImportError naming the install command. Nothing here pretends they run.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, random_causal_lm
from trainer.extras import MissingExtraError
from trainer.recipe import ModelConfig, RolloutConfig
from trainer.rollout.base import SamplingParams
from trainer.rollout.engines import make_engine
from trainer.rollout.hf_engine import HFEngine, sample_next


@pytest.fixture(scope="module")
def tiny_lm():
    from trainer.bootstrap import build_tokenizer

    tokenizer = build_tokenizer(
        [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], vocab_size=300
    )
    model = random_causal_lm(
        "qwen2",
        vocab_size=len(tokenizer),
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _not_installed(package: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here; this test is about machines without it")


def test_transformers_engine_wraps_the_given_model(tiny_lm):
    model, tokenizer = tiny_lm
    engine = make_engine(RolloutConfig(engine="transformers"), "never-read", model=model, tokenizer=tokenizer)
    assert isinstance(engine, HFEngine) and engine.model is model
    prompt = tokenizer("3 + 4 =", add_special_tokens=False)["input_ids"]
    groups = engine.generate([prompt], 2, SamplingParams(max_tokens=5, temperature=1.0, seed=1))
    assert len(groups) == 1 and len(groups[0]) == 2
    for completion in groups[0]:
        n = len(completion.token_ids)
        assert 1 <= n <= 5 and len(completion.logprobs) == n
        assert (n == 5) == (completion.finish_reason == "length")
        # each sampled token's log-prob is what one plain forward of prompt + completion gives it
        ids = torch.tensor([prompt + list(completion.token_ids)])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        expected = logps.gather(1, ids[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(completion.logprobs, dtype=torch.float32), expected, rtol=0, atol=1e-5
        )


def test_ignore_eos_decodes_max_tokens_past_every_eos(tiny_lm):
    """Every token id is an EOS here: a normal request stops after one token, an ignore_eos one runs to
    max_tokens."""
    model, tokenizer = tiny_lm
    engine = HFEngine(model, tokenizer, eos_token_ids=range(len(tokenizer)))
    prompt = tokenizer("3 + 4 =", add_special_tokens=False)["input_ids"]
    stopped = engine.generate([prompt], 3, SamplingParams(max_tokens=7, temperature=1.0, seed=2))[0]
    assert [(len(c.token_ids), c.finish_reason) for c in stopped] == [(1, "stop")] * 3
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=2, ignore_eos=True)
    full = engine.generate([prompt], 3, params)[0]
    assert [(len(c.token_ids), len(c.logprobs), c.finish_reason) for c in full] == [(7, 7, "length")] * 3
    assert [c.token_ids[0] for c in full] == [c.token_ids[0] for c in stopped]  # same seed, same first token


def test_decoding_into_reserved_room_gives_what_concatenation_gives(tiny_lm, monkeypatch):
    """The decode writes each token's keys and values into room reserved after the prefill (growing when a
    long generation fills it) instead of concatenating the cache: the same tokens and log-probs to the last
    bit as transformers' DynamicCache, for ragged prompts, short and long generations."""
    from trainer.rollout import hf_engine, shared_prompt

    model, tokenizer = tiny_lm
    engine = HFEngine(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("3 + 4 =", "12 + 7 = 1", "5")]
    # the decode over repeated prompt caches (models the shared-prompt attention does not serve)
    monkeypatch.setattr(shared_prompt, "supported", lambda model, cache: False)
    reserved_layers = []
    reserve = hf_engine.reserve_room

    def spy(cache, limit):
        reserve(cache, limit)
        reserved_layers.extend(cache.layers)

    def generate(max_tokens, ignore_eos):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5, ignore_eos=ignore_eos)
        return [[(c.token_ids, c.logprobs) for c in g] for g in engine.generate(prompts, 3, params)]

    for max_tokens, ignore_eos in ((1, False), (6, False), (40, True)):
        monkeypatch.setattr(hf_engine, "reserve_room", spy)
        reserved = generate(max_tokens, ignore_eos)
        monkeypatch.setattr(hf_engine, "reserve_room", lambda cache, limit: None)
        assert reserved == generate(max_tokens, ignore_eos)
    assert {type(layer).__name__ for layer in reserved_layers} == {"ReservedLayer"}
    # the long generation grew its room (doubling) up to its limit: the prompts' width and 39 decoded tokens
    width = max(len(p) for p in prompts)
    assert reserved_layers[-1]._k.shape[-2] == width + 39 and reserved_layers[-1].keys.shape[-2] == width + 39


def test_shared_prompt_attention_is_the_softmax_over_prompt_and_own_tokens():
    """Two prompts (the second left-padded by one position) of two completions each, two query heads over
    one kv head: each row's output is softmax(q.k * scale) over its prompt's unpadded keys and its own
    tokens, written out for every row and head."""
    from trainer.rollout.shared_prompt import PromptCache, shared_prompt_attention

    torch.manual_seed(0)
    prompt_k, prompt_v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    own_k, own_v = torch.randn(4, 1, 2, 4), torch.randn(4, 1, 2, 4)
    query = torch.randn(4, 2, 1, 4) * 3  # large scores: the merged maxes matter
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    cache = PromptCache.from_prefill(
        type("Prefill", (), {"layers": [type("Layer", (), {"keys": prompt_k, "values": prompt_v})]}), mask, 2
    )
    out, weights = shared_prompt_attention(
        type("Attention", (), {"layer_idx": 0}), query, own_k, own_v, None, scaling=0.5, prompt_cache=cache
    )
    assert weights is None and out.shape == (4, 1, 2, 4)
    for row in range(4):
        p = row // 2
        keys = torch.cat([prompt_k[p, 0, mask[p] == 1], own_k[row, 0]])
        values = torch.cat([prompt_v[p, 0, mask[p] == 1], own_v[row, 0]])
        for head in range(2):
            expected = torch.softmax(keys @ query[row, head, 0] * 0.5, dim=0) @ values
            torch.testing.assert_close(out[row, 0, head], expected, rtol=0, atol=1e-6)


def test_decoding_over_shared_prompt_caches_gives_what_repeated_caches_give(tiny_lm, monkeypatch):
    """A prompt's keys and values are kept once for its completions (shared_prompt.py) instead of repeated
    n times: for ragged prompts, short and long generations (past the first 64 reserved positions of the
    completions' own cache), the same tokens as the repeated caches and log-probs within float rounding,
    each equal to a full forward's; the model's attention implementation is its own again afterwards."""
    from trainer.rollout import shared_prompt

    model, tokenizer = tiny_lm
    engine = HFEngine(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("3 + 4 =", "12 + 7 = 1", "5")]
    implementation = model.config._attn_implementation
    for max_tokens, ignore_eos in ((1, False), (6, False), (90, True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=ignore_eos)
        decoding = engine.start(prompts, 3, params)
        assert decoding.prompt_cache is not None  # the shared path was taken
        decoding.step()
        shared = decoding.results()
        assert model.config._attn_implementation == implementation
        with monkeypatch.context() as patch:
            patch.setattr(shared_prompt, "supported", lambda model, cache: False)
            repeated = engine.generate(prompts, 3, params)
        for prompt, group, group_repeated in zip(prompts, shared, repeated, strict=True):
            for completion, reference in zip(group, group_repeated, strict=True):
                assert completion.token_ids == reference.token_ids
                assert not ignore_eos or len(completion.token_ids) == max_tokens
                got = torch.tensor(completion.logprobs)
                torch.testing.assert_close(got, torch.tensor(reference.logprobs), rtol=0, atol=1e-5)
                ids = torch.tensor([prompt + completion.token_ids])
                with torch.no_grad():
                    logps = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
                expected = logps.gather(1, ids[0, len(prompt) :, None])[:, 0]
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_sampling_draws_each_token_with_its_tempered_probability_and_none_outside_top_p():
    """logits [2, 1, 0, -1, 0.5] at T 0.7: softmax(logits / 0.7) = [0.7002, 0.1678, 0.0402, 0.0096,
    0.0821]; with top_p 0.8 the two most likely tokens (0.7002 + 0.1678 >= 0.8) share the mass,
    0.7002 / 0.8680 = 0.8067 and 0.1933. 20,000 seeded draws are within 0.01 of these (the standard error
    is at most 0.0035); a slice of the batch drawn as that slice draws what the whole batch drew there."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    cases = [
        (1.0, [0.7002, 0.1678, 0.0402, 0.0096, 0.0821]),
        (0.8, [0.8067, 0.1933, 0.0, 0.0, 0.0]),
    ]
    for top_p, expected in cases:
        sampling = SamplingParams(temperature=0.7, top_p=top_p)
        tokens, logps = sample_next(logits, sampling, torch.Generator().manual_seed(1))
        frequencies = torch.bincount(tokens, minlength=5) / len(tokens)
        torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.01, rtol=0)
        if top_p < 1:
            assert set(tokens.tolist()) == {0, 1}
        torch.testing.assert_close(
            logps, torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
        )
        part, _ = sample_next(logits[300:700], sampling, torch.Generator().manual_seed(1), rows=(300, 20000))
        assert torch.equal(part, tokens[300:700])


def test_transformers_engine_loads_from_a_checkpoint(tiny_lm, tmp_path):
    model, tokenizer = tiny_lm
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = make_engine(RolloutConfig(), str(tmp_path), model_cfg=ModelConfig(dtype="float32"))
    assert isinstance(engine, HFEngine) and engine.model is not model
    prompt = tokenizer("12 + 7 =", add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    loaded = engine.generate([prompt], 1, greedy)[0][0]
    original = HFEngine(model, tokenizer).generate([prompt], 1, greedy)[0][0]
    assert loaded.token_ids == original.token_ids
    assert loaded.logprobs == pytest.approx(original.logprobs, abs=1e-5)


def test_transformers_engine_loads_its_copy_with_the_whole_model_config(tiny_lm, tmp_path):
    """Every setting of the recipe's model section reaches the engine's own copy, not only its dtype."""
    model, tokenizer = tiny_lm
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cfg = ModelConfig(dtype="bfloat16", attn_implementation="eager")  # transformers would choose sdpa here
    engine = make_engine(RolloutConfig(), str(tmp_path), model_cfg=cfg)
    assert engine.model.dtype == torch.bfloat16
    assert engine.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("engine", ["vllm", "lmdeploy"])
def test_gpu_engine_without_the_extra_names_the_install_command(engine, tmp_path):
    _not_installed(engine)
    with pytest.raises(MissingExtraError) as info:
        make_engine(RolloutConfig(engine=engine), str(tmp_path))
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert f"pip install '.[{engine}]'" in message and f"pip install {engine}" in message
    assert f"'{engine}' rollout engine" in message


def test_gpu_engine_classes_raise_the_same_error_when_built_directly(tmp_path):
    _not_installed("vllm")
    _not_installed("lmdeploy")
    from trainer.rollout.lmdeploy_engine import LMDeployEngine
    from trainer.rollout.vllm_engine import VLLMEngine

    for cls in (VLLMEngine, LMDeployEngine):
        with pytest.raises(MissingExtraError, match=r"pip install '\.\[(vllm|lmdeploy)\]'"):
            cls(str(tmp_path))


def test_deepspeed_without_the_extra_names_the_install_command(monkeypatch):
    # make install builds DeepSpeed here; a None entry makes `import deepspeed` fail as on a machine without
    # it
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    from trainer.deepspeed_setup import initialize, zero_config

    config = zero_config(stage=2, micro_batch_size=4)
    assert config["zero_optimization"]["stage"] == 2 and config["train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(ValueError, match="stage"):
        zero_config(stage=4)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(MissingExtraError, match=r"pip install --no-build-isolation '\.\[deepspeed\]'"):
        initialize(model, torch.optim.AdamW(model.parameters()), config)


def test_bad_engine_choices_are_refused(tmp_path):
    with pytest.raises(ValueError, match="transformers, vllm or lmdeploy"):
        make_engine(RolloutConfig(engine="sglang"), str(tmp_path))
    with pytest.raises(ValueError, match="server_url"):
        make_engine(RolloutConfig(engine="lmdeploy", server_url="http://127.0.0.1:1"), str(tmp_path))


def test_vllm_server_engine_names_an_unreachable_server():
    from trainer.rollout.vllm_server import VLLMServerEngine, VLLMServerError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(VLLMServerError, match=f"127.0.0.1:{port}"):
        VLLMServerEngine(f"http://127.0.0.1:{port}", timeout_s=5)


def test_server_completions_are_grouped_by_prompt_from_an_openai_body():
    """Our parser on a hand-written body in the OpenAI /v1/completions format that vLLM answers with
    (choices prompt-major by `index`); it says nothing about a live server."""
    from trainer.rollout.vllm_server import VLLMServerError, completions_from_response

    def choice(index, ids, logps, reason, with_ids=True):
        c = {
            "index": index,
            "text": f"t{index}",
            "finish_reason": reason,
            "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": logps},
        }
        if with_ids:
            c["token_ids"] = ids
        return c

    body = {
        "choices": [
            choice(3, [9], [-0.5], "length"),
            choice(0, [5, 2], [-1.0, -0.25], "stop"),
            choice(2, [8, 8], [-2.0, None], "length", with_ids=False),
            choice(1, [7], [-0.1], "stop"),
        ]
    }
    groups = completions_from_response(body, n_prompts=2, n=2, version=4)
    assert [[c.token_ids for c in g] for g in groups] == [[[5, 2], [7]], [[8, 8], [9]]]
    assert (
        groups[0][0].logprobs == [-1.0, -0.25] and groups[1][0].logprobs[1] != groups[1][0].logprobs[1]
    )  # nan
    assert [c.finish_reason for c in groups[0]] == ["stop", "stop"] and groups[1][1].policy_version == 4
    with pytest.raises(VLLMServerError, match="expected 6 choices"):
        completions_from_response(body, n_prompts=3, n=2)


def test_gpu_smoke_script_passes_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    # the `grpoflow train` layouts (2 gloo ranks + a rollout worker) take minutes here; tests/test_multigpu.py
    # and tests/test_async.py run those paths, tests/test_deepspeed.py ZeRO-2 through the trainer
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "infra" / "gpu" / "smoke.py"),
            "--device",
            "cpu",
            "--skip",
            "layout_sync,layout_async,deepspeed",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True
    checks = result["checks"]
    for name in ("generate", "logprobs", "bf16_logps", "bf16_masters", "train"):
        assert checks[name]["ok"] is True, checks[name]
    assert checks["logprobs"]["ratio_to_untempered"] < 0.01
    # bf16 steps fp32 master weights: nearly every weight moves as in fp32, few of the bf16 copy's own do
    masters = checks["bf16_masters"]
    assert masters["relative_update_difference_l1"] < 1e-2 and masters["masters_moved_fraction"] > 0.99
    assert masters["bf16_module_moved_fraction"] < 0.5
    assert len(checks["bf16_logps"]["sampling/sampling_logp_difference/mean"]) == 2
    assert checks["memory_plan"] == {"ok": None, "skipped": "needs cuda: torch.cuda.max_memory_allocated"}
    assert "deepspeed: --skip, skipped" in proc.stdout


@pytest.mark.parametrize("rollout_async", ["true", "false"], ids=["async-workers", "in-process"])
def test_train_with_a_missing_gpu_engine_exits_2_naming_the_install(
    tmp_path, tiny_base, tiny_data, rollout_async
):
    """Real behaviour on a machine without vLLM: a clear error before any training, not a traceback, whether
    the engine would be built in a rollout worker process (the shipped recipe, asynchronous) or in the
    trainer's."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            "rollout.engine=vllm",
            f"rollout.async={rollout_async}",
            f"bootstrap.out={tiny_base['path']}",
            f"data.out={tiny_data}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "pip install '.[vllm]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "latest").exists()


def test_one_model_loader_decides_pad_token_and_padding_side(tiny_base, tmp_path):
    """A tokenizer without a pad token gets its EOS token and left padding, whichever path loads it."""
    import ast
    import shutil

    from trainer.model_loading import load_model

    copy = tmp_path / "no-pad"
    shutil.copytree(tiny_base["path"], copy)
    (copy / "manifest.json").unlink()  # an ordinary HF folder now, as from the hub
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    config["padding_side"] = "right"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))

    model, tokenizer = load_model(str(copy), ModelConfig(dtype="float32"))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    assert model.dtype == torch.float32
    engine = make_engine(RolloutConfig(), str(copy), model_cfg=ModelConfig(dtype="float32"))  # transformers
    assert (engine.tokenizer.pad_token, engine.tokenizer.padding_side) == (tokenizer.pad_token, "left")

    # The other call sites run in child processes (rollout workers, the model server): they must load through
    # the same function and never call from_pretrained themselves.
    for module in (
        "trainer/grpo.py",
        "trainer/rollout/engines.py",
        "trainer/rollout/worker_processes.py",
        "evaluation/serving/server.py",
        "tasks/evaluation.py",
    ):
        tree = ast.parse((REPO_ROOT / module).read_text())
        called = {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        }
        assert "load_model" in called and "from_pretrained" not in called, module
