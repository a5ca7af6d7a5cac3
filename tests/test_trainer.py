"""The GRPO trainer on the real tiny model: ratios, resume after SIGKILL, failing rewards, learning."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from trainer.grpo import GRPOTrainer
from trainer.logprobs import completion_logps
from trainer.model_loading import load_model
from trainer.recipe import load_recipe

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


def small_recipe(tmp_path: Path, tiny_base: dict, data: Path, *overrides: str):
    return load_recipe(
        TINY,
        [
            f"bootstrap.out={tiny_base['path']}",
            f"data.out={data}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.prompts_per_step=2",
            "train.num_generations=4",
            "train.eval_heldout=16",
            "train.micro_batch_size=4",
            # stepped from the first update at the given rate (Adam's first step moves a weight ~lr): the
            # recipe's warm-up (200 of its 2,800 steps) would start these at 0.5% of it
            "train.warmup_steps=0",
            "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
            *overrides,
        ],
    )


def test_ratio_is_exactly_one_on_first_pass_and_not_after_an_update(
    tmp_path, tiny_base, tiny_data, loss_ratios
):
    recipe = small_recipe(
        tmp_path, tiny_base, tiny_data, "train.num_iterations=2", "train.learning_rate=1e-3"
    )
    trainer = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False)
    trainer.setup()
    batch, _ = trainer.rollout_source().next(0)
    mb = batch.micro_batch(torch.arange(len(batch)), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        before, _ = completion_logps(trainer.model, mb, recipe.train.temperature, share_prompts=True)
    # behaviour log-probs from incremental decoding match a full forward of the same policy
    mask = mb.completion_mask > 0
    assert torch.allclose(before[mask], mb.behaviour_logps[mask], atol=1e-4)

    batch.advantages = torch.linspace(-1, 1, len(batch))  # make sure the update moves the policy
    trainer.optimize(batch)
    # the ratios the trainer's own loss saw: 2 micro-batches of 4, two passes
    assert [first for first, _ in loss_ratios] == [True, True, False, False]
    for first, ratio in loss_ratios:
        if first:  # the proximal policy is the one being evaluated: exactly 1, not merely close
            assert torch.equal(ratio, torch.ones_like(ratio)), (ratio - 1).abs().max()
        else:  # after pass one's update
            assert not torch.allclose(ratio, torch.ones_like(ratio)), (ratio - 1).abs().max()
    with torch.no_grad():
        after, _ = completion_logps(trainer.model, mb, recipe.train.temperature, share_prompts=True)
    assert not torch.allclose(after[mask], before[mask])
    assert trainer.version == 1  # one policy version per trained batch, whatever mu (here 2 updates)


def test_a_raising_reward_is_counted_and_training_goes_on(tmp_path, tiny_base, tiny_data):
    calls = tmp_path / "calls.jsonl"
    plugin = tmp_path / "flaky.py"
    plugin.write_text(
        "import json\n"
        "def flaky(prompts, completions, **kw):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(json.dumps([len(c) for c in completions]) + '\\n')\n"
        "    out = []\n"
        "    for c in completions:\n"
        "        if len(c) % 2:\n"
        "            raise RuntimeError('flaky reward saw an odd length')\n"
        "        out.append(0.5)\n"
        "    return out\n"
    )
    recipe = small_recipe(
        tmp_path,
        tiny_base,
        tiny_data,
        "train.max_steps=2",
        "train.eval_heldout=0",
        f"rewards=[{{name: accuracy}}, {{name: '{plugin}:flaky', weight: 0.5}}]",
    )
    result = GRPOTrainer(recipe, tiny_base["path"], tiny_data, progress=False).train()
    assert result.steps == 2
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]

    # What the plugin saw, written by the plugin itself: per step one call with the whole batch
    # (2 prompts x 4), then, if that raised, one call per completion. The errors expected are the odd lengths
    # of the batch calls.
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    batches = [i for i, lengths in enumerate(seen) if len(lengths) == 8]
    assert len(batches) == 2 and batches[0] == 0
    expected = []
    for start, end in zip(batches, [*batches[1:], len(seen)], strict=True):
        lengths = seen[start]
        odd = sum(n % 2 for n in lengths)
        # a raising batch is retried one completion at a time, in order; a clean batch is not retried
        assert seen[start + 1 : end] == ([[n] for n in lengths] if odd else [])
        expected.append(odd)
    assert [r["rewards/flaky/errors"] for r in rows] == expected
    assert [r["reward_errors"] for r in rows] == expected
    assert sum(expected) > 0, "no completion of odd length: the test saw no error to count"
    for row, odd in zip(rows, expected, strict=True):
        if odd < 8:  # the completions that did not raise scored 0.5 each, and only they are averaged
            assert row["rewards/flaky/mean"] == 0.5
        else:
            assert "rewards/flaky/mean" not in row


def _train_cmd(tmp_path: Path, tiny_base: dict, data: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(TINY),
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=6",
        "train.save_steps=2",
        "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=8",
        "train.learning_rate=3e-4",
        "train.num_iterations=2",
        # with the curriculum's record in the checkpoint: a resumed choice of prompts needs it
        "train.skip_solved_prompts=1",
        "train.solved_reward=1.2",
        "--json",
    ]


def test_sigkill_then_rerun_resumes_exactly(tmp_path, tiny_base, tiny_data):
    straight = tmp_path / "straight"
    done = subprocess.run(
        _train_cmd(straight, tiny_base, tiny_data), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr

    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(
        _train_cmd(crashed, tiny_base, tiny_data),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = crashed / "run" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert latest.exists(), "no checkpoint appeared"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = latest.read_text().strip()
    assert killed_at != "checkpoint-6", "the run finished before it could be killed"

    resumed = subprocess.run(
        _train_cmd(crashed, tiny_base, tiny_data), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == int(killed_at.split("-")[1])
    # the held-out answers scored before and after training are kept in the run directory, named in the
    # summary: before training's from the killed attempt (kept in its checkpoint's state), after's from the
    # rerun
    from trainer.heldout import read_samples

    straight_summary = json.loads(done.stdout.strip().splitlines()[-1])
    for moment in ("before", "after"):
        scores = summary[f"heldout_{moment}"]
        assert Path(scores["samples_path"]) == (crashed / "run" / "heldout" / f"{moment}.jsonl").resolve()
        samples = read_samples(scores)
        assert len(samples) == scores["n"] == 8
        assert sum(s["correct"] or 0.0 for s in samples) / 8 == scores["accuracy"]
    # the base model's greedy answers, the same whichever attempt scored them
    assert read_samples(summary["heldout_before"]) == read_samples(straight_summary["heldout_before"])

    def steps(run):
        return [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]

    a, b = steps(straight), steps(crashed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    # full fine-tuning's optimizer state: AdamW's two fp32 moments per parameter, a 4-byte step per tensor
    params = list(load_model(tiny_base["path"])[0].parameters())
    full = 8 * sum(p.numel() for p in params) + 4 * len(params)
    assert {r["memory/optimizer_bytes"] for r in a + b} == {full}
    for x, y in zip(a, b, strict=True):  # same data, same samples, same rewards
        assert x["reward"] == y["reward"] and x["completions/mean_length"] == y["completions/mean_length"]

    from safetensors.torch import load_file

    wa = load_file(straight / "run" / "checkpoint-6" / "model.safetensors")
    wb = load_file(crashed / "run" / "checkpoint-6" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


# The learning proxy: the embedded default's recipe cut to its first steps (its warm-up and linear decay over
# them), seed 0 as shipped. Two signals, each with room: held-out greedy accuracy on 256 problems, and the
# sampled accuracy reward (1,280 samples in each of the first and last 20 steps). Measured on one thread, 200
# steps, seeds 0, 1, 2 (2026-12-06, 16 prompts x 4, rewards not scaled by their group's std): the AVX-512 base
# (0.281) +26.2, +27.3, +28.5 held-out points and +23.8, +15.2, +21.3 reward points; the AVX2 base (0.410;
# ATEN_CPU_CAPABILITY=avx2 etc., README) +7.8, +8.6, +7.4 and +21.4, +12.9, +18.0. With the recipe's warm-up
# of the learning rate (a fraction of the run: 15 of these 200 steps): AVX-512 base seed 0 +30.1 and +18.0,
# AVX2 base +10.5 / +12.9 / +10.5 and +15.9 / +13.7 / +15.2. Early held-out accuracy on that base is noisy
# (the sampled reward steadier): cut to 120 steps, the recipe without the warm-up gave it +2.3, +6.6, +4.3
# (seed 0 under the bound), and the whole 1,400-step recipe gave +50 and +34 (medians of 3 seeds, README
# "Measured here"). Sampled asynchronously, as the recipe now ships (seed 0, one thread, 2026-12-07): the AVX2
# base +11.7 held-out and +17.6 reward points, an Intel Xeon's base (0.312) +13.3 and +10.1; the whole
# recipe, 2,800 steps, +41 on the AVX2 base (median of 3 seeds). A change that stops learning leaves both
# where they were, or lower.
PROXY_STEPS, PROXY_GAIN, PROXY_REWARD_GAIN = 200, 0.03, 0.03


@pytest.mark.slow
def test_tiny_cpu_recipe_learns(tmp_path, tiny_base, tiny_recipe):
    """The learning proxy of the embedded default: its recipe, cut to its first 200 steps, raises held-out
    greedy accuracy on 256 problems by >= 3 points and the sampled accuracy reward (last 20 steps over the
    first 20) by >= 3 points, and logs TRL's metrics at every step."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            "--config",
            str(TINY),
            f"bootstrap.out={tiny_base['path']}",
            f"data.out={tmp_path / 'data'}",
            f"train.output_dir={tmp_path / 'run'}",
            f"train.max_steps={PROXY_STEPS}",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["heldout_before"]["n"] >= 200
    assert s["heldout_accuracy_after"] >= s["heldout_accuracy_before"] + PROXY_GAIN, s
    assert s["steps"] == PROXY_STEPS and Path(s["checkpoint"]).is_dir()
    rows = [json.loads(line) for line in Path(s["metrics"]).read_text().splitlines()]
    first, last = (
        statistics.fmean(r["rewards/accuracy/mean"] for r in part) for part in (rows[:20], rows[-20:])
    )
    assert last >= first + PROXY_REWARD_GAIN, (first, last)
    for key in (
        "reward",
        "reward_std",
        "rewards/accuracy/mean",
        "rewards/format/std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "kl",
        "clip_ratio/region_mean",
        "entropy",
        "frac_reward_zero_std",
        "grad_norm",
        "learning_rate",
        "timing/rollout_s",
        "timing/step_s",
        "tokens_per_s",
    ):
        assert key in rows[-1], key
