"""Benchmark, the engine axis: grpoflow's rollouts on transformers next to vLLM, sync and async, in ONE run.

It needs vLLM, so it runs in the vLLM venv (vLLM's CPU build, made by `make install-vllm`):
`GRPOFLOW_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -m bench tests/benchmarks/test_bench_engines.py -s`,
or `.venv-vllm/bin/python tests/benchmarks/test_bench_engines.py`. Without vLLM the module is skipped (as under
`make bench` in the main venv), unless GRPOFLOW_REQUIRE_VLLM=1, which makes a missing vLLM a failure.
Knobs: BENCH_STEPS (generated batches per run, default 10), BENCH_REPEATS (runs per side, default 2),
BENCH_MODELS (default "tiny,wide"), BENCH_TRL_VLLM=1 (add TRL's GRPOTrainer on vLLM).

The work is test_bench_grpo's (`make_recipe`: 4 prompts x 8 generations per batch, configs/tiny-cpu.yaml for
everything else, its prepared data), with 16 held-out rows, on two models with the same tokenizer:
- tiny: the bootstrapped base model (.state/models/tiny-base, 0.9M parameters), completions <= 24 tokens;
- wide: a Qwen2 of hidden size 512, 8 layers, 8 heads (head_dim 64: vLLM's CPU attention wants >= 32), FFN
  1024, tied embeddings, random weights (seed 0), made in the run's tmp dir; completions <= 64 tokens. It
  learns nothing; it is there so that the model's arithmetic, not per-token Python overhead, sets the pace.

Four sides per model, each a whole `GRPOTrainer(...).train()`: sync transformers, sync vLLM (enforce_eager),
async vLLM and async transformers (one rollout worker process; trainer and worker get one core each). Per
run: the median over steps 2..N (step 1 holds vLLM's warm-up) of `timing/step_s`, of `timing/rollout_s` and of
rollout tokens/s = prompts x generations x mean completion length / rollout_s. Sync vLLM's rollout_s includes
the weight update into the engine; async's is the worker's generation time. Runs alternate, A B C D then
D C B A, ..., `BENCH_REPEATS` rounds; a side's figure is the median over its runs. Ratios of s/step:
vLLM/transformers (sync, async) and async/sync per engine; and vLLM/transformers of sync rollout tokens/s.

Every run starts with the thread count the process started with: building an in-process vLLM replaces
`torch.set_num_threads` with a no-op for the whole process (infra/vllm-cpu-notes.md, section 4) and an async
run sets the trainer to one thread, so both are put back between runs, as a fresh process would have them.
other% is test_bench_grpo's meter: CPU used by other processes meanwhile; above a few %, the run is noisy.

TRL (BENCH_TRL_VLLM=1): test_bench_grpo's TRL side, its GRPOConfig given use_vllm=True,
vllm_mode="colocate", once per model after all of ours (its vLLM initialises torch.distributed in this
process). TRL leaves vLLM's dtype on "auto", bfloat16 on CPU (notes, section 4), so its rollouts are not float32
as ours are. Where oneDNN can pack bf16 weights (AVX-512 BF16 / AMX CPUs), vLLM drops each linear layer's weight
and TRL 1.16's per-parameter `load_weights` fails ("'Parameter' object has no attribute 'weight_loader'", notes
section 2a); it ran on the notes' AVX2-only CPU only because packing failed there. A failure is recorded in the
JSON (error and traceback), not raised.

Nothing here asserts a time: the test checks that every side ran and gave finite numbers, and prints a table
and ratios. The numbers are also written to `.state/bench/engines.json`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
for _folder in (BENCH_DIR, BENCH_DIR.parent):  # pytest's importlib mode, or run from elsewhere
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import test_bench_grpo as grpo_bench  # noqa: E402
from test_bench_grpo import (  # noqa: E402
    REPO_ROOT,
    OtherCPU,
    bench_steps,
    make_recipe,
    median_after_first,
    prepare_inputs,
)

from conftest import require_vllm  # noqa: E402

require_vllm("run this benchmark with .venv-vllm/bin/python (make bench)")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default asks for 90% of all RAM

RESULT_JSON = REPO_ROOT / ".state" / "bench" / "engines.json"
HELDOUT_ROWS = 16
COMPLETION_TOKENS = {"tiny": 24, "wide": 64}
WIDE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8}
SIDES = {  # in the order of the first round; recipe overrides
    "sync_transformers": ["rollout.engine=transformers", "rollout.async=false"],
    "sync_vllm": ["rollout.engine=vllm", "rollout.enforce_eager=true", "rollout.async=false"],
    "async_vllm": ["rollout.engine=vllm", "rollout.enforce_eager=true", "rollout.async=true"],
    "async_transformers": ["rollout.engine=transformers", "rollout.async=true"],
}
LABELS = {"sync_transformers": "sync transformers", "sync_vllm": "sync vLLM", "async_vllm": "async vLLM",
          "async_transformers": "async transformers"}


def bench_repeats() -> int:
    return int(os.environ.get("BENCH_REPEATS", "2"))


def bench_models() -> list[str]:
    names = [n.strip() for n in os.environ.get("BENCH_MODELS", "tiny,wide").split(",") if n.strip()]
    unknown = sorted(set(names) - set(COMPLETION_TOKENS))
    if unknown or not names:
        raise ValueError(f"BENCH_MODELS={os.environ.get('BENCH_MODELS')!r}: expected names from "
                         f"{sorted(COMPLETION_TOKENS)}, comma-separated")
    return names


def model_overrides(model: str) -> list[str]:
    return [f"train.max_completion_length={COMPLETION_TOKENS[model]}", f"train.eval_heldout={HELDOUT_ROWS}"]


# ----------------------------------------------------------------------------------------------- models
def make_wide_model(base: str, out: Path) -> str:
    """WIDE's shape with tiny-base's tokenizer, vocabulary, special tokens and tied embeddings; seed 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base, **WIDE, layer_types=["full_attention"] * WIDE["num_hidden_layers"])
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
def reset_threads(set_num_threads, threads: int) -> None:
    """Undo what earlier runs did to torch's threads (see the module docstring)."""
    import torch

    torch.set_num_threads = set_num_threads
    set_num_threads(threads)


