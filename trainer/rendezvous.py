"""The nodes of a multi-node run finding each other before their trainer ranks start, within a bounded time.

`grpoflow train --node-rank K --rendezvous HOST:PORT` on every node of `rollout.nodes`: node 0 holds a store
on PORT (HOST is node 0's address as the other nodes reach it), every node writes where it runs (host name and
its address on the network towards HOST), and node 0 waits for all of them. A node that does not come within
`rollout.rendezvous_timeout_s` is named: node 0 says which node ranks never joined and who did; another node
that cannot reach node 0 names HOST:PORT. Only then does each node start its trainer ranks under torchrun,
whose own rendezvous (static, on PORT + 1, node 0 its master) then finds everyone already there: ranks are
numbered node by node, node 0's first, so trainer rank 0 is on node 0 where the plan puts the rollout.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

from data.errors import ServiceUnavailable
from trainer.typed_config import ConfigError


class RendezvousError(ServiceUnavailable):
    """The nodes did not all meet in time; the message names who is missing or unreachable (exit 2: nothing
    has started)."""


class NodeZeroUnreachable(RendezvousError):
    """A node other than 0 found no rendezvous at node 0's HOST:PORT in time."""


@dataclass(frozen=True)
class Member:
    node: int
    host: str
    address: str

    def __str__(self) -> str:
        return f"node {self.node} on {self.host} ({self.address})"


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT of `--rendezvous` (ConfigError naming the flag when it is not one)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ConfigError(
            f"--rendezvous: expected HOST:PORT (node 0's address and a free port), got {text!r}"
        )
    return host.strip("[]"), int(port)


def address_towards(host: str) -> str:
    """This machine's address on the network that reaches `host` (the local end of a route to it; nothing is
    sent)."""
    if host in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def interface_of(address: str) -> str | None:
    """The name of the network interface holding `address` (Linux), for gloo's GLOO_SOCKET_IFNAME: gloo
    otherwise uses the address the host name resolves to, which need not be on the nodes' network."""
    try:
        import fcntl
        import struct

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue  # an interface without an IPv4 address
                if socket.inet_ntoa(packed[20:24]) == address:
                    return name
    except (ImportError, OSError):
        return None
    return None


def meet(
    nodes: int,
    node: int,
    host: str,
    port: int,
    timeout_s: float,
    args: list[str] = (),
    members_wait_s: float | None = None,
) -> tuple[list[Member], list[str]]:
    """Every node's Member, node 0 first, once all `nodes` have come to node 0's store at host:port, and node
    0's `args` (its `grpoflow train` arguments, for a node that joins without a recipe: `nodes` matters on
    node 0 alone). Raises RendezvousError naming the missing nodes (on node 0), NodeZeroUnreachable naming
    node 0's HOST:PORT (on the others) when they have not met after `timeout_s`. `members_wait_s`: how long
    a node other than 0, once connected, waits for the others (default: what is left of `timeout_s`)."""
    from torch.distributed import TCPStore

    me = Member(node, socket.gethostname(), address_towards(host))
    deadline = time.monotonic() + timeout_s
    if node == 0:
        store = TCPStore(
            "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
    else:
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - torch raises several kinds for a connect that never succeeds
            raise NodeZeroUnreachable(
                f"node {node}: node 0's rendezvous at {host}:{port} did not answer within {timeout_s:g} s "
                f"(rollout.rendezvous_timeout_s): start `grpoflow train --node-rank 0 --rendezvous "
                f"{host}:{port}` there, and check that {host} is node 0's address as this node reaches it "
                f"({type(e).__name__})"
            ) from None
    store.set(f"node/{node}", json.dumps([me.host, me.address]))
    if node == 0:
        keys = [f"node/{k}" for k in range(nodes)]
        while not store.check(keys):
            if time.monotonic() > deadline:
                joined = [k for k in range(nodes) if store.check([f"node/{k}"])]
                missing = [k for k in range(nodes) if k not in joined]
                seen = "; ".join(str(_member(store, k)) for k in joined)
                raise RendezvousError(
                    f"rendezvous at {host}:{port}: waited {timeout_s:g} s (rollout.rendezvous_timeout_s) for "
                    f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {nodes}, "
                    f"which never joined (start `grpoflow train --node-rank K --rendezvous {host}:{port}` "
                    f"on each); joined: {seen}"
                )
            time.sleep(0.2)
        members = [_member(store, k) for k in range(nodes)]
        store.set("args", json.dumps(list(args)))
        store.set("members", json.dumps([[m.host, m.address] for m in members]))
        # the store goes when node 0 moves on: wait (bounded) until every node has read the list
        acks = [f"ack/{k}" for k in range(1, nodes)]
        while acks and not store.check(acks) and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        return members, list(args)
    try:
        left = deadline - time.monotonic() if members_wait_s is None else members_wait_s
        store.wait(["members"], timedelta(seconds=max(1.0, left)))
    except Exception:  # noqa: BLE001 - a timeout, or node 0 gone
        bound = "rollout.rendezvous_timeout_s" if members_wait_s is None else "--wait-s"
        waited = timeout_s if members_wait_s is None else members_wait_s
        raise RendezvousError(
            f"node {node}: joined node 0's rendezvous at {host}:{port}, but the other nodes did not all come "
            f"within {waited:g} s ({bound}); node 0's log names the missing ones"
        ) from None
    members = [Member(k, h, a) for k, (h, a) in enumerate(json.loads(store.get("members")))]
    args = json.loads(store.get("args"))
    store.set(f"ack/{node}", "1")
    return members, args


def _member(store, k: int) -> Member:
    host, address = json.loads(store.get(f"node/{k}"))
    return Member(k, host, address)
