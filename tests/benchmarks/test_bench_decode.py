"""Benchmark: a generation whose decoding steps run the model's forward written out (decode_step.py) next to
the same generation through the model's own forward.

The tiny recipe's base model and prompts (`configs/tiny-cpu.yaml`, its prepared data), completions of up to
the recipe's length (24 tokens) at its temperature, two shapes: 4 prompts x 8 on the process's threads (the
step bench's pinned work) and 16 prompts x 4 on one thread (the recipe's batch as the asynchronous rollout
worker generates it). The two sides alternate within each round (BENCH_DECODE_ROUNDS, default 12; each side
generates with the round's seed, so both sample the same tokens: the sides are bit-identical, which is
asserted); a side's figure is the median over rounds and the ratio written out / model forward is taken per
round, then medianed.
Writes `.state/bench/decode.json`. About a minute on 2 cores.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # side_by_side, beside this file
from side_by_side import BENCH_OUT, env_int, format_ratio, write_json  # noqa: E402

SHAPES = (("4 x 8, all threads", 4, 8, None), ("16 x 4, one thread", 16, 4, 1))


def run_benchmark(work: Path, rounds: int | None = None) -> dict:
    import torch
    from test_bench_grpo import prepare_inputs, shipped_recipe
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.prepare import load_prepared
    from trainer.prompts import encode_prompts
    from trainer.rollout import decode_step
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf_engine import HFEngine

    rounds = rounds or env_int("BENCH_DECODE_ROUNDS", 12)
    recipe = shipped_recipe(work)
    model_path, data_dir = prepare_inputs(recipe)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = encode_prompts(tokenizer, load_prepared(data_dir)[:16], recipe.train.max_prompt_length)
    engine = HFEngine(model, tokenizer)
    assert decode_step.supported(model)
    supported, threads = decode_step.supported, torch.get_num_threads()

    def generate(written_out: bool, n_prompts: int, n: int, seed: int):
        decode_step.supported = supported if written_out else (lambda model: False)
        params = SamplingParams(
            temperature=recipe.train.temperature, max_tokens=recipe.train.max_completion_length, seed=seed
        )
        started = time.perf_counter()
        groups = engine.generate(prompts[:n_prompts], n, params)
        return time.perf_counter() - started, [(c.token_ids, c.logprobs) for g in groups for c in g]

    report = {
        "rounds": rounds,
        "threads": threads,
        "max_tokens": recipe.train.max_completion_length,
        "shapes": {},
    }
    try:
        for label, n_prompts, n, shape_threads in SHAPES:
            torch.set_num_threads(shape_threads or threads)
            times: dict[bool, list[float]] = {True: [], False: []}
            generate(True, n_prompts, n, 0)  # warm-up
            for r in range(rounds):
                outputs = {}
                for written_out in (True, False) if r % 2 == 0 else (False, True):
                    seconds, outputs[written_out] = generate(written_out, n_prompts, n, r)
                    times[written_out].append(seconds)
                assert outputs[True] == outputs[False], "the two sides sampled different tokens"
            per_round = [a / b for a, b in zip(times[True], times[False], strict=True)]
            report["shapes"][label] = {
                "written_out_ms": 1e3 * statistics.median(times[True]),
                "model_forward_ms": 1e3 * statistics.median(times[False]),
                "ratio": {
                    "median": statistics.median(per_round),
                    "rounds": per_round,
                    "min": min(per_round),
                    "max": max(per_round),
                },
            }
    finally:
        decode_step.supported = supported
        torch.set_num_threads(threads)
    write_json(BENCH_OUT / "decode.json", report)
    print(
        f"\ndecode bench: {rounds} rounds alternated, <= {recipe.train.max_completion_length} tokens, "
        "the recipe's base and prompts"
    )
    for label, figures in report["shapes"].items():
        print(
            f"  {label:20s} written out {figures['written_out_ms']:7.1f} ms, model forward "
            f"{figures['model_forward_ms']:7.1f} ms, ratio {format_ratio(figures['ratio'])}"
        )
    return report


@pytest.mark.bench
def test_bench_decode(tmp_path):
    report = run_benchmark(tmp_path)
    for figures in report["shapes"].values():
        assert len(figures["ratio"]["rounds"]) == report["rounds"]
        assert figures["written_out_ms"] > 0 and figures["model_forward_ms"] > 0


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        run_benchmark(Path(work))
