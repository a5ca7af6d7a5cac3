"""Benchmark: grpoflow's GRPO step next to TRL's GRPOTrainer and next to the machine's limit, in ONE run.

Run with `make bench` (pytest -m bench tests/benchmarks -s) or directly:
`python tests/benchmarks/test_bench_grpo.py`. `BENCH_STEPS` sets the generated batches per side (default 10).

Every side does the same work, one after the other in this process, on the same tiny base model
(`bootstrap()`, cached under `.state/models/tiny-base`) and the same prepared data: 4 prompts x 8
generations = 32 sampled completions of at most 24 tokens per generated batch (pinned here), with the
learning rate, schedule, temperature, loss type, clipping and weighted rewards of `configs/tiny-cpu.yaml`,
mu = 1 unless said otherwise.

1. grpoflow, mu=1: seconds per generated batch = mean `timing/step_s` of metrics.jsonl, the first step left
   out (warm-up); held-out greedy accuracy after training (`TrainResult.heldout_after`).
2. TRL's GRPOTrainer, mu=1, configured to the same work (32 completions per generation, float32, no
   gradient checkpointing, constant lr, beta 0, nothing saved or evaluated during training). TRL counts
   optimizer steps, so it runs `steps * mu` of them; a callback timestamps every optimizer step and the
   time per generated batch is the wall time between the ends of consecutive groups of mu steps (so it
   includes TRL's data loading and logging), the first group left out. Its trained model is scored with
   grpoflow's own `evaluate_greedy` on the same held-out rows, so the accuracy metric is identical.
3. The limit: plain `model.generate` (sampling, same max_new_tokens, 4 prompts x num_return_sequences=8)
   plus ONE forward+backward over the same 32 prompt+completion sequences, mean over repeats after a
   warm-up: the bare work of a step done with plain transformers calls. It is a reference, not a hard
   floor: `generate` has per-token overhead that a trainer with its own decode loop (ours) can avoid.
4. grpoflow with mu=4 on the same batches: seconds per step and the ratio to mu=1.

Nothing here asserts a time: the test checks that every side ran and produced numbers, and prints ratios.
Each side also reports `other%`, the share of the machine's CPU that other processes used while it ran
(from /proc/stat, this process and its children left out): on 2 shared cores a concurrent job slows
2-thread torch many times over, so only a run with other% near 0 on every side is worth quoting.
The numbers are also written to `.state/bench/grpo.json`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # when run as a script
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"
BASE_MODEL_DIR = REPO_ROOT / ".state" / "models" / "tiny-base"
RESULT_JSON = REPO_ROOT / ".state" / "bench" / "grpo.json"
HELDOUT_ROWS = 128
# The work is pinned (the recipe's shape may move); everything else (lr, temperature, loss, rewards) is the recipe's.
PROMPTS_PER_STEP, NUM_GENERATIONS, MAX_COMPLETION_LENGTH = 4, 8, 24
MU_HIGH = 4
LIMIT_REPEATS = 5


def bench_steps() -> int:
    return int(os.environ.get("BENCH_STEPS", "10"))


# ------------------------------------------------------------------------------------------ shared setup
def make_recipe(work: Path, steps: int, extra: list[str] = ()):
    from trainer.recipe import load_recipe

    return load_recipe(CONFIG, [f"train.max_steps={steps}", f"train.eval_heldout={HELDOUT_ROWS}",
                                f"train.prompts_per_step={PROMPTS_PER_STEP}",
                                f"train.num_generations={NUM_GENERATIONS}",
                                f"train.max_completion_length={MAX_COMPLETION_LENGTH}",
                                # one forward/backward per update, as TRL's per_device_train_batch_size below
                                f"train.micro_batch_size={PROMPTS_PER_STEP * NUM_GENERATIONS}",
                                f"bootstrap.out={BASE_MODEL_DIR}", f"data.out={work / 'data'}",
                                f"train.output_dir={work / 'unused'}", *extra])


def prepare_inputs(recipe) -> tuple[str, Path]:
    """The base model (a cache hit after the first time) and the prepared data of the recipe."""
    from data.prepare import prepare
    from trainer.bootstrap import bootstrap

    model = bootstrap(recipe.bootstrap, out=recipe.bootstrap.out, system_prompt=recipe.data.system_prompt,
                      progress=False)
    prepare(**recipe.data.prepare_kwargs())
    return model["path"], Path(recipe.data.out)


def mean_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return statistics.fmean(rest) if rest else math.nan


class OtherCPU:
    """Share of the machine's CPU time that OTHER processes used while a side ran (Linux /proc/stat).

    Speed is only comparable side by side if this stays near 0 for every side; the run prints it."""

    def __enter__(self):
        self.busy, self.own, self.wall = _busy_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.wall
        others = (_busy_s() - self.busy) - (_own_cpu_s() - self.own)
        self.share = max(0.0, others) / (wall * (os.cpu_count() or 1)) if wall > 0 else math.nan


def _busy_s() -> float:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its children, reaped or alive (the math grader worker lives on)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _live_descendants_cpu_s(os.getpid())


def _live_descendants_cpu_s(root: int) -> float:
    stats = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime+stime
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def median_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return statistics.median(rest) if rest else math.nan


# ------------------------------------------------------------------------------------------------- ours
def run_ours(recipe_args: tuple, model_path: str, data_dir: Path, mu: int, out_dir: Path,
             asynchronous: bool = False) -> dict:
    from trainer.grpo import GRPOTrainer

    work, steps = recipe_args
    recipe = make_recipe(work, steps, [f"train.num_iterations={mu}", f"train.output_dir={out_dir}",
                                       f"rollout.async={str(asynchronous).lower()}"])
    started = time.perf_counter()
    result = GRPOTrainer(recipe, model_path, data_dir, progress=False).train()
    total = time.perf_counter() - started
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines() if line.strip()]
    step_s = [r["timing/step_s"] for r in rows]
    return {
        "steps": len(rows),
        "num_iterations": mu,
        "s_per_step": mean_after_first(step_s),
        "median_s_per_step": median_after_first(step_s),
        "step_s": step_s,
        "rollout_s": mean_after_first([r["timing/rollout_s"] for r in rows]),
        "reward_s": mean_after_first([r["timing/reward_s"] for r in rows]),
        "train_s": mean_after_first([r["timing/train_s"] for r in rows]),
        "completion_mean_length": statistics.fmean(r["completions/mean_length"] for r in rows),
        "heldout_before": result.heldout_before.get("accuracy"),
        "heldout_after": result.heldout_after.get("accuracy"),
        "wall_s": total,
        **({"trainer_idle_fraction": mean_after_first([r["trainer_idle_fraction"] for r in rows]),
            "rollout_idle_fraction": mean_after_first([r["rollout_idle_fraction"] for r in rows]),
            "weight_sync_s": mean_after_first([r["timing/weight_sync_s"] for r in rows])} if asynchronous else {}),
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
        calls.append({"completions": len(completions),
                      "prompts": len({json.dumps(p, sort_keys=True) for p in prompts})})
        return fn(prompts, completions, **columns)
    return wrapped


def run_trl(recipe_args: tuple, model_path: str, data_dir: Path, mu: int, out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig
    from trl import GRPOTrainer as TRLGRPOTrainer

    from data.prepare import load_prepared
    from trainer.heldout import evaluate_greedy
    from trainer.rewards import accuracy_reward, format_reward, resolve_reward
    from trainer.rollout.hf_engine import HFEngine

    work, steps = recipe_args
    recipe = make_recipe(work, steps)
    cfg = recipe.train
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    train_rows = load_prepared(data_dir, "train")
    heldout_rows = load_prepared(data_dir, "heldout")[:cfg.eval_heldout]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])

    calls: list[dict] = []
    reward_funcs = [resolve_reward(s.name, s.args) for s in recipe.rewards]
    reward_funcs[0] = _counting(reward_funcs[0], calls)  # TRL calls every reward once per generated batch
    stamps: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
        num_generations=cfg.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=cfg.max_completion_length,
        num_iterations=mu,
        max_steps=steps * mu,
        beta=cfg.beta,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
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
        activation_checkpointing=False,  # TRL defaults to True (as gradient_checkpointing); we do not recompute
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in ("", "transformers", "trl", "accelerate")]
    for logger in loggers:
        logger.addHandler(collect)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = TRLGRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                                     processing_class=tokenizer, callbacks=[Timer()])
            started = time.perf_counter()
            trainer.train()
            total = time.perf_counter() - started
    finally:
        for logger in loggers:
            logger.removeHandler(collect)
    m = trainer.model
    setup = {"generation_batch_size": trainer.args.generation_batch_size,
             "steps_per_generation": trainer.args.steps_per_generation, "bf16": trainer.args.bf16,
             "activation_checkpointing": bool(getattr(m, "is_activation_checkpointing", False)),
             "dtype": str(next(m.parameters()).dtype)}
    notes = sorted({f"{w.category.__name__}: {w.message}" for w in caught} | set(collect.messages))

    # per generated batch: from the end of one group of mu optimizer steps to the end of the next
    ends = stamps[0::mu] if len(stamps) == steps * mu + 1 else []
    per_generation = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    history = [h for h in trainer.state.log_history if "completions/mean_length" in h]

    trained = trainer.model
    trained.eval()
    engine = HFEngine(trained, tokenizer)
    heldout = evaluate_greedy(engine, tokenizer, heldout_rows, accuracy_reward, format_reward,
                              max_tokens=cfg.max_completion_length, max_prompt_length=cfg.max_prompt_length)
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
        "completion_mean_length": (statistics.fmean(h["completions/mean_length"] for h in history)
                                   if history else math.nan),
        "trl_step_time_mean": (statistics.fmean(h["step_time"] for h in trainer.state.log_history
                                                if "step_time" in h) if history else math.nan),
        "heldout_after": heldout["accuracy"],
        "wall_s": total,
        "setup": setup,
        "notes": notes,
    }


# ------------------------------------------------------------------------------------------------ limit
def run_limit(recipe_args: tuple, model_path: str, data_dir: Path, repeats: int = LIMIT_REPEATS) -> dict:
    """generate (HF, sampling) + one forward/backward over the same 32 sequences; mean after one warm-up."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.prepare import load_prepared
    from trainer.prompts import encode_prompts
    from trainer.rollout_source import prompt_indices

    work, steps = recipe_args
    cfg = make_recipe(work, steps).train
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
            out = model.generate(**enc, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                 max_new_tokens=cfg.max_completion_length,
                                 num_return_sequences=cfg.num_generations, eos_token_id=eos, pad_token_id=pad)
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
        logits = model(input_ids=out, attention_mask=attn, position_ids=positions,
                       logits_to_keep=completion.shape[1] + 1, use_cache=False).logits[:, :-1]
        logps = torch.log_softmax(logits.float() / cfg.temperature, -1).gather(-1, completion[..., None])[..., 0]
        loss = -(logps * c_mask).sum() / c_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        gen_s.append(t1 - t0)
        fwd_bwd_s.append(t2 - t1)
        lengths.append(float(c_mask.sum(1).float().mean()))
    generate, fwd_bwd = mean_after_first(gen_s), mean_after_first(fwd_bwd_s)
    totals = [g + f for g, f in zip(gen_s, fwd_bwd_s, strict=True)]
    return {"s_per_step": generate + fwd_bwd, "median_s_per_step": median_after_first(totals),
            "step_s": totals, "generate_s": generate, "fwd_bwd_s": fwd_bwd,
            "sequences": int(out.shape[0]), "repeats": repeats,
            "completion_mean_length": statistics.fmean(lengths[1:])}


