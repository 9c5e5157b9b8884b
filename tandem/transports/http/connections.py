"""Inbound connections of the HTTP server: accepted by our own loop, capped, and timed.

aiohttp's server has no header read timeout and no connection cap, so a few hundred
connections that never finish their request heads hold as many file descriptors for as long
as their peers like, until ``accept`` and the party's own ``open`` fail with "Too many open
files". `Listener` accepts connections itself and hands each to aiohttp's request handler
wrapped in a `ConnectionGuard`:

* **caps**: at most ``max_connections`` connections, and ``max_connections_per_address`` per
  client address. A connection over a cap replaces the oldest one that is not inside a request
  (still in its TLS handshake, still sending its head, or idle between requests); when every
  connection is inside a request the new one is closed at once. So a flood of stalled
  connections can neither lock out a prompt client (``GET /healthz``, a peer's request) nor
  hold more descriptors than the cap.
* **timeouts**: a connection must complete its TLS handshake and its request head within
  ``header_timeout`` of its accept, or of its first byte after an idle keep-alive period; an
  idle keep-alive connection closes after ``keepalive_timeout``. (A stalled *body* is the
  receiver's business: ``body_idle_timeout`` in `body.read_into`.)
* **descriptors**: at start the cap is lowered so that at least `fd_reserve` descriptors of
  ``RLIMIT_NOFILE`` stay free for everything else the party opens (outgoing connections,
  checkpoints, the export); `ConfigError` when the limit leaves too little room.

A connection is *inside a request* from the moment its head is parsed (`Listener.begin`, called
by the application's middleware) until its handler returns (`Listener.end`).

**What aiohttp reads before a handler decides** is bounded too: outside a request, a guard hands
aiohttp at most `PRE_REQUEST_LIMIT` bytes (the head and the start of its body), then pauses
reading until the handler begins. Without it the loop would read a body into aiohttp's buffer
(up to twice ``read_bufsize``, 8 MiB, per connection) before the handler could refuse it
from its head. A refused request whose body is left unread ends through `ConnectionGuard.discard`:
what its sender still writes is dropped as it arrives, up to a bound, never buffered. A guard
never resumes a reading that aiohttp paused for itself (requests pipelined beyond its queue), so
a client pipelining requests without reading the answers is stopped there, not read on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any

from tandem.errors import ConfigError

#: fewest connections a listener may be left with after `fd_reserve` (below: ConfigError)
MIN_CONNECTIONS = 8


def fd_reserve(soft_limit: int) -> int:
    """Descriptors kept free of inbound connections under a ``RLIMIT_NOFILE`` of
    ``soft_limit``: a quarter of it, and at least 128."""
    return max(128, soft_limit // 4)


def connection_cap(wanted: int, log: Any = None) -> int:
    """``wanted`` lowered to leave `fd_reserve` descriptors free; `ConfigError` when fewer
    than `MIN_CONNECTIONS` remain."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = soft - fd_reserve(soft)
    if room < MIN_CONNECTIONS:
        raise ConfigError(
            f"RLIMIT_NOFILE is {soft} file descriptors: too few to serve connections and keep "
            f"{fd_reserve(soft)} for the party's own files; raise it (ulimit -n 4096)"
        )
    if wanted > room:
        if log is not None:
            log.warning(
                "max_connections=%d lowered to %d: RLIMIT_NOFILE=%d keeps %d descriptors for "
                "the party's own files (raise ulimit -n for more connections)",
                wanted,
                room,
                soft,
                fd_reserve(soft),
            )
        return room
    return wanted


#: bytes of a first request head held before aiohttp's handler exists; a head still
#: incomplete beyond this goes to aiohttp, whose limits refuse it
HEAD_HOLD_LIMIT = 64 << 10
#: bytes of a request handed to aiohttp before its handler begins (see the module docstring)
PRE_REQUEST_LIMIT = 64 << 10


