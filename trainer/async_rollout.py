"""The trainer's side of asynchronous rollout: which batch is in flight, when weights go out.

Order per step t (max_staleness >= 1): take batch t (generated while batch t-1 trained), send the
current weights, request batch t+1, then train on batch t. Batch t was therefore produced by the policy
one version behind the one that trains on it, and the loss corrects for that with importance weights.
With max_staleness 0 the next batch is requested only after the update (no overlap, no staleness).
"""

from __future__ import annotations

import time

import torch

from trainer.rollout.remote import RemoteRollout, cpu_threads_per_side


class AsyncRollout:
    def __init__(self, trainer):
        r = trainer.recipe.rollout
        devices = [f"cuda:{d}" for d in r.rollout_devices] if r.rollout_devices and torch.cuda.is_available() else None
        self.trainer, self.overlap = trainer, r.max_staleness >= 1
        self.remote = RemoteRollout(str(trainer.checkpoint or trainer.model_path), trainer.recipe.model.dtype,
                                    devices, r.num_engines, r.sync_timeout_s, cpu_threads_per_side(r.num_engines),
                                    version=trainer.version)
        self.synced_version = trainer.version
        self.inflight = None

    def start(self, step: int) -> None:
        self._submit(step)

    def _submit(self, step: int) -> None:
        if step >= self.trainer.cfg.max_steps:
            return
        rows, prompt_ids, sampling = self.trainer.rows_for(step)
        self.inflight = (rows, prompt_ids)
        self.remote.submit(step, prompt_ids, self.trainer.cfg.num_generations, sampling)

    def _sync_and_submit(self, next_step: int) -> float:
        """Send the current weights (unless the workers hold them already), then request `next_step`."""
        seconds = 0.0
        if self.trainer.version != self.synced_version:
            seconds = self.remote.sync_weights(self.trainer.model, self.trainer.version)
            self.synced_version = self.trainer.version
        self._submit(next_step)
        return seconds

    def collect(self, step: int):
        """Batch `step`, scored, with timing metrics; starts the next batch when overlapping."""
        rows, prompt_ids = self.inflight
        t0, busy_before = time.perf_counter(), self.remote.busy_s
        groups = self.remote.collect(step)
        # workers generate their shards in parallel: the batch kept each of them busy this long on average
        busy = (self.remote.busy_s - busy_before) / len(self.remote.procs)
        metrics = {"timing/wait_s": time.perf_counter() - t0, "timing/rollout_s": busy,
                   "timing/generate_busy_s": busy, "timing/weight_sync_s": 0.0}
        if self.overlap:
            metrics["timing/weight_sync_s"] = self._sync_and_submit(step + 1)
        return self.trainer.score(rows, prompt_ids, groups, metrics)

    def after_update(self, step: int) -> float:
        """Without overlap, the next batch starts only now, from the updated weights."""
        return 0.0 if self.overlap else self._sync_and_submit(step + 1)

    def close(self) -> None:
        self.remote.close()
