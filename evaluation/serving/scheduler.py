"""Fair generation for the transformers server: many requests share one model, none holds it to the end.

A worker thread keeps a list of generations in progress (`Decoding`s of `HFEngine`) and advances each by
`tokens_per_turn` tokens in turn, so a short request admitted next to a long one finishes after a few
turns instead of after the long one. Requests that arrive together with equal sampling settings share one
batched generation (up to `max_batch_size` requests and `max_batch_sequences` rows). At most
`max_active_sequences` rows are generated at once; later requests wait in arrival order.

A request is cancelled with `cancel()` (its client went away, or it ran past its deadline): it leaves the
queue, or its rows stop being decoded; a batch whose requests are all cancelled is dropped at once.
Every cancellation is counted (`cancelled`, `timed_out`) and logged with how far it got.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from itertools import count

from trainer.rollout.base import SamplingParams

log = logging.getLogger("grpoflow.serve")
_unique = count()


@dataclass(eq=False)
class Job:
    """One request's generation: `n` completions for each of its prompts."""

    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    name: str = "request"
    future: Future = field(default_factory=Future)
    why_cancelled: str | None = None
    timed_out: bool = False

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def key(self) -> tuple:
        """Jobs with equal keys can share one batched generation."""
        s = self.sampling
        if s.temperature <= 0:  # greedy: top_p and seed change nothing
            return (self.n, s.max_tokens, 0.0, s.ignore_eos)
        if s.seed is not None:  # a shared generator would make its tokens depend on its batch-mates
            return ("seeded", next(_unique))
        return (self.n, s.max_tokens, s.temperature, s.top_p, s.ignore_eos)


@dataclass(eq=False)
class _Batch:
    decoding: object  # trainer.rollout.hf_engine.Decoding
    jobs: list[Job]
    stopped: set = field(default_factory=set)  # ids of jobs whose rows no longer count


class Scheduler:
    """Round-robin token slices over the generations in progress, on one worker thread."""

    def __init__(
        self,
        engine,
        max_batch_size: int = 16,
        max_batch_sequences: int = 64,
        max_active_sequences: int = 256,
        tokens_per_turn: int = 16,
        window_s: float = 0.005,
    ):
        if min(max_batch_size, max_batch_sequences, max_active_sequences, tokens_per_turn) < 1:
            raise ValueError("scheduler sizes must be >= 1")
        self.engine, self.max_batch_size = engine, max_batch_size
        self.max_batch_sequences, self.max_active_sequences = max_batch_sequences, max_active_sequences
        self.tokens_per_turn, self.window_s = tokens_per_turn, window_s
        self.batches = self.requests = self.cancelled = self.timed_out = 0
        self._waiting: deque[Job] = deque()
        self._active: list[_Batch] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="grpoflow-scheduler", daemon=True)
        self._thread.start()

    # ---- called from request handlers -------------------------------------------------------------------

    def submit(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, name: str = "request"
    ) -> Job:
        job = Job(prompts, n, sampling, name)
        with self._cond:
            self._waiting.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job, why: str, timed_out: bool = False) -> None:
        """Stop generating for `job`; its future is cancelled (a result that raced in is dropped)."""
        with self._cond:
            if job.why_cancelled is None and not job.future.done():
                job.why_cancelled, job.timed_out = why, timed_out
                job.future.cancel()
                if job in self._waiting:  # not started: it just leaves the queue
                    self._waiting.remove(job)
                    self._count_cancelled(job, 0)
                self._cond.notify()

    def stats(self) -> dict:
        with self._cond:
            active = sum(len(b.jobs) - len(b.stopped) for b in self._active)
            return {
                "batches": self.batches,
                "requests": self.requests,
                "cancelled": self.cancelled,
                "timed_out": self.timed_out,
                "active": active,
                "waiting": len(self._waiting),
            }

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ---- the worker -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active or self._closing):
                    self._cond.wait()
                if self._closing:
                    break
                idle = not self._active
            if idle:
                time.sleep(self.window_s)  # let requests sent together arrive together: one batch
            self._admit()
            for batch in list(self._active):
                self._turn(batch)
        with self._cond:
            for job in [*self._waiting, *(j for b in self._active for j in b.jobs)]:
                job.future.cancel()
            self._waiting.clear()
            self._active.clear()

    def _admit(self) -> None:
        """Start generations for waiting requests, in arrival order, while rows are free."""
        from_queue = []
        with self._cond:
            busy = sum(b.decoding.rows for b in self._active)
            while self._waiting:
                head = self._waiting[0]
                if head.why_cancelled is not None:
                    self._waiting.popleft()
                    self._count_cancelled(head, 0)
                    continue
                if (self._active or from_queue) and busy + head.rows > self.max_active_sequences:
                    break  # it waits for rows to free up; those behind it wait too (arrival order)
                group, rows = [self._waiting.popleft()], head.rows
                for job in list(self._waiting):
                    if len(group) >= self.max_batch_size:
                        break
                    if (
                        job.key == head.key
                        and job.why_cancelled is None
                        and rows + job.rows <= self.max_batch_sequences
                        and busy + rows + job.rows <= self.max_active_sequences
                    ):
                        self._waiting.remove(job)
                        group.append(job)
                        rows += job.rows
                from_queue.append(group)
                busy += rows
        for group in from_queue:
            prompts = [p for job in group for p in job.prompts]
            try:
                decoding = self.engine.start(prompts, group[0].n, group[0].sampling)
            except Exception as e:  # noqa: BLE001 - the requests get the error, the server stays up
                self._fail(group, e)
                continue
            with self._cond:
                self._active.append(_Batch(decoding, group))

    def _turn(self, batch: _Batch) -> None:
        """Drop what was cancelled, decode `tokens_per_turn` tokens, deliver the batch if it finished."""
        decoding = batch.decoding
        with self._cond:
            start = 0
            for job in batch.jobs:
                if job.why_cancelled is not None and id(job) not in batch.stopped:
                    batch.stopped.add(id(job))
                    decoding.stop_rows(start, start + job.rows)
                    self._count_cancelled(job, decoding.t)
                start += job.rows
            if len(batch.stopped) == len(batch.jobs):
                self._active.remove(batch)  # nobody waits for it: its cache goes now
                return
        try:
            decoding.step(self.tokens_per_turn)
            outputs = decoding.results() if decoding.done else None
        except Exception as e:  # noqa: BLE001 - the requests get the error, the server stays up
            with self._cond:
                self._active.remove(batch)
            self._fail([j for j in batch.jobs if id(j) not in batch.stopped], e)
            return
        if outputs is None:
            return
        with self._cond:
            self._active.remove(batch)
            self.batches += 1
            first = 0  # the job's first prompt in the batch
            for job in batch.jobs:
                mine = outputs[first : first + len(job.prompts)]
                first += len(job.prompts)
                if id(job) in batch.stopped:
                    continue
                try:
                    job.future.set_result(mine)
                    self.requests += 1
                except InvalidStateError:  # cancelled while its last tokens were decoded
                    self._count_cancelled(job, decoding.t)

    def _fail(self, jobs: list[Job], error: Exception) -> None:
        for job in jobs:
            try:
                job.future.set_exception(error)
            except InvalidStateError:
                pass

    def _count_cancelled(self, job: Job, tokens: int) -> None:
        """Called with the lock held, once per cancelled job."""
        if job.timed_out:
            self.timed_out += 1
        else:
            self.cancelled += 1
        log.info(
            "%s: %s; its generation stopped after %d of %d tokens",
            job.name,
            job.why_cancelled,
            tokens,
            job.sampling.max_tokens,
        )
