"""Scoring a batch with several weighted reward functions, so that one broken reward cannot stop training.

`RewardRunner` calls each function once on the whole batch, in a worker thread bounded by `timeout_s`:
- if the call raises (or returns a list of the wrong length, or not a list), the function is called again on
  each completion alone, so that only the completions it fails on get None and the rest keep their rewards;
- if the call runs past `timeout_s`, it is abandoned and every completion of that call gets None (the batch is
  not retried sample by sample: that could cost `timeout_s` per completion);
- a value that is not None and not a finite real number is an error for that completion only; a reward that
  scores completions independently (a model behind an endpoint) puts an exception instance in its list for
  each completion it could not score, which is that completion's error, without the batch being retried.

Each completion that gets None through an error counts once in `errors[name]`; a function returning None
itself (e.g. an unreadable gold answer) is not an error. The first failure of each (function, exception type)
is logged on the "grpoflow.rewards" logger with an example message; later ones are only counted.

The total per completion is the sum of weight * reward over the functions that gave a value, and None when
none did (TRL's nansum, except that it keeps "no signal at all" visible).

A Python thread cannot be killed: an abandoned call keeps running in its daemon thread until it returns, and a
long C call (a huge big-integer power) holds the GIL so that not even the timeout can fire. Rewards must bound
their own work; the math rewards do, by grading in a subprocess (`math_grader`). A reward marked
`bounds_own_work` (every built-in: no waits, work linear in the completions' length, math-verify behind its
own 5 s a pair) is therefore called in the caller's thread: a thread could stop nothing in it, and starting
one and waiting for its result cost the step more than the rewards themselves (the bench's pinned step, an
idle Intel Xeon: 3.2-3.8 ms of rewards and scoring a step in threads, 0.9 ms in the caller's). A plug-in may
carry the mark too (`fn.bounds_own_work = True`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import numbers
import statistics
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger("grpoflow.rewards")

# TRL's reward signature: f(prompts, completions, **columns) -> one float (or None: no reward) per completion.
RewardFn = Callable[..., list]


class RewardTimeout(TimeoutError):
    """A reward call ran past the runner's timeout and was abandoned."""


def call_with_timeout(fn: Callable, timeout_s: float, name: str, *args, **kwargs):
    """`fn(*args, **kwargs)`, or TimeoutError after `timeout_s` seconds (the call is abandoned, left to end
    on its own in a daemon thread named `name`). Its exception, if it raises, is raised here.

    A daemon thread rather than a ThreadPoolExecutor: executors join their threads at interpreter exit, so
    one hung call (a reward, a tool) would keep the process from ever ending."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # handed to the caller, which decides what to count
            future.set_exception(error)

    threading.Thread(target=work, name=name, daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    if not done:
        raise TimeoutError(f"no result after {timeout_s} s")
    return future.result()


def bounds_own_work(fn: RewardFn) -> RewardFn:
    """Marks `fn` as a reward whose calls end by its own code (module docstring): the runner calls it in
    the caller's thread, with no timeout thread."""
    fn.bounds_own_work = True
    return fn


class BadRewardOutput(TypeError):
    """A reward returned something other than one finite number or None per completion."""


@dataclass
class RewardResult:
    """Rewards of one batch: per function, weighted total, and completions lost to errors per function."""

    per_function: dict[str, list[float | None]]
    total: list[float | None]
    errors: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return reward_metrics(self)

    @classmethod
    def concat(cls, parts: Sequence[RewardResult]) -> RewardResult:
        """The rewards of consecutive parts of one batch (each trainer rank's share) as one batch's."""
        names = list(parts[0].per_function) if parts else []
        return cls(
            {name: [v for part in parts for v in part.per_function[name]] for name in names},
            [v for part in parts for v in part.total],
            {name: sum(part.errors.get(name, 0) for part in parts) for name in names},
        )


def reward_metrics(result: RewardResult) -> dict[str, float]:
    """`rewards/<fn>/mean`, `rewards/<fn>/std` (sample std, 0.0 for a single value) over the non-None values,
    and `rewards/<fn>/errors`. Mean and std are left out for a function with no value at all in the batch."""
    metrics: dict[str, float] = {}
    for name, values in result.per_function.items():
        present = [v for v in values if v is not None]
        if present:
            metrics[f"rewards/{name}/mean"] = statistics.fmean(present)
            metrics[f"rewards/{name}/std"] = statistics.stdev(present) if len(present) > 1 else 0.0
        metrics[f"rewards/{name}/errors"] = float(result.errors.get(name, 0))
    return metrics


