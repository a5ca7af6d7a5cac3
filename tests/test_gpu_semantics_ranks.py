"""Synchronous rollout and the held-out evaluation under several trainer ranks, on real gloo ranks (torchrun)
and the real tiny model: each rank generates only its share of the prompts, sampled as one process samples
them, and the ranks train on one agreed batch through the same number of micro-batches, also when the batch
does not split evenly and dynamic sampling drops a group on one rank's share only; the held-out rows are
shared over the ranks, in batches of the size asked for, with the one-process scores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from data.prepare import load_prepared
from trainer.recipe import load_recipe
from trainer.rollout.base import SamplingParams
from trainer.rollout.source import prompt_indices

_RANKS_TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"
_RANKS_PROMPTS, _RANKS_GENERATIONS, _RANKS_MICRO, _RANKS_HELDOUT, _RANKS_HELDOUT_BATCH = 3, 3, 2, 8, 2

# One step of a trainer rank, recorded as it goes (a rank that never finishes still leaves what it did):
# the held-out evaluation, then batch 0 and one update on it. Every call of the rank's engine is counted.
_RANKS_SCRIPT = """
import json, sys, torch
from trainer.grpo import GRPOTrainer
from trainer.heldout import evaluate_greedy
from trainer.recipe import load_recipe
from trainer.rewards import accuracy_reward, format_reward
out, recipe = sys.argv[3], load_recipe(sys.argv[1], sys.argv[5:])
trainer = GRPOTrainer(recipe, sys.argv[2], recipe.data.out, progress=False)
trainer.heldout_batch_size = int(sys.argv[4])  # what a memory plan would size
trainer.setup()
engine, calls, record = trainer.local_engine.engine, [], {}
generate = engine.generate
def counted(prompts, n, sampling):
    calls.append({"prompts": len(prompts), "n": n, "greedy": sampling.temperature <= 0})
    return generate(prompts, n, sampling)
engine.generate = counted
def dump():
    json.dump(record, open(f"{out}/rank{trainer.rank}.json", "w"))
heldout = trainer.evaluate_heldout("before")
record["heldout"] = {k: heldout[k] for k in ("accuracy", "format_rate", "mean_length", "n")}
record["heldout_calls"], calls[:] = list(calls), []
if trainer.rank == 0:  # the same rows evaluated by this process alone, in the batches the ranks used
    with trainer.local_engine.holding(trainer.model, trainer.version) as plain:
        alone = evaluate_greedy(
            plain, trainer.tokenizer, trainer.heldout_rows, accuracy_reward, format_reward,
            max_tokens=recipe.train.max_completion_length, batch_size=int(sys.argv[4]),
            max_prompt_length=recipe.train.max_prompt_length, return_samples=True)
    record["heldout_alone"] = {k: alone[k] for k in ("accuracy", "format_rate", "mean_length", "n")}
    written = [json.loads(line) for line in open(heldout["samples_path"])]
    record["heldout_samples_equal"] = written == alone["samples"]
calls[:] = []
batch, _ = trainer.rollout_source().next(0)
record["step_calls"], calls[:] = list(calls), []
record["batch"] = {"tokens": [c.token_ids for c in batch.completions], "sampled_out": batch.sampled_out,
                   "advantages": batch.advantages.tolist(), "loss_mask": batch.loss_mask.tolist()}
dump()
backward, passes = trainer.strategy.backward, []
def counted_backward(loss, last):
    passes.append(last)
    backward(loss, last)
trainer.strategy.backward = counted_backward
grads = {}
def keep_grads(optimizer, args, kwargs):  # the gradient the optimizer steps with (after DDP's all-reduce)
    grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
trainer.strategy.optimizer.register_step_pre_hook(keep_grads)
trainer.optimize(batch)
record["micro_batches"] = len(passes)
dump()
if trainer.rank == 0:
    torch.save(grads, f"{out}/grads.pt")
