"""A delaying TCP relay: a round-trip delay on a path whose kernel has no ``netem``.

`DelayRelay` listens on an address and forwards every connection it accepts to a target,
holding each direction's bytes for ``one_way_s`` seconds before writing them on; one route
per target. Two routes crossing it (the client's requests one way, the server's answers the
other) add ``2 * one_way_s`` to every round trip, on top of the links the bytes cross.

Contract, per connection and direction:

* **order**: bytes leave in the order they arrived (one FIFO, release times non-decreasing);
* **delay**: a byte read at ``t`` is written no earlier than ``t + one_way_s``; the first byte
  from the client no earlier than ``accept + 3 * one_way_s`` (a TCP handshake's round trip
  before the client may send, then the one-way trip), so a new connection costs what it
  costs on a real long link, although the kernel completes the handshake with the relay at
  once;
* **backpressure**: at most ``buffer_bytes`` plus one read are held; past that the relay
  stops reading, the kernel's receive window closes, and the sender waits. To carry a rate of
  ``R`` bytes/s the buffer must hold ``R * one_way_s`` (the bytes in flight): `buffer_for`;
* **end**: an end of stream is passed on (``write_eof``) after the bytes before it; an error
  on either side aborts both (a reset is a reset).

Every connection's tasks live in the relay's `asyncio.TaskGroup`; `aclose` stops listening
and ends them all. It runs in the caller's loop (it never makes one): a test or a try-out of
a deployment puts it between two parties on loopback to see them over a long link
(``python -m bench.relay`` runs one as a process of its own for `bench.wan`).
"""

from __future__ import annotations

import asyncio
import collections

READ_BYTES = 1 << 16  # the most bytes one read takes from a socket


def buffer_for(rate_Bps: float, one_way_s: float) -> int:
    """A buffer that does not limit a ``rate_Bps`` path: twice the bytes in flight during
    ``one_way_s``, and at least 1 MiB."""
    return int(max(1 << 20, 2 * rate_Bps * one_way_s))


class _DelayLine:
    """One direction of one connection: a bounded FIFO of (release time, bytes)."""

    def __init__(self, buffer_bytes: int, relay: DelayRelay) -> None:
        self.relay = relay
        self.items: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0  # bytes in ``items``; invariant: held <= buffer_bytes + READ_BYTES
        self.limit = buffer_bytes
        self.changed = asyncio.Event()

    async def put(self, release: float, data: bytes) -> None:
        while self.held >= self.limit:
            self.changed.clear()
            await self.changed.wait()
        self.items.append((release, data))
        self.held += len(data)
        self.relay.peak_held = max(self.relay.peak_held, self.held)
        self.changed.set()

    async def get(self) -> tuple[float, bytes]:
        while not self.items:
            self.changed.clear()
            await self.changed.wait()
        release, data = self.items.popleft()
        self.held -= len(data)
        self.changed.set()
        return release, data


class DelayRelay:
    """Forwards connections to targets with a one-way delay each direction (module docstring).

    Use inside a running loop::

        async with DelayRelay(0.020) as relay:
            port = await relay.route("10.0.0.2", ("127.0.0.1", 8080))

    Args:
      one_way_s: seconds each direction's bytes are held (half the added round trip).
      buffer_bytes: the most bytes held per connection and direction (`buffer_for`).
    """

    def __init__(self, one_way_s: float, *, buffer_bytes: int = 1 << 22) -> None:
        if not one_way_s >= 0:
            raise ValueError(f"one_way_s must be >= 0 s, got {one_way_s!r}")
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes!r}")
        self.one_way_s = one_way_s
        self.buffer_bytes = buffer_bytes
        self.connections = 0  # accepted so far
        self.peak_held = 0  # the most bytes one direction of one connection held
        self._servers: list[asyncio.Server] = []
        self._tg: asyncio.TaskGroup | None = None
        self._closing: asyncio.Event | None = None

    async def __aenter__(self) -> DelayRelay:
        self._closing = asyncio.Event()
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
        if self._tg is not None:
            await self._tg.__aexit__(*exc)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        """Stop listening and end every connection (idempotent)."""
        if self._closing is not None:
            self._closing.set()
        for server in self._servers:
            server.close()
        self._servers.clear()

    async def route(self, listen_host: str, target: tuple[str, int], port: int = 0) -> int:
        """Listen on ``listen_host:port`` (0: any free port) and forward each connection to
        ``target``; returns the port listened on."""
        if self._tg is None:
            raise RuntimeError("use `async with DelayRelay(...)` before adding routes")
        tg = self._tg

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            tg.create_task(self._connection(reader, writer, target))

        server = await asyncio.start_server(accepted, listen_host, port, limit=READ_BYTES)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _connection(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        target: tuple[str, int],
    ) -> None:
        """Forward one accepted connection until both directions ended, an error, or
        `aclose`; closes both sockets (gracefully after a clean end, else by abort)."""
        loop = asyncio.get_running_loop()
        opens = loop.time() + 2 * self.one_way_s  # the client may send after a round trip
        assert self._closing is not None
        writers = [client_w]
        clean = False
        try:
            server_r, server_w = await asyncio.open_connection(*target, limit=READ_BYTES)
            writers.append(server_w)
            async with asyncio.TaskGroup() as tg:
                both = tg.create_task(self._forward(client_r, client_w, server_r, server_w, opens))
                stop = tg.create_task(self._closing.wait())
                await asyncio.wait({both, stop}, return_when=asyncio.FIRST_COMPLETED)
                clean = both.done() and not both.cancelled() and both.exception() is None
                stop.cancel()
                both.cancel()
        except* (OSError, EOFError):
            pass  # a reset on either side, or the target is gone: both are aborted below
        finally:
            for w in writers:
                if clean:
                    w.close()
                else:
                    w.transport.abort()

    async def _forward(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        server_r: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
        opens: float,
    ) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump(client_r, server_w, opens))
            tg.create_task(self._pump(server_r, client_w, 0.0))

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opens: float
    ) -> None:
        """Forward ``reader`` to ``writer`` through a delay line; pass the end of stream on."""
        line = _DelayLine(self.buffer_bytes, self)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            while True:
                data = await reader.read(READ_BYTES)
                await line.put(max(loop.time(), opens) + self.one_way_s, data)
                if not data:
                    return

        async def write() -> None:
            while True:
                release, data = await line.get()
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(read())
            tg.create_task(write())
