"""The real model server with its model paced by the test: `grpoflow serve-model` whose forward passes and
request-handling tokenizer calls can be held at a gate until the test lets them through.

Some serving behaviours are orderings: a request times out while it is still being generated, a small request
completes while a big one is still being generated, /health answers while a body is being parsed. Left to
the CPU, each is a race that a faster machine loses. Here the test decides when generation moves on, so the
ordering holds at any speed; what the server computes is untouched (the real checkpoint, tokenizer and
generation: the gate only waits before a call).

The server side: `python tests/paced_model.py PACE_DIR serve-model CHECKPOINT ...` installs the gates and runs
`grpoflow serve-model` (flows.cli's main) in that process. The gates are a forward pre-hook on the model
(every forward pass, prefill and decoding steps) and a wrapper of the tokenizer's `__call__` and `decode` for
the calls made outside generation (parsing a request, cutting a reply at stop strings: the server's worker
threads; the decoding of finished completions on the generating thread passes freely).

The test side: `Pace(PACE_DIR)`. A gate is open unless the test holds it. Each call counts itself in
`<gate>.entered` as it reaches the gate; while `<gate>.allowed` exists, call number k waits until k <= its
value. A call is waiting at the gate when entered > allowed; the test lets calls through by raising allowed.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_POLL_S = 0.002  # how often a held call, or the test, looks at the gate's files


def _write(path: Path, value: int) -> None:
    """Atomically: the other process reads the old value or the new one, never a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(str(value))
    os.replace(tmp, path)


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return None


# ---- the test's side --------------------------------------------------------------------------------------


class Pace:
    """The gates of one paced server, driven from the test through the files in `directory`."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def command(self, *args: str) -> list[str]:
        """`grpoflow ARGS` in a process whose model and tokenizer are paced by this object."""
        return [sys.executable, str(Path(__file__).resolve()), str(self.directory), *args]

    def entered(self, gate: str) -> int:
        """How many calls have reached `gate` (passed, or waiting at it)."""
        return _read(self.directory / f"{gate}.entered") or 0

    def waiting(self, gate: str) -> bool:
        allowed = _read(self.directory / f"{gate}.allowed")
        return allowed is not None and self.entered(gate) > allowed

    @contextmanager
    def holding(self, gate: str, passing: int = 0) -> Iterator[None]:
        """While the block runs, the next `passing` calls go through `gate` and the ones after wait; the gate
        opens when the block ends, however it ends."""
        _write(self.directory / f"{gate}.allowed", self.entered(gate) + passing)
        try:
            yield
        finally:
            self.open(gate)

    def open(self, gate: str) -> None:
        (self.directory / f"{gate}.allowed").unlink(missing_ok=True)

    def let_one_through(self, gate: str) -> None:
        path = self.directory / f"{gate}.allowed"
        _write(path, _read(path) + 1)

    def wait_held(self, gate: str, what: str, answered: Callable[[], bool]) -> None:
        """Return once a call waits at `gate` (the server has got as far as the test lets it); fail at once
        if `answered()`, the request the test is pacing was answered first."""
        _until(lambda: self.waiting(gate), what, answered)

    def step_until(self, gate: str, done: Callable[[], bool], what: str) -> int:
        """Let the calls waiting at `gate` through one at a time until `done()`; returns how many went
        through."""
        steps = 0
        while not done():
            _until(lambda: self.waiting(gate) or done(), what)  # the next call has reached the gate
            if not done():
                self.let_one_through(gate)
                steps += 1
        return steps


def _until(condition: Callable[[], bool], what: str, answered=lambda: False, bound_s: float = 120) -> None:
    """Poll `condition` (the bound only keeps a broken server from hanging the tests)."""
    end = time.monotonic() + bound_s
    while not condition():
        if answered():
            raise AssertionError(f"{what}: never happened; the request was answered first")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: never happened")
        time.sleep(_POLL_S)


# ---- the server's side ------------------------------------------------------------------------------------


class _Gate:
    def __init__(self, directory: Path, name: str):
        self.entered_path, self.allowed_path = directory / f"{name}.entered", directory / f"{name}.allowed"
        self.count, self.lock = 0, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.count += 1
            mine = self.count
            _write(self.entered_path, mine)
        while (allowed := _read(self.allowed_path)) is not None and mine > allowed:
            time.sleep(_POLL_S)


def install(directory: Path) -> None:
    """Gate the model and tokenizer that the server loads (through `trainer.model_loading.load_model`, the
    one loader, which the server imports when it starts serving)."""
    from trainer import model_loading

    real_load = model_loading.load_model

    @functools.wraps(real_load)
    def load_paced(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        forward, tokenizer_gate = _Gate(directory, "forward"), _Gate(directory, "tokenizer")
        generating: set[int] = set()  # the threads that run forward passes

        def before_forward(module, inputs):
            generating.add(threading.get_ident())
            forward()

        model.register_forward_pre_hook(before_forward)
        cls = type(tokenizer)  # the server process holds this one tokenizer
        for name in ("__call__", "decode"):
            real = getattr(cls, name)

            def paced(self, *a, _real=real, **k):
                if threading.get_ident() not in generating:
                    tokenizer_gate()
                return _real(self, *a, **k)

            setattr(cls, name, functools.wraps(real)(paced))
        return model, tokenizer

    model_loading.load_model = load_paced


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this file is in
    pace_dir, *argv = sys.argv[1:]
    install(Path(pace_dir))
    from flows.cli import main

    sys.exit(main(argv))
