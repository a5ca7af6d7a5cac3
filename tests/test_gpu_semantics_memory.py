"""The memory plan of a GPU run (trainer/memory_plan.py): each GPU's parts from the recipe and the model's
config, numbers by hand; the shipped GPU recipes fit 80 GiB GPUs in `grpoflow train --dry-run --json`; a
recipe that does not fit is refused (exit 2) naming what to change, before anything loads; a colocated
engine's default share is what the trainer leaves; the CUDA cache is emptied before a colocated engine
wakes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import REPO_ROOT
from trainer.recipe import load_recipe

_MEMORY_GIB = 1 << 30
# Qwen2.5-7B's public config.json values: what sizes it
_MEMORY_QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _memory_dry_run(config: str, *args: str) -> subprocess.CompletedProcess:
    """`grpoflow train --dry-run --json` as a user types it, on a machine where no GPU is seen."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", config, "--dry-run", "--json", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def _memory_shape(**fields):
    from trainer.memory_plan import ModelShape

    base = dict(
        params=10**9,
        hidden=2048,
        layers=16,
        intermediate=5632,
        vocab=32000,
        kv_width=512,
        dtype="bfloat16",
        source="by hand",
    )
    return ModelShape(**{**base, **fields})


def test_memory_plan_reads_the_parameter_count_from_a_local_config_json_without_weights(tmp_path):
    from trainer.memory_plan import model_shape

    (tmp_path / "config.json").write_text(json.dumps(_MEMORY_QWEN25_7B))  # no weights in the directory
    recipe = load_recipe(None, [f"model.name_or_path={tmp_path}", "model.dtype=auto"])
    shape = model_shape(recipe)
    assert shape.params == 7_615_616_512  # Qwen2.5-7B's published parameter count
    assert (shape.hidden, shape.layers, shape.intermediate, shape.vocab) == (3584, 28, 18944, 152064)
    assert (shape.kv_width, shape.dtype) == (4 * 128, "bfloat16")
    assert str(tmp_path) in shape.source


def test_memory_plan_parts_by_hand_for_1e9_parameters_in_bf16_zero2_over_six_ranks():
    from trainer.memory_plan import estimate

    recipe = load_recipe(
        None,
        [
            "model.dtype=bfloat16",
            "train.deepspeed=zero2",
            "train.beta=0.001",
            "train.micro_batch_size=2",
            "train.max_prompt_length=100",
            "train.max_completion_length=156",
            "rollout.engine=vllm",
            "rollout.async=true",
            "rollout.train_devices=[0,1,2,3,4,5]",
            "rollout.rollout_devices=[6,7]",
            "rollout.num_engines=2",
        ],
    )
    memory = estimate(recipe, gpus=8, gpu_memory_gib=80.0, shape=_memory_shape())
    trainer = {
        "weights": 2e9,  # bf16
        # the 1/6 bf16 partition + the fp32 partition stepped + DeepSpeed's 2 reduce buffers of 5e8 bf16
        "gradients": 2e9 / 6 + 4e9 / 6 + 2 * 5e8 * 2,
        "master_weights": 4e9 / 6,
        "optimizer_states": 8e9 / 6,
        "reference": 2e9,  # beta > 0: the whole reference in bf16
        # 2 x 256 tokens x 16 layers x (13 x 2048 + 4 x 5632) x 2 bytes + 2 x 156 completion positions x
        # 32000 logits x (2 + 2 + 4) bytes
        "activations": 805_306_368 + 79_872_000,
        "kv_cache": 0,
    }
    assert memory["fits"] is True and memory["gpu_memory_gib"] == 80.0
    devices = memory["devices"]
    assert [(d["device"], d["role"]) for d in devices] == [(f"cuda:{i}", "trainer") for i in range(6)] + [
        ("cuda:6", "rollout"),
        ("cuda:7", "rollout"),
    ]
    for d in devices[:6]:
        assert d["parts"] == pytest.approx({k: v / _MEMORY_GIB for k, v in trainer.items()}, abs=1e-3)
        assert d["total_gib"] == pytest.approx(9_885_178_368 / _MEMORY_GIB, abs=1e-3)  # 9.206 GiB
    for d in devices[6:]:  # vLLM's share of a GPU of its own: 0.9 x 80
        assert d["parts"]["kv_cache"] == 72.0 and d["total_gib"] == 72.0
    assert any("activations: an estimate" in n for n in memory["notes"])

    # one process, no DeepSpeed: fp32 master weights and their fp32 gradients, Adam's two fp32 moments
    single = load_recipe(None, ["model.dtype=bfloat16", "rollout.train_devices=[0]"])
    parts = estimate(single, gpus=1, shape=_memory_shape())["devices"][0]["parts"]
    expected = {"weights": 2e9, "gradients": 4e9, "master_weights": 4e9, "optimizer_states": 8e9}
    assert {k: parts[k] for k in expected} == pytest.approx(
        {k: v / _MEMORY_GIB for k, v in expected.items()}, abs=1e-3
    )


