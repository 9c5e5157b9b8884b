"""Loopback ports for servers a test, a benchmark or a user's script starts in another process,
or names in a config before they listen (e.g. a local try-out of ``tandem fl server`` and its
clients).

A port found by binding port 0 and closing the socket is an ephemeral port: until the server
binds it, the kernel may hand it to any outgoing connection, and under pytest-xdist another
worker may be given it too. `free_port` avoids both. It draws only from the ports below the
kernel's ephemeral range (``net.ipv4.ip_local_port_range``), which the kernel never assigns on
its own; it gives each xdist worker (``PYTEST_XDIST_WORKER`` gwN of
``PYTEST_XDIST_WORKER_COUNT``) its own slice of them; it starts at an offset derived from the
pid, so two test sessions on one machine start far apart; it never returns a port twice in
one process; and it returns a port only if binding it (with ``SO_REUSEADDR``, as every server
here binds) succeeds right now.

A server that lives in the test's own process and can report its address should bind port 0
and read the port back instead.
"""

from __future__ import annotations

import os
import socket

LOWEST = 10_000  # clear of the well-known ports and of the usual service ports below it
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL_START = 32_768  # Linux's default, also below the IANA range 49152-65535


def _ephemeral_start() -> int:
    """The first port the kernel may give an unbound or outgoing socket."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


class PortPool:
    """Worker ``index`` of ``count``'s slice of [LOWEST, ephemeral start), walked from an
    offset derived from ``pid``; each port is handed out at most once."""

    def __init__(self, index: int, count: int, pid: int) -> None:
        end = _ephemeral_start()
        if end - LOWEST < 256:
            raise RuntimeError(
                f"{_RANGE_FILE} starts the ephemeral ports at {end}, leaving fewer than 256 "
                f"ports in [{LOWEST}, {end}) for tests; raise the range's start with "
                f"`sysctl net.ipv4.ip_local_port_range` (e.g. '32768 60999')"
            )
        if not 0 <= index < count:
            raise ValueError(f"worker index {index} is outside 0..{count - 1}")
        size = (end - LOWEST) // count
        self.ports = range(LOWEST + index * size, LOWEST + (index + 1) * size)
        self._cursor = (pid * 7919) % size  # a prime stride spreads neighbouring pids
        self._given: set[int] = set()

    def take(self) -> int:
        """The next port of the slice not handed out yet and bindable now."""
        for _ in range(len(self.ports)):
            port = self.ports[self._cursor]
            self._cursor = (self._cursor + 1) % len(self.ports)
            if port not in self._given and _bindable(port):
                self._given.add(port)
                return port
        raise RuntimeError(
            f"every port in {self.ports} is in use or was handed out already; fewer xdist "
            f"workers (-n) give each a larger slice"
        )


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _this_process() -> PortPool:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return PortPool(index, max(count, index + 1), os.getpid())


_pool: PortPool | None = None


def free_port() -> int:
    """A loopback port no other test or benchmark of this session is given and nothing
    listens on now."""
    global _pool
    if _pool is None:
        _pool = _this_process()
    return _pool.take()


def free_ports(n: int) -> list[int]:
    """``n`` distinct `free_port`s."""
    return [free_port() for _ in range(n)]
