"""EvalScope's child process: how it is launched, where its output goes, and what an error says of it.

EvalScope runs in `evalscope_worker.py`, a child process, so that its offline flags, its logging and its
memory stay out of the caller. Both the evaluation run and the collection build launch it through `launch`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from data.manifest import write_json_atomic

WORKER = Path(__file__).with_name("evalscope_worker.py")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def launch(
    spec: dict,
    workdir: Path,
    log_path: Path,
    *,
    offline: bool,
    echo: bool = False,
    secret_env: dict | None = None,
    name: str = "spec",
) -> tuple[int, dict]:
    """Run the worker on `spec` in `workdir`; its whole output goes to `log_path` (and to stderr when `echo`).

    Returns (exit code, the status the worker wrote, or {} when it wrote none). `secret_env`: variables for
    the child only (an endpoint's credentials), never written to a file.
    """
    spec_path, status_path = workdir / f"{name}.json", workdir / f"{name.replace('spec', 'status')}.json"
    write_json_atomic(spec_path, spec)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(OFFLINE_ENV if offline else {}), **(secret_env or {})}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(WORKER), str(spec_path), str(status_path)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            text=True,
            stdout=subprocess.PIPE if echo else log,
            stderr=subprocess.STDOUT,
        )
        try:
            if echo:
                for line in proc.stdout:
                    log.write(line)
                    sys.stderr.write(line)
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return code, json.loads(status_path.read_text()) if status_path.is_file() else {}


def log_tail(log_path: Path) -> str:
    """How an error about a worker ends: where its log is. The log's own lines (a traceback, progress bars)
    stay in the file: quoted, their fragments would make an error of many lines, none of them the cause."""
    return f"; EvalScope's log: {log_path}"


def one_line(message: str, limit: int = 500) -> str:
    """A worker's error message as one line: a traceback's lines and ANSI colours dropped, cut to `limit`."""
    lines = [line.strip() for line in _ANSI.sub("", message).splitlines()]
    kept = [
        line
        for line in lines
        if line
        and not line.startswith(("Traceback (most recent call last)", 'File "'))
        and set(line) - set("^~ ")
    ]
    text = " ".join(kept)
    return text if len(text) <= limit else text[: limit - 3] + "..."
