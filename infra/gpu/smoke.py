#!/usr/bin/env python3
"""GPU smoke check: what a GPU changes, with the real trainer: the rollout engines and their behaviour
log-probs, `grpoflow train` in the layouts the GPU recipes use, bf16 numerics (fp32 master weights, the
engine-vs-trainer log-prob gap), the memory plan against the CUDA allocator on real-size models, DeepSpeed
ZeRO-2.

Builds a random Qwen2 model (hidden 256, 4 layers on cuda; smaller on cpu; weights a bf16 value holds exactly)
with a tokenizer trained on the spot by `trainer.bootstrap.build_tokenizer`, so it needs no model download and
no bootstrap run. Checks, in order, each failing loudly:
  generate      HFEngine.generate, batched, n samples per prompt: shapes, finite log-probs <= 0, diverse
                samples
  logprobs      the engine's behaviour log-probs against the trainer's own forward (`trainer.logprobs`) on its
                batch layout (`RolloutBatch.micro_batch`) at the same temperature (default 0.5): max / mean
                abs difference within tolerance, and the mean below 0.3 of the gap to untempered log-probs (so
                log-probs that ignore the temperature fail even on a random model's flat distributions)
  layout_sync   `grpoflow train` (a subprocess, as a user runs it) for 3 steps, synchronous: on cuda one GPU
                with the engine colocated (vLLM when it imports: sleep / wake-up / weight sync every step), on
                cpu the transformers engine. Per step: finite loss and gradient norm, staleness 0, step /
                rollout / train / weight-sync times, and the engine-vs-trainer log-prob difference
                (`sampling/sampling_logp_difference/mean`, checked against the engine tolerance)
  layout_async  the same, asynchronous: 2 trainer ranks + 1 rollout GPU (3+ GPUs; 1 + 1 on 2 GPUs; skipped on
                one), on cpu 2 gloo trainer ranks + 1 rollout worker. Staleness 0 then 1 (one-step off-policy)
  vllm          (if vllm imports, cuda only) VLLMEngine on the saved model: same log-prob check at T != 1,
                then (after train) sleep(1) / wake_up(["weights"]) / update_weights(trained weights) /
                wake_up(["kv_cache"]) and the check again against the trained model
  lmdeploy      (if lmdeploy imports, cuda only) LMDeployEngine(backend="pytorch"; Ray executor), same checks
                at T = 1
  bf16_logps    the real `GRPOTrainer` in bf16 for 2 steps, the transformers engine colocated: the
                engine-vs-trainer gap it logs (`sampling/sampling_logp_difference/mean`) at most the bf16
                tolerance (0.03) on each step
  bf16_masters  one trainer update (`GRPOTrainer.optimize`) at lr 1e-6 from the same weights and batch in bf16
                and in fp32: AdamW steps fp32 weights in both, and the bf16 run's update (of its fp32 master
                weights) is within 1e-2 of the fp32 one (relative, L1; L2, the sign disagreements and how
                little of the bf16 module itself moved are reported beside it)
  memory_plan   (cuda only) random models of Qwen2.5-0.5B's and -1.5B's public shapes, made on the GPU: the
                peak `torch.cuda.max_memory_allocated` of two real trainer updates (bf16, fp32 masters, AdamW)
                on the countdown recipe's micro-batch (one group of 8 x 256 + 1,024 tokens) against
                `trainer.memory_plan.estimate`'s trainer parts of device 0 (all but kv_cache), within 15 %;
                without that module the peaks are reported and the check says "skipped"
  train         the real `GRPOTrainer` (trainer/grpo.py) in this process for a few steps on the saved model,
                with synthetic addition data and a reward that differs between completions (a random model
                solves nothing): transformers rollout, dapo loss, held-out greedy evaluation, a checkpoint;
                finite losses and gradient norms, finite weights, weights changed (the engines' weight-sync
                checks load these)
  deepspeed     (if deepspeed is installed) `grpoflow train train.deepspeed=zero2` with one trainer rank for 3
                steps, checked as the layouts are, and the checkpoint holding ZeRO's optimizer shards. On cpu
                DeepSpeed's CPU accelerator builds its shm op on first use (about 2 minutes on 2 cores, then
                cached in ~/.cache/torch_extensions)
Prints a line per check (and per training step of the layouts), then one JSON line with the results and
timings; writes the JSON to $OUT/smoke.json when OUT is set (or to --out), and exits non-zero when any check
failed. Missing optional packages are reported as skipped; `--skip vllm,lmdeploy,deepspeed,layout_async,...`
leaves checks out (the engines share this process). The layouts run first, while this process holds little
GPU memory.

    python3 infra/gpu/smoke.py                 # cuda when available
    python3 infra/gpu/smoke.py --device cpu    # small sizes, a few minutes on two cores
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

SIZES = {
    "cuda": dict(hidden=256, layers=4, prompts=16, n=8, max_tokens=64, dtype="bfloat16", micro=64),
    "cpu": dict(hidden=64, layers=2, prompts=4, n=4, max_tokens=16, dtype="float32", micro=16),
}
# (max, mean) absolute log-prob difference allowed between an engine and the trainer's forward
TOLERANCE = {"float32": (2e-3, 2e-4), "bfloat16": (0.25, 0.03), "float16": (0.1, 0.01)}
ENGINE_TOLERANCE = {"float32": (1e-2, 1e-3), "bfloat16": (0.5, 0.05), "float16": (0.2, 0.02)}
RELATIVE_TOLERANCE = 0.3
TRAIN_STEPS = 3
LAYOUT_STEPS = 3
# the engine-vs-trainer log-prob difference the trainer logs per step (TRL's name), when it does
LOGP_DIFF = "sampling/sampling_logp_difference/mean"
STEP_TIMES = ("timing/step_s", "timing/rollout_s", "timing/train_s", "timing/weight_sync_s", "timing/wait_s")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# bf16 training with fp32 master weights against fp32: one update at this learning rate, from the same weights
# and batch; most of a bf16 weight's own update would round away at it (half an ulp at |w| ~ 0.02 is ~6e-5)
MASTER_LR = 1e-6
# |update(bf16 masters) - update(fp32)|_1 / |update(fp32)|_1 over all weights. L1: Adam's first step moves
# each weight by ~lr times the sign of its gradient, so the two updates differ only where bf16 rounding flips
# the sign of a near-zero gradient; a fraction f of flips is 2f in L1 but 2 sqrt(f) in L2 (0.08 at f = 0.16 %,
# as measured on cpu), which would hide a correct run behind a few rounding flips. Without masters it is ~1.
MASTER_TOLERANCE = 1e-2
# the public shapes of Qwen2.5-0.5B and -1.5B (their config.json), for random models made here: no download
QWEN_SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12
    ),
}
QWEN_COMMON = dict(
    vocab_size=151936,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)
# the micro-batch of configs/countdown-qwen2.5-3b.yaml: one group of 8 completions, 256 + 1,024 tokens each
MEMORY_BATCH = dict(micro_batch_size=8, max_prompt_length=256, max_completion_length=1024)
MEMORY_TOLERANCE = 0.15  # |plan - measured| / measured, the trainer's parts of device 0


class CheckFailed(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(args):
    """A tokenizer trained on a small arithmetic corpus, a seeded random Qwen2 model and chat prompts."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.bootstrap import build_tokenizer
    from trainer.prompts import encode_prompts

    corpus = [
        f"What is {a} + {b}? <think>{a} + {b} = {a + b}</think><answer>{a + b}</answer>"
        for a in range(40)
        for b in range(0, 40, 3)
    ] + ["system", "user", "assistant"] * 50
    tokenizer = build_tokenizer(corpus, vocab_size=384)
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # weights a bf16 value can hold exactly, so that a bf16 and an fp32 trainer start from the same ones
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).to(args.device, DTYPES[args.dtype])
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {7 * i} + {i * i}?" + " Think." * (i % 4)}]}
        for i in range(args.prompts)
    ]
    return tokenizer, model, encode_prompts(tokenizer, rows)


