"""An exclusive lock on a directory that one grpoflow process at a time may write (a run directory, a state
folder).

The lock is an advisory `fcntl.flock` on a file in the directory (`.lock` by default) that records its holder:
pid, host, start time and command line, for the message a second process gets. The kernel releases it when
the holder's file is closed, so a process that dies (SIGKILL included) leaves no stale lock; the file itself
stays. Only grpoflow processes honour it: it keeps two grpoflow commands apart, not a person with `rm`.

- Held per process: taking a lock this process already holds is a no-op (a command that holds a state
  folder and calls a stage that takes it again), and the file's descriptor is not inherited by children.
- Handed down: the trainer ranks a launcher starts take the lock their launcher holds as held by them
  (`Held.child_env`, checked against the pid the lock file records), so they neither deadlock on it nor
  need it released meanwhile.
- On a busy lock the caller either fails at once (`wait_s=0`: `DirectoryBusy`, exit 2 naming the holder)
  or waits a bounded time for it.

flock works on local file systems and, on Linux, on NFS (emulated with POSIX locks); not on every network
file system: keep run directories that several hosts write on one that supports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data.errors import GrpoflowUserError
from data.redact import redact

LOCK_FILE = ".lock"
HANDED_DOWN = "GRPOFLOW_HELD_LOCKS"  # JSON {lock file: pid of the process that holds it for this one}
_POLL_S = 0.2
_COMMAND_CHARS = 1000  # of the holder's command line in its record: enough to recognise it
_held_here: dict[str, int] = {}  # lock files this process holds -> how many holders nest


class DirectoryBusy(GrpoflowUserError):
    """Another process holds the directory's lock; the message names the directory and the holder."""


@dataclass(frozen=True)
class Held:
    lock_file: Path
    owner: bool  # False: taken by an outer holder in this process, or by the process that launched this one

    def child_env(self) -> dict[str, str]:
        """Environment for processes started to work under this lock (trainer ranks) instead of taking it."""
        handed = _handed_down()
        handed[str(self.lock_file)] = (
            os.getpid() if self.owner else handed.get(str(self.lock_file), os.getpid())
        )
        return {HANDED_DOWN: json.dumps(handed)}


@contextlib.contextmanager
def exclusive(
    directory: str | os.PathLike, setting: str, *, name: str = LOCK_FILE, wait_s: float = 0.0
) -> Iterator[Held]:
    """Hold `directory`'s lock file `name` for the block (the directory is made if missing). `setting` names
    the directory in the message (`train.output_dir`, `--state-dir`). Busy: wait up to `wait_s` seconds, then
    raise `DirectoryBusy` naming the holder's pid, host, command and start time."""
    directory = Path(directory).resolve()
    lock_file = directory / name
    key = str(lock_file)
    if key in _held_here:
        _held_here[key] += 1
        try:
            yield Held(lock_file, owner=False)
        finally:
            _held_here[key] -= 1
        return
    made = _make_dirs(directory)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        holder = _acquire(fd, lock_file, setting, wait_s)
        if holder is not None:  # held by the process that launched this one
            yield Held(lock_file, owner=False)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_record()).encode(), 0)
        _held_here[key] = 1
        try:
            yield Held(lock_file, owner=True)
        finally:
            del _held_here[key]
            os.ftruncate(fd, 0)  # a reader that finds the lock busy in between reads no stale holder
            _remove_if_unused(made, lock_file)
    finally:
        os.close(fd)  # releases the lock


def _make_dirs(directory: Path) -> list[Path]:
    """Make `directory` and its missing parents; returns those it made, deepest first."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_if_unused(made: list[Path], lock_file: Path) -> None:
    """Remove the directories this lock made when nothing but the lock file was written in them (a run
    refused before it wrote anything leaves no trace). Done while still holding the lock: a process that
    opened the file meanwhile is refused as busy, one that comes later makes a new one."""
    if not made or any(p != lock_file for p in made[0].iterdir()):
        return
    lock_file.unlink(missing_ok=True)
    for d in made:
        try:
            d.rmdir()
        except OSError:  # something else was written there meanwhile
            return


def holder_of(lock_file: str | os.PathLike) -> dict:
    """What the lock file records about its holder ({} when it records nothing yet)."""
    try:
        record = json.loads(Path(lock_file).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _acquire(fd: int, lock_file: Path, setting: str, wait_s: float) -> dict | None:
    """Lock `fd`; None when this process now holds it, the holder's record when the holder handed it down."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            holder = holder_of(lock_file)
            if holder.get("pid") is not None and _handed_down().get(str(lock_file)) == holder["pid"]:
                return holder
            if time.monotonic() >= deadline:
                raise DirectoryBusy(_busy_message(lock_file, setting, holder, wait_s)) from None
            time.sleep(_POLL_S)


def _busy_message(lock_file: Path, setting: str, holder: dict, wait_s: float) -> str:
    if holder.get("pid") is None:
        who = "a process that is just starting (its record is not written yet)"
    else:
        who = (
            f"pid {holder['pid']} on {holder.get('host', '?')}, since {holder.get('started', '?')}: "
            f"{holder.get('command', '?')}"
        )
    waited = f" (waited {wait_s:g} s)" if wait_s else ""
    return (
        f"{setting} {lock_file.parent} is in use by another grpoflow process{waited}: {who} (lock file "
        f"{lock_file.name}); wait for it to finish, or use another {setting}"
    )


def _record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": redact(" ".join(getattr(sys, "orig_argv", sys.argv)))[:_COMMAND_CHARS] or "?",
    }


def _handed_down() -> dict:
    try:
        handed = json.loads(os.environ.get(HANDED_DOWN) or "{}")
    except ValueError:
        return {}
    return handed if isinstance(handed, dict) else {}
