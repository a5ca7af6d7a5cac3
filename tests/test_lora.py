"""LoRA (`model.lora`): adapters trained on a frozen base model, the merged weights the engines get, adapter
checkpoints that resume exactly, and the merged model that is registered and evaluated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, eval_cli_args, grpoflow_run, last_json, stopped_after
from data.manifest import read_manifest

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
LORA = "model.lora={r: 4, alpha: 8}"  # scale alpha / r = 2
# the tiny model: 4 blocks of q, k, v, o, gate, up, down projections get adapters (the tied head does not)
ADAPTED_PER_BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def train_args(run: Path, tiny_base: dict, data: Path, *overrides: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TINY),
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={run}",
        LORA,
        "train.learning_rate=5e-3",  # adapters move visibly in a few steps
        "train.max_steps=4",
        "train.save_steps=2",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=8",
        "train.micro_batch_size=8",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *overrides,
        "--json",
    ]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def lora_run(tiny_base, tiny_data, tmp_path_factory) -> tuple[Path, dict]:
    """Four synchronous steps of LoRA training on the transformers engine, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("lora") / "run"
    proc = grpoflow_run(*train_args(run, tiny_base, tiny_data))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, last_json(proc)


def test_the_engines_get_the_base_weights_plus_the_scaled_adapter_product_under_the_plain_names(tiny_base):
    from trainer.lora import attach
    from trainer.model_loading import load_model
    from trainer.recipe import LoraConfig
    from trainer.rollout.engines import policy_tensors
    from trainer.rollout.weight_sync import sync_layout, sync_order, sync_tensors

    plain, _ = load_model(tiny_base["path"])
    base, _ = load_model(tiny_base["path"])
    policy = attach(base, LoraConfig(r=2, alpha=4.0), tiny_base["path"])  # scale 4 / 2 = 2
    q = policy.get_base_model().model.layers[1].self_attn.q_proj
    with torch.no_grad():
        q.lora_A["default"].weight.zero_()
        q.lora_B["default"].weight.zero_()
        q.lora_A["default"].weight[0, 5] = 0.5  # A: r x in
        q.lora_B["default"].weight[3, 0] = 0.25  # B: out x r
    # delta = scale * B @ A: one entry, [3, 5] = 2 * 0.25 * 0.5 = 0.25; every other weight is the base's
    sent = dict(sync_tensors(policy))
    w = plain.model.layers[1].self_attn.q_proj.weight
    expected = w.detach().clone()
    expected[3, 5] += 0.25
    assert torch.equal(sent["model.layers.1.self_attn.q_proj.weight"], expected)
    for name, tensor in sync_order(plain):
        if name != "model.layers.1.self_attn.q_proj.weight":
            assert torch.equal(sent[name], tensor), name
    # the names, order, dtypes and shapes a plain model's receiver expects; the tied head under its own name
    assert list(sent) == [name for name, _ in sync_order(plain)]
    assert sync_layout(policy) == sync_layout(plain)
    state = dict(policy_tensors(policy))
    assert list(state) == list(plain.state_dict()) and "lm_head.weight" in state
    assert torch.equal(state["model.layers.1.self_attn.q_proj.weight"], expected)
    # computed out of place: the base weight itself is untouched
    assert torch.equal(q.base_layer.weight, w)


def test_only_the_adapters_train_and_the_checkpoint_holds_the_adapter_and_its_optimizer_state(
    lora_run, tiny_base
):
    from trainer.model_loading import load_model

    run, summary = lora_run
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint == run / "checkpoint-4"
    files = set(read_manifest(checkpoint)["files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= files
    assert "model.safetensors" not in files  # the base weights are not copied into every checkpoint
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(tiny_base["path"]).resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8)

    weights = adapters(checkpoint)
    assert len(weights) == 2 * 4 * len(ADAPTED_PER_BLOCK)  # A and B of 7 projections in 4 blocks
    n_adapter = sum(t.numel() for t in weights.values())
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    moments = state["optimizer"]["state"].values()
    assert len(moments) == len(weights)  # the optimizer steps the adapters and nothing else
    assert sum(m["exp_avg"].numel() for m in moments) == n_adapter
    # AdamW's two fp32 moments per parameter and a 4-byte step count per tensor
    plain, _ = load_model(tiny_base["path"])
    n_full, tensors_full = sum(p.numel() for p in plain.parameters()), len(list(plain.parameters()))
    lora_bytes = 8 * n_adapter + 4 * len(weights)
    full_bytes = 8 * n_full + 4 * tensors_full  # what full fine-tuning keeps (tests/test_trainer.py logs it)
    rows = metrics(run)
    assert [r["memory/optimizer_bytes"] for r in rows] == [lora_bytes] * 4
    assert full_bytes >= 10 * lora_bytes, (full_bytes, lora_bytes)

    # the trained policy, loaded like any checkpoint: the base's weights except where the adapters act
    merged, _ = load_model(str(checkpoint))
    base = dict(plain.named_parameters())
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, base[n])}
    adapted = {
        f"model.layers.{i}.{kind}.{m}.weight"
        for i in range(4)
        for kind, ms in (("self_attn", ADAPTED_PER_BLOCK[:4]), ("mlp", ADAPTED_PER_BLOCK[4:]))
        for m in ms
    }
    assert changed and changed <= adapted, changed - adapted
    assert summary["heldout_after"]["n"] == 8  # held-out evaluation ran on the LoRA policy


