"""Is a service there? One bounded probe for every network service grpoflow talks to, asked before the work.

MLflow's client retries an unreachable server for minutes, an OpenAI client waits on a server that accepted
the connection and never answers, and Prefect's client retries too: a command that needs a service asks this
module first, with a short timeout, and stops with one line naming the service (credentials masked) when it is
not there.

- `probe(url, timeout)`: why `url` cannot be used, or None when it can. For `http(s)://` a GET must get any
  HTTP answer (an error status counts as an answer: the server is there); for other schemes with a host
  (`postgresql://`, `mysql://`, ...) a TCP connection must open. URLs without a host (`sqlite:`, `file:`, a
  path) need no network and always pass.
- `require_reachable(url, what, timeout, hint)`: raises `ServiceUnavailable` naming `what`, the masked URL,
  the reason, and `hint` (where the URL was set, e.g. `MLFLOW_TRACKING_URI`).

A proxy configured in the environment is used for remote http(s) URLs, as the real clients use it; loopback
addresses never go through one.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from data.errors import ServiceUnavailable
from data.redact import mask_uri, strip_credentials

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_VIA_ENV_PROXY = urllib.request.build_opener()


def probe(url: str, timeout: float) -> str | None:
    """Why `url` is unusable within `timeout` seconds (one line), or None when it answered."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as e:
        return f"not a valid URL ({e})"
    scheme = parts.scheme.lower().split("+", 1)[0]  # postgresql+psycopg2 -> postgresql
    if not host:
        return None
    if scheme in ("http", "https"):
        return _probe_http(url, host, timeout)
    port = port or DEFAULT_PORTS.get(scheme)
    if port is None:
        return None  # a scheme whose port we do not know: leave it to its client
    return probe_tcp(host, port, timeout)


def probe_tcp(host: str, port: int, timeout: float) -> str | None:
    """Why a TCP connection to host:port cannot be opened within `timeout` seconds, or None."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except TimeoutError:
        return f"no connection within {timeout:g} s"
    except OSError as e:
        return _reason(e, timeout)
    return None


def require_reachable(url: str, what: str, timeout: float, hint: str | None = None) -> None:
    """Raise `ServiceUnavailable` unless `url` answers within `timeout` seconds (see `probe`)."""
    reason = probe(url, timeout)
    if reason is not None:
        raise ServiceUnavailable(
            f"{what} at {mask_uri(url)} is unreachable: {reason}" + (f" ({hint})" if hint else "")
        )


def _probe_http(url: str, host: str, timeout: float) -> str | None:
    bare, userinfo, _query = strip_credentials(url)  # never send credentials to a probe
    opener = _DIRECT if host in LOOPBACK else _VIA_ENV_PROXY
    try:
        with opener.open(urllib.request.Request(bare, method="GET"), timeout=timeout) as response:
            response.read(1)
    except urllib.error.HTTPError:
        return None  # any HTTP status is an answer: the server is there
    except urllib.error.URLError as e:
        return _reason(e.reason, timeout)
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:  # a connection reset or closed in the middle of the answer
        return _reason(e, timeout)
    return None


def _reason(error: object, timeout: float) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, socket.gaierror):
        return f"unknown host ({error.strerror or error})"
    if isinstance(error, OSError):
        return error.strerror or str(error) or type(error).__name__
    return str(error)