def rollout_batch(prompts, groups):
    """The trainer's batch layout for `groups` (zero advantages: only the log-prob checks use it)."""
    from trainer.rollout.batch import RolloutBatch

    flat = [c for g in groups for c in g]
    n = len(groups[0])
    return RolloutBatch(
        [p for p in prompts for _ in range(n)], flat, torch.zeros(len(flat)), torch.ones(len(flat))
    )


def micro_batches(batch, size: int, pad_id: int, device: str):
    for idx in torch.arange(len(batch)).split(size):
        yield batch.micro_batch(idx, pad_id).to(device)


@torch.no_grad()
def logprob_gap(model, tokenizer, prompts, groups, temperature: float, args) -> dict:
    """Max and mean |engine log-prob - trainer forward log-prob| over all completion tokens."""
    from trainer.logprobs import completion_logps

    was_training = model.training
    model.eval()
    gaps = []
    for mb in micro_batches(rollout_batch(prompts, groups), args.micro, tokenizer.pad_token_id, model.device):
        logps, _ = completion_logps(model, mb, temperature)
        gaps.append((logps - mb.behaviour_logps).abs()[mb.completion_mask > 0].float())
    model.train(was_training)
    gap = torch.cat(gaps)
    check(bool(torch.isfinite(gap).all()), "non-finite log-prob difference")
    return {"max_abs_diff": gap.max().item(), "mean_abs_diff": gap.mean().item(), "tokens": gap.numel()}


def check_groups(groups, prompts: int, n: int, max_tokens: int, vocab: int) -> dict:
    check(len(groups) == prompts and all(len(g) == n for g in groups), "wrong number of groups or samples")
    lengths = []
    for c in (c for g in groups for c in g):
        check(
            0 < len(c.token_ids) <= max_tokens,
            f"completion length {len(c.token_ids)} outside 1..{max_tokens}",
        )
        check(len(c.logprobs) == len(c.token_ids), "one log-prob per token expected")
        check(all(math.isfinite(v) and v <= 1e-4 for v in c.logprobs), "log-probs must be finite and <= 0")
        check(all(0 <= t < vocab for t in c.token_ids), "token id outside the vocabulary")
        check(c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason!r}")
        lengths.append(len(c.token_ids))
    check(any(len({tuple(c.token_ids) for c in g}) > 1 for g in groups), "no group has two different samples")
    return {
        "completions": len(lengths),
        "tokens": sum(lengths),
        "stopped": sum(c.finish_reason == "stop" for g in groups for c in g),
    }


