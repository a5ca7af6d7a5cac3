"""Several rollout workers, fully on-policy asynchronous rollout, and `grpoflow train` relaunching itself as
torchrun ranks, all on CPU processes with the real tiny model.

- two workers (rollout.num_engines: 2): the batch's prompts are sharded across them and each prompt's group
  comes back to that prompt, in the order of `prompt_indices`, batch after batch;
- max_staleness 0 with two workers: every batch is sampled by the very weights that train on it (both workers
  receive each sync), no importance correction is applied, and the run keeps its two worker processes;
- an interrupt while `close` waits for the workers' start stops them and is raised, not swallowed;
- `grpoflow train` with rollout.train_devices [0, 1] re-runs itself under torchrun as two DDP ranks, which
  leave their process group before exiting, and rank 0 alone logs, saves and prints the summary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO_ROOT
from trainer.grpo import GRPOTrainer
from trainer.recipe import load_recipe

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


def small(tmp_path: Path, tiny_base: dict, data: Path, *overrides: str) -> list[str]:
    return [
        f"bootstrap.out={tiny_base['path']}",
        f"data.out={data}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.prompts_per_step=2",
        "train.num_generations=4",
        "train.eval_heldout=0",
        "train.micro_batch_size=8",
        "train.max_completion_length=16",
        *overrides,
    ]


def async_source(recipe, model_path: str, rows: list[dict], model, tokenizer, score):
    """The recipe's asynchronous rollout source on one trainer rank, its workers starting from
    `model_path` (policy version 0), `score` standing in for the trainer's scoring."""
    from trainer.rollout.source import AsyncRollout, step_prompts

    return AsyncRollout(
        recipe.rollout,
        recipe.train,
        model_path,
        0,
        recipe.model,
        rank=0,
        world=1,
        prompts=functools.partial(step_prompts, rows=rows, tokenizer=tokenizer, cfg=recipe.train),
        score=score,
        policy=lambda: (model, 0),
    )


def worker_pids() -> set[int]:
    """This process's rollout workers (multiprocessing's spawned children)."""
    return {c.pid for c in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(c.cmdline())}


def test_two_workers_shard_the_prompts_and_return_each_group_to_its_prompt(tmp_path, tiny_base, tiny_data):
    from data.prepare import load_prepared
    from trainer.curriculum import prompt_indices
    from trainer.model_loading import load_model
    from trainer.prompts import encode_prompts
    from trainer.rollout.hf_engine import HFEngine
    from trainer.rollout.source import step_prompts
    from trainer.rollout.worker_processes import cpu_threads_per_side

    recipe = load_recipe(
        TINY,
        small(
            tmp_path,
            tiny_base,
            tiny_data,
            "rollout.async=true",
            "rollout.num_engines=2",
            "train.prompts_per_step=5",
            "train.max_steps=2",
        ),
    )
    cfg, rows = recipe.train, load_prepared(tiny_data, "train")
    model, tokenizer = load_model(tiny_base["path"], recipe.model, "cpu")
    model.eval()
    seen = []  # what the trainer would score: (rows, prompt ids, groups) of each batch

    def keep(rows, prompt_ids, groups, metrics):
        seen.append((rows, prompt_ids, groups))
        return None, metrics

    source = async_source(recipe, tiny_base["path"], rows, model, tokenizer, score=keep)
    with source:
        source.start(0)  # after the workers are up: a child just forked still shows its parent's command line
        pids = {p.pid for p in source.workers.procs}
        assert len(pids) == 2 and pids == worker_pids()  # two engines, each a process of its own
        source.next(0)
        source.next(1)  # requested while batch 0 was collected: results are kept apart by step
    assert not worker_pids() & pids  # closed with the source

    # The same prompts generated here, shard by shard as the workers got them: 5 prompts over 2 workers are
    # prompts 0-2 (worker 1, the step's seed) and 3-4 (worker 2, the step's seed + 2**32). Same weights,
    # seeds, batch and thread count: the same samples.
    engine = HFEngine(model, tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_side(2))
    try:
        for step, (got_rows, got_ids, groups) in enumerate(seen):
            wanted = [rows[i] for i in prompt_indices(step, len(rows), 5, cfg.seed)]
            assert [r["id"] for r in got_rows] == [r["id"] for r in wanted]
            assert [r["answer"] for r in got_rows] == [r["answer"] for r in wanted]
            assert got_ids == encode_prompts(tokenizer, wanted, cfg.max_prompt_length)
            sampling = step_prompts(step, rows, tokenizer, cfg)[2]
            shards = [(0, 3, sampling.seed), (3, 5, sampling.seed + 2**32)]
            expected = [
                g
                for lo, hi, seed in shards
                for g in engine.generate(got_ids[lo:hi], 4, dataclasses.replace(sampling, seed=seed))
            ]
            assert len(groups) == 5 and all(len(g) == 4 for g in groups)
            assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in expected]
            for g, e in zip(groups, expected, strict=True):
                for c, d in zip(g, e, strict=True):
                    torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(d.logprobs))
        # the two steps' batches differ (other prompts, other seeds): a step's result was not served twice
        assert [r["id"] for r in seen[0][0]] != [r["id"] for r in seen[1][0]]
    finally:
        torch.set_num_threads(threads)