def test_heldout_batch_is_what_the_kv_cache_fits_beside_the_training_state():
    from trainer.heldout import HELDOUT_BATCH_SIZE
    from trainer.memory_plan import estimate, heldout_rows

    recipe = load_recipe(
        None,
        [
            "model.dtype=bfloat16",
            "train.deepspeed=zero2",
            "train.beta=0.001",
            "train.max_prompt_length=100",
            "train.max_completion_length=156",
            "rollout.engine=vllm",
            "rollout.async=true",
            "rollout.train_devices=[0,1,2,3,4,5]",
            "rollout.rollout_devices=[6,7]",
            "rollout.num_engines=2",
        ],
    )
    shape = _memory_shape()
    memory = estimate(recipe, gpus=8, gpu_memory_gib=12.0, shape=shape)
    # what stays on a trainer GPU once training began: weights 2e9, gradients 3e9, masters 4e9/6, Adam 8e9/6,
    # reference 2e9 = 9e9 bytes; left of 12 GiB beside the 2 GiB reserve: 10 x 2^30 - 9e9 = 1,737,418,240;
    # one row's KV cache: 256 tokens x 2 (K, V) x 16 layers x 512 x 2 bytes = 8,388,608 -> 207 rows
    assert heldout_rows(recipe, memory, shape) == 207
    assert heldout_rows(recipe, estimate(recipe, gpus=8, gpu_memory_gib=80.0, shape=shape), shape) == 256
    assert heldout_rows(recipe, None) == HELDOUT_BATCH_SIZE  # a CPU run: not sized by a plan


