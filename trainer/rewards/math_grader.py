"""Deciding whether a predicted answer equals a gold answer with math-verify, in a process that can be killed.

Why a separate process: math-verify's own timeout is `signal.alarm`, which only works in the main thread and,
more importantly, cannot interrupt a single long C call. Parsing `\\binom{1000000}{500000}` or comparing
`2^{2^{30}}` with a number spends seconds to hours inside one big-integer operation that holds the GIL, so a
thread timeout cannot stop it either: the whole training process would freeze (huggingface/Math-Verify#65).
`grade_answer` therefore sends each (gold, predicted) pair to one long-lived worker subprocess (this file run
as a script) and waits at most `GRADE_TIMEOUT_S`; a worker that does not answer in time is killed and
restarted, and the answer scores 0.0 (an answer too costly to check is treated as wrong). The worker's address
space is capped at `WORKER_MEMORY_BYTES` where the OS allows it. One worker serves the whole process, one pair
at a time.

`parse_math` and `grade_in_process` are the plain in-process functions the worker runs; they use math-verify's
signal timeouts in the main thread and switch them off elsewhere (they raise there otherwise).

This module imports nothing from `trainer`, so that the worker starts with just the standard library and
math-verify.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading

from math_verify import parse, verify

logger = logging.getLogger("grpoflow.rewards")

GRADE_TIMEOUT_S = 5.0  # per pair; math-verify's own default, ample for any real answer
STARTUP_TIMEOUT_S = 120.0  # importing sympy on a busy CI machine
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's signal timeout inside the worker (whole seconds)
WORKER_MEMORY_BYTES = 4 * 1024**3

# Text that already carries LaTeX delimiters is parsed as written; bare text is wrapped in `$…$` first.
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def parse_math(text: str) -> list:
    """math-verify's parse of an answer string; plain numbers and bare LaTeX are wrapped in `$…$` so that
    "025", "18" and "\\frac{1}{2}" all parse. Empty list if nothing parses."""
    timeout = _signal_timeout()
    if any(delimiter in text for delimiter in _LATEX_DELIMITERS):
        candidates = [text]
    else:
        # Bare text second: `$…$` reads "3\sqrt{2}" whole, where bare parsing would stop at "3".
        candidates = [f"${text}$", text]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=timeout)
        if parsed:
            return parsed
    return []


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    # A group's completions share one gold answer: parse it once.
    return tuple(parse_math(gold))


def grade_in_process(gold: str, predicted: str) -> float | None:
    """1.0 if `predicted` equals `gold` under math-verify, 0.0 if not, None if `gold` does not parse.
    Unbounded."""
    gold_parsed = list(_parse_gold(gold))
    if not gold_parsed:
        return None
    predicted_parsed = parse_math(predicted)
    if not predicted_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, predicted_parsed, timeout_seconds=_signal_timeout()) else 0.0


def _signal_timeout() -> int | None:
    # signal.alarm raises ValueError outside the main thread; None turns math-verify's timeout off there.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


_PLAIN_INT = re.compile(r"-?[0-9]{1,30}")


def grade_answer(gold: str, predicted: str) -> float | None:
    """`grade_in_process` in the worker subprocess, bounded by GRADE_TIMEOUT_S (0.0 when it runs out).

    Two plain ASCII integers are compared here directly: math-verify would say the same ("025" equals
    "25"), and most answers in arithmetic tasks are such integers, so most calls skip the worker trip.
    """
    g, p = gold.strip(), predicted.strip()
    if _PLAIN_INT.fullmatch(g):
        if not p:  # no answer at all against a readable gold: nothing to verify
            return 0.0
        if _PLAIN_INT.fullmatch(p):
            return 1.0 if int(g) == int(p) else 0.0
    return _WORKER.grade(gold, predicted)


class _WorkerProcess:
    """The worker subprocess: JSON `[gold, predicted]` lines in, JSON result lines out; restarted when
    killed."""

    def __init__(self):
        self._forget()

    def grade(self, gold: str, predicted: str) -> float | None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps([gold, predicted]) + "\n")
                self._proc.stdin.flush()
                line = self._lines.get(timeout=GRADE_TIMEOUT_S)
            except (queue.Empty, BrokenPipeError):
                line = None
            if line is None:  # timed out, or the worker died on this pair (e.g. out of memory)
                self._stop()
                self.killed += 1
                log = logger.warning if self.killed == 1 else logger.debug
                log(
                    "math-verify gave no verdict within %s s on answer %.80r; scored 0.0, worker restarted "
                    "(later cases are logged at debug level)",
                    GRADE_TIMEOUT_S,
                    predicted,
                )
                return 0.0
            return json.loads(line)

    def _start(self) -> None:
        # run_path rather than `python <file>`: the latter would put trainer/rewards/ first on the worker's
        # sys.path, where our module names could shadow top-level ones.
        command = [
            sys.executable,
            "-u",
            "-c",
            f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')",
        ]
        self._proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True).start()
        try:
            ready = self._lines.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            ready = None
        if ready != "ready\n":
            self._stop()
            raise RuntimeError(f"math-verify worker ({__file__}) did not start; its stderr above says why")

    def _forget(self) -> None:
        # Also run in a forked child (e.g. a dataloader worker), where the pipe belongs to the parent: start
        # afresh, kill nothing, and do not inherit a lock another thread may have held at the fork.
        self._lock = threading.Lock()
        self.killed = 0  # pairs that got no verdict in time (or crashed the worker)
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _pump(stream, lines: queue.Queue) -> None:
    # Reading in a thread lets `grade` wait on a queue with a timeout, on every OS; None marks the end.
    for line in stream:
        lines.put(line)
    lines.put(None)


_WORKER = _WorkerProcess()
atexit.register(_WORKER._stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKER._forget)


def serve() -> None:
    """The worker loop: one result line per request line, until stdin closes (the parent exited)."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass  # no such limit on this OS; the timeout still bounds the time
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are reported as 0.0, not as log spam
    print("ready", flush=True)
    for line in sys.stdin:
        gold, predicted = json.loads(line)
        try:
            result = grade_in_process(gold, predicted)
        except (
            Exception
        ):  # whatever math-verify lets escape (RecursionError on deep nesting...) is a wrong answer
            result = 0.0
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    serve()