from trainer.launch import leave_distributed; leave_distributed()  # no rank exits with the group alive
"""


def _ranks_constant_prompt(tiny_data: Path) -> str:
    """The first prompt of batch 0 (rank 0's share under two ranks), as the reward function sees it."""
    recipe = load_recipe(_RANKS_TINY, [f"data.out={tiny_data}"])
    rows = load_prepared(tiny_data, "train")
    first = prompt_indices(0, len(rows), _RANKS_PROMPTS, recipe.train.seed)[0]
    return repr(rows[first]["prompt"])


def _ranks_run(tmp_path: Path, tiny_base: dict, tiny_data: Path, ranks: int) -> dict:
    """Launch `_RANKS_SCRIPT` on `ranks` gloo ranks; what each rank recorded, its grads and the exit."""
    out = tmp_path / f"ranks-{ranks}"
    out.mkdir()
    plugin = tmp_path / "uneven.py"
    # the first prompt's group gets one reward for every completion (dynamic sampling drops it); the others
    # are rewarded by their characters, so their groups stay unless all their completions are the same
    plugin.write_text(
        f"CONSTANT = {_ranks_constant_prompt(tiny_data)!r}\n"
        "def uneven(prompts, completions, **kw):\n"
        "    return [1.0 if repr(p) == CONSTANT else float(sum(map(ord, c)))\n"
        "            for p, c in zip(prompts, completions)]\n"
    )
    script = tmp_path / "one_step.py"
    script.write_text(_RANKS_SCRIPT)
    overrides = [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={tiny_data}",
        f"train.output_dir={out / 'run'}",
        f"train.prompts_per_step={_RANKS_PROMPTS}",
        f"train.num_generations={_RANKS_GENERATIONS}",
        f"train.micro_batch_size={_RANKS_MICRO}",
        f"train.eval_heldout={_RANKS_HELDOUT}",
        "train.dynamic_sampling=true",
        "train.learning_rate=1e-3",
        "rollout.sync_timeout_s=60",  # a rank left waiting on a collective fails in a minute, not ten
        f"rewards=[{{name: '{plugin}:uneven'}}]",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                str(script),
                str(_RANKS_TINY),
                tiny_base["path"],
                str(out),
                str(_RANKS_HELDOUT_BATCH),
                *overrides,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=400,
            env=env,
        )
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, stderr = None, f"timed out after {e.timeout} s"
    records = [
        json.loads(path.read_text()) if (path := out / f"rank{r}.json").is_file() else {}
        for r in range(ranks)
    ]
    grads = torch.load(out / "grads.pt") if (out / "grads.pt").is_file() else None
    return {"returncode": returncode, "stderr": stderr[-3000:], "records": records, "grads": grads}


@pytest.fixture(scope="module")
def _ranks_runs(tmp_path_factory, tiny_base, tiny_data) -> dict[int, dict]:
    """The same held-out evaluation and step on one rank and on two."""
    tmp = tmp_path_factory.mktemp("ranks")
    return {ranks: _ranks_run(tmp, tiny_base, tiny_data, ranks) for ranks in (1, 2)}


def _ranks_sampled(calls: list[dict]) -> int:
    return sum(c["prompts"] * c["n"] for c in calls if not c["greedy"])


def test_each_rank_generates_only_its_share_of_the_batch_and_all_hold_the_one_process_batch(_ranks_runs):
    one, two = _ranks_runs[1]["records"][0], _ranks_runs[2]["records"]
    assert all("batch" in r for r in two), _ranks_runs[2]["stderr"]
    batch = _RANKS_PROMPTS * _RANKS_GENERATIONS
    assert _ranks_sampled(one["step_calls"]) == batch
    # 3 prompts over 2 ranks: 2 and 1, each with its 3 completions; nothing generated twice
    assert [_ranks_sampled(r["step_calls"]) for r in two] == [2 * _RANKS_GENERATIONS, _RANKS_GENERATIONS]
    # each prompt sampled with the random numbers it gets in the whole batch: the same completions, rewards,
    # advantages and masks as one process, on both ranks
    assert two[0]["batch"] == two[1]["batch"] == one["batch"]


def test_an_odd_batch_with_a_group_dropped_on_one_share_trains_every_rank_through_as_many_micro_batches(
    _ranks_runs,
):
    one, two = _ranks_runs[1], _ranks_runs[2]
    assert one["returncode"] == 0, one["stderr"]
    assert two["returncode"] == 0, two["stderr"]  # no rank left waiting on a collective
    batch = two["records"][0]["batch"]
    # dynamic sampling dropped the first prompt's group, which only rank 0 generated
    assert batch["loss_mask"][:_RANKS_GENERATIONS] == [0.0] * _RANKS_GENERATIONS
    assert batch["sampled_out"] >= _RANKS_GENERATIONS
    # 9 rows, every 2nd on each rank: 5 and 4, in micro-batches of 2: 3 on both ranks (the shorter share
    # runs a stand-in with nothing in the loss), 5 on one rank
    assert [r["micro_batches"] for r in two["records"]] == [3, 3]
    assert one["records"][0]["micro_batches"] == 5
    # and the ranks' shares add up to the one-process loss: the same gradient reaches the optimizer (up to
    # float summation order, as in the two-rank DDP check of tests/test_async.py)
    assert one["grads"].keys() == two["grads"].keys()
    assert any(g.abs().max() > 0 for g in one["grads"].values())
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-6)