# -------------------------------------------------------------------------------------------- the whole
def run_benchmark(work: Path, steps: int | None = None) -> dict:
    import torch

    steps = steps or bench_steps()
    work = Path(work)
    recipe = make_recipe(work, steps)
    model_path, data_dir = prepare_inputs(recipe)
    threads = torch.get_num_threads()
    from transformers import AutoModelForCausalLM
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    args = (work, steps)

    sides = {}
    for name, run in (("grpoflow_mu1", lambda: run_ours(args, model_path, data_dir, 1, work / "ours-mu1")),
                      ("trl_mu1", lambda: run_trl(args, model_path, data_dir, 1, work / "trl-mu1")),
                      ("limit", lambda: run_limit(args, model_path, data_dir)),
                      ("grpoflow_mu4", lambda: run_ours(args, model_path, data_dir, MU_HIGH, work / "ours-mu4")),
                      ("grpoflow_async", lambda: run_ours(args, model_path, data_dir, 1, work / "ours-async", True))):
        with OtherCPU() as meter:
            sides[name] = run()
        sides[name]["other_cpu_share"] = meter.share
    ours, trl, limit, ours_mu4 = sides["grpoflow_mu1"], sides["trl_mu1"], sides["limit"], sides["grpoflow_mu4"]
    ours_async = sides["grpoflow_async"]
    cfg = recipe.train
    report = {
        "work": {"prompts_per_step": cfg.prompts_per_step, "num_generations": cfg.num_generations,
                 "max_completion_length": cfg.max_completion_length, "steps": steps,
                 "learning_rate": cfg.learning_rate, "parameters": params, "threads": threads,
                 "threads_after": torch.get_num_threads(), "heldout_rows": HELDOUT_ROWS,
                 "torch": torch.__version__, "trl": _version("trl"), "transformers": _version("transformers")},
        "grpoflow_mu1": ours,
        "trl_mu1": trl,
        "limit": limit,
        "grpoflow_mu4": ours_mu4,
        "grpoflow_async": ours_async,
        "ratios": {
            "async_over_sync": ours_async["s_per_step"] / ours["s_per_step"],
            "async_over_trl": ours_async["s_per_step"] / trl["s_per_step"],
            "grpoflow_over_trl": ours["s_per_step"] / trl["s_per_step"],
            "trl_over_grpoflow": trl["s_per_step"] / ours["s_per_step"],
            "grpoflow_over_limit": ours["s_per_step"] / limit["s_per_step"],
            "trl_over_limit": trl["s_per_step"] / limit["s_per_step"],
            "mu4_over_mu1": ours_mu4["s_per_step"] / ours["s_per_step"],
        },
    }
    RESULT_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESULT_JSON.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    return report


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package)