def rss_gib() -> float:
    """This process' resident memory: engines of earlier runs that were not freed would show here."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def release_memory() -> None:
    """Free the finished run's in-process vLLM (its 1 GiB KV cache) before the next is built. vLLM's engine core
    calls gc.freeze() when built and gc.unfreeze() only in its shutdown, which the trainer does not call: frozen,
    the engine is never collected, and every vLLM run would add about 1.3 GiB to this process."""
    gc.unfreeze()
    gc.collect()


def run_side(work: Path, steps: int, model: str, model_path: str, data_dir: Path, side: str, out_dir: Path) -> dict:
    import torch

    from trainer.grpo import GRPOTrainer

    recipe = make_recipe(work, steps, [*model_overrides(model), f"train.output_dir={out_dir}", *SIDES[side]])
    cfg, threads = recipe.train, torch.get_num_threads()
    with OtherCPU() as meter:
        started = time.perf_counter()
        result = GRPOTrainer(recipe, model_path, data_dir, progress=False).train()
        wall = time.perf_counter() - started
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines() if line.strip()]
    shutil.rmtree(out_dir, ignore_errors=True)  # checkpoints: 0.3 GB per run for the wide model
    release_memory()
    step_s, rollout_s = [r["timing/step_s"] for r in rows], [r["timing/rollout_s"] for r in rows]
    tokens_per_s = [cfg.prompts_per_step * cfg.num_generations * r["completions/mean_length"] / r["timing/rollout_s"]
                    for r in rows]
    return {"steps": len(rows), "median_s_per_step": median_after_first(step_s),
            "median_rollout_s": median_after_first(rollout_s),
            "median_rollout_tokens_per_s": median_after_first(tokens_per_s),
            "completion_mean_length": median_after_first([r["completions/mean_length"] for r in rows]),
            "step_s": step_s, "rollout_s": rollout_s, "wall_s": wall, "setup_s": wall - sum(step_s),
            "other_cpu_share": meter.share, "threads": threads, "threads_after": torch.get_num_threads(),
            "rss_gib_after": rss_gib()}


def summarize(runs: list[dict]) -> dict:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {"s_per_step": median("median_s_per_step"), "rollout_s": median("median_rollout_s"),
            "rollout_tokens_per_s": median("median_rollout_tokens_per_s"),
            "completion_mean_length": median("completion_mean_length"), "setup_s": median("setup_s"),
            "other_cpu_share_max": max(r["other_cpu_share"] for r in runs), "runs": runs}


def ratios(sides: dict) -> dict:
    s = {name: side["s_per_step"] for name, side in sides.items()}
    return {"vllm_over_transformers_sync": s["sync_vllm"] / s["sync_transformers"],
            "vllm_over_transformers_async": s["async_vllm"] / s["async_transformers"],
            "async_over_sync_transformers": s["async_transformers"] / s["sync_transformers"],
            "async_over_sync_vllm": s["async_vllm"] / s["sync_vllm"],
            "rollout_tokens_per_s_vllm_over_transformers_sync":
                sides["sync_vllm"]["rollout_tokens_per_s"] / sides["sync_transformers"]["rollout_tokens_per_s"]}


# -------------------------------------------------------------------------------------------------- TRL
def colocated(config):
    """TRL's GRPOConfig with vLLM colocated. test_bench_grpo passes `activation_checkpointing`, the name newer
    transformers give the field; the transformers vllm-cpu pins (< 5.20) still call it `gradient_checkpointing`."""
    names = {f.name for f in dataclasses.fields(config)}

    def make(**kwargs):
        if "activation_checkpointing" in kwargs and "activation_checkpointing" not in names:
            kwargs["gradient_checkpointing"] = kwargs.pop("activation_checkpointing")
        return config(**kwargs, use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False)
    return make


def run_trl_vllm(work: Path, steps: int, model: str, model_path: str, data_dir: Path) -> dict:
    """test_bench_grpo's TRL side with vLLM colocated: its GRPOConfig and recipe are wrapped for the call
    rather than copied. TRL sets RANK, WORLD_SIZE, MASTER_* for vLLM; the environment is put back after."""
    import trl

    config, recipe, environ = trl.GRPOConfig, grpo_bench.make_recipe, dict(os.environ)
    trl.GRPOConfig = colocated(config)
    grpo_bench.make_recipe = lambda w, s, extra=(): recipe(w, s, [*model_overrides(model), *extra])
    try:
        with OtherCPU() as meter:
            side = grpo_bench.run_trl((work, steps), model_path, data_dir, 1, work / f"trl-vllm-{model}")
        side["other_cpu_share"] = meter.share
        return side
    except Exception as e:  # a benchmark side that cannot run here is a finding, not a crash
        return {"error": f"{type(e).__name__}: {e}"[:4000], "traceback": traceback.format_exc()[-6000:]}
    finally:
        trl.GRPOConfig, grpo_bench.make_recipe = config, recipe
        os.environ.clear()
        os.environ.update(environ)
        shutil.rmtree(work / f"trl-vllm-{model}", ignore_errors=True)
        release_memory()


# -------------------------------------------------------------------------------------------- the whole
def run_benchmark(work: Path, steps: int | None = None, repeats: int | None = None) -> dict:
    import torch
    import vllm

    steps, repeats, work = steps or bench_steps(), repeats or bench_repeats(), Path(work)
    names = bench_models()
    recipe = make_recipe(work, steps)
    tiny_path, data_dir = prepare_inputs(recipe)
    paths = {"tiny": tiny_path}
    if "wide" in names:
        paths["wide"] = make_wide_model(tiny_path, work / "wide-model")
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()

    runs: dict[str, dict[str, list]] = {m: {s: [] for s in SIDES} for m in names}
    for model in names:
        for repeat in range(repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
            for side in order:
                reset_threads(set_num_threads, threads)
                runs[model][side].append(run_side(work, steps, model, paths[model], data_dir, side,
                                                  work / f"{model}-{side}-{repeat}"))
    reset_threads(set_num_threads, threads)

    models = {}
    for model in names:
        sides = {side: summarize(runs[model][side]) for side in SIDES}
        models[model] = {"path": paths[model], "parameters": parameters(paths[model]),
                         "max_completion_length": COMPLETION_TOKENS[model], "sides": sides, "ratios": ratios(sides)}
    if os.environ.get("BENCH_TRL_VLLM") == "1":
        trl_vllm = {m: run_trl_vllm(work, steps, m, paths[m], data_dir) for m in names}
        reset_threads(set_num_threads, threads)
    else:
        trl_vllm = {"skipped": "off by default; BENCH_TRL_VLLM=1 runs TRL's GRPOTrainer with use_vllm=True, "
                               "vllm_mode='colocate' (about a minute to build its engine per model)"}
    cfg = recipe.train
    report = {
        "work": {"prompts_per_step": cfg.prompts_per_step, "num_generations": cfg.num_generations, "steps": steps,
                 "repeats": repeats, "heldout_rows": HELDOUT_ROWS, "threads": threads, "cpu_count": os.cpu_count(),
                 "torch": torch.__version__, "vllm": vllm.__version__, "transformers": version("transformers"),
                 "trl": version("trl")},
        "models": models,
        "trl_vllm": trl_vllm,
    }
    RESULT_JSON.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULT_JSON.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(RESULT_JSON)
    print(format_table(report))
    return report


def format_table(r: dict) -> str:
    w = r["work"]
    lines = [
        "",
        f"engines: {w['prompts_per_step']} prompts x {w['num_generations']} generations per batch, {w['steps']} "
        f"steps per run, {w['repeats']} runs per side (alternated), {w['threads']} CPU threads; vLLM {w['vllm']}, "
        f"torch {w['torch']}, transformers {w['transformers']}",
        f"s/step, rollout: seconds per step and in rollout, median of steps 2..{w['steps']}, then median of runs; "
        "tok/s: rollout tokens per second; tokens: mean completion length; roll%: rollout_s / step s (async: "
        "the worker generates while the trainer trains, so up to 100% is hidden and above 100% is possible)",
        "setup: run wall time outside the steps (model load, engine build, held-out eval, save); other%: CPU "
        "other processes used meanwhile (max over runs; above a few %: noisy)",
    ]
    for name, m in r["models"].items():
        lines += ["", f"{name} ({m['parameters'] / 1e6:.2f}M params, <={m['max_completion_length']} completion tokens)",
                  f"{'':20s}{'s/step':>8s}{'rollout':>9s}{'tok/s':>9s}{'tokens':>8s}{'roll%':>7s}{'setup':>8s}"
                  f"{'other%':>8s}   s/step of each run"]
        for side, s in m["sides"].items():
            each = " ".join(f"{run['median_s_per_step']:.3f}" for run in s["runs"])
            lines.append(f"{LABELS[side]:20s}{s['s_per_step']:8.3f}{s['rollout_s']:9.3f}"
                         f"{s['rollout_tokens_per_s']:9.0f}{s['completion_mean_length']:8.1f}"
                         f"{s['rollout_s'] / s['s_per_step']:7.0%}"
                         f"{s['setup_s']:8.1f}{100 * s['other_cpu_share_max']:8.0f}   {each}")
        x = m["ratios"]
        tokens = x["rollout_tokens_per_s_vllm_over_transformers_sync"]
        lines.append(f"  s/step vLLM/transformers: sync {x['vllm_over_transformers_sync']:.2f}x, async "
                     f"{x['vllm_over_transformers_async']:.2f}x; async/sync: transformers "
                     f"{x['async_over_sync_transformers']:.2f}x, vLLM {x['async_over_sync_vllm']:.2f}x; "
                     f"rollout tok/s vLLM/transformers (sync) {tokens:.2f}x")
    lines += ["", "TRL GRPOTrainer + vLLM colocate (bf16 rollouts):"]
    for name, t in r["trl_vllm"].items():
        if name == "skipped":
            lines.append(f"  skipped: {t}")
        elif "error" in t:
            lines.append(f"  {name}: failed: {t['error'][:300]}")
        else:
            ours = r["models"][name]["sides"]["sync_vllm"]["s_per_step"]
            lines.append(f"  {name}: {t['median_s_per_step']:.3f} s/step (median of steps 2..), tokens "
                         f"{t['completion_mean_length']:.1f}, other% {100 * t['other_cpu_share']:.0f}; "
                         f"TRL/grpoflow sync vLLM = {t['median_s_per_step'] / ours:.2f}x")
    lines.append(f"written to {RESULT_JSON}")
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_engines(tmp_path):
    r = run_benchmark(tmp_path)
    steps, repeats = r["work"]["steps"], r["work"]["repeats"]
    for name, m in r["models"].items():
        for side, s in m["sides"].items():
            assert [run["steps"] for run in s["runs"]] == [steps] * repeats, (name, side)
            for key in ("s_per_step", "rollout_s", "rollout_tokens_per_s"):
                assert math.isfinite(s[key]) and s[key] > 0, (name, side, key)
        assert all(math.isfinite(v) and v > 0 for v in m["ratios"].values()), name
    for name, t in r["trl_vllm"].items():  # skipped, failed (recorded), or numbers
        if name != "skipped" and "error" not in t:
            assert math.isfinite(t["median_s_per_step"]) and t["median_s_per_step"] > 0, name


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        run_benchmark(Path(tmp))
