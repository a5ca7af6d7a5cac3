"""What a model server accepts: the request and connection limits, the address it listens on, the API key.

Every check raises `ServingInputError` (a user error: exit 2) naming the flag, the host:port or the variable.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import math
import os
import socket
import threading
from dataclasses import dataclass, field, fields

from data.errors import GrpoflowUserError

LOOPBACK = "127.0.0.1"


class ServingInputError(GrpoflowUserError, ValueError):
    """A checkpoint, engine, address or limit that cannot be served (bad input, or a missing extra)."""


def _limit(default, flag: str, help: str, kind=int):
    return field(default=default, metadata={"flag": flag, "help": help, "type": kind})


@dataclass(frozen=True)
class ServerLimits:
    """What one request or connection may ask of the transformers server; each field is a `serve-model` flag.

    A request over a limit gets HTTP 400 naming the field (413 for the body). vLLM applies its own.
    `connections.py` applies the connection limits and timeouts.
    """

    max_body_bytes: int = _limit(
        1_000_000, "--max-body-bytes", "largest request body in bytes (HTTP 413 beyond)"
    )
    max_sequences: int = _limit(
        64, "--max-sequences", "most completions one request may ask for: prompts x n"
    )
    max_tokens: int | None = _limit(
        None,
        "--max-tokens",
        "largest max_tokens a request may ask for, and the "
        "default when it asks for none (default: what the "
        "model's context leaves after the prompt)",
    )
    max_stop: int = _limit(16, "--max-stop", "most stop strings per request")
    max_stop_length: int = _limit(256, "--max-stop-length", "longest stop string, in characters")
    request_timeout_s: float = _limit(
        600.0,
        "--request-timeout",
        "seconds a request may take, its upload included, before it is cancelled (HTTP 504)",
        float,
    )
    max_active_sequences: int = _limit(
        256,
        "--max-active-sequences",
        "completions generated at once across requests; later requests wait their turn",
    )
    max_connections: int = _limit(
        128,
        "--max-connections",
        "connections held at once; a connection beyond "
        "closes the one idle longest, else gets HTTP 503 "
        "(a few more may still ask for /health)",
    )
    max_connections_per_client: int | None = _limit(
        None,
        "--max-connections-per-client",
        "connections one client address may hold, so that one "
        "client cannot take them all (default: a quarter of "
        "--max-connections; behind a proxy, its clients are one "
        "address)",
    )
    header_timeout_s: float = _limit(
        10.0,
        "--header-timeout",
        "seconds a connection may take to send a "
        "request's headers, counted from its opening or "
        "its previous response; then it is closed",
        float,
    )
    body_timeout_s: float = _limit(
        60.0,
        "--body-timeout",
        "seconds a request's body may take to arrive after its headers (HTTP 408 beyond)",
        float,
    )
    keep_alive_timeout_s: float = _limit(
        5.0,
        "--keep-alive-timeout",
        "seconds an idle connection stays open after a response, waiting for the next request",
        float,
    )

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ServingInputError(
                    f"{f.metadata['flag']} must be a positive finite number, got {value!r}"
                )
        if self.max_sequences > self.max_active_sequences:
            raise ServingInputError(
                f"--max-sequences ({self.max_sequences}) cannot exceed --max-active-sequences "
                f"({self.max_active_sequences})"
            )
        if self.connections_per_client > self.max_connections:
            raise ServingInputError(
                f"--max-connections-per-client ({self.connections_per_client}) cannot exceed "
                f"--max-connections ({self.max_connections})"
            )

    @property
    def connections_per_client(self) -> int:
        return self.max_connections_per_client or max(1, self.max_connections // 4)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(
            **{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        )


def bind_socket(
    host: str, port: int, api_key: str | None = None, resolve_timeout_s: float = 10.0
) -> socket.socket:
    """A listening TCP socket on host:port; `ServingInputError` naming host:port if that cannot be.

    An address other machines can reach is refused without an `api_key`.
    """
    where = f"{host}:{port}"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServingInputError(f"cannot listen on {where}: --port must be 0..65535")
    answer: dict = {}

    def resolve() -> None:
        try:
            answer["found"] = socket.getaddrinfo(
                host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except (OSError, UnicodeError) as e:
            answer["error"] = e

    resolver = threading.Thread(target=resolve, daemon=True)  # getaddrinfo has no timeout of its own
    resolver.start()
    resolver.join(resolve_timeout_s)
    if not answer.get("found"):
        why = answer.get("error") or f"no answer within {resolve_timeout_s:g} s"
        raise ServingInputError(
            f"cannot listen on {where}: {host!r} is not an address or a known host name ({why})"
        )
    family, kind, proto, _, address = answer["found"][0]
    if not api_key and not ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
        raise ServingInputError(
            f"--host {host} is reachable from other machines: give an API key with "
            "--api-key-env VAR (clients then send 'Authorization: Bearer <value>'), or "
            f"listen on {LOOPBACK}"
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        reason = (
            "the port is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e)).lower()
        )
        raise ServingInputError(f"cannot listen on {where}: {reason}") from None
    return sock


def api_key_from_env(var: str | None) -> str | None:
    """The key in `$var`, without the whitespace around it (a key read from a file ends with a newline)."""
    if var is None:
        return None
    value = os.environ.get(var, "").strip()
    if not value:
        raise ServingInputError(f"--api-key-env {var}: the environment variable {var} is not set or empty")
    bad = next((i for i, c in enumerate(value) if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:  # no client can send it in a header
        raise ServingInputError(f"--api-key-env {var}: the key has a control character at position {bad}")
    return value
