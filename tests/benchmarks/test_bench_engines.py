"""Benchmark, the engine axis: grpoflow's rollouts on transformers next to vLLM, sync and async, in ONE run.

It needs vLLM, so it runs in the vLLM venv (vLLM's CPU build, made by `make install-vllm`):
`GRPOFLOW_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -m bench tests/benchmarks/test_bench_engines.py -s`,
or `.venv-vllm/bin/python tests/benchmarks/test_bench_engines.py`. Without vLLM the module is skipped (as
under `make bench` in the main venv), unless GRPOFLOW_REQUIRE_VLLM=1, which makes a missing vLLM a failure.
Knobs: BENCH_STEPS (generated batches per side per round, default 6 here: the wide model's steps are long and
steady), BENCH_REPEATS (rounds, default 3), BENCH_MODELS (default "tiny,wide"), BENCH_TRL_VLLM (default 1:
TRL's GRPOTrainer on vLLM as a side; 0 leaves it out), BENCH_WIDE_TOKENS (the wide model's completion budget,
default 64). Measured on this 2-core machine: a round of the wide
model takes about 8.5 min at 6 steps (TRL's side 3.5 min of it), of the tiny one about 2 min; the defaults,
about 32 min.

The work is test_bench_grpo's (`pinned_recipe`: 4 prompts x 8 generations per batch, configs/tiny-cpu.yaml for
everything else, its prepared data), with 16 held-out rows, on two models with the same tokenizer:
- tiny: the bootstrapped base model (.state/models/tiny-base, 0.9M parameters), completions <= 24 tokens;
- wide: a Qwen2 of hidden size 512, 8 layers, 8 heads (head_dim 64: vLLM's CPU attention wants >= 32), FFN
  1024, tied embeddings, random weights (seed 0), made in the run's tmp dir; completions <= 64 tokens
  (BENCH_WIDE_TOKENS). It learns nothing; it is there so that the model's arithmetic, not per-token Python
  overhead, sets the pace.

Sides per model, each a whole `GRPOTrainer(...).train()` (test_bench_grpo's `run_ours`): sync transformers,
sync vLLM (enforce_eager), async vLLM and async transformers (one rollout worker process; trainer and worker
get one core each); and TRL (below). Per run: the median over steps 2..N (step 1 holds vLLM's warm-up) of
`timing/step_s`, of `timing/rollout_s` and of rollout tokens/s = prompts x generations x mean completion
length / rollout_s. Sync vLLM's rollout_s includes the weight update into the engine; async's is the worker's
generation time. The sides run in rounds, alternated (A B C D E, then E D C B A, ...;
tests/benchmarks/side_by_side.py), BENCH_REPEATS rounds per model; a side's figure is the median over its
rounds. Ratios are computed within each round and then medianed over rounds: s/step vLLM/transformers (sync,
async), async/sync per engine, grpoflow sync and async vLLM/TRL on vLLM (the aim: <= 0.5), and
vLLM/transformers of sync rollout tokens/s. `other%` (the CPU other processes used meanwhile) is kept per run.

Every run starts with the thread count the process started with (side_by_side.run_rounds): building an
in-process vLLM replaces `torch.set_num_threads` with a no-op for the whole process (infra/vllm-cpu-notes.md,
section 4) and an async run sets the trainer to one thread; both are put back between runs, as a fresh process
would have them.

TRL: test_bench_grpo's TRL side (`run_trl` with `pinned_trl_args`) given use_vllm=True, vllm_mode="colocate",
run in a child process each round (its vLLM initialises torch.distributed in the process it runs in; the
child's start-up is outside its step times, not outside its other%). TRL leaves vLLM's dtype on "auto",
bfloat16 on CPU (notes, section 4), so its rollouts are not float32 as ours are. Where oneDNN packs the
weights, vLLM drops each linear layer's weight and TRL 1.16's per-parameter `load_weights` fails at its first
weight sync ("'Parameter' object has no attribute 'weight_loader'", notes section 2a). A failure is recorded
in the JSON (error and the traceback's tail) and printed, not raised; a side that failed is not retried in
later rounds.

Nothing here asserts a time: the test checks that every side ran and gave finite numbers, and prints a table
and ratios. The numbers go to `.state/bench/engines.json`, the per-round ratios to
`engines_ratios_<model>.png`.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # side_by_side and test_bench_grpo, beside this file

from side_by_side import (  # noqa: E402
    BENCH_OUT,
    REPO_ROOT,
    bench_repeats,
    bench_steps,
    env_int,
    format_ratio,
    max_other,
    median_over,
    plot_round_ratios,
    round_ratio,
    run_rounds,
    write_json,
)
from test_bench_grpo import pinned_recipe, pinned_trl_args, prepare_inputs, run_ours, run_trl  # noqa: E402

if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests"))
from conftest import require_vllm  # noqa: E402

require_vllm("run this benchmark with .venv-vllm/bin/python (make bench)")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default asks for 90% of all RAM

RESULT_JSON = BENCH_OUT / "engines.json"
HELDOUT_ROWS = 16
# the wide model's completions: BENCH_WIDE_TOKENS (default 64; 256 makes generation most of a step, and a
# round about 4x longer)
COMPLETION_TOKENS = {"tiny": 24, "wide": env_int("BENCH_WIDE_TOKENS", 64)}
WIDE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
SIDES = {  # in the order of the first round; recipe overrides
    "sync_transformers": ["rollout.engine=transformers", "rollout.async=false"],
    "sync_vllm": ["rollout.engine=vllm", "rollout.enforce_eager=true", "rollout.async=false"],
    "async_vllm": ["rollout.engine=vllm", "rollout.enforce_eager=true", "rollout.async=true"],
    "async_transformers": ["rollout.engine=transformers", "rollout.async=true"],
}
TRL_SIDE = "trl_vllm"
ENGINE_STEPS = 6  # BENCH_STEPS' default here (test_bench_grpo: 10)
LABELS = {
    "sync_transformers": "sync transformers",
    "sync_vllm": "sync vLLM",
    "async_vllm": "async vLLM",
    "async_transformers": "async transformers",
    TRL_SIDE: "TRL + vLLM colocate",
}
RATIOS = {  # label: (numerator side, denominator side, per-run figure)
    "vLLM/transformers sync": ("sync_vllm", "sync_transformers", "median_s_per_step"),
    "vLLM/transformers async": ("async_vllm", "async_transformers", "median_s_per_step"),
    "async/sync transformers": ("async_transformers", "sync_transformers", "median_s_per_step"),
    "async/sync vLLM": ("async_vllm", "sync_vllm", "median_s_per_step"),
    "rollout tok/s vLLM/transformers sync": ("sync_vllm", "sync_transformers", "median_rollout_tokens_per_s"),
    "grpoflow sync vLLM/TRL vLLM": ("sync_vllm", TRL_SIDE, "median_s_per_step"),
    "grpoflow async vLLM/TRL vLLM": ("async_vllm", TRL_SIDE, "median_s_per_step"),
}
TRL_AIM = 0.5  # the aim: with vLLM, our step time at most half of TRL's on the same work


def bench_models() -> list[str]:
    names = [n.strip() for n in os.environ.get("BENCH_MODELS", "tiny,wide").split(",") if n.strip()]
    unknown = sorted(set(names) - set(COMPLETION_TOKENS))
    if unknown or not names:
        raise ValueError(
            f"BENCH_MODELS={os.environ.get('BENCH_MODELS')!r}: expected names from "
            f"{sorted(COMPLETION_TOKENS)}, comma-separated"
        )
    return names


def trl_vllm_enabled() -> bool:
    return os.environ.get("BENCH_TRL_VLLM", "1").strip() != "0"


def model_overrides(model: str) -> list[str]:
    return [f"train.max_completion_length={COMPLETION_TOKENS[model]}", f"train.eval_heldout={HELDOUT_ROWS}"]


# ----------------------------------------------------------------------------------------------- models
def make_wide_model(base: str, out: Path) -> str:
    """WIDE's shape with tiny-base's tokenizer, vocabulary, special tokens and tied embeddings; seed 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(
        base, **WIDE, layer_types=["full_attention"] * WIDE["num_hidden_layers"]
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(base) / name).exists():  # not manifest.json: its checksums are tiny-base's
            shutil.copy(Path(base) / name, out / name)
    model.save_pretrained(out)
    return str(out)


