"""DeepSpeed ZeRO in the trainer, for real: DeepSpeed's CPU accelerator with 2 gloo ranks under torchrun.

What a GPU node would do with `train.deepspeed`, minus CUDA: ZeRO-2 and ZeRO-3 updates equal the plain
one-rank update, a ZeRO-3 weight sync hands an engine the weights the trainer trains, bf16 training keeps fp32
master weights, and a run killed with SIGKILL under ZeRO resumes to the same weights as one that was not.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO_ROOT

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


def small(tmp_path: Path, tiny_base: dict, data: Path, *overrides: str) -> list[str]:
    return [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=8",
        "train.micro_batch_size=2",
        # stepped from the first update at the given rate (Adam's first step moves a weight ~lr): the
        # recipe's warm-up (200 of its 2,800 steps) would start these at 0.5% of it
        "train.warmup_steps=0",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        *overrides,
    ]


def clean_env(**extra: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")
    }
    return {**env, "DS_ACCELERATOR": "cpu", **extra}


# One update on a fixed batch (advantages set by hand), then the whole weights and, under ZeRO-3, the
# log-probs an engine holding the synced weights gives vs the trainer's own on the same completions.
ONE_UPDATE = """
import sys, torch
from trainer.deepspeed_setup import gathered
from trainer.grpo import GRPOTrainer
from trainer.logprobs import completion_logps
from trainer.recipe import load_recipe
from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.batch import RolloutBatch
from trainer.model_loading import load_model
recipe = load_recipe(sys.argv[1], sys.argv[4:])
trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
trainer.setup()
batch, _ = trainer.rollout_source().next(0)
batch.advantages = torch.linspace(-1, 1, len(batch))
grad_norm = trainer.optimize(batch)["grad_norm"]  # the whole gradient's norm, before clipping
# the weight sync's view: whole tensors, a group at a time (every rank iterates; rank 0 keeps them)
weights = {n: t.clone() for n, t in gathered(trainer.model.state_dict(keep_vars=True).items(), budget_mb=1)}
out = {"weights": weights, "lr": trainer.strategy.learning_rate(), "grad_norm": grad_norm}
# an engine of its own (what a rollout worker holds) loads the synced weights and samples
engine_model, tok = load_model(sys.argv[2], recipe.model, "cpu", verify=False)
engine_model.load_state_dict(weights)
asked = [batch.prompt_ids[0], batch.prompt_ids[-1]]  # two distinct prompts (rows of a group share one)
groups = HFEngine(engine_model.eval(), tok).generate(asked, 3, \
SamplingParams(max_tokens=8, temperature=recipe.train.temperature, seed=7))
completions = [c for g in groups for c in g]
prompts = [p for p, g in zip(asked, groups) for _ in g]
sampled = RolloutBatch(prompts, completions, torch.zeros(len(completions)), torch.ones(len(completions)))
mb = sampled.micro_batch(torch.arange(len(completions)), tok.pad_token_id)
with torch.no_grad():  # the trainer's forward (through DeepSpeed's engine under ZeRO: collective)
    ours, _ = completion_logps(trainer.strategy.policy, mb, recipe.train.temperature)
out["logp_gap"] = float(((ours - mb.behaviour_logps).abs() * mb.completion_mask).max())
out["tokens"] = int(mb.completion_mask.sum())
if (engine := getattr(trainer.strategy, "engine", None)) is not None:  # DeepSpeed's, under ZeRO
    out["ds_world"] = engine.world_size
    out["zero_stage"] = engine.zero_optimization_stage()
if trainer.rank == 0:
    torch.save(out, sys.argv[3])
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