def within(gap: dict, tolerance: tuple[float, float], what: str, untempered: dict | None = None) -> dict:
    """Absolute tolerance, and (T != 1) a relative one: the gap must be well below what log-probs taken
    without the temperature would give, so an engine returning raw log-probs cannot pass on a flat model."""
    check(
        gap["max_abs_diff"] <= tolerance[0] and gap["mean_abs_diff"] <= tolerance[1],
        f"{what}: log-prob gap max {gap['max_abs_diff']:.3g} / mean {gap['mean_abs_diff']:.3g} above "
        f"tolerance {tolerance}",
    )
    out = {**gap, "tolerance": list(tolerance)}
    if untempered is not None:
        ratio = gap["mean_abs_diff"] / max(untempered["mean_abs_diff"], 1e-12)
        check(
            ratio <= RELATIVE_TOLERANCE,
            f"{what}: mean gap {gap['mean_abs_diff']:.3g} is {ratio:.2f} of the gap "
            f"to untempered log-probs ({untempered['mean_abs_diff']:.3g}); temperature not applied?",
        )
        out.update(untempered_mean_abs_diff=untempered["mean_abs_diff"], ratio_to_untempered=ratio)
    return out


def engine_gap(model, ctx, groups, temperature: float, args, tolerance, what: str) -> dict:
    gap = logprob_gap(model, ctx["tokenizer"], ctx["prompts"], groups, temperature, args)
    untempered = None
    if temperature != 1.0:
        untempered = logprob_gap(model, ctx["tokenizer"], ctx["prompts"], groups, 1.0, args)
    return within(gap, tolerance, what, untempered)


def run_generate(ctx, args) -> dict:
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf_engine import HFEngine

    engine = HFEngine(ctx["model"], ctx["tokenizer"])
    engine.generate(ctx["prompts"][:1], 1, SamplingParams(max_tokens=2, temperature=1.0, seed=0))  # warm-up
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    sync(args.device)
    t0 = time.perf_counter()
    groups = engine.generate(ctx["prompts"], args.n, sampling)
    sync(args.device)
    seconds = time.perf_counter() - t0
    ctx["groups"] = groups
    stats = check_groups(groups, args.prompts, args.n, args.max_tokens, len(ctx["tokenizer"]))
    return {**stats, "seconds": seconds, "tokens_per_s": stats["tokens"] / seconds}


def run_logprobs(ctx, args) -> dict:
    return engine_gap(
        ctx["model"],
        ctx,
        ctx["groups"],
        args.temperature,
        args,
        TOLERANCE[args.dtype],
        "HFEngine vs trainer forward",
    )


def scattered_reward(prompts, completions, **columns) -> list[float]:
    """A reward in [0, 1) that differs between the completions of a group, fixed by their text."""
    return [zlib.crc32(text.encode()) / 2**32 for text in completions]


def saved_model(ctx) -> str:
    """The untrained smoke model and its tokenizer in HF format, saved once."""
    if "checkpoint" not in ctx:
        ctx["checkpoint"] = os.path.join(ctx["work"], "model")
        ctx["model"].save_pretrained(ctx["checkpoint"])
        ctx["tokenizer"].save_pretrained(ctx["checkpoint"])
    return ctx["checkpoint"]


def prepared_data(ctx) -> Path:
    """Synthetic addition rows (64 train, 8 held out), prepared once for every training check."""
    if "data" not in ctx:
        from data.prepare import prepare

        ctx["data"] = Path(ctx["work"]) / "data"
        prepare(
            "synthetic",
            "synthetic:addition",
            ctx["data"],
            heldout=8,
            synthetic_rows=64,
            system_prompt="brief",
        )
    return ctx["data"]


REWARD = f"{Path(__file__).resolve()}:scattered_reward"


def trainer_recipe(ctx, args, name: str, *overrides: str):
    """The recipe of a trainer run in this process: the saved model, the prepared data, the smoke's sizes, no
    held-out evaluation, its run directory `name`; `overrides` last."""
    from trainer.recipe import load_recipe

    return load_recipe(
        None,
        [
            f"model.name_or_path={saved_model(ctx)}",
            f"model.dtype={args.dtype}",
            f"data.out={prepared_data(ctx)}",
            f"train.output_dir={Path(ctx['work']) / name}",
            f"train.seed={args.seed}",
            f"train.prompts_per_step={args.prompts}",
            f"train.num_generations={args.n}",
            f"train.micro_batch_size={args.micro}",
            f"train.max_completion_length={args.max_tokens}",
            f"train.temperature={args.temperature}",
            "train.eval_heldout=0",
            f"rewards=[{{name: {json.dumps(REWARD)}}}]",
            *(["rollout.train_devices=[0]"] if args.device.startswith("cuda") else []),
            *overrides,
        ],
    )


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten().cpu() for t in tensors])


