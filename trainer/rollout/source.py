"""Where each step's batch comes from: the prompts of a step, and one interface over both ways of rollout.

`RolloutSource.next(step)` gives the scored batch of `step` and its metrics. `SyncRollout` generates it
there and then, in this process, with the policy being trained. `AsyncRollout` takes the batch that the
rollout workers generated while the previous step trained.

Asynchronous order per step t (max_staleness >= 1): take batch t (generated while batch t-1 trained), send
the current weights, request batch t+1, then train on batch t. Batch t was therefore produced by the policy
one version behind the one that trains on it, and the loss corrects for that with importance weights.
Where the workers take the weights out of shared memory (one trainer rank, workers on its CPU), the same
versions go earlier: right after the update of step t, the weights and the request of batch t+2 are queued
behind the batch t+1 the workers are generating, so they go on to it without waiting for the trainer to
collect batch t+1 (and the trainer waits for no acknowledgement in its step).
With max_staleness 0 the next batch is requested only after the update (no overlap, no staleness).
Only rank 0 talks to the workers; under DDP it hands each batch to the other trainer ranks. The same holds
for a rollout server (`rollout.server_url`): rank 0 alone sends it the weights and asks it for the batch.
Under ZeRO-3 the other ranks still take part in each sync, at the same moment, because gathering the sharded
weights is collective (`_follow`, `LocalEngine.follow`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from trainer.curriculum import PromptOrder
from trainer.deepspeed_setup import whole_parameters
from trainer.prompts import encode_prompts
from trainer.recipe import ModelConfig, RolloutConfig, TrainConfig
from trainer.rewards import RewardResult
from trainer.rollout.base import SamplingParams, contiguous_shares
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.engines import load_policy, policy_tensors, served_by_rank_zero, shares_weights
from trainer.rollout.weight_sync import sync_tensors
from trainer.rollout.worker_processes import RolloutWorkers, cpu_threads_per_side

StepPrompts = tuple[list[dict], list[list[int]], SamplingParams]
Score = Callable[[list[dict], list[list[int]], list, dict], tuple[RolloutBatch, dict]]


def step_prompts(
    step: int, rows: list[dict], tokenizer, cfg: TrainConfig, order: PromptOrder | None = None
) -> StepPrompts:
    """The prompt rows of `step` (as `order` chooses them; None: the seeded data order), tokenized, and the
    sampling settings (seeded by step: resumable)."""
    order = order or PromptOrder(len(rows), cfg.prompts_per_step, cfg.seed)
    chosen = [rows[i] for i in order.indices(step)]
    prompt_ids = encode_prompts(tokenizer, chosen, cfg.max_prompt_length)
    sampling = SamplingParams(
        cfg.max_completion_length, cfg.temperature, cfg.top_p, seed=cfg.seed * 1_000_003 + step
    )
    return chosen, prompt_ids, sampling


def _observe(order: PromptOrder | None, step: int, batch: RolloutBatch) -> None:
    """Tell the prompt order (a curriculum) what batch `step` taught, on every rank, before anyone asks for
    the prompts it decides."""
    if order is not None:
        order.observe(step, batch.rewards)


class RolloutSource:
    """The scored batch of each step. Use as a context manager: `close` stops whatever generates batches."""

    def start(self, step: int) -> None:
        """Called once before the first `next(step)`."""

    def next(self, step: int) -> tuple[RolloutBatch, dict]:
        raise NotImplementedError

    def after_update(self, step: int, metrics: dict) -> None:
        """Called once the step's optimizer updates are applied."""

    def idle_metrics(self, metrics: dict) -> dict:
        """Figures that need the whole step's time (`metrics["timing/step_s"]`)."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalEngine:
    """The rollout engine in this process (synchronous rollout, held-out evaluation), made to hold the
    trainer's current policy whenever it is used.

    transformers' engine shares the trainer's module, so it always samples the current policy. vLLM / LMDeploy
    hold their own copy: it is refreshed when the policy has moved on. Colocated engines sleep while the
    trainer uses the devices: wake the weights, send the new ones, then wake the KV cache (so the cache is not
    allocated while the weights are copied), and sleep again. At sleep level 2 the weights do not survive the
    sleep, so each use sends them.
    """

    def __init__(self, engine, rollout: RolloutConfig, version: int):
        self.engine, self.rollout = engine, rollout
        self.version = version  # the policy version the engine's own weights hold
        self.shares_weights = shares_weights(engine)

    @contextlib.contextmanager
    def holding(self, model, version: int):
        """The engine, holding policy `version` (the weights of `model`) for the duration of the block."""
        if self.shares_weights:  # generating with the policy itself: under ZeRO-3 every rank gathers it whole
            self.engine.version = version
            with whole_parameters(model):
                yield self.engine
            return
        colocate = self.rollout.colocate
        if colocate:
            torch.cuda.empty_cache()  # the trainer's freed cached blocks back to the GPU: no OOM on waking
            self.engine.wake_up(["weights"])
        if self._stale(version):
            load_policy(self.engine, model, version)
            self.version = version
        if colocate:
            self.engine.wake_up(["kv_cache"])
        try:
            yield self.engine
        finally:
            if colocate:
                self.engine.sleep(self.rollout.sleep_level)

    def follow(self, model, version: int) -> None:
        """On trainer ranks other than 0 when rank 0 alone brings a shared engine (a server) to `version`:
        take the part of its weight sync that needs every rank (ZeRO-3 gathers), send nothing."""
        if not self.shares_weights and self._stale(version):
            for _ in policy_tensors(model):
                pass
            self.version = version

    def _stale(self, version: int) -> bool:
        """Whether the engine's weights must be sent before it generates with policy `version`. Sleep level
        2 discards them, so every use after one sends them again, also at an unchanged version (held-out
        evaluation at version 0, then step 0). Decided from the recipe, not from this rank's own sleeps, so
        that all ranks decide alike (rank 0 alone evaluates, and under ZeRO-3 the sync's gather is
        collective)."""
        return (self.rollout.colocate and self.rollout.sleep_level >= 2) or self.version != version


def trainer_rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the trainer ranks' process group; (0, 1) outside one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SyncRollout(RolloutSource):
    """Generate each batch when it is asked for, with the policy being trained.

    Each trainer rank generates its own share of the prompts (consecutive, `contiguous_shares`) with its own
    engine, sampled exactly as the whole batch would sample them (`SamplingParams.share`), and rewards it;
    the ranks then exchange their shares, so every rank holds the same whole batch (the same micro-batch
    count, the same loss totals) and generation is not repeated on every rank. With a rollout server, rank 0
    alone brings the server up to date and asks it for the whole batch, which it hands to the other ranks;
    each still rewards its share.

    `reward(rows, groups)` rewards one share (`scoring.reward_groups`), `score(prompt_ids, groups, rewards,
    metrics)` scores the whole batch from them (`scoring.score_rewarded`); `policy()` returns the trainer's
    (model, policy version) at the time of asking."""

    def __init__(
        self,
        engine: LocalEngine,
        cfg: TrainConfig,
        *,
        prompts: Callable[[int], StepPrompts],
        reward: Callable[[list[dict], list], RewardResult],
        score: Callable[..., tuple[RolloutBatch, dict]],
        policy: Callable,
        rank: int | None = None,
        world: int | None = None,
        order: PromptOrder | None = None,
    ):
        self.engine, self.cfg, self.prompts, self.policy = engine, cfg, prompts, policy
        self.order = order
        self.reward, self.score = reward, score
        self.rank, self.world = (
            (rank, world) if rank is not None and world is not None else trainer_rank_and_world()
        )
        self.shared = self.world > 1 and served_by_rank_zero(engine.rollout)

    def next(self, step: int) -> tuple[RolloutBatch, dict]:
        rows, prompt_ids, sampling = self.prompts(step)
        lo, hi = contiguous_shares(len(prompt_ids), self.world)[self.rank]
        t0 = time.perf_counter()
        if self.shared:
            groups = None
            if self.rank == 0:
                with self.engine.holding(*self.policy()) as engine:
                    groups = engine.generate(prompt_ids, self.cfg.num_generations, sampling)
            else:
                self.engine.follow(*self.policy())
            shared = [groups]
            torch.distributed.broadcast_object_list(shared, src=0)
            groups = shared[0][lo:hi]
        else:
            share = replace(sampling, share=(lo, len(prompt_ids))) if self.world > 1 else sampling
            with self.engine.holding(*self.policy()) as engine:  # every rank: ZeRO-3 gathers collectively
                groups = (
                    engine.generate(prompt_ids[lo:hi], self.cfg.num_generations, share) if hi > lo else []
                )
        t1 = time.perf_counter()
        part = (
            groups,
            self.reward(rows[lo:hi], groups) if groups else None,
            t1 - t0,
            time.perf_counter() - t1,
        )
        parts = [part]
        if self.world > 1:  # every rank gets every share, in prompt order
            parts = [None] * self.world
            torch.distributed.all_gather_object(parts, part)
        groups = [g for p in parts for g in p[0]]
        rewards = RewardResult.concat([p[1] for p in parts if p[1] is not None])
        t2 = time.perf_counter()
        batch, metrics = self.score(
            prompt_ids, groups, rewards, {"timing/rollout_s": max(p[2] for p in parts)}
        )
        # the slowest rank's rewards held the step up, then every rank scored the whole batch
        metrics["timing/reward_s"] = max(p[3] for p in parts) + time.perf_counter() - t2
        _observe(self.order, step, batch)
        return batch, metrics


class AsyncRollout(RolloutSource):
    """Batches generated by rollout worker processes while the trainer trains; see the module docstring.

    `policy()` returns the trainer's (model, policy version) at the time of asking."""

    def __init__(
        self,
        rollout: RolloutConfig,
        cfg: TrainConfig,
        model_path: str,
        model_version: int,
        model: ModelConfig,
        *,
        prompts: Callable[[int], StepPrompts],
        score: Score,
        policy: Callable,
        rank: int,
        world: int,
        order: PromptOrder | None = None,
    ):
        self.prompts, self.score, self.policy, self.cfg = prompts, score, policy, cfg
        self.order = order
        self.overlap, self.world, self.workers, self._ready = rollout.max_staleness >= 1, world, None, None
        self.inflight: dict[int, tuple] = {}  # step -> (rows, prompt ids) of each batch asked for, not yet in
        self.asked = -1  # the last step whose batch was asked for (or, past the last step, passed over)
        # the policy version the workers hold (that of `model_path`), on every rank: the others follow rank
        # 0's syncs (ZeRO-3 gathers)
        self.synced_version = model_version
        if rank == 0:
            self._start_workers(rollout, model_path, model)
        # on a CPU the cores are split between the trainer and the workers while they run; the trainer has
        # them all again after `close` (its held-out evaluation after training)
        self.trainer_threads = None
        if not torch.cuda.is_available():
            self.trainer_threads = torch.get_num_threads()
            torch.set_num_threads(cpu_threads_per_side(rollout.num_engines))

    def _start_workers(self, rollout: RolloutConfig, model_path: str, model: ModelConfig) -> None:
        """Start the workers; they come up (interpreter, torch, model) while the trainer goes on (its held-out
        evaluation), and `start` waits for them."""
        from trainer.placement import this_trainer

        placed = this_trainer(rollout)[0].workers  # each on its engine's GPUs, or the CPU
        trainer_device = next(self.policy()[0].parameters()).device  # where the weights are sent from
        self.workers = RolloutWorkers(
            model_path,
            model_cfg=model,
            devices=[w.device for w in placed],
            num_engines=len(placed),
            timeout_s=rollout.sync_timeout_s,
            threads_per_worker=cpu_threads_per_side(len(placed)),
            version=self.synced_version,
            rollout=rollout,
            max_model_len=self.cfg.max_prompt_length + self.cfg.max_completion_length,
            seed=self.cfg.seed,
            cuda_visible_devices=[w.cuda_visible_devices for w in placed],
            trainer_device=str(trainer_device),
            wait=False,
        )
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-workers-start")
        self._ready = pool.submit(self.workers.wait_ready)
        pool.shutdown(wait=False)

    def start(self, step: int) -> None:
        """Start batch `step`, from the current policy: workers started from another version (a LoRA run's
        from its base model) are synced first."""
        if self.workers is not None:
            self._ready.result()
            self._sync_and_submit(step)
        else:
            self._follow()

    def next(self, step: int) -> tuple[RolloutBatch, dict]:
        if self.workers is not None:
            scored = self._collect(step)
        else:  # another trainer rank: rank 0 syncs the workers inside _collect when overlapping
            scored = (None, None)
            if self.overlap:
                self._follow()
        if self.world > 1:
            shared = [scored]
            torch.distributed.broadcast_object_list(shared, src=0)
            scored = shared[0]
        _observe(self.order, step, scored[0])
        return scored

    def after_update(self, step: int, metrics: dict) -> None:
        """Without overlap, the next batch starts only now, from the updated weights. With overlap, where the
        workers can take the weights while they generate (`syncs_while_generating`: one trainer rank), the
        updated weights and the request of batch step + 2 go now: each worker starts it as soon as it ends
        batch step + 1, instead of after the trainer has collected that batch."""
        if self.overlap:
            if self._syncs_early():
                self.asked = step + 2
                if step + 2 < self.cfg.max_steps:  # the last two updates feed no batch
                    metrics.update(self._sync_and_submit(step + 2))
            return
        if self.workers is not None:
            metrics.update(self._sync_and_submit(step + 1))
        else:
            self._follow()

    def idle_metrics(self, metrics: dict) -> dict:
        step_s = metrics["timing/step_s"]
        return {
            "trainer_idle_fraction": metrics["timing/wait_s"] / step_s,
            "rollout_idle_fraction": max(0.0, 1 - metrics["timing/rollout_s"] / step_s),
        }

    def close(self) -> None:
        try:
            if self.workers is not None:
                try:
                    # a start that failed stopped its workers itself (and was raised at `start`); a Ctrl-C
                    # while waiting for one under way still stops the workers, then goes on up
                    with contextlib.suppress(Exception):
                        self._ready.result()
                finally:
                    self.workers.close()
        finally:
            if self.trainer_threads is not None:
                torch.set_num_threads(self.trainer_threads)

    def _syncs_early(self) -> bool:
        return self.workers is not None and self.world == 1 and self.workers.syncs_while_generating

    def _request(self, step: int) -> tuple | None:
        """Batch `step`'s prompts as the workers take them (None past the last step)."""
        if step >= self.cfg.max_steps:
            return None
        rows, prompt_ids, sampling = self.prompts(step)
        return step, rows, prompt_ids, sampling

    def _sync_and_submit(self, next_step: int, request: tuple | None = None) -> dict:
        """Send the current weights (unless the workers hold them already) and request `next_step` (its
        `request` made already, or made now) behind them; the sync's metrics."""
        metrics = {"timing/weight_sync_s": 0.0, "weight_sync/bytes": 0}
        model, version = self.policy()
        self.asked = max(self.asked, next_step)
        request = request or self._request(next_step)
        then = None
        if request is not None:
            step, rows, prompt_ids, sampling = request
            self.inflight[step] = (rows, prompt_ids)
            then = (step, prompt_ids, self.cfg.num_generations, sampling)
        if version != self.synced_version:
            sync = self.workers.sync_weights(model, version, then)
            metrics = {"timing/weight_sync_s": sync.seconds, "weight_sync/bytes": sync.bytes}
            self.synced_version = version
        elif then is not None:
            self.workers.submit(*then)
        return metrics

    def _follow(self) -> None:
        """On trainer ranks other than 0, at the moments rank 0 syncs the workers: take the part of the sync
        that needs every rank (ZeRO-3 gathers the weights collectively), send nothing. For whole weights (DDP,
        ZeRO-1/2) it only walks the parameters. `LocalEngine.follow` is the same for a server's sync (its
        tensors differ)."""
        model, version = self.policy()
        if version != self.synced_version:
            for _ in sync_tensors(model):
                pass
            self.synced_version = version

    def _collect(self, step: int) -> tuple[RolloutBatch, dict]:
        """Batch `step`, scored, with timing metrics; starts the next batch when overlapping."""
        rows, prompt_ids = self.inflight.pop(step)
        # the next batch's prompts while this one is still generating (unless asked for already): the
        # workers wait on nothing but the weights once it is back (the curriculum has seen batch step - 1)
        ask_next = self.overlap and step + 1 > self.asked
        request = self._request(step + 1) if ask_next else None
        t0, busy_before = time.perf_counter(), self.workers.busy_s
        groups = self.workers.collect(step)
        # workers generate their shards in parallel: the batch kept each of them busy this long on average
        busy = (self.workers.busy_s - busy_before) / len(self.workers.procs)
        metrics = {
            "timing/wait_s": time.perf_counter() - t0,
            "timing/rollout_s": busy,
            "timing/weight_sync_s": 0.0,
            "weight_sync/bytes": 0,
        }
        if ask_next:
            metrics.update(self._sync_and_submit(step + 1, request))
        return self.score(rows, prompt_ids, groups, metrics)


__all__ = [
    "AsyncRollout",
    "LocalEngine",
    "RolloutSource",
    "StepPrompts",
    "SyncRollout",
    "step_prompts",
    "trainer_rank_and_world",
]