def one_update(tmp_path: Path, tiny_base: dict, data: Path, ranks: int, *overrides: str) -> dict:
    script = tmp_path / "one_update.py"
    script.write_text(ONE_UPDATE)
    out = tmp_path / f"update-{ranks}-{'-'.join(o.split('=')[-1] for o in overrides) or 'plain'}.pt"
    args = small(tmp_path, tiny_base, data, "train.learning_rate=1e-3", *overrides)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            str(script),
            str(TINY),
            tiny_base["path"],
            str(out),
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_base, tiny_data) -> dict:
    return one_update(tmp_path_factory.mktemp("plain"), tiny_base, tiny_data, 1)


def assert_same_update(zero: dict, plain: dict, base_path: str) -> None:
    from safetensors.torch import load_file

    base = load_file(Path(base_path) / "model.safetensors")
    assert any(not torch.equal(base[n], plain["weights"][n]) for n in base), "the update changed nothing"
    assert zero["weights"].keys() == plain["weights"].keys()
    assert zero["lr"] == plain["lr"] > 0  # the schedule stepped once on both sides
    # Adam's first step is about lr * g / |g| on every component: a gradient taken from one rank's half of
    # the batch only would flip many of them. Components whose gradient is mathematically zero (k_proj.bias)
    # are float noise and may step anywhere in [-lr, lr], so all but such components must agree.
    close = [
        torch.isclose(zero["weights"][n], plain["weights"][n], rtol=1e-5, atol=1e-6).flatten() for n in base
    ]
    assert torch.cat(close).float().mean() > 0.999
    # lr * sign(g) hides g's scale, so the weights cannot tell a gradient halved or doubled (the ranks'
    # shares summed wrong): its norm, reduced over the ranks by DeepSpeed, must be the one-rank gradient's
    assert math.isfinite(plain["grad_norm"]) and plain["grad_norm"] > 0, plain["grad_norm"]
    assert math.isclose(zero["grad_norm"], plain["grad_norm"], rel_tol=1e-4), (
        zero["grad_norm"],
        plain["grad_norm"],
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_two_rank_zero_update_equals_the_one_rank_update(stage, tmp_path, tiny_base, tiny_data, one_rank):
    zero = one_update(tmp_path, tiny_base, tiny_data, 2, f"train.deepspeed=zero{stage}")
    assert zero["ds_world"] == 2 and zero["zero_stage"] == stage
    assert_same_update(zero, one_rank, tiny_base["path"])
    # the synced weights sample with the log-probs the trainer computes for the same tokens (float32 both
    # sides; the engine's incremental decode vs the trainer's one forward differ by float summation order
    # only)
    assert zero["tokens"] >= 6 and zero["logp_gap"] < 1e-4
    assert one_rank["logp_gap"] < 1e-4


MASTER_WEIGHTS = """
import json, sys, torch
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe
recipe = load_recipe(sys.argv[1], sys.argv[3:])
trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
trainer.setup()
master = trainer.strategy.engine.optimizer.single_partition_of_fp32_groups[0]
before = master.detach().clone()
module_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
batch, _ = trainer.rollout_source().next(0)
batch.advantages = torch.linspace(-1, 1, len(batch))
trainer.optimize(batch)
after = master.detach()
module_after = {n: p.detach() for n, p in trainer.model.named_parameters()}
moved = (after - before).abs()
print(json.dumps({"master_dtype": str(master.dtype), \
"module_dtype": str(next(trainer.model.parameters()).dtype),
       "median_step": moved.median().item(), "master_moved": (moved > 0).float().mean().item(),
       "module_moved": sum((module_after[n] != module_before[n]).sum().item() for n in module_after)
                       / sum(p.numel() for p in module_after.values())}))
from trainer.launch import end_rank; end_rank()  # leaves the group, ends without finalization
"""


def test_bf16_training_keeps_fp32_master_weights_that_hold_updates_bf16_would_round_away(
    tmp_path, tiny_base, tiny_data
):
    script = tmp_path / "master.py"
    script.write_text(MASTER_WEIGHTS)
    # Adam's first step moves each weight by about lr; bf16 keeps ~3 digits, so |w| ~ 0.02 has an ulp ~1e-4
    lr = 1e-5
    args = small(
        tmp_path,
        tiny_base,
        tiny_data,
        f"train.learning_rate={lr}",
        "model.dtype=bfloat16",
        "train.deepspeed=zero2",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(script),
            str(TINY),
            tiny_base["path"],
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["master_dtype"] == "torch.float32" and r["module_dtype"] == "torch.bfloat16"
    assert r["master_moved"] > 0.95  # the fp32 master weights took the update...
    assert 0.5 * lr < r["median_step"] < 1.5 * lr
    assert r["module_moved"] < 0.5  # ...which mostly rounds away in the bf16 copy the forward uses


def _train_cmd(tmp_path, tiny_base, data, *overrides) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(TINY),
        *small(tmp_path, tiny_base, data, "rollout.train_devices=[0, 1]", *overrides),
        "--json",
    ]


def test_a_zero_run_killed_with_sigkill_resumes_to_the_weights_of_an_uninterrupted_run(
    tmp_path, tiny_base, tiny_data
):
    from safetensors.torch import load_file

    overrides = (
        "train.deepspeed=zero2",
        "train.max_steps=6",
        "train.save_steps=2",
        "train.learning_rate=1e-3",
    )
    whole = subprocess.run(
        _train_cmd(tmp_path / "whole", tiny_base, tiny_data, *overrides),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
    )
    assert whole.returncode == 0, whole.stderr[-4000:]

    cmd = _train_cmd(tmp_path / "killed", tiny_base, tiny_data, *overrides)
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    run = tmp_path / "killed" / "run"
    deadline = time.time() + 600
    while not (run / "checkpoint-2").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert (run / "checkpoint-2").is_dir(), proc.communicate()[1][-4000:]
    # the whole run at once, mid-run: grpoflow, torchrun and both ranks (torchrun starts its ranks in sessions
    # of their own, so killing the process group alone would leave them training)
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    saved = sorted(p.name for p in run.glob("checkpoint-*"))
    assert (
        run / "checkpoint-2" / "zero" / "state"
    ).is_dir()  # every rank's optimizer shard is in the checkpoint

    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=clean_env())
    assert again.returncode == 0, again.stderr[-4000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == int(saved[-1].split("-")[1]) >= 2 and summary["steps"] == 6
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    a = load_file(tmp_path / "whole" / "run" / "checkpoint-6" / "model.safetensors")
    b = load_file(run / "checkpoint-6" / "model.safetensors")
    # data order, sampling seeds, fp32 master weights, Adam moments and the schedule all resume exactly
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("rollout", ["sync", "async"])
def test_grpoflow_train_under_zero3_samples_every_step_from_the_weights_just_trained(
    rollout, tmp_path, tiny_base, tiny_data
):
    """`grpoflow train` end to end under ZeRO-3 (held-out before and after, 3 steps, a checkpoint), 2 ranks.
    sync: each rank generates with the policy itself, gathered whole and unhooked (ranks decode different
    numbers of tokens: ZeRO-3's collective per-module hooks could hang, by reading of DeepSpeed's code).
    async: rank 0 alone sends the rollout worker its weights while the other rank gathers alongside (a
    collective), at the same moments. On-policy (async with max_staleness 0), so the engine's log-probs equal
    the trainer's at every step: a sync that sent shards, stale or partial weights would show as a gap of the
    size of an lr-1e-3 update."""
    from safetensors.torch import load_file

    overrides = (
        "train.deepspeed=zero3",
        "train.max_steps=3",
        "train.save_steps=3",
        "train.learning_rate=1e-3",
        # the first step at the full rate, with groups that do not tie on every CPU's base (2 prompts tied
        # on the Intel Xeon's, and an lr-1e-3 update leaves that base answering nothing right after)
        "train.lr_scheduler_type=constant",
        "train.prompts_per_step=8",
        *(("rollout.async=true", "rollout.max_staleness=0") if rollout == "async" else ()),
    )
    proc = subprocess.run(
        _train_cmd(tmp_path, tiny_base, tiny_data, *overrides),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["staleness"] == 0.0 for r in rows)
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows]
    assert max(gaps) < 1e-5, gaps
    # the mean counts a token without a finite gap as 0: the transformers engine reports every log-prob, so
    # any such token is a failure (a sync that sent non-finite weights, a lost log-prob)
    assert [r["sampling/sampling_logp_difference/nonfinite"] for r in rows] == [0.0] * 3, rows
    manifest = json.loads((run / "checkpoint-3" / "manifest.json").read_text())
    assert manifest["recipe"]["train"]["deepspeed"] == "zero3"
    base = load_file(Path(tiny_base["path"]) / "model.safetensors")
    trained = load_file(run / "checkpoint-3" / "model.safetensors")
    moved = max((trained[n] - base[n]).abs().max().item() for n in base)
    # the updates (steps 2 and 3 sampled after them) really moved the weights: Adam's first step with a
    # signal moves a weight by about the learning rate
    assert moved > 5e-4