def layouts(args) -> dict[str, tuple[str, list[str], str | None]]:
    """name -> (description, rollout overrides, reason to skip) of the layouts `grpoflow train` runs in."""
    if not args.device.startswith("cuda"):
        return {
            "layout_sync": (
                "cpu, transformers engine in the trainer, synchronous",
                ["rollout.engine=transformers", "rollout.async=false"],
                None,
            ),
            # the 3-GPU layout's devices: on cpu they only count the ranks, and `--dry-run` shows the GPU plan
            "layout_async": (
                "cpu, 2 gloo trainer ranks + 1 rollout worker, asynchronous",
                [
                    "rollout.engine=transformers",
                    "rollout.async=true",
                    "rollout.train_devices=[0,1]",
                    "rollout.rollout_devices=[2]",
                    "rollout.num_engines=1",
                ],
                None,
            ),
        }
    engine = args.engine
    gpus = torch.cuda.device_count()
    out = {
        "layout_sync": (
            f"GPU 0, {engine} colocated with the trainer, synchronous",
            [
                f"rollout.engine={engine}",
                "rollout.colocate=true",
                "rollout.async=false",
                "rollout.train_devices=[0]",
                "rollout.num_engines=1",
            ],
            None,
        )
    }
    train, rollout = ([0, 1], [2]) if gpus >= 3 else ([0], [1])
    skip = None if gpus >= 2 else f"needs 2 GPUs (3 for 2 trainer ranks + 1 rollout GPU), {gpus} visible"
    out["layout_async"] = (
        f"{len(train)} trainer rank(s) on GPU {train}, {engine} rollout worker on GPU {rollout}, "
        "asynchronous",
        [
            f"rollout.engine={engine}",
            "rollout.async=true",
            "rollout.colocate=false",
            f"rollout.train_devices={train}",
            f"rollout.rollout_devices={rollout}",
            "rollout.num_engines=1",
        ],
        skip,
    )
    return out


def layout_recipe(ctx, args, name: str, rollout: list[str]) -> Path:
    """A recipe file for `grpoflow train`: the saved model, the prepared data, small sizes, `rollout`
    overrides."""
    import yaml

    from trainer.recipe import load_recipe

    work = Path(ctx["work"]) / name
    data = {
        "model": {"name_or_path": saved_model(ctx), "dtype": args.dtype},
        "data": {
            "task": "synthetic",
            "source": "synthetic:addition",
            "out": str(prepared_data(ctx)),
            "heldout": 8,
            "synthetic_rows": 64,
            "system_prompt": "brief",
        },
        "train": {
            "output_dir": str(work / "run"),
            "max_steps": LAYOUT_STEPS,
            "save_steps": LAYOUT_STEPS,
            "seed": args.seed,
            "prompts_per_step": args.prompts,
            "num_generations": args.n,
            "micro_batch_size": args.micro,
            "max_completion_length": args.max_tokens,
            # LMDeploy's PyTorch backend reports exact log-probs at T = 1 only (nan otherwise)
            "temperature": 1.0 if args.engine == "lmdeploy" else args.temperature,
            "learning_rate": 1e-3,
            "loss_type": "dapo",
            # on cuda the held-out evaluations wake and sync a colocated engine outside the steps too
            "eval_heldout": 8 if args.device.startswith("cuda") else 0,
        },
        "rollout": {
            "gpu_memory_utilization": 0.25,
            "enforce_eager": True,
            "sync_timeout_s": args.layout_timeout,
        },
        "rewards": [{"name": REWARD}],
    }
    work.mkdir(parents=True, exist_ok=True)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_recipe(path, rollout)  # a recipe error is this script's bug: say so here, not in a subprocess log
    return path


def grpoflow_train(recipe: Path, overrides: list[str], log: Path, timeout_s: float, *extra: str):
    """`grpoflow train --config recipe overrides... --json` as a subprocess; (exit status, output,
    seconds)."""
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", str(recipe), *overrides, *extra, "--json"]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            code = subprocess.run(
                cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, log.read_text(errors="replace"), time.perf_counter() - t0


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def run_layout(ctx, args, name: str, description: str, overrides: list[str]) -> dict:
    """LAYOUT_STEPS steps of `grpoflow train` with `overrides` (run directory `name`); checks and prints each
    step's metrics."""
    recipe = layout_recipe(ctx, args, name, overrides)
    work = recipe.parent
    print(f"{name}: {description}", flush=True)
    # the placement plan, where this trainer can print one (`--dry-run`); informative only
    code, out, _ = grpoflow_train(recipe, overrides, work / "dry-run.log", 120, "--dry-run")
    plan = last_json(out) if code == 0 else None
    if plan is not None:
        print(
            f"{name}: plan "
            f"{json.dumps({k: plan.get(k) for k in ('train_devices', 'rollout_devices', 'colocate')})}",
            flush=True,
        )
    code, out, seconds = grpoflow_train(recipe, overrides, work / "train.log", args.layout_timeout)
    check(
        code == 0,
        f"grpoflow train exited with status {code}"
        + (" (timed out)" if code == 124 else "")
        + f"; last output:\n{out[-3000:]}",
    )
    metrics = work / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    check(
        [r["step"] for r in rows] == list(range(1, LAYOUT_STEPS + 1)),
        f"metrics.jsonl has steps {[r['step'] for r in rows]}, expected 1..{LAYOUT_STEPS}",
    )
    asynchronous = "rollout.async=true" in overrides
    for r in rows:
        check(math.isfinite(r["loss"]), f"step {r['step']}: loss is {r['loss']}")
        check(
            math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0,
            f"step {r['step']}: gradient norm {r['grad_norm']}",
        )
        times = " ".join(f"{k.split('/')[1]}={r[k]:.2f}" for k in STEP_TIMES if k in r)
        diff = f" logp_diff={r[LOGP_DIFF]:.2e}" if LOGP_DIFF in r else ""
        print(
            f"{name}: step {r['step']} staleness={r.get('staleness', float('nan')):.0f} {times}{diff}",
            flush=True,
        )
    staleness = [r.get("staleness") for r in rows]
    # asynchronous, max_staleness 1: batch 1 comes from the starting weights, each later one from the weights
    # one update behind the trainer's
    expected = [0.0] + [1.0] * (LAYOUT_STEPS - 1) if asynchronous else [0.0] * LAYOUT_STEPS
    check(staleness == expected, f"staleness per step {staleness}, expected {expected}")
    result = {
        "layout": description,
        "overrides": overrides,
        "seconds": seconds,
        "placement": plan,
        "steps": [
            {k: r[k] for k in ("step", "loss", "reward", "staleness", LOGP_DIFF, *STEP_TIMES) if k in r}
            for r in rows
        ],
    }
    on_policy = [r[LOGP_DIFF] for r in rows if LOGP_DIFF in r and r.get("staleness") == 0]
    if on_policy:  # the same weights on both sides: the gap is the engine's numerics, nothing else
        tolerance = ENGINE_TOLERANCE[args.dtype][1]
        check(
            max(on_policy) <= tolerance,
            f"engine-vs-trainer log-prob difference {max(on_policy):.3g} on "
            f"on-policy steps, above {tolerance}",
        )
        result["logp_diff_on_policy_max"] = max(on_policy)
    else:
        result["logp_diff_on_policy_max"] = f"not logged by this trainer ({LOGP_DIFF})"
    summary = last_json(out)
    if summary:
        result["s_per_step"] = summary.get("seconds_per_step")
    return result


