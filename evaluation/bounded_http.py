"""The HTTP client EvalScope's OpenAI client talks to an endpoint with: each request bounded whole.

The OpenAI client's `timeout` bounds each read of the socket, not the request: an endpoint that drips a
byte a second, or streams forever, is never timed out, and an answer is read into memory whole whatever
its size. `bounded_client(timeout_s, max_bytes)` is the OpenAI client's own HTTP client (its defaults kept)
with two limits on every request:

- a deadline `timeout_s` after it is sent. Connecting, sending, waiting for the headers and reading the
  body all count: each read waits at most until the deadline, and a watchdog shuts the request's socket
  down when it passes, which ends a read that keeps receiving a byte at a time. The request then fails
  with the HTTP library's `ReadTimeout` naming the deadline; the OpenAI client reports that as
  `APITimeoutError`, which EvalScope retries like any timeout.
- a budget of `max_bytes` for the response body: a larger Content-Length is refused before the body is
  read, a body without one when it passes the budget, so at most `max_bytes` of it is ever held.
  `ResponseTooLarge` is no HTTP error on purpose: the OpenAI client lets it through unwrapped, so its
  message reaches the worker's status.

Connections are not kept alive: the watchdog can only shut down a socket it saw the request open, and a
new connection per request costs little next to a generation. Answers are asked for uncompressed, so that
the budget counts the bytes that are held (an endpoint that compresses anyway is counted compressed).
This module imports nothing from grpoflow: the EvalScope worker imports it.
"""

from __future__ import annotations

import socket
import threading
import time


class ResponseTooLarge(Exception):
    """An endpoint's answer longer than the client's byte budget."""

    def __init__(self, url, max_bytes: int, detail: str):
        self.max_bytes = max_bytes
        super().__init__(f"the answer from {_shown(url)} {detail}, over the limit of {max_bytes} bytes")


def bounded_client(timeout_s: float, max_bytes: int):
    """An instance of the OpenAI client's HTTP client class with a whole-request deadline and a byte
    budget."""
    import openai

    base = openai.DefaultHttpxClient  # the httpx (httpx2 since openai 3) Client the OpenAI client is built on
    http = __import__(base.__mro__[1].__module__.partition(".")[0])

    class BoundedClient(base):
        def send(self, request, *, stream: bool = False, **kwargs):
            watch = _Watchdog(timeout_s)
            request.headers["Accept-Encoding"] = "identity"
            timeouts = dict(request.extensions.get("timeout") or {})
            request.extensions = {
                **request.extensions,
                "trace": watch.trace(request.extensions.get("trace")),
                "timeout": {
                    k: min(v or timeout_s, timeout_s)
                    for k, v in {
                        "connect": None,
                        "read": None,
                        "write": None,
                        "pool": None,
                        **timeouts,
                    }.items()
                },
            }
            try:
                response = super().send(request, stream=True, **kwargs)
            except http.TransportError as e:
                watch.cancel()
                if watch.expired:
                    raise watch.timeout_error(http, request) from e
                raise
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                response.close()
                watch.cancel()
                raise ResponseTooLarge(request.url, max_bytes, f"is {length} bytes long (Content-Length)")
            response.stream = _bounded_stream(http, response.stream, request, watch, max_bytes)
            if not stream:
                try:
                    response.read()
                except BaseException:
                    response.close()
                    raise
            return response

    return BoundedClient(limits=http.Limits(max_connections=1000, max_keepalive_connections=0))


class _Watchdog:
    """One request's deadline: shuts the request's socket down when it passes."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def trace(self, chained):
        """httpcore's `trace` extension: learns the socket of each connection the request opens."""

        def on_event(name: str, info: dict):
            if name.endswith((".connect_tcp.complete", ".connect_unix_socket.complete")):
                sock = info["return_value"].get_extra_info("socket")
                if sock is not None:
                    with self._lock:
                        self._sockets.append(sock)
                        expired = self.expired
                    if expired:
                        _shut(sock)
            if chained is not None:
                chained(name, info)

        return on_event

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def check(self) -> None:
        if time.monotonic() >= self.deadline:
            self._expire()

    def cancel(self) -> None:
        self._timer.cancel()

    def timeout_error(self, http, request):
        return http.ReadTimeout(
            f"no complete answer from {_shown(request.url)} within {self.timeout_s:g} s "
            "(the deadline for the whole request)",
            request=request,
        )


def _shown(url) -> str:
    """A request's URL without its query, where an endpoint's credentials may travel."""
    return str(url.copy_with(query=None))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # unlike close(), wakes a recv() blocked in another thread
    except OSError:
        pass  # already closed: the request finished as the deadline passed


def _bounded_stream(http, inner, request, watch: _Watchdog, max_bytes: int):
    """`inner` (a response's byte stream) read within the request's deadline and byte budget."""

    class BoundedStream(http.SyncByteStream):
        def __iter__(self):
            received = 0
            try:
                for chunk in inner:
                    received += len(chunk)
                    if received > max_bytes:
                        raise ResponseTooLarge(request.url, max_bytes, f"passed {max_bytes} bytes")
                    watch.check()
                    if watch.expired:
                        raise watch.timeout_error(http, request)
                    yield chunk
            except http.TransportError as e:
                if watch.expired and not isinstance(e, http.TimeoutException):
                    raise watch.timeout_error(http, request) from e
                raise

        def close(self):
            watch.cancel()
            inner.close()

    return BoundedStream()
