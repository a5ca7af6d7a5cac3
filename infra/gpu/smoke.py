#!/usr/bin/env python3
"""GPU smoke check: the rollout engines, their behaviour log-probs, and the real trainer through
`grpoflow train` in the two layouts the GPU recipes use, on a small random model.

Builds a random Qwen2 model (hidden 256, 4 layers on cuda; smaller on cpu) with a tokenizer trained on the
spot by `trainer.bootstrap.build_tokenizer`, so it needs no model download and no bootstrap run. Checks, in
order, each failing loudly:
  generate      HFEngine.generate, batched, n samples per prompt: shapes, finite log-probs <= 0, diverse
                samples
  logprobs      the engine's behaviour log-probs against the trainer's own forward (`trainer.logprobs`) on its
                batch layout (`RolloutBatch.micro_batch`) at the same temperature (default 0.5): max / mean
                abs difference within tolerance, and the mean below 0.3 of the gap to untempered log-probs (so
                log-probs that ignore the temperature fail even on a random model's flat distributions)
  layout_sync   `grpoflow train` (a subprocess, as a user runs it) for 3 steps, synchronous: on cuda one GPU
                with the engine colocated (vLLM when it imports: sleep / wake-up / weight sync every step), on
                cpu the transformers engine. Per step: finite loss and gradient norm, staleness 0, step /
                rollout / train / weight-sync times, and the engine-vs-trainer log-prob difference when the
                trainer logs it (`sampling/sampling_logp_difference/mean`, checked against the engine
                tolerance)
  layout_async  the same, asynchronous: 2 trainer ranks + 1 rollout GPU (3+ GPUs; 1 + 1 on 2 GPUs; skipped on
                one), on cpu 2 gloo trainer ranks + 1 rollout worker. Staleness 0 then 1 (one-step off-policy)
  vllm          (if vllm imports, cuda only) VLLMEngine on the saved model: same log-prob check at T != 1,
                then (after train) sleep(1) / wake_up(["weights"]) / update_weights(trained weights) /
                wake_up(["kv_cache"]) and the check again against the trained model
  lmdeploy      (if lmdeploy imports, cuda only) LMDeployEngine(backend="pytorch"; Ray executor), same checks
                at T = 1
  train         the real `GRPOTrainer` (trainer/grpo.py) in this process for a few steps on the saved model,
                with synthetic addition data and a reward that differs between completions (a random model
                solves nothing): transformers rollout, dapo loss, held-out greedy evaluation, a checkpoint;
                finite losses and gradient norms, finite weights, weights changed (the engines' weight-sync
                checks load these)
  deepspeed     (if deepspeed imports, cuda only) a ZeRO-2 engine around a fresh model, one policy-gradient
                step through the trainer's forward
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
    model = Qwen2ForCausalLM(config).to(args.device, DTYPES[args.dtype])
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


def run_layout(ctx, args, name: str) -> dict:
    """LAYOUT_STEPS steps of `grpoflow train` in layout `name`; checks and prints each step's metrics."""
    description, overrides, _ = layouts(args)[name]
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
    from trainer.recipe import load_recipe

    work = Path(ctx["work"])
    data = prepared_data(ctx)
    recipe = load_recipe(
        None,
        [
            f"model.name_or_path={saved_model(ctx)}",
            f"model.dtype={args.dtype}",
            f"data.out={data}",
            f"train.output_dir={work / 'run'}",
            f"train.max_steps={TRAIN_STEPS}",
            f"train.seed={args.seed}",
            f"train.prompts_per_step={args.prompts}",
            f"train.num_generations={args.n}",
            f"train.micro_batch_size={args.micro}",
            f"train.max_completion_length={args.max_tokens}",
            f"train.temperature={args.temperature}",
            "train.learning_rate=1e-2",
            "train.epsilon_high=0.28",
            "train.loss_type=dapo",
            "train.eval_heldout=8",
            f"rewards=[{{name: {json.dumps(REWARD)}}}]",
        ],
    )
    trainer = GRPOTrainer(recipe, saved_model(ctx), data, progress=False)  # on cuda when there is one
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
    from trainer import loss as L
    from trainer.deepspeed_setup import initialize, zero_config
    from trainer.logprobs import completion_logps

    model = type(ctx["model"])(ctx["model"].config).to(
        args.device
    )  # fresh fp32 weights; DeepSpeed casts them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mb = next(
        micro_batches(
            rollout_batch(ctx["prompts"], ctx["groups"]),
            args.micro,
            ctx["tokenizer"].pad_token_id,
            args.device,
        )
    )
    engine = initialize(
        model,
        optimizer,
        zero_config(stage=2, micro_batch_size=mb.input_ids.shape[0], bf16=args.dtype == "bfloat16"),
    )
    before = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    t0 = time.perf_counter()
    logps, _ = completion_logps(
        engine, mb, args.temperature
    )  # the plain forward: DeepSpeed wraps `forward` only
    advantages = torch.linspace(-1, 1, logps.shape[0], device=logps.device)
    loss = L.masked_mean(-(logps * advantages[:, None]), mb.completion_mask)
    engine.backward(loss)
    engine.step()
    sync(args.device)
    check(math.isfinite(loss.item()), f"ZeRO-2 loss is {loss.item()}")
    changed = sum(
        int(not torch.equal(p.detach().float(), before[n])) for n, p in engine.module.named_parameters()
    )
    check(changed > 0, "no weight changed under ZeRO-2")
    return {"loss": loss.item(), "changed_tensors": changed, "seconds": time.perf_counter() - t0}


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
        steps.append((name, lambda c, a, n=name: run_layout(c, a, n), skip))
    for name in ("vllm", "lmdeploy"):
        steps.append((name, lambda c, a, n=name: run_engine(c, a, n), optional(name, gpu_only)))
    steps.append(("train", run_train, None))
    for name in ("vllm", "lmdeploy"):
        steps.append(
            (f"{name}_weight_sync", lambda c, a, n=name: run_engine_sync(c, a, n), optional(name, gpu_only))
        )
    steps.append(
        (
            "deepspeed",
            run_deepspeed,
            optional(
                "deepspeed",
                None
                if kind == "cuda"
                else "cpu: DeepSpeed's CPU accelerator compiles its shm op first (minutes); "
                "tests/test_deepspeed.py runs ZeRO on CPU",
            ),
        )
    )

    needs = {
        "logprobs": ("generate",),
        "deepspeed": ("generate",),
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
            result["checks"][name] = {"ok": True, **fn(ctx, args)}
            print(f"{name}: ok ({time.perf_counter() - t0:.0f} s)", flush=True)
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