def run_train(ctx, args) -> dict:
    """TRAIN_STEPS steps of the real GRPOTrainer on the saved model; the trained model is kept for weight
    sync."""
    from trainer.grpo import GRPOTrainer

    recipe = trainer_recipe(
        ctx,
        args,
        "run",
        f"train.max_steps={TRAIN_STEPS}",
        "train.learning_rate=1e-2",
        "train.epsilon_high=0.28",
        "train.loss_type=dapo",
        "train.eval_heldout=8",
    )
    # on cuda when there is one
    trainer = GRPOTrainer(recipe, saved_model(ctx), prepared_data(ctx), progress=False)
    sync(args.device)
    t0 = time.perf_counter()
    result = trainer.train()
    sync(args.device)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    check(len(rows) == TRAIN_STEPS, f"{len(rows)} metrics rows for {TRAIN_STEPS} steps")
    for row in rows:
        check(math.isfinite(row["loss"]), f"step {row['step']}: loss is {row['loss']}")
        check(
            math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0,
            f"step {row['step']}: gradient norm is {row['grad_norm']}",
        )
    ctx["trained_model"] = trained = trainer.model
    before = dict(ctx["model"].named_parameters())
    changed = 0
    for name, p in trained.named_parameters():
        check(bool(torch.isfinite(p).all()), f"{name} has non-finite values after training")
        changed += int(not torch.equal(p.detach(), before[name].detach().to(p.device)))
    check(changed >= 0.95 * len(before), f"only {changed} of {len(before)} weight tensors changed")
    last = rows[-1]
    return {
        "steps": len(rows),
        "loss": last["loss"],
        "grad_norm": last["grad_norm"],
        "changed_tensors": changed,
        "tensors": len(before),
        "reward": last["reward"],
        "seconds": seconds,
        "s_per_step": result.seconds_per_step,
        "heldout_accuracy": result.heldout_after.get("accuracy"),
    }


def run_deepspeed(ctx, args) -> dict:
    """`grpoflow train train.deepspeed=zero2` with one trainer rank (the transformers engine, synchronous):
    LAYOUT_STEPS steps through DeepSpeed's ZeRO optimizer, whose shards the checkpoint must hold."""
    overrides = ["train.deepspeed=zero2", "rollout.engine=transformers", "rollout.async=false"]
    if args.device.startswith("cuda"):
        overrides.append("rollout.train_devices=[0]")
    where = "GPU 0" if args.device.startswith("cuda") else "cpu (DeepSpeed's CPU accelerator, gloo)"
    result = run_layout(ctx, args, "deepspeed", f"{where}, ZeRO-2, one trainer rank, synchronous", overrides)
    run = Path(ctx["work"]) / "deepspeed" / "run"
    shards = sorted(str(p.relative_to(run)) for p in run.glob("checkpoint-*/zero/**/*") if p.is_file())
    check(bool(shards), f"no ZeRO optimizer shards under {run}/checkpoint-*/zero: did DeepSpeed train?")
    return {**result, "zero_shards": shards}