def format_table(r: dict) -> str:
    w, ours, trl, limit, mu4, x = r["work"], r["grpoflow_mu1"], r["trl_mu1"], r["limit"], r["grpoflow_mu4"], r["ratios"]

    def row(name, side=None, acc=None, note=""):
        s_step = f"{side['s_per_step']:8.3f}{side['median_s_per_step']:8.3f}" if side else " " * 16
        acc_s = f"{acc:10.3f}" if acc is not None else " " * 10
        tokens = f"{side['completion_mean_length']:8.1f}{100 * side['other_cpu_share']:8.0f}" if side else " " * 16
        return f"{name:26s}{s_step}{acc_s}{tokens}   {note}".rstrip()

    lines = [
        "",
        f"work: {w['prompts_per_step']} prompts x {w['num_generations']} generations, "
        f"<={w['max_completion_length']} completion tokens, {w['steps']} steps, "
        f"model {w['parameters'] / 1e6:.2f}M params, {w['threads']} CPU threads, lr {w['learning_rate']:g}",
        f"s/step: wall seconds per generated batch, mean (and median) of steps 2..{w['steps']}; acc: greedy "
        f"held-out accuracy on {w['heldout_rows']} rows; tokens: mean completion length",
        "other%: share of the machine's CPU that other processes used meanwhile (above a few %: noisy)",
        f"{'':26s}{'s/step':>8s}{'median':>8s}{'acc':>10s}{'tokens':>8s}{'other%':>8s}",
        row("base model (before)", acc=ours["heldout_before"]),
        row("grpoflow (mu=1)", ours, ours["heldout_after"],
            f"rollout {ours['rollout_s']:.3f} + reward {ours['reward_s']:.3f} + train {ours['train_s']:.3f} s"),
        row("TRL GRPOTrainer (mu=1)", trl, trl["heldout_after"]),
        f"{'ratio grpoflow/TRL':26s}{x['grpoflow_over_trl']:8.3f}{'':34s}   TRL = {x['trl_over_grpoflow']:.1f}x grpoflow",
        row("limit (generate+fwd/bwd)", limit, None,
            f"grpoflow = {x['grpoflow_over_limit']:.2f}x limit, TRL = {x['trl_over_limit']:.2f}x limit "
            f"(generate {limit['generate_s']:.3f} + fwd/bwd {limit['fwd_bwd_s']:.3f} s)"),
        row("grpoflow (mu=4)", mu4, mu4["heldout_after"], f"mu4/mu1 = {x['mu4_over_mu1']:.2f}x"),
        row("grpoflow async (mu=1)", r["grpoflow_async"], r["grpoflow_async"]["heldout_after"],
            f"async/sync = {x['async_over_sync']:.2f}x, async/TRL = {x['async_over_trl']:.2f}x; idle: trainer "
            f"{r['grpoflow_async']['trainer_idle_fraction']:.0%}, rollout {r['grpoflow_async']['rollout_idle_fraction']:.0%}; "
            f"weight sync {r['grpoflow_async']['weight_sync_s'] * 1000:.0f} ms"),
        f"TRL check: {trl['generations']} generations, completions per generation "
        f"{trl['completions_per_generation']}, distinct prompts per generation {trl['prompts_per_generation']}, "
        f"{trl['optimizer_steps']} optimizer steps; its own step_time metric (mean incl. step 1) {trl['trl_step_time_mean']:.3f} s; "
        f"{trl['setup']}",
        f"written to {RESULT_JSON}",
    ]
    if trl["notes"]:
        lines.append("TRL warnings:")
        lines += [f"  - {n[:300]}" for n in trl["notes"]]
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_grpo(tmp_path):
    r = run_benchmark(tmp_path)
    steps = r["work"]["steps"]
    for side in ("grpoflow_mu1", "trl_mu1", "limit", "grpoflow_mu4", "grpoflow_async"):
        assert math.isfinite(r[side]["s_per_step"]) and r[side]["s_per_step"] > 0, side
    for side in ("grpoflow_mu1", "trl_mu1", "grpoflow_mu4"):
        assert 0.0 <= r[side]["heldout_after"] <= 1.0, side
    assert r["grpoflow_mu1"]["steps"] == r["grpoflow_mu4"]["steps"] == r["grpoflow_async"]["steps"] == steps
    # the comparison is only fair if TRL did the same work per generation
    work = r["work"]
    assert r["trl_mu1"]["generations"] == steps
    assert r["trl_mu1"]["completions_per_generation"] == [work["prompts_per_step"] * work["num_generations"]]
    assert r["trl_mu1"]["prompts_per_generation"] == [work["prompts_per_step"]]


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        run_benchmark(Path(tmp))
