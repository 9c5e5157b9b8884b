"""The receiving half of the HTTP transport: `HttpServer` serves one party's endpoints
(`endpoints`) and keeps what it received, through one module per concept:

* `identity` (`Gate`): who is asking (signatures, certificates, admission of unknown peers);
* `checks` (`FrameChecks`): what a frame must pass before delivery, and the admission hooks;
* `reassembly` (`Reassembler`): chunks into messages, messages delivered in order;
* `store` (`InboundStore`): streams, bounded inboxes, the byte budget, sweeping idle partials;
* `connections` (`Listener`): accepting connections within caps and timeouts;
* here: the lifecycle, and what every request passes (`_track`) and every refusal (`refusal`).

A request for a new message first reserves a slot in its stream's inbox and its whole size in
the receiver's `budget.ByteBudget`, waiting up to ``backpressure_wait`` for each (then 503).
Refusals keep their order: authentication (401; 421 when correctly signed for another
incarnation of this receiver), certificate identity (403), the stream admission hook (403),
sizes (413/400), spec (409), retired incarnation (410), then, once the body is in, its
digest (401), the decoding (400), NaN/Inf and the validator (422) and the frame admission hook
(422, naming the field). De-duplication follows `streams`; no lock is held while a body is
read (a stalled body is closed after ``body_idle_timeout``, and a retry of its chunk takes it
over), and partial messages left idle for ``partial_timeout`` are dropped. The server keeps
serving whatever arrives: every bad request gets its status, one rate-limited log line (no
traceback), and the next one is handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs, web

from ..base import Frame, LinkStats
from ..inbox import Inbox
from .body import DRAIN_BYTES, Body
from .checks import AdmitFrame, AdmitSize, AdmitStream, FrameChecks
from .config import HttpConfig
from .connections import Listener
from .endpoints import Endpoints
from .identity import Gate, cert_identities
from .protocol import (
    BYE_PATH,
    FRAME_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    STREAM_PATH,
    MessageHead,
    Refuse,
    Reply,
)
from .quietlog import QuietLog
from .reassembly import MAX_STREAMS, Reassembler
from .store import InboundStore

log = logging.getLogger(__name__)

SERVER_NAME = "tandem"  # the ``Server`` header: no software or version banner
#: the only ``Content-Encoding`` a request may declare: Tandem never compresses bodies, so any
#: other is refused from the headers (415) and its body is never read, let alone inflated
IDENTITY = frozenset({"", "identity"})
DRAIN_SECONDS = 1.0  # and the longest that takes
#: the routes whose handlers read a request body (any other body is never read)
BODY_PATHS = frozenset({FRAME_PATH, STREAM_PATH})
#: refusals that are part of the protocol's normal flow, not logged
QUIET_REASONS = frozenset(
    {"ahead", "busy", "closing", "evicted", "misdirected", "out_of_order", "too_many_peers"}
)


class _RequestHandler(web.RequestHandler):
    """aiohttp's request handler, with its own answers to unparsable requests (400) carrying
    no version banner either."""

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        resp = super().handle_error(request, status, exc, message)
        resp.headers["Server"] = SERVER_NAME
        return resp


class HttpServer:
    """Serves one party's endpoints and keeps what it received. Built by `HttpTransport`;
    `start` inside a running loop, `close` then `stop` once.

    ``peers`` (name -> base URL) is shared with the transport: a request from a sender not in
    it is refused (401) unless ``admit_unknown`` admits it, which adds it there. ``spec_hash``,
    ``validator``, ``admit_stream`` and ``admit_frame`` are plain attributes that may be
    replaced at any time (after negotiation; `checks.FrameChecks` reads them on each use).
    ``admit_stream(sender, channel)`` runs on each request head, before its body is read or
    any memory is reserved; ``admit_frame(frame)`` on each complete frame that passed every
    other check, just before delivery (on the loop, with nothing awaited between it and the
    delivery); ``admit_size(sender, channel, total)`` on each message head's declared size
    (413). Each refuses by raising `AdmissionError` (403 and 422, naming the field) or
    `FrameError`.

    The receiving state lives in ``store`` (`store.InboundStore`); ``inboxes``, ``held``,
    ``streams``, ``budget``, ``retired``, ``received``, ``requests``, ``lost`` and
    ``down_since`` are the same objects, for the transport, `liveness` and `metrics`."""

    def __init__(
        self,
        config: HttpConfig,
        peers: dict[str, str],
        incarnation: str,
        metrics_text: Callable[[], str],
    ) -> None:
        self.cfg = config
        self.peers = peers
        self.incarnation = incarnation
        self.spec_hash = config.spec_hash
        self.validator = config.validator
        self.admit_stream: AdmitStream | None = None
        self.admit_frame: AdmitFrame | None = None
        self.admit_size: AdmitSize | None = None
        self.quiet = QuietLog(log, ceiling=logging.WARNING)
        self.gate = Gate(config, peers, incarnation)
        self.verifier = self.gate.verifier
        self.checks = FrameChecks(config, self)
        self.store = store = InboundStore(config, self.quiet)
        self.reassembly = Reassembler(config, store, self.checks)
        self.endpoints = Endpoints(self, metrics_text)
        self.budget, self.inboxes, self.held = store.budget, store.inboxes, store.held
        self.streams, self.retired, self.received = store.streams, store.retired, store.received
        self.requests, self.lost, self.down_since = store.requests, store.lost, store.down_since
        self.refused: dict[str, int] = {}  # reason -> refused requests
        # reason -> refused frame stream handshakes: no frame travels on a handshake, and its
        # sender POSTs the frame next (refused again, and counted in ``refused``, if it must be)
        self.refused_handshakes: dict[str, int] = {}
        self.frame_streams: set[asyncio.Transport] = set()  # upgraded connections (`streamserve`)
        self.runner: web.AppRunner | None = None
        self.listener: Listener | None = None
        self.metrics_runner: web.AppRunner | None = None
        #: the port of the ``metrics_listen`` listener (None: none)
        self.metrics_port: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> int:
        """Serve on ``host:port`` (port 0: any free port); returns the port bound."""
        cfg, ends = self.cfg, self.endpoints
        app = web.Application(client_max_size=1 << 20, middlewares=[self._track])
        app.router.add_post(FRAME_PATH, ends.frame)
        app.router.add_post(BYE_PATH, ends.bye)
        if cfg.offers_streams:
            app.router.add_post(STREAM_PATH, ends.stream)
        app.router.add_get(HEALTH_PATH, ends.health)
        app.router.add_get(METRICS_PATH, ends.metrics)
        app.on_response_prepare.append(_hide_banner)
        handler_args: dict[str, Any] = dict(
            access_log=None,
            read_bufsize=cfg.read_bufsize,
            keepalive_timeout=cfg.keepalive_timeout,
            lingering_time=min(cfg.header_timeout, DRAIN_SECONDS),
            logger=self.quiet,
            auto_decompress=False,  # a compressed body is refused by `_track`, never inflated
        )
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, **handler_args)
        await runner.setup()
        loop = asyncio.get_running_loop()
        server = runner.server
        assert server is not None

        def make_handler() -> asyncio.Protocol:
            try:
                return _RequestHandler(server, loop=loop, **handler_args)
            except TypeError:  # another aiohttp's constructor: its own handler (with banner)
                return server()

        listener = Listener(
            make_handler,
            max_connections=cfg.max_connections,
            max_per_address=cfg.max_connections_per_address,
            header_timeout=cfg.header_timeout,
            keepalive_timeout=cfg.keepalive_timeout,
            ssl_context=cfg.ssl_server,
            log=self.quiet,
        )
        try:
            port = await listener.start(cfg.host, cfg.port)
        except BaseException:
            await runner.cleanup()
            raise
        self.runner, self.listener = runner, listener
        if cfg.metrics_listen is not None:
            await self._serve_metrics()
        self.store.start_sweeping()
        return port

    async def _serve_metrics(self) -> None:
        """The ``metrics_listen`` listener: ``GET /metrics`` to whoever reaches it (bind it
        to an address only readers reach; loopback unless a host is named)."""
        host, port = self.cfg.metrics_address()
        app = web.Application(client_max_size=1024)
        app.router.add_get(METRICS_PATH, self.endpoints.metrics_document)
        app.on_response_prepare.append(_hide_banner)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.metrics_runner = runner
        self.metrics_port = int(runner.addresses[0][1]) if runner.addresses else port

    @property
    def closed(self) -> bool:
        """Set by `close`: further frames are refused (503 closing)."""
        return self.store.closed

    def close(self) -> None:
        """Refuse further frames (503 closing); receives drain what is queued, then fail."""
        self.store.close()

    async def stop(self) -> None:
        """Stop accepting, close every connection, drop partial messages."""
        self.store.stop_sweeping()
        for transport in list(self.frame_streams):
            transport.abort()  # their sessions end at once instead of delaying the shutdown
        if self.listener is not None:
            await self.listener.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        if self.listener is not None:
            self.listener.abort_all()
            await asyncio.sleep(0)  # the aborted transports close their sockets on this turn
        for (sender, channel), state in list(self.streams.items()):
            self.store.drop_pending(sender, channel, state)

    # -- what every request passes ---------------------------------------------------------------
    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every request passes here: a declared ``Content-Encoding`` is refused (415) before
        anything else, and an answer that leaves more than `DRAIN_BYTES` of the body unread
        closes the connection (see `_close_unread`), as does any unread body of a route that
        reads none. Tells the listener a connection is inside a request (not evictable, no
        timers) and, for a route that reads a body, that its handler decides what is read."""
        listener, transport = self.listener, request.transport
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
        reads_body = request.method == "POST" and request.path in BODY_PATHS
        if listener is not None:
            listener.begin(transport, release=reads_body and encoding in IDENTITY)
        try:
            if encoding not in IDENTITY:
                resp = self.refusal(
                    Refuse(
                        415,
                        "encoding",
                        f"Content-Encoding {encoding[:40]!r}: Tandem sends bodies "
                        "uncompressed; send the body as it is, without Content-Encoding",
                    )
                ).response()
            else:
                resp = await handler(request)
            if not request.content.is_eof() and resp.status != 101:
                left = request.content_length
                held = listener is not None and listener.holds(transport)
                if left is None or left > DRAIN_BYTES or held:
                    await self._close_unread(request, resp)
            return resp
        finally:
            if listener is not None:
                listener.end(transport)

    async def _close_unread(self, request: web.Request, resp: web.StreamResponse) -> None:
        """Answer ``request`` whose body is mostly unread, then end its connection: the answer
        and an end of stream are sent, at most `DRAIN_BYTES` more of the body are read and
        dropped within `DRAIN_SECONDS` (so that a caller still writing sees the answer rather
        than a reset), and the connection is closed. Nothing else of the body is read, and
        what is dropped is never buffered (`connections.ConnectionGuard.discard`)."""
        transport = request.transport
        await resp.prepare(request)
        await resp.write_eof()
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        guard = self.listener.guard(transport) if self.listener is not None else None
        if guard is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_SECONDS):
                    await guard.discard(DRAIN_BYTES)
            request.protocol.force_close()
            return
        dropped = 0
        with contextlib.suppress(TimeoutError, ConnectionError, aiohttp.ClientPayloadError):
            async with asyncio.timeout(DRAIN_SECONDS):
                while dropped < DRAIN_BYTES and not request.content.is_eof():
                    data, _ = await request.content.readchunk()
                    if not data:
                        break
                    dropped += len(data)
        request.protocol.force_close()

    def refusal(self, r: Refuse, *, handshake: bool = False) -> Reply:
        """The answer to refusal ``r``, counted by reason: in ``refused_handshakes`` for a
        frame stream handshake (``handshake``), in ``refused`` otherwise, so that a frame
        refused on the handshake and again on its POST counts once."""
        if r.status != 421:  # 421 is how a sender learns whom to sign for (`rebinds`)
            counter = self.refused_handshakes if handshake else self.refused
            counter[r.reason] = counter.get(r.reason, 0) + 1
        # an admissible newcomer's stream handshake is refused before its first frame (POST)
        # admits it: normal flow. Were it not admissible, that POST's refusal is logged.
        joining = handshake and r.reason == "unknown_peer" and self.cfg.admit_unknown
        if r.reason not in QUIET_REASONS and not joining:
            self.quiet.info(
                "%s: refused request (%d %s): %s", self.cfg.name, r.status, r.reason, r.text
            )
        if r.status == 401:
            return Reply(401, "unauthorized")
        if r.extra:
            return Reply(
                r.status,
                orjson.dumps({"error": r.text, **r.extra}).decode(),
                content_type="application/json",
                reason=r.reason,
            )
        return Reply(r.status, r.text, reason=r.reason)

    # -- what the transport, `liveness` and `streamserve` ask of it -----------------------------
    def stats(self, peer: str) -> LinkStats:
        return self.store.stats(peer)

    def inbox(self, peer: str, channel: str) -> Inbox[Frame]:
        """`store.InboundStore.inbox`."""
        return self.store.inbox(peer, channel)

    def known_incarnation(self, peer: str) -> str | None:
        """`store.InboundStore.known_incarnation`."""
        return self.store.known_incarnation(peer)

    async def forget_incarnation(self, sender: str, inc: str) -> None:
        """`store.InboundStore.forget_incarnation` (a goodbye, or a peer found gone)."""
        await self.store.forget_incarnation(sender, inc)

    def authenticate(self, request: web.Request, path: str) -> str:
        """`identity.Gate.authenticate`."""
        return self.gate.authenticate(request, path)

    def check_stream(self, sender: str, channel: str) -> None:
        """`checks.FrameChecks.check_stream` (the ``admit_stream`` hook)."""
        self.checks.check_stream(sender, channel)

    def receive_now(self, head: MessageHead, body: memoryview) -> Reply | None:
        """`reassembly.Reassembler.receive_now`."""
        return self.reassembly.receive_now(head, body)

    async def receive_message(
        self, head: MessageHead, length: int, spec: str | None, body: Body, digest: str | None
    ) -> Reply:
        """`reassembly.Reassembler.receive_message`."""
        return await self.reassembly.receive_message(head, length, spec, body, digest)


async def _hide_banner(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


__all__ = [
    "DRAIN_BYTES",
    "DRAIN_SECONDS",
    "IDENTITY",
    "MAX_STREAMS",
    "HttpServer",
    "cert_identities",
]