def test_an_async_lora_run_syncs_the_merged_weights_and_resumes_exactly_from_its_adapter_checkpoint(
    tmp_path, tiny_base, tiny_data
):
    """Rollout workers in their own processes (rollout.async, each batch after the update: staleness 0), fed
    the merged weights at every step. Resumed from checkpoint 2, the workers start from the base model and
    must be given the checkpoint's policy before their first batch: the rerun's steps 3 and 4 are the
    straight run's, sample for sample."""
    args = ("rollout.async=true", "rollout.max_staleness=0")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = grpoflow_run(*train_args(straight, tiny_base, tiny_data, *args))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(straight)
    assert [r["staleness"] for r in rows] == [0.0] * 4
    # the workers sample the trainer's policy: log-probs agree to float noise on every on-policy batch
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4, rows
    # after each update the whole merged model is sent, never the adapters alone
    plain_bytes = 4 * sum(t.numel() for t in adapters_free_model_weights(tiny_base))
    assert [r["weight_sync/bytes"] for r in rows[:-1]] == [plain_bytes] * 3

    shutil.copytree(straight, resumed)
    stopped_after(resumed, 2)
    again = grpoflow_run(*train_args(resumed, tiny_base, tiny_data, *args))
    assert again.returncode == 0, again.stderr[-4000:]
    assert last_json(again)["resumed_from_step"] == 2
    for x, y in zip(rows, metrics(resumed), strict=True):
        assert (x["step"], x["reward"], x["completions/mean_length"]) == (
            y["step"],
            y["reward"],
            y["completions/mean_length"],
        )
    a, b = adapters(straight / "checkpoint-4"), adapters(resumed / "checkpoint-4")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)


def adapters_free_model_weights(tiny_base: dict) -> list[torch.Tensor]:
    """The plain tiny model's unique parameters (the tied head once): what one weight sync sends."""
    from trainer.model_loading import load_model

    return list(load_model(tiny_base["path"])[0].parameters())


def test_a_registered_lora_version_is_the_merged_model_that_mlflow_loads(lora_run, store):
    import mlflow

    from tasks.registry import MODEL_DIR, register_checkpoint
    from trainer.model_loading import load_model

    run, summary = lora_run
    checkpoint = Path(summary["checkpoint"])
    client, experiment, _ = store
    run_id = client.create_run(experiment, run_name="register").info.run_id
    sha = read_manifest(checkpoint)["sha256"]
    assert register_checkpoint(client, "tiny-lora", experiment, run_id, checkpoint, sha, {}) == ("1", True)

    local = Path(mlflow.artifacts.download_artifacts("models:/tiny-lora/1")) / MODEL_DIR
    served = read_manifest(local)
    assert served["merged_lora"] is True and served["checkpoint_sha256"] == sha
    assert "model.safetensors" in served["files"] and "adapter_config.json" not in served["files"]
    assert {"adapter_model.safetensors", "trainer_state.pt"} <= set(served["left_out"])

    model, tokenizer = load_model(str(checkpoint))
    prompt = "What is 12+30?"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    direct = tokenizer.decode(out, skip_special_tokens=True)
    pipe = mlflow.transformers.load_model("models:/tiny-lora@candidate")
    [out] = pipe(prompt, max_new_tokens=12, do_sample=False, return_full_text=False)
    assert out["generated_text"].replace(" ", "") == direct.replace(" ", "")