def test_heldout_rows_are_shared_over_the_ranks_in_batches_of_the_asked_size_with_the_one_process_scores(
    _ranks_runs,
):
    one, two = _ranks_runs[1]["records"][0], _ranks_runs[2]["records"]
    assert all("heldout" in r for r in two), _ranks_runs[2]["stderr"]
    # each rank generates half the rows, two at a time: rank 1 works alongside rank 0 instead of waiting on
    # a collective for the whole evaluation, and no batch is larger than asked
    for record in two:
        assert [c["prompts"] for c in record["heldout_calls"]] == [_RANKS_HELDOUT_BATCH] * 2
        assert all(c["greedy"] for c in record["heldout_calls"])
    assert [c["prompts"] for c in one["heldout_calls"]] == [_RANKS_HELDOUT_BATCH] * 4
    # every rank gets the scores of all rows, the same as one process scoring them alone, and rank 0 writes
    # every row's answer
    assert two[0]["heldout"] == two[1]["heldout"] == two[0]["heldout_alone"] == one["heldout"]
    assert two[0]["heldout"]["n"] == _RANKS_HELDOUT
    assert two[0]["heldout_samples_equal"] and one["heldout_samples_equal"]


def test_a_share_of_a_batch_samples_what_the_whole_batch_samples_for_its_prompts(tiny_base):
    """The transformers engine's seeded sampling of prompts 1..2 of a batch of 4, asked for alone with
    `share`, gives those prompts' completions in the whole batch (token ids and behaviour log-probs)."""
    from trainer.model_loading import load_model
    from trainer.recipe import ModelConfig
    from trainer.rollout.hf_engine import HFEngine

    model, tokenizer = load_model(tiny_base["path"], ModelConfig(dtype="float32"), "cpu", verify=False)
    engine = HFEngine(model.eval(), tokenizer)
    prompts = [tokenizer.encode(f"{a} + {b} =") for a, b in ((3, 4), (12, 30), (7, 7), (250, 9))]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    whole = engine.generate(prompts, 3, sampling)
    share = engine.generate(
        prompts[1:3], 3, SamplingParams(max_tokens=12, temperature=1.0, seed=11, share=(1, 4))
    )
    assert [[c.token_ids for c in g] for g in share] == [[c.token_ids for c in g] for g in whole[1:3]]
    for got, want in zip([c for g in share for c in g], [c for g in whole[1:3] for c in g], strict=True):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    # the same call without `share` is another sample: the share's rows are not those of a batch of two
    alone = engine.generate(prompts[1:3], 3, sampling)
    assert [[c.token_ids for c in g] for g in alone] != [[c.token_ids for c in g] for g in share]


# Held-out evaluation with a rollout server: rank 0 alone can generate (the others hold no client).
_RANKS_SERVER_SCRIPT = """
import json, sys, torch.distributed as dist
from data.prepare import load_prepared
from trainer.heldout import evaluate_greedy
from trainer.launch import init_distributed, leave_distributed
from trainer.model_loading import load_model
from trainer.recipe import ModelConfig
from trainer.rewards import accuracy_reward, format_reward
from trainer.rollout.hf_engine import HFEngine
rank, world = init_distributed(60)
model, tokenizer = load_model(sys.argv[1], ModelConfig(dtype="float32"), "cpu", verify=False)
engine = HFEngine(model.eval(), tokenizer) if rank == 0 else None  # the others cannot generate at all
rows, waits = load_prepared(sys.argv[2], "heldout")[:6], []
def gather(part):
    waits.append(len(part[1]))  # how many rows this rank scored before this wait
    out = [None] * world
    dist.all_gather_object(out, part)
    return out
def evaluate(**shared):
    return evaluate_greedy(engine, tokenizer, rows, accuracy_reward, format_reward, max_tokens=24,
                           batch_size=2, max_prompt_length=64, return_samples=True, **shared)
result = evaluate(rank=rank, world=world, gather=gather, alone=True)
record = {"result": result, "waits": waits}
if rank == 0:
    record["one_process"] = evaluate()
json.dump(record, open(f"{sys.argv[3]}/rank{rank}.json", "w"))
leave_distributed()
"""


def test_with_a_rollout_server_rank_zero_evaluates_heldout_one_batch_per_wait_of_the_other_ranks(
    tmp_path, tiny_base, tiny_data
):
    """In server mode only rank 0 talks to the server: it scores the held-out rows one batch at a time and
    every rank gets the scores after each batch, so no rank waits on a collective for the whole evaluation;
    the scores are one process's."""
    (tmp_path / "server_heldout.py").write_text(_RANKS_SERVER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(tmp_path / "server_heldout.py"),
            tiny_base["path"],
            str(tiny_data),
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # 6 rows in batches of 2: three waits, after each of which rank 0 had scored one batch more
    assert rank0["waits"] == [2, 2, 2] and rank1["waits"] == [0, 0, 0]
    assert rank0["result"] == rank1["result"] == rank0["one_process"]
    assert rank0["result"]["n"] == len(rank0["result"]["samples"]) == 6