def one_update(ctx, args, dtype: str, batch) -> dict:
    """One update of the real trainer (`GRPOTrainer.optimize`) on `batch` at MASTER_LR from the saved model,
    computing in `dtype`: the change of the weights AdamW steps (fp32 master weights under bf16) and the
    fraction of the module's own weights (what the forward runs) that moved."""
    from trainer.grpo import GRPOTrainer

    recipe = trainer_recipe(
        ctx,
        args,
        f"masters-{dtype}",
        f"model.dtype={dtype}",
        f"train.learning_rate={MASTER_LR}",
        "train.max_steps=1",
    )
    trainer = GRPOTrainer(recipe, saved_model(ctx), prepared_data(ctx), progress=False)
    trainer.setup()
    stepped = [p for group in trainer.strategy.optimizer.param_groups for p in group["params"]]
    check(
        {p.dtype for p in stepped} == {torch.float32},
        f"{dtype}: AdamW steps {sorted({str(p.dtype) for p in stepped})} weights, expected float32 only",
    )
    before, module_before = flat(stepped), flat(trainer.model.parameters())
    metrics = trainer.optimize(batch)
    sync(args.device)
    module_moved = (flat(trainer.model.parameters()) != module_before).float().mean().item()
    return {"update": flat(stepped) - before, "module_moved": module_moved, "grad_norm": metrics["grad_norm"]}


def run_bf16_masters(ctx, args) -> dict:
    """bf16 training keeps fp32 master weights: one update at lr 1e-6 from the same weights and batch, in bf16
    and in fp32; the two updates must agree within MASTER_TOLERANCE (relative, over all weights)."""
    batch = rollout_batch(ctx["prompts"], ctx["groups"])
    batch.advantages = torch.linspace(-1, 1, len(batch))  # every completion pulls, none of them by zero
    bf16, fp32 = (one_update(ctx, args, dtype, batch) for dtype in ("bfloat16", "float32"))
    reference = fp32["update"]
    check(bool(reference.abs().max() > 0), "the fp32 update moved no weight")
    difference = bf16["update"] - reference
    relative = (difference.norm(1) / reference.norm(1)).item()
    result = {
        "learning_rate": MASTER_LR,
        "weights": reference.numel(),
        "relative_update_difference_l1": relative,
        "tolerance": MASTER_TOLERANCE,
        "relative_update_difference_l2": (difference.norm() / reference.norm()).item(),
        "sign_disagreement_fraction": (bf16["update"].sign() != reference.sign()).float().mean().item(),
        "update_norm_ratio": (bf16["update"].norm() / reference.norm()).item(),
        "masters_moved_fraction": (bf16["update"] != 0).float().mean().item(),
        "fp32_moved_fraction": (reference != 0).float().mean().item(),
        # what the bf16 forward sees move: the masters' change rounded into bf16 (mostly lost at this rate)
        "bf16_module_moved_fraction": bf16["module_moved"],
        "grad_norm": {"bfloat16": bf16["grad_norm"], "float32": fp32["grad_norm"]},
    }
    check(
        relative < MASTER_TOLERANCE,
        f"bf16 update differs from the fp32 one by {relative:.3g} (relative, L1), above {MASTER_TOLERANCE}: "
        f"{json.dumps(result)}",
    )
    return result


def run_bf16_logps(ctx, args) -> dict:
    """Two steps of the real trainer in bf16 with the transformers engine colocated (it generates with the
    trainer's own module): the engine-vs-trainer log-prob gap the trainer logs each step
    (`sampling/sampling_logp_difference/mean`, TRL's name), bounded by the bf16 engine tolerance."""
    from trainer.grpo import GRPOTrainer

    recipe = trainer_recipe(
        ctx,
        args,
        "bf16-colocated",
        "model.dtype=bfloat16",
        "rollout.engine=transformers",
        "rollout.colocate=true",
        "rollout.async=false",
        "train.max_steps=2",
        "train.learning_rate=1e-4",
    )
    result = GRPOTrainer(recipe, saved_model(ctx), prepared_data(ctx), progress=False).train()
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    gaps = [r.get(LOGP_DIFF) for r in rows]
    check(all(g is not None and math.isfinite(g) for g in gaps), f"{LOGP_DIFF} per step: {gaps}")
    bound = TOLERANCE["bfloat16"][1]
    check(max(gaps) <= bound, f"{LOGP_DIFF} per step {gaps}, above {bound} (bf16)")
    return {
        LOGP_DIFF: gaps,
        "bound": bound,
        "temperature": args.temperature,
        "staleness": [r.get("staleness") for r in rows],
        "s_per_step": result.seconds_per_step,
    }


