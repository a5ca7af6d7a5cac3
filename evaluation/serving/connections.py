"""Who may hold a connection to the transformers server, and for how long: uvicorn's h11 protocol plus three
rules.

uvicorn closes a keep-alive connection after `--keep-alive-timeout`, but keeps a connection that never
completes a request (silent from its first byte, or dripping its headers) forever; counted against
`--max-connections`, a handful of those would shut every client out. Here:

- A connection must deliver a request's headers within `--header-timeout` of opening, or of its previous
  response; else it is closed. Its body is then the app's to bound (`--body-timeout`, 408).
- One client address holds at most `--max-connections-per-client` connections, all together
  `--max-connections`. A connection over a cap closes the connection idle longest (no request in progress:
  the same client's for its own cap, anyone's for the total), so idle connections never keep a request out.
- When nothing is idle, up to `HEALTH_RESERVE` connections more are let in: they answer `/health` and
  answer anything else 503 naming the cap; beyond those, a connection gets a 503 and is closed at once.

Only the event loop's thread touches this state: no lock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from evaluation.serving.app import error_response
from evaluation.serving.guards import ServerLimits

HEALTH_RESERVE = 4  # connections over the caps that may still ask for /health
_PER_CLIENT, _TOTAL = "--max-connections-per-client", "--max-connections"


def _refusal(flag: str, limit: int, client: str) -> bytes:
    who = f"this client ({client}) holds" if flag == _PER_CLIENT else "the server holds"
    return error_response(
        503, f"{who} {limit} connections with requests in progress ({flag}); retry when one of them finishes"
    ).body


@dataclass(eq=False)
class _Slot:
    protocol: GuardedH11
    client: str
    idle_since: float | None  # monotonic; None while a request is in progress
    over: str | None = None  # the cap it is over: a reserve connection, for /health only


class ConnectionRegistry:
    """The connections of one server, by client address."""

    def __init__(
        self, max_connections: int, per_client: int, header_timeout_s: float, reserve: int = HEALTH_RESERVE
    ):
        self.max_connections, self.per_client = max_connections, per_client
        self.header_timeout_s, self.reserve = header_timeout_s, reserve
        self.slots: dict[GuardedH11, _Slot] = {}

    def admit(self, protocol: GuardedH11, client: str) -> _Slot | None:
        """A slot for a new connection (closing an idle one to make room if need be); None: refuse it."""
        now = time.monotonic()
        over = self.over(client)
        if over is not None:
            victim = self._idle_longest(lambda s: s.over is None and (over == _TOTAL or s.client == client))
            if victim is not None:
                self.close(victim)
                over = self.over(client)
        if over is not None and sum(s.over is not None for s in self.slots.values()) >= self.reserve:
            victim = self._idle_longest(lambda s: s.over is not None)
            if victim is None:
                return None
            self.close(victim)
        self.slots[protocol] = _Slot(protocol, client, now, over)
        return self.slots[protocol]

    def close(self, slot: _Slot) -> None:
        self.slots.pop(slot.protocol, None)
        slot.protocol.transport.close()

    def release(self, protocol: GuardedH11) -> None:
        self.slots.pop(protocol, None)

    def refusal(self, over: str, client: str) -> bytes:
        return _refusal(over, self.per_client if over == _PER_CLIENT else self.max_connections, client)

    def over(self, client: str) -> str | None:
        held = [s for s in self.slots.values() if s.over is None]
        if sum(s.client == client for s in held) >= self.per_client:
            return _PER_CLIENT
        return _TOTAL if len(held) >= self.max_connections else None

    def _idle_longest(self, which) -> _Slot | None:
        idle = [s for s in self.slots.values() if s.idle_since is not None and which(s)]
        return min(idle, key=lambda s: s.idle_since, default=None)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, admitted by `registry` and closed when idle past its header timeout."""

    registry: ConnectionRegistry  # one per server: `guarded_protocol()` makes the subclass

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        client = self.client[0] if self.client else ""
        self._slot = self.registry.admit(self, client)
        if self._slot is None:  # over a cap, and even the /health reserve is busy
            over = self.registry.over(client) or _TOTAL
            body = self.registry.refusal(over, client)
            self.transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()
            return
        if self._slot.over is not None:
            self.app = _health_only(self.app, self.registry.refusal(self._slot.over, client))
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._refresh()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._refresh()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disarm()
        self.registry.release(self)

    def _refresh(self) -> None:
        """A request in progress stops the header clock; the connection idle again restarts it."""
        slot = getattr(self, "_slot", None)
        if slot is None or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            slot.idle_since = None
            self._disarm()
        elif slot.idle_since is None:
            slot.idle_since = time.monotonic()
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.registry.header_timeout_s, self._headers_too_late)

    def _disarm(self) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_too_late(self) -> None:
        self._timer = None
        slot = self.registry.slots.get(self)
        if slot is not None and slot.idle_since is not None:
            self.registry.close(slot)


def _health_only(app, refusal: bytes):
    """The app for a connection over a cap: `/health` as usual, anything else 503; it closes after
    answering."""

    async def reserve(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/health":
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", b"1"),
                        (b"content-length", b"%d" % len(refusal)),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": refusal})
            return

        async def closing(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await app(scope, receive, closing)

    return reserve


def guarded_protocol(limits: ServerLimits) -> type[GuardedH11]:
    """uvicorn's `http=` protocol class for one server with these limits."""
    registry = ConnectionRegistry(
        limits.max_connections, limits.connections_per_client, limits.header_timeout_s
    )
    return type("GuardedH11", (GuardedH11,), {"registry": registry})