def test_grpoflow_eval_evaluates_a_lora_checkpoint(lora_run, tmp_path):
    run, summary = lora_run
    proc = grpoflow_run(*eval_cli_args(tmp_path, summary["checkpoint"], "--json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = last_json(proc)
    assert report["scores"]["aime24"] is not None, report
    assert not list((tmp_path / "state").rglob(".merged-*"))  # the merged copy lived for the evaluation only


def test_the_memory_plan_counts_the_adapters_for_gradients_and_optimizer_state(tiny_base):
    from trainer.memory_plan import model_shape, trainer_parts
    from trainer.recipe import load_recipe

    overrides = [f"bootstrap.out={tiny_base['path']}", "model.dtype=bfloat16"]
    full = load_recipe(TINY, overrides)
    lora = load_recipe(TINY, [*overrides, LORA])
    # per block, r = 4: q, k, v, o are 128 -> 128 (4 heads, 4 key/value heads): 4 x 4 x (128 + 128) = 4096;
    # gate and up 128 -> 384, down 384 -> 128: 3 x 4 x (128 + 384) = 6144; 4 blocks: 40,960
    shape = model_shape(lora)
    assert shape.trainable == 40_960 and model_shape(full).trainable is None
    P = shape.params
    parts = trainer_parts(lora, shape, ranks=1)
    # the adapters train in fp32 (PEFT widens a bf16 model's), so they are their own master weights
    assert (parts["gradients"], parts["master_weights"], parts["optimizer_states"]) == (
        4 * 40_960,
        0,
        8 * 40_960,
    )
    assert parts["weights"] == 2 * P  # the whole bf16 model still runs
    whole = trainer_parts(full, model_shape(full), ranks=1)
    assert (whole["gradients"], whole["master_weights"], whole["optimizer_states"]) == (4 * P, 4 * P, 8 * P)


@pytest.mark.slow
def test_tiny_cpu_lora_recipe_learns_with_a_tenth_of_the_optimizer_state(tmp_path, tiny_base):
    """The learning proxy of `configs/tiny-cpu-lora.yaml`: its first 60 steps (of 200; measured on one thread,
    AVX-512 base 0.3125: +9.0 points; the whole recipe +33 to +38) raise held-out greedy accuracy by >= 4
    points, keeping at least 10x less optimizer state than full fine-tuning of the same model."""
    from trainer.model_loading import load_model
    from trainer.recipe import load_recipe

    recipe = REPO_ROOT / "configs" / "tiny-cpu-lora.yaml"
    proc = grpoflow_run(
        "train",
        "--config",
        str(recipe),
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tmp_path / 'data'}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=60",
        "--json",
        timeout=1200,  # about 2.5 minutes on one busy core: a bound against a hang, not a speed check
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = last_json(proc)
    print(f"tiny-cpu-lora: held-out {s['heldout_accuracy_before']:.3f} -> {s['heldout_accuracy_after']:.3f}")
    assert s["heldout_before"]["n"] == 256 and s["steps"] == 60 < load_recipe(recipe).train.max_steps
    assert s["heldout_accuracy_after"] >= s["heldout_accuracy_before"] + 0.04, s
    params = list(load_model(tiny_base["path"])[0].parameters())
    full = 8 * sum(p.numel() for p in params) + 4 * len(params)  # AdamW's state under full fine-tuning
    assert 10 * metrics(tmp_path / "run")[-1]["memory/optimizer_bytes"] <= full


def test_lora_under_deepspeed_is_refused_by_the_dry_run_naming_both_settings():
    gpu = str(REPO_ROOT / "configs" / "qwen2.5-7b-numina-8gpu.yaml")  # ZeRO-2 on 6 trainer ranks
    refused = grpoflow_run("train", "--dry-run", "--json", "--config", gpu, "model.lora={r: 16}")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert (
        "model.lora" in last_json(refused)["error"]
        and "train.deepspeed (zero2)" in last_json(refused)["error"]
    )
    planned = grpoflow_run(
        "train", "--dry-run", "--json", "--config", gpu, "model.lora={r: 16}", "train.deepspeed=null"
    )
    assert planned.returncode == 0, planned.stderr[-2000:]
    parts = last_json(planned)["memory"]["devices"][0]["parts"]
    # Qwen2.5-7B, r = 16 on every linear layer of 28 blocks: 40,370,176 adapter parameters, fp32 moments
    assert parts["optimizer_states"] == round(8 * 40_370_176 / 2**30, 3) and parts["master_weights"] == 0