def random_qwen(ctx, args, name: str, shape: dict) -> tuple[str, int]:
    """A Qwen2.5 model of `shape` with random bf16 weights, made on the device and saved with the smoke's
    tokenizer (its ids are a subset of the vocabulary); (path, parameter count)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = ctx["tokenizer"]
    config = Qwen2Config(
        **QWEN_COMMON,
        **shape,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it trains: seconds on a GPU
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    path = os.path.join(ctx["work"], name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return path, count


def full_length_batch(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int):
    """One GRPO group of `n` completions that all run to `completion_len` tokens: the longest micro-batch a
    recipe with these lengths trains on."""
    from trainer.rollout.base import Completion
    from trainer.rollout.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
    completions = [
        Completion(
            torch.randint(3, vocab, (completion_len,), generator=generator).tolist(),
            [-1.0] * completion_len,
            "length",
        )
        for _ in range(n)
    ]
    return RolloutBatch([prompt] * n, completions, torch.linspace(-1, 1, n), torch.ones(n))


def training_peak_gib(ctx, args, recipe, path: str) -> float:
    """GiB of GPU memory the real trainer on `path` holds at its peak over two updates on a full-length batch
    (the second runs its forward and backward beside Adam's states), less what this process held before."""
    import gc

    from trainer.grpo import GRPOTrainer

    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    trainer = GRPOTrainer(recipe, path, prepared_data(ctx), progress=False)
    trainer.setup()
    torch.cuda.reset_peak_memory_stats()  # loading's transient copies are not training
    batch = full_length_batch(
        recipe.train.micro_batch_size,
        recipe.train.max_prompt_length,
        recipe.train.max_completion_length,
        len(ctx["tokenizer"]),
        args.seed,
    )
    for _ in range(2):
        trainer.optimize(batch)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def run_memory_plan(ctx, args) -> dict:
    """The memory plan (`trainer.memory_plan.estimate`) against the measured peak of real training, for random
    models of Qwen2.5-0.5B's and -1.5B's shapes in bf16 (fp32 master weights, AdamW, no reference) on the
    countdown recipe's micro-batch: the plan's trainer parts of device 0 (all but the engine's KV cache)
    within MEMORY_TOLERANCE of `torch.cuda.max_memory_allocated`. Without the plan module the peaks are
    still measured and reported."""
    found = importlib.util.find_spec("trainer.memory_plan") is not None
    memory_plan = importlib.import_module("trainer.memory_plan") if found else None
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    models, errors = {}, []
    for name, shape in QWEN_SHAPES.items():
        path, params = random_qwen(ctx, args, name, shape)
        recipe = trainer_recipe(
            ctx,
            args,
            f"memory-{name}",
            f"model.name_or_path={path}",
            "model.dtype=bfloat16",
            "rollout.engine=transformers",
            "rollout.async=false",
            "train.beta=0.0",
            "train.prompts_per_step=1",
            f"train.num_generations={MEMORY_BATCH['micro_batch_size']}",
            *(f"train.{k}={v}" for k, v in MEMORY_BATCH.items()),
        )
        t0 = time.perf_counter()
        entry = {"parameters": params, "measured_peak_gib": training_peak_gib(ctx, args, recipe, path)}
        entry["seconds"] = time.perf_counter() - t0
        if memory_plan is not None:
            plan = memory_plan.estimate(recipe, gpus=1, gpu_memory_gib=gpu_gib)
            parts = plan["devices"][0]["parts"]
            planned = sum(v for k, v in parts.items() if k != "kv_cache")
            error = (planned - entry["measured_peak_gib"]) / entry["measured_peak_gib"]
            entry.update(
                plan_parts_gib=parts, plan_trainer_gib=planned, relative_error=error, fits=plan["fits"]
            )
            if abs(error) > MEMORY_TOLERANCE:
                errors.append(
                    f"{name}: plan {planned:.2f} GiB vs measured {entry['measured_peak_gib']:.2f} GiB"
                )
        models[name] = entry
        print(f"memory_plan: {name} {json.dumps(entry)}", flush=True)
        shutil.rmtree(path, ignore_errors=True)
    result = {
        "gpu_memory_gib": gpu_gib,
        "batch": MEMORY_BATCH,
        "tolerance": MEMORY_TOLERANCE,
        "models": models,
    }
    if memory_plan is None:
        return {"skipped": "no trainer.memory_plan", **result}
    check(not errors, f"memory plan off by more than {MEMORY_TOLERANCE:.0%}: {'; '.join(errors)}")
    return result


def run_engine(ctx, args, name: str) -> dict:
    """A GPU engine on the saved (untrained) model; weights are then synced from the trained model."""
    from trainer.rollout.base import SamplingParams

    temperature = (
        args.temperature if name == "vllm" else 1.0
    )  # LMDeploy-pytorch reports exact log-probs at T=1
    if name == "vllm":
        from trainer.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            saved_model(ctx),
            gpu_memory_utilization=0.2,
            enable_sleep_mode=True,
            dtype=args.dtype,
            seed=args.seed,
            enforce_eager=True,
            max_model_len=1024,
        )
    else:
        from trainer.rollout.lmdeploy_engine import LMDeployEngine

        engine = LMDeployEngine(
            saved_model(ctx),
            backend="pytorch",
            gpu_memory_utilization=0.2,
            dtype=args.dtype,
            seed=args.seed,
            session_len=1024,
        )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=args.seed)
    t0 = time.perf_counter()
    groups = engine.generate(ctx["prompts"], args.n, sampling)
    seconds = time.perf_counter() - t0
    stats = check_groups(groups, args.prompts, args.n, args.max_tokens, len(ctx["tokenizer"]))
    gap = engine_gap(
        ctx["model"],
        ctx,
        groups,
        temperature,
        args,
        ENGINE_TOLERANCE[args.dtype],
        f"{name} vs trainer forward",
    )
    result = {**stats, "seconds": seconds, "tokens_per_s": stats["tokens"] / seconds, "logprobs": gap}
    ctx.setdefault("engines", {})[name] = (engine, sampling)
    return result


