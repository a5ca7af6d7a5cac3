"""Several "hosts" on this machine for tests: network namespaces joined by a private switch.

Each host is a network namespace with its own loopback and one interface, `eth0`, at 10.91.0.<k+1>/24; the
interfaces are veth pairs whose other ends hang on a bridge inside a switch namespace of its own, so nothing
the hosts send reaches this machine's own network stack or leaves the machine. Processes started with
`Hosts.popen(k, ...)` run in host k's network stack (the filesystem is this machine's: the shared disk a
cluster would mount). `kill(k)` ends every process in host k's namespace (a host lost); leaving the `with`
block kills what is left and removes every namespace and interface, also when the test failed or timed out.

`names`: host names each host's processes resolve to its address, as a cluster's DNS would (a hosts file per
namespace, /etc/netns/<namespace>/hosts, which `ip netns exec` shows as /etc/hosts).

Needs root (`ip netns`); each `Hosts` has names of its own (the pid and a counter), so test workers running
side by side do not meet.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.91.0"
NETNS_ETC = Path("/etc/netns")  # files `ip netns exec NAME` bind-mounts over /etc for NAME's processes
_COUNTER = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Hosts:
    def __init__(self, count: int, names: dict[int, list[str]] | None = None):
        self.tag = f"gf{os.getpid() % 100000}x{next(_COUNTER)}"
        self.names = [f"{self.tag}h{k}" for k in range(count)]
        self.switch = f"{self.tag}sw"
        self.procs: list[subprocess.Popen] = []
        self.host_names = names or {}

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for k, name in enumerate(self.names):
                _ip("netns", "add", name)
                host_end, switch_end = f"{self.tag}a{k}", f"{self.tag}b{k}"
                _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
                _ip("link", "set", host_end, "netns", name)
                _ip("link", "set", switch_end, "netns", self.switch)
                _ip("-n", name, "link", "set", host_end, "name", "eth0")
                _ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
                _ip("-n", self.switch, "link", "set", switch_end, "up")
            if self.host_names:
                lines = ["127.0.0.1 localhost"]
                lines += [f"{self.address(k)} {' '.join(n)}" for k, n in sorted(self.host_names.items())]
                for name in self.names:
                    (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
                    (NETNS_ETC / name / "hosts").write_text("\n".join(lines) + "\n")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def popen(self, k: int, args: list[str], **kwargs) -> subprocess.Popen:
        """`args` started inside host k (its own process group, so that a test can stop it whole)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[k], *args], start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def pids(self, k: int) -> list[int]:
        out = _ip("netns", "pids", self.names[k], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, k: int) -> list[int]:
        """SIGKILL every process in host k: the host is lost. Returns the pids killed."""
        pids = self.pids(k)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        for k in range(len(self.names)):
            self.kill(k)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in self.names:
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        deadline = time.monotonic() + 10
        for name in [*self.names, self.switch]:
            while _ip("netns", "del", name, check=False).returncode != 0 and time.monotonic() < deadline:
                if name not in _ip("netns", "list", check=False).stdout:
                    break
                time.sleep(0.2)


def netns_available() -> bool:
    """Whether this process may make network namespaces (root with iproute2)."""
    return os.geteuid() == 0 and subprocess.run(["which", "ip"], capture_output=True).returncode == 0