def test_an_interrupt_while_close_waits_for_the_workers_start_stops_them_and_goes_on_up(
    tmp_path, tiny_base, tiny_data
):
    """A Ctrl-C while `close` waits for the workers' start still under way (the trainer interrupted during
    the base model's held-out evaluation) stops the workers, gives the trainer its threads back, and is
    raised, not swallowed. The interrupt is the start's future answering KeyboardInterrupt, as a signal
    arriving during that wait would: a real signal could land outside the wait on a fast machine."""
    import concurrent.futures

    from data.prepare import load_prepared
    from trainer.model_loading import load_model

    recipe = load_recipe(TINY, small(tmp_path, tiny_base, tiny_data, "rollout.async=true"))
    rows = load_prepared(tiny_data, "train")
    model, tokenizer = load_model(tiny_base["path"], recipe.model, "cpu")
    threads = torch.get_num_threads()
    source = async_source(
        recipe, tiny_base["path"], rows, model, tokenizer, score=lambda rows, ids, groups, m: (None, m)
    )
    procs = source.workers.procs
    assert procs and all(p.is_alive() for p in procs)  # started, not yet up
    interrupted = concurrent.futures.Future()
    interrupted.set_exception(KeyboardInterrupt())
    source._ready = interrupted
    with pytest.raises(KeyboardInterrupt):
        source.close()
    assert not any(p.is_alive() for p in procs)
    assert torch.get_num_threads() == threads


class WorkerWatch:
    """A training callback that notes the rollout worker processes alive at each step."""

    def __init__(self):
        self.pids: list[set[int]] = []

    def on_step(self, step, metrics):
        self.pids.append(worker_pids())


def test_on_policy_async_with_two_workers_samples_every_batch_with_the_weights_that_train_on_it(
    tmp_path, tiny_base, tiny_data
):
    from safetensors.torch import load_file

    recipe = load_recipe(
        TINY,
        small(
            tmp_path,
            tiny_base,
            tiny_data,
            "rollout.async=true",
            "rollout.num_engines=2",
            "rollout.max_staleness=0",
            "train.max_steps=3",
            "train.learning_rate=1e-3",
            # constant: a step whose groups all tie (no signal) is not the one with the full rate; 8
            # prompts, so that the first step has groups that do not tie on every CPU's base (2 prompts
            # tied on the Intel Xeon's, and an lr-1e-3 update leaves that base answering nothing right)
            "train.lr_scheduler_type=constant",
            "train.prompts_per_step=8",
        ),
    )
    watch = WorkerWatch()
    result = GRPOTrainer(recipe, tiny_base["path"], tiny_data, callbacks=[watch], progress=False).train()
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert result.steps == 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert [r["staleness"] for r in rows] == [0.0, 0.0, 0.0]
    # on-policy: no importance weights (the ratio to the behaviour policy is 1), nothing clipped on the one
    # pass
    assert not any(k.startswith("importance_ratio") for r in rows for k in r)
    assert all(r["clip_ratio/region_mean"] == 0.0 for r in rows)
    # each worker sampled its half of every batch with the trainer's current weights: after an lr 1e-3 update,
    # a worker left on older weights would put its log-probs far from the trainer's
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows]
    assert max(gaps) < 1e-5, gaps
    assert all(r["timing/weight_sync_s"] > 0 for r in rows[:-1])  # after each update, before the next batch
    base = load_file(Path(tiny_base["path"]) / "model.safetensors")
    trained = load_file(Path(result.checkpoint) / "model.safetensors")
    # the updates were real: Adam's first step with a signal moves weights by about the learning rate
    assert max((trained[n] - base[n]).abs().max().item() for n in base) > 5e-4
    # two worker processes, the same two for the whole run, and none left behind
    assert len(watch.pids) == 3 and len(watch.pids[0]) == 2 and all(p == watch.pids[0] for p in watch.pids)
    assert not worker_pids() & watch.pids[0]


RANK_REPORT = """
import atexit, json, os
from pathlib import Path
import torch.distributed as dist

OUT = Path(__file__).parent


def make():  # a training callback factory: every trainer rank calls it once its process group exists
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    (OUT / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "pid": os.getpid(),
                                                       "ppid": os.getppid(), \
"env_rank": os.environ.get("RANK")}))
    # at interpreter exit: has the rank left its process group?
    atexit.register(lambda: (OUT / f"exit-{rank}.json").write_text(json.dumps(
        {"group_alive": dist.is_initialized()})))
    return object()
"""


def test_grpoflow_train_relaunches_itself_as_two_ddp_ranks_that_end_cleanly(tmp_path, tiny_base, tiny_data):
    plugin = tmp_path / "ranks" / "rank_report.py"
    plugin.parent.mkdir()
    plugin.write_text(RANK_REPORT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(TINY),
        *small(
            tmp_path,
            tiny_base,
            tiny_data,
            "rollout.train_devices=[0, 1]",
            "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
            "train.max_steps=2",
            "train.micro_batch_size=2",
            f"train.callbacks=['{plugin}:make']",
        ),
        "--json",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if (
            proc.poll() is None
        ):  # timed out: end the whole tree (torchrun starts its ranks in sessions of their own)
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                p.kill()
    assert proc.returncode == 0, err[-4000:]
    reports = plugin.parent
    assert sorted(p.name for p in reports.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
    ranks = [json.loads((reports / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["env_rank"]) for r in ranks] == [(0, 2, "0"), (1, 2, "1")]
    # two processes of their own, started by torchrun (a child of the command), not the command itself
    assert len({r["pid"] for r in ranks} | {proc.pid}) == 3 and all(r["ppid"] != proc.pid for r in ranks)
    assert sorted(p.name for p in reports.glob("exit-*.json")) == ["exit-0.json", "exit-1.json"]
    assert [json.loads((reports / f"exit-{r}.json").read_text()) for r in (0, 1)] == [
        {"group_alive": False}
    ] * 2
    # rank 0 alone prints the summary, logs the steps and saves
    printed = [line for line in out.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and json.loads(printed[0])["steps"] == 2
    run = tmp_path / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    manifest = json.loads((run / "checkpoint-2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and (run / "checkpoint-2" / "model.safetensors").is_file()
    assert (run / "latest").read_text().strip() == "checkpoint-2"