def test_activation_estimate_covers_what_autograd_keeps_for_a_small_qwen2_in_bf16():
    """The estimate against a measurement: every tensor autograd saves for backward (saved-tensor hooks,
    parameters left out) in the trainer's log-prob forward of a small Qwen2, plus the logits it returns."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.loss import sequence_logps
    from trainer.memory_plan import activation_bytes

    torch.manual_seed(0)
    h, inter, layers, heads, kv, vocab, b, seq, completion = 256, 768, 2, 8, 2, 1000, 2, 96, 64
    config = Qwen2Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, vocab, (b, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=completion + 1)
        sequence_logps(out.logits[:, :-1], ids[:, seq - completion :], 0.9)
    measured = sum(saved.values()) + out.logits.untyped_storage().nbytes()
    shape = _memory_shape(params=0, hidden=h, layers=layers, intermediate=inter, vocab=vocab)
    estimate = activation_bytes(shape, 2, b, seq, completion)
    assert 1.0 <= estimate / measured <= 1.15, (estimate, measured)


def test_shipped_gpu_recipes_fit_80_gib_gpus_in_the_dry_run():
    for config, roles, share in (
        ("configs/qwen2.5-7b-numina-8gpu.yaml", ["trainer"] * 6 + ["rollout"] * 2, 72.0),
        ("configs/countdown-qwen2.5-3b.yaml", ["colocated"] * 8, 20.0),  # what DDP leaves: 0.25 x 80
    ):
        proc = _memory_dry_run(config)
        assert proc.returncode == 0, proc.stderr[-3000:]
        memory = json.loads(proc.stdout.strip().splitlines()[-1])["memory"]
        assert memory["gpu_memory_gib"] == 80.0 and memory["fits"] is True
        assert [d["role"] for d in memory["devices"]] == roles
        for d in memory["devices"]:
            assert set(d["parts"]) == {
                "weights",
                "gradients",
                "master_weights",
                "optimizer_states",
                "reference",
                "activations",
                "kv_cache",
            }
            assert d["fits"] is True and d["total_gib"] + 2 <= 80
        assert max(d["parts"]["kv_cache"] for d in memory["devices"]) == share
        assert "memory plan, GPUs of 80 GiB: fits" in proc.stderr


def test_dry_run_refuses_a_recipe_that_does_not_fit_naming_the_fields_to_change():
    proc = _memory_dry_run(
        "configs/qwen2.5-7b-numina-8gpu.yaml", "model.dtype=float32", "train.deepspeed=null"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert "does not fit GPUs of 80 GiB" in error
    for field in ("model.dtype", "train.deepspeed", "train.beta"):
        assert field in error, error
    assert "cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5 (trainer) needs 212.9 GiB" in error


def test_a_gpu_run_checks_the_memory_plan_before_anything_loads_and_a_cpu_run_does_not(
    tmp_path, monkeypatch, caplog
):
    """The GPU's size is what a GPU machine would report (emulated: no GPU here); the refusal comes from
    `prepare_inputs`, before the data is prepared or the base model fetched."""
    from trainer.grpo import prepare_inputs
    from trainer.memory_plan import MemoryPlanError, check_gpu_memory

    recipe = load_recipe(
        REPO_ROOT / "configs" / "qwen2.5-7b-numina-8gpu.yaml",
        ["model.dtype=float32", "train.deepspeed=null", f"data.out={tmp_path / 'data'}"],
    )
    with caplog.at_level(logging.INFO, logger="grpoflow.train"):
        assert check_gpu_memory(recipe) is None  # a CPU run: not checked, and said so
    assert "the memory plan is not checked" in caplog.text

    class _H100:
        total_memory = 80 * _MEMORY_GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _H100())
    with pytest.raises(MemoryPlanError, match="model.dtype"):
        prepare_inputs(recipe)
    assert not (tmp_path / "data").exists()


def test_colocated_engine_share_defaults_to_what_the_trainer_leaves():
    from trainer.memory_plan import engine_utilization, estimate
    from trainer.recipe import RolloutConfig
    from trainer.rollout.engines import vllm_settings

    assert RolloutConfig().gpu_memory_utilization is None  # one default: "from the memory plan"
    assert vllm_settings(RolloutConfig(engine="vllm"))["gpu_memory_utilization"] == 0.9  # a GPU of its own
    colocated = load_recipe(
        None,
        [
            "model.dtype=bfloat16",
            "train.micro_batch_size=1",
            "rollout.engine=vllm",
            "rollout.colocate=true",
            "rollout.train_devices=[0,1,2,3,4,5,6,7]",
            "rollout.num_engines=8",
        ],
    )
    shape = _memory_shape()
    # DDP over 8 ranks, bf16: weights 2e9 + fp32 gradients 4e9 + DDP's bf16 buckets 2e9 + masters 4e9 +
    # Adam 8e9 = 20e9 bytes = 18.63 GiB stay while the engine is awake (the activations do not: it sleeps
    # while training); (80 - 2 reserved - 18.63) / 80 = 0.742 -> 0.74
    assert engine_utilization(colocated, 8, 80.0, shape=shape) == 0.74
    memory = estimate(colocated, 8, 80.0, shape=shape)
    assert memory["fits"] and {d["parts"]["kv_cache"] for d in memory["devices"]} == {0.74 * 80}
    assert {d["total_gib"] for d in memory["devices"]} == {round(20e9 / _MEMORY_GIB + 0.74 * 80, 3)}
    # an engine that stays awake beside the trainer (synchronous, not colocated) leaves the activations room:
    # one process, 18e9 bytes of state + 768 tokens x 16 x 49152 x 2 + 256 x 32000 x 8 = 19.27e9 bytes
    # = 17.95 GiB; (80 - 2 - 17.95) / 80 = 0.7506 -> 0.75
    awake = replace(
        colocated, rollout=replace(colocated.rollout, colocate=False, train_devices=[0], num_engines=1)
    )
    assert engine_utilization(awake, 1, 80.0, shape=shape) == 0.75
    # the user's value is kept
    mine = replace(colocated, rollout=replace(colocated.rollout, gpu_memory_utilization=0.3))
    assert engine_utilization(mine, 8, 80.0, shape=shape) == 0.3


def test_colocated_engine_wakes_after_the_cuda_cache_is_emptied_emulated(monkeypatch):
    """A colocated engine's wake-up allocates its weights and KV cache on the GPU the trainer just used: the
    blocks torch's caching allocator keeps from training must go back first. Emulated: CUDA's cache and
    vLLM's sleep mode cannot run here, so both are a recording of calls."""
    from trainer.recipe import RolloutConfig
    from trainer.rollout.source import LocalEngine

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    class _SleepingEngine:
        version = 0

        def wake_up(self, tags=None):
            calls.append(f"wake_up {tags}")

        def sleep(self, level=1):
            calls.append(f"sleep {level}")

    local = LocalEngine(_SleepingEngine(), RolloutConfig(engine="vllm", colocate=True), version=0)
    with local.holding(torch.nn.Linear(1, 1), version=0):
        calls.append("generate")
    assert calls == ["empty_cache", "wake_up ['weights']", "wake_up ['kv_cache']", "generate", "sleep 1"]