def parameters(model_path: str) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())


# ------------------------------------------------------------------------------------------------ a run
def rss_gib() -> float:
    """This process' resident memory: engines of earlier runs that were not freed would show here."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def release_memory() -> None:
    """Free the finished run's in-process vLLM (its 1 GiB KV cache) before the next is built. vLLM's engine
    core calls gc.freeze() when built and gc.unfreeze() only in its shutdown, which the trainer does not call:
    frozen, the engine is never collected, and every vLLM run would add about 1.3 GiB to this process."""
    gc.unfreeze()
    gc.collect()


def run_side(
    work: Path, steps: int, model: str, model_path: str, data_dir: Path, side: str, out_dir: Path
) -> dict:
    recipe = pinned_recipe(
        work, steps, [*model_overrides(model), f"train.output_dir={out_dir}", *SIDES[side]]
    )
    run = run_ours(recipe, model_path, data_dir)
    release_memory()
    return {**run, "setup_s": run["wall_s"] - sum(run["step_s"]), "rss_gib_after": rss_gib()}


# -------------------------------------------------------------------------------------------------- TRL
def trl_vllm_side(work: Path, steps: int, model: str, model_path: str, data_dir: Path) -> dict:
    """TRL's GRPOTrainer with vLLM colocated, in this process (the child that `run_trl_vllm` starts)."""
    recipe = pinned_recipe(work, steps, model_overrides(model))
    args = {
        **pinned_trl_args(recipe, 1),
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_enable_sleep_mode": False,
    }
    try:
        return run_trl(recipe, model_path, data_dir, work / f"trl-vllm-{model}", args)
    except Exception as e:  # a benchmark side that cannot run here is a finding, not a crash
        return {"error": f"{type(e).__name__}: {e}"[:4000], "traceback": traceback.format_exc()[-6000:]}