def run_engine_sync(ctx, args, name: str) -> dict:
    engine, sampling = ctx["engines"][name]
    t0 = time.perf_counter()
    engine.sleep(1)
    engine.wake_up(["weights"])
    engine.update_weights(ctx["trained_model"].named_parameters(), version=1)
    engine.wake_up(["kv_cache"])
    sync_seconds = time.perf_counter() - t0
    groups = engine.generate(ctx["prompts"], args.n, sampling)
    check(
        all(c.policy_version == 1 for g in groups for c in g),
        "completions after the sync must carry version 1",
    )
    gap = engine_gap(
        ctx["trained_model"],
        ctx,
        groups,
        sampling.temperature,
        args,
        ENGINE_TOLERANCE[args.dtype],
        f"{name} after weight sync vs trained model",
    )
    return {"sleep_wake_sync_seconds": sync_seconds, "logprobs": gap}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument(
        "--out", default=None, help="JSON result file (default $OUT/smoke.json when OUT is set)"
    )
    for key in ("hidden", "layers", "prompts", "n", "max_tokens", "micro"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument(
        "--engine",
        choices=("vllm", "lmdeploy", "transformers"),
        default=None,
        help="rollout engine of the cuda layouts (default vllm when it imports, else transformers)",
    )
    parser.add_argument(
        "--layout-timeout",
        type=float,
        default=None,
        help="seconds each `grpoflow train` layout may take (default 150 on cuda, 240 on cpu)",
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated checks not to run, e.g. vllm,lmdeploy,deepspeed,"
        "layout_sync,layout_async (the engines share this process; run one at a time if both "
        "misbehave together)",
    )
    args = parser.parse_args(argv)
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        print(
            f"smoke: --device {args.device} but torch {torch.__version__} sees no CUDA device",
            file=sys.stderr,
        )
        return 2
    for key, value in SIZES[kind].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.engine is None:
        args.engine = (
            "vllm" if kind == "cuda" and importlib.util.find_spec("vllm") is not None else "transformers"
        )
    if args.layout_timeout is None:
        args.layout_timeout = 150.0 if kind == "cuda" else 240.0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    result = {
        "device": args.device,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "engine": args.engine,
        "gpu": torch.cuda.get_device_name() if kind == "cuda" else None,
        "gpus": torch.cuda.device_count() if kind == "cuda" else 0,
        "checks": {},
    }
    ctx = {"work": tempfile.mkdtemp(prefix="grpoflow-smoke-")}
    t_start = time.perf_counter()
    try:
        tokenizer, model, prompts = build(args)
    except ModuleNotFoundError as e:
        print(
            f"smoke: cannot build the test model, {e}; infra/gpu/smoke.sh says how to bring pure-Python "
            "packages (math-verify for trainer.bootstrap) to a bare GPU image",
            file=sys.stderr,
        )
        raise
    ctx.update(tokenizer=tokenizer, model=model, prompts=prompts)

    def optional(package: str, reason: str | None = None) -> str | None:
        if reason is None and importlib.util.find_spec(package) is None:
            reason = "not installed"
        return reason

    gpu_only = None if kind == "cuda" else "needs cuda"
    steps = [("generate", run_generate, None), ("logprobs", run_logprobs, None)]
    for name, (_, _, skip) in layouts(args).items():  # first: this process holds little GPU memory yet
        steps.append((name, lambda c, a, n=name: run_layout(c, a, n, *layouts(a)[n][:2]), skip))
    for name in ("vllm", "lmdeploy"):
        steps.append((name, lambda c, a, n=name: run_engine(c, a, n), optional(name, gpu_only)))
    steps.append(("bf16_logps", run_bf16_logps, None))
    steps.append(("bf16_masters", run_bf16_masters, None))
    steps.append(
        ("memory_plan", run_memory_plan, gpu_only and f"{gpu_only}: torch.cuda.max_memory_allocated")
    )
    steps.append(("train", run_train, None))
    for name in ("vllm", "lmdeploy"):
        steps.append(
            (f"{name}_weight_sync", lambda c, a, n=name: run_engine_sync(c, a, n), optional(name, gpu_only))
        )
    steps.append(("deepspeed", run_deepspeed, optional("deepspeed")))

    needs = {
        "logprobs": ("generate",),
        "bf16_masters": ("generate",),
        "vllm": ("generate",),
        "lmdeploy": ("generate",),
        "vllm_weight_sync": ("vllm", "train"),
        "lmdeploy_weight_sync": ("lmdeploy", "train"),
    }
    for name, fn, skip in steps:
        if name in skipped:
            skip = "--skip"
        failed = [d for d in needs.get(name, ()) if not result["checks"].get(d, {}).get("ok")]
        if skip is None and failed:
            skip = f"{' and '.join(failed)} did not pass"
        if skip is not None:
            print(f"{name}: {skip}, skipped", flush=True)
            result["checks"][name] = {"ok": None, "skipped": skip}
            continue
        t0 = time.perf_counter()
        try:
            figures = fn(ctx, args)
            ok = None if "skipped" in figures else True  # ran, but what it compares with is missing
            result["checks"][name] = {"ok": ok, **figures, "wall_s": time.perf_counter() - t0}
            verdict = f"skipped, {figures['skipped']}" if ok is None else "ok"
            print(f"{name}: {verdict} ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the exit status says so
            result["checks"][name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=8),
            }
            print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if kind == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["seconds"] = time.perf_counter() - t_start
    result["ok"] = all(c["ok"] is not False for c in result["checks"].values())
    line = json.dumps(result, default=str)
    print(line, flush=True)
    out = args.out or (os.path.join(os.environ["OUT"], "smoke.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(line + "\n")
    shutil.rmtree(ctx["work"], ignore_errors=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