class RewardRunner:
    """Weighted reward functions with per-completion isolation of errors and a per-call timeout.

    specs: (name, function, weight) triples; names must be unique, they label the metrics.
    timeout_s: seconds one call may take; None calls in the current thread without any bound (debugging).
    """

    def __init__(self, specs: Sequence[tuple[str, RewardFn, float]], timeout_s: float | None = 60.0):
        self.specs: list[tuple[str, RewardFn, float]] = []
        for name, fn, weight in specs:
            if not callable(fn):
                raise TypeError(f"reward {name!r}: expected a callable, got {type(fn).__name__}")
            if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
            if any(name == other for other, _, _ in self.specs):
                raise ValueError(
                    f"reward name {name!r} appears twice; names label metrics and must be unique"
                )
            self.specs.append((name, fn, float(weight)))
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self._logged: set[tuple[str, str]] = set()

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.specs]

    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> RewardResult:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        per_function, errors = {}, {}
        for name, fn, _ in self.specs:
            per_function[name], errors[name] = self._score(name, fn, prompts, completions, columns)
        total = []
        for i in range(len(completions)):
            parts = [
                w * per_function[name][i] for name, _, w in self.specs if per_function[name][i] is not None
            ]
            total.append(math.fsum(parts) if parts else None)
        return RewardResult(per_function, total, errors)

    def _score(
        self, name: str, fn: RewardFn, prompts, completions, columns
    ) -> tuple[list[float | None], int]:
        n = len(completions)
        if n == 0:
            return [], 0
        try:
            raw = _as_list(self._call(fn, prompts, completions, columns), n)
        except RewardTimeout as error:
            self._log_once(name, error, "the whole batch")
            return [None] * n, n
        except Exception as error:
            # Log the batch failure too: a function failing only on batches would otherwise run n times slower
            # silently.
            self._log_once(name, error, "the whole batch")
            return self._score_each(name, fn, prompts, completions, columns)
        values, failed = [], 0
        for i, value in enumerate(raw):
            try:
                values.append(_as_reward(value))
            except Exception as error:  # BadRewardOutput, or the exception the reward returned for it
                self._log_once(name, error, f"completion {i}")
                values.append(None)
                failed += 1
        return values, failed

    def _score_each(self, name, fn, prompts, completions, columns) -> tuple[list[float | None], int]:
        n = len(completions)
        values, failed = [], 0
        for i in range(n):
            row = {key: _row(column, i, n) for key, column in columns.items()}
            try:
                raw = _as_list(self._call(fn, [prompts[i]], [completions[i]], row), 1)
                values.append(_as_reward(raw[0]))
            except Exception as error:
                self._log_once(name, error, f"completion {i}")
                values.append(None)
                failed += 1
        return values, failed

    def _call(self, fn: RewardFn, prompts, completions, columns):
        if self.timeout_s is None or getattr(fn, "bounds_own_work", False):
            return fn(prompts, completions, **columns)
        name = f"reward-{getattr(fn, '__name__', 'fn')}"
        try:
            return call_with_timeout(fn, self.timeout_s, name, prompts, completions, **columns)
        except TimeoutError:
            raise RewardTimeout(f"no result after {self.timeout_s} s (call abandoned)") from None

    def _log_once(self, name: str, error: BaseException, where: str) -> None:
        key = (name, type(error).__name__)
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(
            "reward %r failed on %s with %s: %s (further %s from %r are counted, not logged)",
            name,
            where,
            key[1],
            error,
            key[1],
            name,
        )


def _row(column, i: int, n: int):
    # Per-sample columns are lists as long as the batch; anything else (e.g. TRL's trainer_state) passes
    # through.
    if isinstance(column, Sequence) and not isinstance(column, str) and len(column) == n:
        return [column[i]]
    return column


def _as_list(raw, n: int) -> list:
    # Lists, tuples and numpy arrays are all fine; a string or a mapping is not a list of rewards.
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable):
        raise BadRewardOutput(f"returned {_describe(raw)}, expected a list of {n} rewards")
    values = list(raw)
    if len(values) != n:
        raise BadRewardOutput(f"returned {len(values)} rewards for {n} completions")
    return values


def _as_reward(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, Exception):
        raise value
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    raise BadRewardOutput(f"returned {_describe(value)}, expected a finite number or None")


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