def run_trl_vllm(
    work: Path, steps: int, model: str, model_path: str, data_dir: Path, round_index: int
) -> dict:
    """`trl_vllm_side` in a fresh Python process; its JSON back, or why there is none."""
    out = work / f"trl-vllm-{model}-{round_index}.json"
    spec = {
        "work": str(work),
        "steps": steps,
        "model": model,
        "model_path": model_path,
        "data_dir": str(data_dir),
        "out": str(out),
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--trl-vllm", json.dumps(spec)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not out.exists():
        return {
            "error": f"the child process exited with {proc.returncode} and no result",
            "traceback": (proc.stdout + proc.stderr)[-6000:],
            "process_s": time.perf_counter() - started,
        }
    return {**json.loads(out.read_text()), "process_s": time.perf_counter() - started}


def _trl_vllm_child(spec: dict) -> None:
    result = trl_vllm_side(
        Path(spec["work"]), spec["steps"], spec["model"], spec["model_path"], Path(spec["data_dir"])
    )
    Path(spec["out"]).write_text(json.dumps(result, default=str))


def skipping_after_failure(side):
    """A side that failed once (recorded) is not run again: the same error would cost a vLLM build per
    round."""
    failed: list[dict] = []

    def run(r: int) -> dict:
        if failed:
            return {"error": f"not retried: failed in round {failed[0]['round'] + 1}", "skipped": True}
        result = side(r)
        if "error" in result:
            failed.append({**result, "round": r})
        return result

    return run


# -------------------------------------------------------------------------------------------- the whole
def run_benchmark(work: Path, steps: int | None = None, repeats: int | None = None) -> dict:
    import torch
    import vllm

    steps, repeats, work = steps or bench_steps(ENGINE_STEPS), repeats or bench_repeats(), Path(work)
    names = bench_models()
    recipe = pinned_recipe(work, steps)
    tiny_path, data_dir = prepare_inputs(recipe)
    paths = {"tiny": tiny_path}
    if "wide" in names:
        paths["wide"] = make_wide_model(tiny_path, work / "wide-model")
    with_trl = trl_vllm_enabled()

    started, models = time.perf_counter(), {}
    for model in names:

        def side(name: str, model=model):
            return lambda r: run_side(
                work, steps, model, paths[model], data_dir, name, work / f"{model}-{name}-{r}"
            )

        sides = {name: side(name) for name in SIDES}
        if with_trl:
            sides[TRL_SIDE] = skipping_after_failure(
                lambda r, model=model: run_trl_vllm(work, steps, model, paths[model], data_dir, r)
            )
        model_started = time.perf_counter()
        runs = run_rounds(sides, repeats, after_each=release_memory)
        ratios = {
            label: round_ratio(runs, num, den, key)
            for label, (num, den, key) in RATIOS.items()
            if num in runs and den in runs
        }
        models[model] = {
            "path": paths[model],
            "parameters": parameters(paths[model]),
            "max_completion_length": COMPLETION_TOKENS[model],
            "elapsed_s": time.perf_counter() - model_started,
            "sides": {name: summarize(runs[name]) for name in runs},
            "ratios": ratios,
        }
        models[model]["plot"] = plot_round_ratios(
            BENCH_OUT / f"engines_ratios_{model}.png",
            f"engines, {model} model: {repeats} rounds x {steps} steps, per-round ratios",
            ratios,
            {label: TRL_AIM for label, (num, den, _) in RATIOS.items() if den == TRL_SIDE},
        )
    cfg = recipe.train
    report = {
        "work": {
            "prompts_per_step": cfg.prompts_per_step,
            "num_generations": cfg.num_generations,
            "steps": steps,
            "repeats": repeats,
            "heldout_rows": HELDOUT_ROWS,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "elapsed_s": time.perf_counter() - started,
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "transformers": version("transformers"),
            "trl": version("trl"),
            "trl_vllm": with_trl,
        },
        "ratio_method": "per round: the two sides' medians over steps 2..N; then the median over rounds",
        "models": models,
    }
    write_json(RESULT_JSON, report)
    print(format_table(report))
    return report


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    keys = (
        "median_s_per_step",
        "median_rollout_s",
        "median_rollout_tokens_per_s",
        "completion_mean_length",
        "setup_s",
        "process_s",
    )
    return {
        **{key: median_over(ok, key) for key in keys},
        "other_cpu_share_max": max_other(runs),
        "errors": [
            {
                "round": r["round"],
                "error": r["error"],
                **({"traceback": r["traceback"]} if "traceback" in r else {}),
            }
            for r in runs
            if "error" in r and not r.get("skipped")
        ],
        "runs": runs,
    }


def format_table(r: dict) -> str:
    w = r["work"]
    lines = [
        "",
        f"engines: {w['prompts_per_step']} prompts x {w['num_generations']} generations per batch, "
        f"{w['steps']} steps per side per round, {w['repeats']} rounds alternated (A B C .. C B A ..), "
        f"{w['threads']} CPU threads; vLLM {w['vllm']}, torch {w['torch']}, "
        f"transformers {w['transformers']}, trl {w['trl']}; {w['elapsed_s'] / 60:.1f} min",
        f"s/step, rollout: seconds per step and in rollout, median of steps 2..{w['steps']}, then median "
        "over rounds; tok/s: rollout tokens per second; tokens: mean completion length; roll%: "
        "rollout_s / step s (async: the worker generates while the trainer trains, so up to 100% is hidden "
        "and above 100% is possible)",
        "setup: run wall time outside the steps (model load, engine build, held-out eval, save); other%: CPU "
        "other processes used during each run (above a few %: noisy)",
    ]
    for name, m in r["models"].items():
        lines += [
            "",
            f"{name} ({m['parameters'] / 1e6:.2f}M params, <={m['max_completion_length']} completion tokens; "
            f"{m['elapsed_s'] / 60:.1f} min)",
            f"{'':22s}{'s/step':>8s}{'rollout':>9s}{'tok/s':>9s}{'tokens':>8s}{'roll%':>7s}{'setup':>8s}"
            f"  {'other%':>10s}  s/step per round",
        ]
        for side, s in m["sides"].items():
            others = " ".join(f"{100 * run['other_cpu_share']:.0f}" for run in s["runs"])
            each = " ".join("-" if "error" in run else f"{run['median_s_per_step']:.3f}" for run in s["runs"])
            if not math.isfinite(s["median_s_per_step"]):
                lines.append(f"{LABELS[side]:22s}{'failed':>8s}{'':49s}  {others:>10s}  {each}")
                continue
            if side == TRL_SIDE:  # TRL reports no rollout time; its start-up runs in a child process
                lines.append(
                    f"{LABELS[side]:22s}{s['median_s_per_step']:8.3f}{'':18s}"
                    f"{s['completion_mean_length']:8.1f}{'':15s}  {others:>10s}  {each}   (child process "
                    f"{s['process_s']:.0f} s; vLLM dtype auto: bf16 on CPU)"
                )
                continue
            lines.append(
                f"{LABELS[side]:22s}{s['median_s_per_step']:8.3f}{s['median_rollout_s']:9.3f}"
                f"{s['median_rollout_tokens_per_s']:9.0f}{s['completion_mean_length']:8.1f}"
                f"{s['median_rollout_s'] / s['median_s_per_step']:7.0%}"
                f"{s['setup_s']:8.1f}  {others:>10s}  {each}"
            )
        lines.append(
            f"  ratios, per round then the median over rounds [min-max; each round] (aim grpoflow/TRL <= "
            f"{TRL_AIM}):"
        )
        lines += [f"    {label:38s}{format_ratio(x)}" for label, x in m["ratios"].items() if x["rounds"]]
        for e in m["sides"].get(TRL_SIDE, {}).get("errors", []):
            lines.append(f"  {LABELS[TRL_SIDE]} failed in round {e['round'] + 1}: {e['error'][:400]}")
        lines.append(f"  plot: {m['plot']}")
    if not w["trl_vllm"]:
        lines.append("TRL + vLLM colocate: left out (BENCH_TRL_VLLM=0)")
    lines.append(f"written to {RESULT_JSON}")
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_engines(tmp_path):
    r = run_benchmark(tmp_path)
    steps, repeats = r["work"]["steps"], r["work"]["repeats"]
    for name, m in r["models"].items():
        for side in SIDES:
            s = m["sides"][side]
            assert [run["steps"] for run in s["runs"]] == [steps] * repeats, (name, side)
            for key in ("median_s_per_step", "median_rollout_s", "median_rollout_tokens_per_s"):
                assert math.isfinite(s[key]) and s[key] > 0, (name, side, key)
        for label, x in m["ratios"].items():
            if TRL_SIDE in RATIOS[label]:  # TRL on vLLM: numbers, or its failure recorded
                assert x["rounds"] or m["sides"][TRL_SIDE]["errors"], name
            else:
                assert len(x["rounds"]) == repeats and math.isfinite(x["median"]) and x["median"] > 0, (
                    name,
                    label,
                )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-vllm":
        _trl_vllm_child(json.loads(sys.argv[2]))
    else:
        logging.basicConfig(level=logging.WARNING)
        with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
            run_benchmark(Path(tmp))