# ---- the config, without starting DeepSpeed ----------------------------------------------------------------


def test_the_recipe_owns_batch_clipping_and_bf16_over_a_users_ds_config(tmp_path, caplog):
    from trainer.deepspeed_setup import recipe_config

    preset = recipe_config("zero3", micro_batch_size=4, max_grad_norm=0.5, bf16=True)
    assert preset["zero_optimization"]["stage"] == 3 and preset["bf16"] == {"enabled": True}
    assert preset["train_micro_batch_size_per_gpu"] == 4 and preset["gradient_clipping"] == 0.5
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps(
            {
                "train_batch_size": 512,
                "train_micro_batch_size_per_gpu": 16,
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": 2.0,
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "Adam"},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            }
        )
    )
    with caplog.at_level("WARNING", logger="grpoflow.train"):
        config = recipe_config(str(user), micro_batch_size=4, max_grad_norm=0.0, bf16=False)
    assert config["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
    }  # the user's own
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 1
    assert config["gradient_clipping"] == 0.0 and config["bf16"] == {"enabled": False}
    assert "train_batch_size" not in config and "optimizer" not in config
    said = caplog.text
    assert (
        "train_micro_batch_size_per_gpu = 16" in said
        and "gradient_clipping = 2.0" in said
        and "'optimizer'" in said
    )