class ConnectionGuard(asyncio.Protocol):
    """One accepted connection: forwards every protocol event to aiohttp's ``inner`` handler,
    and closes the connection when its head or keep-alive timer runs out.

    The handler (``make_inner()``) is made only once the first request head is complete (or
    exceeds `HEAD_HOLD_LIMIT`): until then the guard holds the bytes itself. A connection
    whose head never ends (a slow-loris, replaced as soon as it is evicted) then costs the
    loop an accept and a timer, not aiohttp's handler, its task and their teardown.

    ``phase``: ``"handshake"`` (TLS, before `connection_made`), ``"head"`` (waiting for a
    complete request head), ``"active"`` (inside a request) or ``"idle"`` (keep-alive);
    ``since``: loop time the phase began."""

    def __init__(
        self, listener: Listener, address: str, make_inner: Callable[[], asyncio.Protocol]
    ) -> None:
        self.listener, self.address, self.make_inner = listener, address, make_inner
        self.inner: asyncio.Protocol | None = None  # made once the first head is complete
        self._held: bytearray | None = bytearray()  # the first head, until it is complete
        self.transport: asyncio.BaseTransport | None = None
        self.sock: socket.socket | None = None  # until a transport owns it
        self.opening: asyncio.Task | None = None  # the accept task (TLS handshake)
        self.phase = "handshake"
        self.since = listener.loop.time()
        self.gone = False
        self._timer: asyncio.TimerHandle | None = None
        self._forwarded = 0  # bytes handed to aiohttp since the phase began (outside a request)
        self._held_back = False  # reading paused by this guard until the handler begins
        self._discard_left: int | None = None  # `discard`: bytes still dropped before closing
        self._discarded: asyncio.Future[None] | None = None

    # -- protocol events, forwarded ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.gone:  # replaced while its handshake finished
            transport.abort()  # type: ignore[attr-defined]
            return
        self.listener.made(self, transport)
        self._enter("head", self.listener.header_timeout)

    def data_received(self, data: bytes) -> None:
        held = self._held
        if held is not None:  # the first head, not yet complete: no handler yet
            start = max(0, len(held) - 3)
            held += data
            if held.find(b"\r\n\r\n", start) < 0 and len(held) <= HEAD_HOLD_LIMIT:
                return
            self._held = None
            inner = self.inner = self.make_inner()
            assert self.transport is not None
            inner.connection_made(self.transport)
            self._forward(bytes(held))
            return
        if self._discard_left is not None:
            self._discard(len(data))
            return
        if self.phase == "idle":  # the next request begins: its head has header_timeout
            self._enter("head", self.listener.header_timeout)
        self._forward(data)

    def _forward(self, data: bytes) -> None:
        """Hand ``data`` to aiohttp; outside a request, pause reading once more than
        `PRE_REQUEST_LIMIT` bytes went (until `begin`)."""
        assert self.inner is not None
        if self.phase != "active":
            self._forwarded += len(data)
            if self._forwarded > PRE_REQUEST_LIMIT and not self._held_back:
                self._held_back = True
                self.transport.pause_reading()  # type: ignore[union-attr]
        self.inner.data_received(data)

    def discard(self, limit: int) -> asyncio.Future[None]:
        """From now on, drop what the peer sends instead of handing it to aiohttp (a refused
        request's unread body), reading again if paused; after ``limit`` bytes, pause reading:
        the peer's writes then wait on a full window, costing this side nothing, while it reads
        the answer (closing at once would reset the connection and lose the answer with it).
        The future is done at the peer's end of stream or when the connection is lost; the
        caller bounds the wait and closes. The connection is evictable meanwhile."""
        self._discarded = fut = self.listener.loop.create_future()
        self._discard_left = limit
        self._enter("draining", None)
        transport = self.transport
        if transport is None or transport.is_closing():
            fut.set_result(None)
        elif limit > 0:
            self._held_back = False
            transport.resume_reading()  # type: ignore[attr-defined]
        else:
            transport.pause_reading()  # type: ignore[attr-defined]
        return fut

    def _discard(self, n: int) -> None:
        assert self._discard_left is not None
        self._discard_left -= n
        if self._discard_left <= 0 and self.transport is not None:
            if not self.transport.is_closing():
                self.transport.pause_reading()  # type: ignore[attr-defined]

    def _discard_done(self) -> None:
        if self._discarded is not None and not self._discarded.done():
            self._discarded.set_result(None)

    def eof_received(self) -> bool | None:
        if self._discard_left is not None:
            self._discard_done()
            return True  # the answer is written already; the caller closes
        if self.inner is None:
            return False  # closed before its first head ended: nothing to answer
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._discard_done()
        self.listener.forget(self)
        self._held = None
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # -- phases -----------------------------------------------------------------------------
    @property
    def held_back(self) -> bool:
        """Reading is paused by this guard (`PRE_REQUEST_LIMIT`)."""
        return self._held_back

    def begin(self, release: bool = True) -> None:
        """Inside a request; with ``release``, its handler decides from here on what is
        read (a reading paused by this guard resumes, unless aiohttp holds it paused too:
        its own bound on pipelined requests and their bytes, which it lifts itself as it
        works them off)."""
        self._enter("active", None)
        if self._held_back and release:
            self._held_back = False
            if self._inner_holds():
                return
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()  # type: ignore[attr-defined]

    def _inner_holds(self) -> bool:
        """Whether aiohttp's handler paused reading for itself: requests pipelined beyond
        its queue, a body beyond its buffer (aiohttp >= 3.14 names the first). Resuming then
        would hand it every byte a client pipelines, unbounded, as fast as it sends."""
        inner = self.inner
        return bool(
            getattr(inner, "_buffer_paused", False) or getattr(inner, "_reading_paused", False)
        )

    def end(self) -> None:
        self._enter("idle", self.listener.keepalive_timeout)

    def _enter(self, phase: str, timeout: float | None) -> None:
        self._cancel_timer()
        self.phase, self.since = phase, self.listener.loop.time()
        self._forwarded = 0
        if timeout is not None:
            self._timer = self.listener.loop.call_later(timeout, self._expired)

    def _expired(self) -> None:
        self._timer = None
        self.listener.timed_out[self.phase] += 1
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Close the connection now (no graceful shutdown: it is stalled or replaced)."""
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]
        elif self.opening is not None and not self.opening.done():
            self.opening.cancel()  # the handshake's transport closes the socket
        elif self.sock is not None:
            self.sock.close()
        self.listener.forget(self)

    @property
    def evictable(self) -> bool:
        return not self.gone and self.phase != "active"


class Listener:
    """Accepts connections on ``host:port`` for ``make_handler()`` (aiohttp's request handler
    factory), within the caps and timeouts of the module docstring."""

    def __init__(
        self,
        make_handler: Callable[[], asyncio.Protocol],
        *,
        max_connections: int,
        max_per_address: int,
        header_timeout: float,
        keepalive_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        log: Any = None,
    ) -> None:
        self.make_handler = make_handler
        self.max_connections, self.max_per_address = max_connections, max_per_address
        self.header_timeout, self.keepalive_timeout = header_timeout, keepalive_timeout
        self.ssl_context = ssl_context
        self.log = log or logging.getLogger(__name__)
        self.guards: dict[ConnectionGuard, None] = {}  # insertion-ordered: oldest first
        self.per_address: collections.Counter[str] = collections.Counter()
        self.by_transport: dict[asyncio.BaseTransport, ConnectionGuard] = {}
        self.refused = 0  # connections closed at once: every slot inside a request
        self.evicted = 0  # connections replaced by newer ones
        self.timed_out: collections.Counter[str] = collections.Counter()
        self.accept_errors = 0
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()

    async def start(self, host: str, port: int) -> int:
        """Listen (port 0: any free port) and start accepting; returns the port bound."""
        self.max_connections = connection_cap(self.max_connections, self.log)
        self.max_per_address = min(self.max_per_address, self.max_connections)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server(
            (host, port), family=family, backlog=min(1024, 4 * self.max_connections)
        )
        sock.setblocking(False)
        self._sock = sock
        self._task = self.loop.create_task(self._accept_all())
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting; connections still in their TLS handshake are closed (the others
        are aiohttp's to close, then `abort_all`)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for guard in list(self.guards):  # every handshake task is done by now
            if guard.transport is None:
                guard.opening = None
                guard.close()

    def abort_all(self) -> None:
        """Close every connection still open (after aiohttp's own shutdown)."""
        for guard in list(self.guards):
            guard.close()

    def __len__(self) -> int:
        return len(self.guards)

    # -- accepting --------------------------------------------------------------------------
    async def _accept_all(self) -> None:
        assert self._sock is not None
        async with asyncio.TaskGroup() as tg:  # the handshakes in progress
            while True:
                try:
                    conn, addr = await self._accept_one()
                except OSError as exc:  # EMFILE/ENFILE under pressure: wait, then go on
                    self.accept_errors += 1
                    self.log.warning("accept failed: %s", exc)
                    await asyncio.sleep(0.05)
                    continue
                address = str(addr[0]) if isinstance(addr, tuple) else str(addr)
                if not self._make_room(address):
                    self.refused += 1
                    conn.close()
                    continue
                guard = ConnectionGuard(self, address, self.make_handler)
                guard.sock = conn
                self.guards[guard] = None
                self.per_address[address] += 1
                guard.opening = tg.create_task(self._open(guard, conn))
                # let the connections accepted so far read their heads before the next accept
                # (accept returns at once while the backlog is full, and a flood would
                # otherwise replace them before they ran once)
                await asyncio.sleep(0)

    async def _accept_one(self) -> tuple[socket.socket, Any]:
        """The next accepted connection. Unlike ``loop.sock_accept``, a connection accepted
        just as this wait is cancelled (`stop`) is closed here rather than lost unclosed."""
        assert self._sock is not None
        sock, fut = self._sock, self.loop.create_future()

        def ready() -> None:
            if fut.done():
                return
            try:
                conn, addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                fut.set_exception(exc)
                return
            conn.setblocking(False)
            fut.set_result((conn, addr))

        self.loop.add_reader(sock.fileno(), ready)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result()[0].close()
            raise
        finally:
            self.loop.remove_reader(sock.fileno())

    async def _open(self, guard: ConnectionGuard, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(
                lambda: guard,
                conn,
                ssl=self.ssl_context,
                ssl_handshake_timeout=self.header_timeout if self.ssl_context else None,
            )
        except asyncio.CancelledError:  # replaced during its handshake, or stopping
            conn.close()
            self.forget(guard)
        except Exception as exc:  # a failed handshake must not stop the accept loop
            if isinstance(exc, TimeoutError):
                self.timed_out["handshake"] += 1
            else:
                self.log.info("connection from %s failed to open: %r", guard.address, exc)
            conn.close()
            self.forget(guard)
        finally:
            guard.opening = None

    def _make_room(self, address: str) -> bool:
        """True once a new connection from ``address`` fits under both caps (evicting the
        oldest evictable connections as needed); False when it cannot."""
        if self.per_address[address] >= self.max_per_address:
            victim = next((g for g in self.guards if g.address == address and g.evictable), None)
            if victim is None:
                return False
            self._evict(victim)
        if len(self.guards) >= self.max_connections:
            victim = next((g for g in self.guards if g.evictable), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, guard: ConnectionGuard) -> None:
        self.evicted += 1
        guard.close()

    # -- bookkeeping ------------------------------------------------------------------------
    def made(self, guard: ConnectionGuard, transport: asyncio.BaseTransport) -> None:
        self.by_transport[transport] = guard

    def forget(self, guard: ConnectionGuard) -> None:
        """``guard``'s connection is gone (or going): count it out (once)."""
        if guard.gone:
            return
        guard.gone = True
        self.guards.pop(guard, None)
        self.per_address[guard.address] -= 1
        if self.per_address[guard.address] <= 0:
            del self.per_address[guard.address]
        if guard.transport is not None:
            self.by_transport.pop(guard.transport, None)

    def begin(self, transport: Any, release: bool = True) -> None:
        """A request head arrived on ``transport``: inside a request until `end`; with
        ``release`` its handler reads the body (`ConnectionGuard.begin`)."""
        guard = self.by_transport.get(transport)
        if guard is not None:
            guard.begin(release)

    def holds(self, transport: Any) -> bool:
        """Whether reading ``transport`` is paused by its guard (an unread body waits)."""
        guard = self.by_transport.get(transport)
        return guard is not None and guard.held_back

    def end(self, transport: Any) -> None:
        guard = self.by_transport.get(transport)
        if guard is not None:
            guard.end()

    def guard(self, transport: Any) -> ConnectionGuard | None:
        """The guard of ``transport`` (None: not one of this listener's connections)."""
        return self.by_transport.get(transport)