def test_bad_deepspeed_settings_are_refused_naming_them(tmp_path):
    from data.errors import MissingPathError
    from trainer.deepspeed_setup import recipe_config
    from trainer.grpo import check_supported
    from trainer.recipe import load_recipe
    from trainer.typed_config import ConfigError

    with pytest.raises(ValueError, match="deepspeed must be one of zero1, zero2, zero3 or a path to a .json"):
        load_recipe(TINY, ["train.deepspeed=zero4"])
    with pytest.raises(MissingPathError, match=f"train.deepspeed: {tmp_path / 'nope.json'} is not a file"):
        recipe_config(str(tmp_path / "nope.json"), micro_batch_size=1, max_grad_norm=1.0, bf16=False)
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": ')
    with pytest.raises(ConfigError, match=f"{broken} is not readable JSON"):
        recipe_config(str(broken), micro_batch_size=1, max_grad_norm=1.0, bf16=False)
    with pytest.raises(ConfigError, match="ZeRO stage 3 with rollout.server_url is not supported yet"):
        check_supported(load_recipe(TINY, ["train.deepspeed=zero3", "rollout.server_url=http://127.0.0.1:1"]))
    check_supported(load_recipe(TINY, ["train.deepspeed=zero2", "rollout.server_url=http://127.0.0.1:1"]))
    check_supported(
        load_recipe(TINY, ["train.deepspeed=zero3", "rollout.async=true"])
    )  # rank 0 syncs, all gather
