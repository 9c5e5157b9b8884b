"""The receiving half of the HTTP transport: the aiohttp application, authentication and
admission of requests, reassembly of chunked messages into bounded inboxes, and the checks a
frame passes before delivery.

Endpoints: ``POST /tandem/v1/frame`` (one chunk of a frame, plain or bulk), ``POST
/tandem/v1/bye`` (the sender closed), ``GET /healthz`` (liveness; names this party and its
incarnation only to an authenticated caller) and ``GET /metrics`` (Prometheus text, rendered
by the transport). Connections are accepted, capped and timed by `connections.Listener`.

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
import collections
import contextlib
import hashlib
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs, web

from tandem.errors import AdmissionError, AuthenticationError, FrameError, PayloadTooLargeError

from .. import auth, codec
from ..base import Frame, LinkStats
from ..inbox import Inbox
from .body import Body, PlainBody, read_into
from .budget import ByteBudget
from .bulk import BulkBody
from .config import HttpConfig, check_peer
from .connections import Listener
from .protocol import (
    BULK_PROTOCOL,
    BYE_PATH,
    FRAME_PATH,
    H_BASE,
    H_CHANNEL,
    H_CHUNK,
    H_CHUNKS,
    H_ID,
    H_INC,
    H_OFFSET,
    H_REPLY,
    H_SENDER,
    H_SPEC,
    H_TOTAL,
    HEALTH_PATH,
    INLINE_BYTES,
    METRICS_PATH,
    STREAM_PATH,
    MessageHead,
    Refuse,
    Reply,
    int_header,
    spec_text,
)
from .quietlog import QuietLog
from .scan import FiniteScan, all_finite, is_float
from .streams import Held, Partial, StreamState
from .streamserve import RecordBody, serve_stream

log = logging.getLogger(__name__)

SERVER_NAME = "tandem"  # the ``Server`` header: no software or version banner
MAX_STREAMS = 1024  # (sender, channel) streams a receiver keeps state for
#: the only ``Content-Encoding`` a request may declare: Tandem never compresses bodies, so any
#: other is refused from the headers (415) and its body is never read, let alone inflated
IDENTITY = frozenset({"", "identity"})
#: the most of a body left unread by its answer (a refusal, a duplicate) that is read and
#: dropped so that the caller sees the answer; a longer remainder closes the connection
DRAIN_BYTES = 256 << 10
DRAIN_SECONDS = 1.0  # and the longest that takes
#: refusals that are part of the protocol's normal flow, not logged
QUIET_REASONS = frozenset(
    {"ahead", "busy", "closing", "evicted", "misdirected", "out_of_order", "too_many_peers"}
)

AdmitStream = Callable[[str, str], None]
AdmitFrame = Callable[[Frame], None]


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


def cert_identities(cert: Mapping[str, Any] | None) -> set[str]:
    """The identities a verified peer certificate (``ssl.SSLSocket.getpeercert()``) names:
    its subject's commonName values and every subjectAltName value (DNS, URI, IP, email)."""
    if not cert:
        return set()
    ids = {
        value
        for rdn in cert.get("subject", ())
        for key, value in rdn
        if key == "commonName" and isinstance(value, str)
    }
    ids.update(v for _, v in cert.get("subjectAltName", ()) if isinstance(v, str))
    return ids


class HttpServer:
    """Serves one party's endpoints and keeps what it received. Built by `HttpTransport`;
    `start` inside a running loop, `close` then `stop` once.

    ``peers`` (name -> base URL) is shared with the transport: a request from a sender not in
    it is refused (401) unless ``admit_unknown`` admits it, which adds it there. ``spec_hash``,
    ``validator``, ``admit_stream`` and ``admit_frame`` may be replaced at any time (after
    negotiation). ``admit_stream(sender, channel)`` runs on each request head, before its body
    is read or any memory is reserved; ``admit_frame(frame)`` on each complete frame that
    passed every other check, just before delivery (on the loop, with nothing awaited between
    it and the delivery). Either refuses by raising `AdmissionError` (403 and 422, naming the
    field) or `FrameError`."""

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
        #: called with (peer, reason) when a request naming a configured peer fails its
        #: signature check (before the 401 goes out); must not raise or block
        self.on_auth_refused: Callable[[str, str], None] | None = None
        self.verifier = (
            auth.Verifier(
                config.keys(),
                name=config.name,
                incarnation=incarnation,
                window=config.auth_window,
                future_skew=config.max_clock_skew,
                max_nonces=config.max_nonces,
                max_senders=max(config.max_peers, len(peers)) + 64,
                clock=config.clock,
            )
            if config.secret
            else None
        )
        self.budget = ByteBudget(config.budget_bytes())
        self.inboxes: dict[tuple[str, str], Inbox[Frame]] = {}
        self.held: dict[tuple[str, str], collections.deque[int]] = {}  # sizes of queued frames
        self.streams: dict[tuple[str, str], StreamState] = {}
        self.retired: dict[str, set[str]] = {}  # sender -> incarnations that said goodbye
        self.received: dict[str, LinkStats] = {}
        self.refused: dict[str, int] = {}  # reason -> refused requests
        # reason -> refused frame stream handshakes: no frame travels on a handshake, and its
        # sender POSTs the frame next (refused again, and counted in ``refused``, if it must be)
        self.refused_handshakes: dict[str, int] = {}
        self.requests: dict[str, int] = {}  # path (plain|bulk) -> bodies accepted for reading
        self.lost: dict[str, str] = {}  # peer -> why it was taken as gone (see `liveness`)
        self.down_since: dict[str, float] = {}  # peer -> loop time its probes began failing
        self.frame_streams: set[asyncio.Transport] = set()  # upgraded connections (`streamserve`)
        self.dropped_partials = 0  # partial messages dropped after partial_timeout
        self.rebinds = 0  # 421 answers: signed for another incarnation (not refusals)
        self.runner: web.AppRunner | None = None
        self.listener: Listener | None = None
        self.closed = False
        self.quiet = QuietLog(log, ceiling=logging.WARNING)
        self._metrics_text = metrics_text
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self) -> int:
        """Serve on ``host:port`` (port 0: any free port); returns the port bound."""
        cfg = self.cfg
        app = web.Application(client_max_size=1 << 20, middlewares=[self._track])
        app.router.add_post(FRAME_PATH, self.handle_frame)
        app.router.add_post(BYE_PATH, self.handle_bye)
        if cfg.frame_streams:
            app.router.add_post(STREAM_PATH, self.handle_stream)
        app.router.add_get(HEALTH_PATH, self.handle_health)
        app.router.add_get(METRICS_PATH, self.handle_metrics)
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
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep)
        return port

    def close(self) -> None:
        """Refuse further frames (503 closing); receives drain what is queued, then fail."""
        self.closed = True
        for box in self.inboxes.values():
            box.close()
        for state in self.streams.values():
            state.wake()

    async def stop(self) -> None:
        """Stop accepting, close every connection, drop partial messages."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for transport in list(self.frame_streams):
            transport.abort()  # their sessions end at once instead of delaying the shutdown
        if self.listener is not None:
            await self.listener.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.listener is not None:
            self.listener.abort_all()
        for (sender, channel), state in list(self.streams.items()):
            self.drop_pending(sender, channel, state)

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every request passes here: a declared ``Content-Encoding`` is refused (415) before
        anything else, and an answer that leaves more than `DRAIN_BYTES` of the body unread
        closes the connection (see `_close_unread`). Tells the listener a connection is inside
        a request (not evictable, no timers)."""
        listener, transport = self.listener, request.transport
        if listener is not None:
            listener.begin(transport)
        try:
            encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
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
                if left is None or left > DRAIN_BYTES:
                    await self._close_unread(request, resp)
            return resp
        finally:
            if listener is not None:
                listener.end(transport)

    async def _close_unread(self, request: web.Request, resp: web.StreamResponse) -> None:
        """Answer ``request`` whose body is mostly unread, then end its connection: the answer
        and an end of stream are sent, at most `DRAIN_BYTES` more of the body are read and
        dropped within `DRAIN_SECONDS` (so that a caller still writing sees the answer rather
        than a reset), and the connection is closed. Nothing else of the body is read."""
        transport = request.transport
        await resp.prepare(request)
        await resp.write_eof()
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        dropped = 0
        with contextlib.suppress(TimeoutError, ConnectionError, aiohttp.ClientPayloadError):
            async with asyncio.timeout(DRAIN_SECONDS):
                while dropped < DRAIN_BYTES and not request.content.is_eof():
                    data, _ = await request.content.readchunk()
                    if not data:
                        break
                    dropped += len(data)
        request.protocol.force_close()

    def stats(self, peer: str) -> LinkStats:
        stats = self.received.get(peer)
        if stats is None:
            stats = self.received[peer] = LinkStats()
        return stats

    def inbox(self, peer: str, channel: str) -> Inbox[Frame]:
        """The inbox of frames from ``peer`` on ``channel`` (made on first use). Taking a
        frame from it gives the frame's bytes back to the budget."""
        key = (peer, channel)
        box = self.inboxes.get(key)
        if box is None:
            sizes = self.held[key] = collections.deque()

            def taken(_: Frame) -> None:
                self.budget.release(sizes.popleft())

            box = self.inboxes[key] = Inbox(self.cfg.capacity, closed=self.closed, on_take=taken)
        return box

    def deliver(self, box: Inbox[Frame], key: tuple[str, str], frame: Frame, size: int) -> None:
        self.held[key].append(size)
        box.deliver(frame)

    def refusal(self, r: Refuse, *, handshake: bool = False) -> Reply:
        """The answer to refusal ``r``, counted by reason: in ``refused_handshakes`` for a
        frame stream handshake (``handshake``), in ``refused`` otherwise, so that a frame
        refused on the handshake and again on its POST counts once."""
        if r.status != 421:  # 421 is how a sender learns whom to sign for (`rebinds`)
            counter = self.refused_handshakes if handshake else self.refused
            counter[r.reason] = counter.get(r.reason, 0) + 1
        if r.reason not in QUIET_REASONS:
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

    # -- who is asking -----------------------------------------------------------------------
    def authenticate(self, request: web.Request, path: str) -> str:
        """The sender of a request: a known peer (or one ``admit_unknown`` admits) whose
        signature (with a secret) and certificate (with TLS client certificates) prove it."""
        sender = request.headers.get(H_SENDER, "")
        if sender not in self.peers:
            sender = self.admit(request, path, sender)
        elif self.verifier is not None:
            self.verify(request, path, sender)
        self.check_identity(request, sender)
        return sender

    def verify(self, request: web.Request, path: str, who: str) -> None:
        assert self.verifier is not None
        try:
            self.verifier.verify(request.method, path, request.headers)
        except auth.MisdirectedError as exc:
            self.rebinds += 1
            raise Refuse(
                421, "misdirected", f"from {who!r}: {exc}", incarnation=exc.incarnation
            ) from None
        except AuthenticationError as exc:
            if self.on_auth_refused is not None and who in self.peers:
                self.on_auth_refused(who, str(exc))
            raise Refuse(401, "unauthenticated", f"from {who!r}: {exc}") from None

    def check_identity(self, request: web.Request, sender: str) -> None:
        """With a TLS client certificate, it must name one of ``sender``'s identities (403);
        a server that asks for certificates and holds no secret refuses a request without
        one (401)."""
        transport = request.transport
        cert = transport.get_extra_info("peercert") if transport is not None else None
        if not cert:
            ctx = self.cfg.ssl_server
            if self.verifier is None and ctx is not None and ctx.verify_mode != ssl.CERT_NONE:
                raise Refuse(401, "unauthenticated", f"{sender!r} sent no client certificate")
            return
        ids = cert_identities(cert)
        allowed = list((self.cfg.peer_identities or {}).get(sender) or [sender])
        if not ids.intersection(allowed):
            raise Refuse(
                403,
                "identity",
                f"the TLS client certificate (names {sorted(ids)}) does not belong to "
                f"sender {sender!r} (accepted names: {allowed}); issue the certificate to "
                "that name or map it under peer_identities",
            )

    def admit(self, request: web.Request, path: str, sender: str) -> str:
        """An unknown sender becomes a peer only under ``admit_unknown`` with a valid signature."""
        if not (self.cfg.admit_unknown and self.verifier is not None and path == FRAME_PATH):
            raise Refuse(401, "unknown_peer", f"unknown sender {sender[:80]!r}")
        names = self.cfg.admit_names
        if names is not None and sender not in names:
            raise Refuse(401, "unknown_peer", f"sender {sender[:80]!r} is not in the roster")
        self.verify(request, path, f"unknown {sender}")
        url = request.headers.get(H_REPLY, "")
        if len(self.peers) >= self.cfg.max_peers:
            raise Refuse(
                503,
                "too_many_peers",
                f"{self.cfg.name!r} already has max_peers={self.cfg.max_peers} peers",
            )
        try:
            self.peers[sender] = check_peer(self.cfg.name, sender, url)
        except ValueError as exc:
            raise Refuse(400, "malformed", f"cannot admit {sender!r}: {exc}") from None
        log.info("%s: admitted peer %r at %s", self.cfg.name, sender, url)
        return sender

    def caller_is_peer(self, request: web.Request, path: str) -> bool:
        """Whether a ``GET`` caller proves to be a peer (signature, or certificate), without
        refusing it: for answers that say more to peers than to strangers."""
        sender = request.headers.get(H_SENDER, "")
        if sender not in self.peers:
            return False
        try:
            if self.verifier is not None:
                self.verifier.verify(request.method, path, request.headers, bound=False)
            elif not _cert(request) and self.cfg.ssl_server is not None:
                return self.cfg.ssl_server.verify_mode == ssl.CERT_NONE
            self.check_identity(request, sender)
        except (AuthenticationError, Refuse):
            return False
        return True

    # -- frames ------------------------------------------------------------------------------
    async def handle_frame(self, request: web.Request) -> web.StreamResponse:
        """``POST /tandem/v1/frame``: a plain request (body in the HTTP message) or a bulk one
        (``Upgrade: tandem-frame/1``, body raw after the 101). Both run `receive`; only where
        the body comes from (`PlainBody`, `BulkBody`) and how the reply travels differ."""
        bulk = request.headers.get("Upgrade", "").strip().lower() == BULK_PROTOCOL
        body: Body = (
            BulkBody(request)
            if bulk
            else PlainBody(request.content, request.content_length, request.transport)
        )
        try:
            reply = await self.receive(request, body)
        except Refuse as r:
            reply = self.refusal(r)
        except (ConnectionError, aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as exc:
            self.refused["disconnected"] = self.refused.get("disconnected", 0) + 1
            reply = Reply(400, f"request body incomplete: {exc}")
        except Exception as exc:  # the server must keep serving; report and move on
            self.quiet.error(
                "%s: internal error while receiving a frame", self.cfg.name, exc_info=exc
            )
            self.refused["internal"] = self.refused.get("internal", 0) + 1
            reply = Reply(500, "internal error (see the receiver's log)")
        finally:
            body.release()
        return body.respond(reply)

    async def receive(self, request: web.Request, body: Body) -> Reply:
        if self.closed:
            raise Refuse(503, "closing", "receiver is closing")
        sender = self.authenticate(request, FRAME_PATH)
        h = request.headers
        channel = h.get(H_CHANNEL, "")
        if not channel:
            raise Refuse(400, "malformed", f"missing header {H_CHANNEL}")
        self.check_stream(sender, channel)
        inc = h.get(H_INC, "")
        if not inc:
            raise Refuse(400, "malformed", f"missing header {H_INC}")
        msg_id, chunk, chunks, offset, total = (
            int_header(h, k) for k in (H_ID, H_CHUNK, H_CHUNKS, H_OFFSET, H_TOTAL)
        )
        length = body.length()
        digest = h.get(auth.BODY_SHA, "") if self.verifier is not None else None
        base = int_header(h, H_BASE) if H_BASE in h else msg_id
        head = MessageHead(sender, channel, inc, msg_id, chunk, chunks, offset, total, base)
        return await self.receive_message(head, length, h.get(H_SPEC, ""), body, digest)

    def message_state(
        self, head: MessageHead, length: int, spec: str | None
    ) -> tuple[tuple[str, str], StreamState]:
        """The checks of a message chunk's head, before any lock or memory is taken (sizes,
        chunk consistency, spec, retired incarnation, base), and its stream's state."""
        sender, channel, inc, msg_id, chunk, chunks, offset, total, base = head
        if total > self.cfg.max_frame_bytes:
            raise Refuse(
                413,
                "too_large",
                f"frame of {total} bytes exceeds max_frame_bytes="
                f"{self.cfg.max_frame_bytes} of {self.cfg.name!r}; raise it on the "
                "receiver or send smaller tensors",
            )
        if not (
            chunks >= 1
            and 0 <= chunk < chunks
            and offset + length <= total
            and (chunks > 1 or length == total)
        ):
            raise Refuse(
                400,
                "malformed",
                f"inconsistent chunk headers: chunk {chunk} of {chunks}, offset "
                f"{offset} + length {length} > total {total}",
            )
        if spec is not None and self.spec_hash and spec != self.spec_hash:
            raise Refuse(409, "spec_mismatch", spec_text(spec, self.spec_hash))
        if inc in self.retired.get(sender, ()):
            raise Refuse(410, "retired", f"incarnation {inc} of {sender!r} has closed")
        key = (sender, channel)
        state = self.streams.get(key)
        if state is None:
            if len(self.streams) >= MAX_STREAMS:
                raise Refuse(503, "busy", f"receiver keeps {MAX_STREAMS} streams at most")
            state = self.streams[key] = StreamState()
        if base > msg_id:
            raise Refuse(
                400, "malformed", f"header {H_BASE} ({base}) is above the message id ({msg_id})"
            )
        return key, state

    def adopt_incarnation(self, sender: str, channel: str, state: StreamState, inc: str) -> None:
        """A (re)started sender: fresh ordering state for its new incarnation ``inc`` (the
        former one is retired). Call with ``state.lock`` held, or with nothing awaited."""
        self.lost.pop(sender, None)
        self.down_since.pop(sender, None)
        if state.incarnation:
            self.retired.setdefault(sender, set()).add(state.incarnation)
        self.drop_pending(sender, channel, state)
        state.incarnation, state.next_id = inc, None
        state.refused.clear()
        box = self.inbox(sender, channel)
        if box.closed and not self.closed:
            box.reopen()

    def open_turn(
        self, sender: str, channel: str, state: StreamState, inc: str, msg_id: int, base: int
    ) -> Reply | int:
        """The first admission steps of message ``msg_id`` (both paths take them, in this
        order): adopt the sender's incarnation ``inc`` if it is new, answer a message below
        the stream's next id as a duplicate, forget an earlier refusal of it (sent again: it
        is judged afresh); then the id the stream expects next, once the ids the sender
        settled (below ``base``) are skipped. Call with ``state.lock`` held, or with nothing
        awaited."""
        if state.incarnation != inc:
            self.adopt_incarnation(sender, channel, state, inc)
        if state.next_id is not None and msg_id < state.next_id:
            return Reply(200, "duplicate")
        state.refused.pop(msg_id, None)
        return max(base, state.next_id if state.next_id is not None else base)

    async def receive_message(
        self, head: MessageHead, length: int, spec: str | None, body: Body, digest: str | None
    ) -> Reply:
        """Admission, reading and delivery of one chunk of an authenticated sender's message,
        whichever way it came (a POST, a bulk body, or a frame stream's record). ``spec``: the
        spec hash the request names (None: only the decoded frame's is checked); ``digest``:
        the body's expected SHA-256 (None: the body is authenticated otherwise, or not at
        all without a secret)."""
        sender, channel, inc, msg_id, chunk, chunks, offset, total, base = head
        key, state = self.message_state(head, length, spec)
        loop = asyncio.get_running_loop()
        waited = 0.0
        async with state.lock:  # admission: bounded by backpressure_wait, never a body read
            turn = self.open_turn(sender, channel, state, inc, msg_id, base)
            if isinstance(turn, Reply):
                return turn
            next_id = turn
            box = self.inbox(sender, channel)
            held = state.ready.get(msg_id)
            complete = held is not None
            if held is not None:
                held.base = max(held.base, base)
                self.advance(key, state)
            else:
                if msg_id - next_id >= self.cfg.send_window:
                    raise Refuse(
                        503,
                        "ahead",
                        f"message {msg_id} on {channel!r} is send_window="
                        f"{self.cfg.send_window} or more ahead of message {next_id}, the next "
                        "in order; it is accepted once the messages before it are delivered",
                    )
                part = state.partials.get(msg_id)
                if part is not None and chunk < part.next_chunk:
                    return Reply(200, "duplicate")
                if chunk == 0 and part is None:
                    t0 = time.monotonic()
                    if msg_id > next_id:
                        self.reserve_ahead(box, state, next_id, msg_id, chunks, total)
                    else:
                        await self.reserve(box, channel, total)
                    waited = time.monotonic() - t0
                    part = state.partials[msg_id] = Partial(msg_id, chunks, total, loop.time())
                    if self.cfg.reject_nonfinite and total >= INLINE_BYTES:
                        part.scan = FiniteScan(part.buffer)
                elif part is None or chunk != part.next_chunk:
                    expect = part.next_chunk if part is not None else 0
                    raise Refuse(
                        409,
                        "out_of_order",
                        f"chunk {chunk} of message {msg_id} is out of order; expected chunk "
                        f"{expect}",
                        expect_chunk=expect,
                    )
                if part.chunks != chunks or part.total != total or offset != part.filled:
                    self.drop_partial(sender, channel, state, msg_id)
                    raise Refuse(
                        400,
                        "malformed",
                        "chunk headers disagree with the message's "
                        f"first chunk (chunks {chunks}, total {total}, offset {offset})",
                    )
                claim = part.claim(body.abort, loop.time())  # revokes a stalled older reader
                if part.scan is not None:
                    part.scan.rewind(offset)  # a chunk received again: forget its earlier bytes
        if complete:  # a retry of a message waiting in the reorder buffer: no body to read
            return await self.await_turn(state, inc, msg_id, waited)
        assert part is not None  # admitted above: the message is not complete yet
        # the body is read without the lock: a retry of this chunk may take it over meanwhile
        t_read = time.monotonic()
        try:
            hasher = hashlib.sha256() if digest is not None else None
            if isinstance(body, PlainBody):
                body.claim = claim
            path = await body.begin(part.buffer, offset, length, part.scan)  # bulk: 101 here
            self.requests[path] = self.requests.get(path, 0) + 1
            await read_into(
                body,
                part.buffer,
                offset,
                length,
                hasher,
                part.scan,
                # a stream record's body is already in memory: nothing can stall
                idle=None if isinstance(body, RecordBody) else self.cfg.body_idle_timeout,
                claim=claim,
            )
            if hasher is not None and hasher.hexdigest() != digest:
                raise Refuse(401, "unauthenticated", "body digest does not match")
        except BaseException:
            part.unclaim(claim, loop.time())
            raise
        async with state.lock:
            part.unclaim(claim, loop.time())
            if state.partials.get(msg_id) is not part or not claim.live:
                raise Refuse(
                    409,
                    "superseded",
                    f"chunk {chunk} of message {msg_id} was taken over by a newer request",
                )
            stats = self.stats(sender)
            stats.bytes += length
            stats.busy_seconds += time.monotonic() - t_read
            part.filled += length
            part.next_chunk += 1
            if part.next_chunk < part.chunks:
                return Reply(200, "chunk", waited)
            del state.partials[msg_id]
            try:
                frame = await self.check_frame(sender, channel, msg_id, part.buffer, part.scan)
            except BaseException:
                box.unreserve()
                self.budget.release(part.total)
                raise
            if state.incarnation != inc or (state.next_id is not None and msg_id < state.next_id):
                box.unreserve()  # the stream moved on while the frame was checked
                self.budget.release(part.total)
                raise Refuse(409, "superseded", f"message {msg_id} was settled meanwhile")
            state.ready[msg_id] = Held(frame, part.total, base)
            self.advance(key, state)
        return await self.await_turn(state, inc, msg_id, waited)

    def receive_now(self, head: MessageHead, body: memoryview) -> Reply | None:
        """`receive_message` for a single-chunk message whose body is already in memory and
        authenticated (a frame stream's record), judged on the spot when nothing must be
        awaited: the same checks in the same order, the same verdicts and counters. None, with
        nothing taken, when it would have to wait: its stream's lock is held, it is not the
        next message in order, no inbox slot or budget is free at once, or its checks run in a
        worker thread (large payload, a ``validator``); the caller then runs
        `receive_message`, which picks up where this left off."""
        sender, channel, inc, msg_id, _, _, _, total, base = head
        length = len(body)
        key, state = self.message_state(head, length, None)
        if state.lock.locked() or total >= INLINE_BYTES or self.validator is not None:
            return None
        # nothing below awaits: the stream's lock would be taken and released untouched
        turn = self.open_turn(sender, channel, state, inc, msg_id, base)
        if isinstance(turn, Reply):
            return turn
        next_id = turn
        if msg_id != next_id or msg_id in state.ready or msg_id in state.partials:
            return None  # ahead of its turn, or a retry of a message held: it may wait
        box = self.inbox(sender, channel)
        if not box.try_reserve():
            return None
        if not self.budget.try_acquire(total):
            box.unreserve()
            return None
        t_read = time.monotonic()
        # the record's bytes, copied at once into a writable buffer the frame's arrays view
        # (a bytearray: malloc's alignment suffices, the codec aligns arrays within it)
        buffer = memoryview(bytearray(body))
        self.requests["stream"] = self.requests.get("stream", 0) + 1
        stats = self.stats(sender)
        stats.bytes += length
        stats.busy_seconds += time.monotonic() - t_read
        try:
            frame = self.decode_checked(sender, channel, msg_id, buffer)
            if self.cfg.reject_nonfinite:  # small arrays, no validator: on the loop
                self.validate(frame)
        except BaseException:
            box.unreserve()
            self.budget.release(total)
            raise
        if state.ready or state.partials:
            state.ready[msg_id] = Held(frame, total, base)
            self.advance(key, state)
            return self.turn_settled(state, inc, msg_id, 0.0)
        return self.deliver_next(key, state, box, frame, total)

    def deliver_next(
        self,
        key: tuple[str, str],
        state: StreamState,
        box: Inbox[Frame],
        frame: Frame,
        size: int,
    ) -> Reply:
        """`advance` and `turn_settled` for the message the stream expects next (``box`` slot
        reserved, ``size`` bytes of the budget taken) when nothing else is held: the frame
        passes the ``admit_frame`` hook and is delivered (200), or its refusal is raised with
        its id left unused, as they would do."""
        try:
            self.check_admission(frame)
        except Refuse:
            box.unreserve()
            self.budget.release(size)
            state.wake()
            raise
        self.deliver(box, key, frame, size)
        self.stats(key[0]).frames += 1
        nid = state.next_id = frame.msg_id + 1
        if state.refused:
            for k in [k for k in state.refused if k < nid]:
                del state.refused[k]
        if state.waiters:
            state.wake()
        return Reply(200, "ok", 0.0)

    def advance(self, key: tuple[str, str], state: StreamState) -> None:
        """Deliver from ``ready`` in id order, each frame after the ``admit_frame`` hook; when
        ``next_id`` is missing, the lowest held message whose base is its own id (its sender
        settled every id before it) is delivered instead, skipping the missing ids (their
        partial messages are dropped). A frame the hook refuses leaves its id unused (as any
        refusal does: its sender may send that id again) and its refusal in ``refused`` for
        the request waiting on it. Wakes the waiting requests. Call with ``state.lock`` held."""
        nid, woke = state.next_id, False
        while state.ready:
            if nid is not None and nid in state.ready:
                k = nid
            else:
                settled = [k for k, h in state.ready.items() if h.base == k]
                k = min(settled, default=-1)
                if k < 0 or (nid is not None and k < nid):
                    break
            held = state.ready.pop(k)
            box = self.inbox(*key)
            woke = True
            try:
                self.check_admission(held.frame)
            except Refuse as r:
                box.unreserve()
                self.budget.release(held.size)
                state.refused[k] = r
                continue
            if state.partials:
                for gone in [j for j in state.partials if j < k]:
                    self.drop_partial(key[0], key[1], state, gone)
            self.deliver(box, key, held.frame, held.size)
            self.stats(key[0]).frames += 1
            nid = k + 1
        if nid != state.next_id:
            state.next_id = nid
            if nid is not None and state.refused:
                for k in [k for k in state.refused if k < nid]:
                    del state.refused[k]
        if woke:
            state.wake()

    async def await_turn(self, state: StreamState, inc: str, msg_id: int, waited: float) -> Reply:
        """Wait (up to ``backpressure_wait``) until complete message ``msg_id`` is delivered or
        refused in order; 503 ``ahead`` when the messages before it are still missing (the
        sender retries, with no body to read again), 503 ``evicted`` when it was dropped to
        make room (the sender sends it again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.backpressure_wait
        while True:
            reply = self.turn_settled(state, inc, msg_id, waited)
            if reply is not None:
                return reply
            nid = state.next_id
            if self.closed:
                raise Refuse(503, "closing", "receiver is closing")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Refuse(
                    503, "ahead", f"message {msg_id} waits for message {nid}, the next in order"
                )
            fut: asyncio.Future[None] = loop.create_future()
            state.waiters.append(fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                pass
            finally:
                state.waiters.remove(fut)

    def turn_settled(
        self, state: StreamState, inc: str, msg_id: int, waited: float
    ) -> Reply | None:
        """Complete message ``msg_id``'s verdict once it is delivered (200) or refused (its
        refusal, raised; 410 when its incarnation was replaced, 503 ``evicted`` when it was
        dropped from the reorder buffer); None while it waits in ``ready`` for its turn."""
        if state.incarnation != inc:
            raise Refuse(410, "retired", f"incarnation {inc} was replaced meanwhile")
        refusal = state.refused.pop(msg_id, None)
        if refusal is not None:
            raise refusal
        nid = state.next_id
        if nid is not None and msg_id < nid:
            return Reply(200, "ok", waited)
        if msg_id not in state.ready:
            raise Refuse(
                503,
                "evicted",
                f"message {msg_id} was dropped from the reorder buffer to make room for "
                f"message {nid} before it; send it again",
            )
        return None

    async def reserve(self, box: Inbox[Frame], channel: str, total: int) -> None:
        """An inbox slot and ``total`` bytes of the budget for the next message in order, each
        waited for up to ``backpressure_wait``; `Refuse` (503) when either stays unavailable
        (then messages held ahead of their turn are dropped, so the retry finds room)."""
        wait = self.cfg.backpressure_wait
        if not await box.reserve(wait):
            if self.closed:
                raise Refuse(503, "closing", "receiver is closing")
            if box.closed:  # the sender said goodbye: nobody here reads its channels any more
                raise Refuse(
                    410,
                    "retired",
                    f"channel {channel!r} of this sender was closed by its goodbye; the "
                    "receiver no longer reads it (restart the receiver's session to talk again)",
                )
            raise Refuse(503, "busy", f"receiver busy: inbox of {channel!r} is full")
        if not await self.budget.acquire(total, wait):
            box.unreserve()
            self.evict_ahead()
            raise Refuse(
                503,
                "busy",
                f"receiver busy: {self.budget.held} of its inbound_budget="
                f"{self.budget.capacity} bytes are held; a message of {total} bytes waits",
            )

    def reserve_ahead(
        self,
        box: Inbox[Frame],
        state: StreamState,
        nid: int,
        msg_id: int,
        chunks: int,
        total: int,
    ) -> None:
        """An inbox slot and ``total`` bytes for a message ahead of its turn, taken only now
        and only where they leave a slot for every missing id before it and keep messages held
        ahead to half the budget (so the next message in order always finds room); else 503
        ``ahead`` (its sender waits and retries)."""
        if chunks > 1:
            raise Refuse(
                503, "ahead", f"chunked message {msg_id} is received once {nid} is delivered"
            )
        missing = msg_id - nid - state.reserved_between(nid, msg_id)
        if not box.try_reserve(keep_free=missing):
            if box.closed:
                raise Refuse(503, "closing", "receiver is closing")
            raise Refuse(
                503, "ahead", f"inbox slots are kept for the messages before {msg_id} (from {nid})"
            )
        held_ahead = sum(st.ahead_bytes() for st in self.streams.values())
        if held_ahead + total > self.budget.capacity // 2 or not self.budget.try_acquire(total):
            box.unreserve()
            raise Refuse(
                503, "ahead", f"budget bytes are kept for the messages before {msg_id} (from {nid})"
            )

    def evict_ahead(self) -> None:
        """Drop every message held ahead of its turn (their senders send them again)."""
        for (sender, channel), state in list(self.streams.items()):
            nid = state.next_id
            if nid is None:
                continue
            for k in [k for k in state.partials if k > nid]:
                self.drop_partial(sender, channel, state, k)
            evicted = [k for k in state.ready if k > nid]
            for k in evicted:
                held = state.ready.pop(k)
                self.inbox(sender, channel).unreserve()
                self.budget.release(held.size)
            if evicted:
                state.wake()

    def drop_partial(self, sender: str, channel: str, state: StreamState, msg_id: int) -> None:
        """Forget partial message ``msg_id`` (if any): its reader is cut off, its inbox slot
        and budget bytes are given back."""
        part = state.partials.pop(msg_id, None)
        if part is not None:
            if part.reader is not None:
                part.reader.revoke()
            self.inbox(sender, channel).unreserve()
            self.budget.release(part.total)

    def drop_pending(self, sender: str, channel: str, state: StreamState) -> None:
        """Forget every message of ``state`` not yet delivered (partial or waiting its turn)."""
        for k in list(state.partials):
            self.drop_partial(sender, channel, state, k)
        for held in state.ready.values():
            self.inbox(sender, channel).unreserve()
            self.budget.release(held.size)
        state.ready.clear()
        state.wake()

    def _sweep_every(self) -> float:
        return max(0.05, min(self.cfg.partial_timeout / 4, 5.0))

    def _sweep(self) -> None:
        """Drop partial messages nobody has read into for ``partial_timeout`` s (runs every
        `_sweep_every` s while serving)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for (sender, channel), state in list(self.streams.items()):
            for part in list(state.partials.values()):
                if part.reader is not None or now - part.touched < self.cfg.partial_timeout:
                    continue
                self.drop_partial(sender, channel, state, part.msg_id)
                self.dropped_partials += 1
                self.quiet.info(
                    "%s: dropped message %d from %r on %r: idle for partial_timeout=%g s with "
                    "%d of %d bytes",
                    self.cfg.name,
                    part.msg_id,
                    sender,
                    channel,
                    self.cfg.partial_timeout,
                    part.filled,
                    part.total,
                )
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep)

    def check_stream(self, sender: str, channel: str) -> None:
        """The ``admit_stream`` hook (403 naming the field)."""
        if self.admit_stream is None:
            return
        try:
            self.admit_stream(sender, channel)
        except FrameError as exc:
            field = exc.field if isinstance(exc, AdmissionError) else "channel"
            raise Refuse(403, "not_admitted", str(exc), field=field) from None

    def check_admission(self, frame: Frame) -> None:
        """The ``admit_frame`` hook (422 naming the field)."""
        if self.admit_frame is None:
            return
        try:
            self.admit_frame(frame)
        except FrameError as exc:
            field = exc.field if isinstance(exc, AdmissionError) else ""
            raise Refuse(
                422, "not_admitted", f"frame refused at admission: {exc}", field=field
            ) from None

    async def check_frame(
        self,
        sender: str,
        channel: str,
        msg_id: int,
        buffer: memoryview,
        scan: FiniteScan | None = None,
    ) -> Frame:
        """The frame in ``buffer``, decoded and checked (`decode_checked`, then NaN/Inf and the
        ``validator`` hook: in a worker thread for large arrays or any validator)."""
        frame = self.decode_checked(sender, channel, msg_id, buffer)
        if self.cfg.reject_nonfinite or self.validator is not None:
            known = scan.verdicts(frame) if scan is not None else {}
            unknown = sum(a.nbytes for i, a in enumerate(frame.arrays) if i not in known)
            if unknown < INLINE_BYTES and self.validator is None:
                self.validate(frame, known)
            else:
                await asyncio.to_thread(self.validate, frame, known)
        return frame

    def decode_checked(self, sender: str, channel: str, msg_id: int, buffer: memoryview) -> Frame:
        """The frame in ``buffer``, decoded (bounded by ``max_frame_bytes``), its header
        agreeing with the request's and its spec hash with the negotiated one."""
        try:
            frame = codec.decode(buffer, max_bytes=self.cfg.max_frame_bytes)
        except PayloadTooLargeError as exc:
            raise Refuse(413, "too_large", str(exc)) from None
        except FrameError as exc:
            raise Refuse(400, "malformed", f"malformed frame: {exc}") from None
        if (frame.sender, frame.channel, frame.msg_id) != (sender, channel, msg_id):
            raise Refuse(
                400,
                "malformed",
                f"frame header (sender {frame.sender!r}, channel {frame.channel!r}, id "
                f"{frame.msg_id}) disagrees with the request headers ({sender!r}, "
                f"{channel!r}, {msg_id})",
            )
        if self.spec_hash and frame.spec_hash != self.spec_hash:
            raise Refuse(409, "spec_mismatch", spec_text(frame.spec_hash, self.spec_hash))
        return frame

    def validate(self, frame: Frame, known: Mapping[int, bool] | None = None) -> None:
        """NaN/Inf check, then the ``validator`` hook. ``known``: array index -> finite, the
        verdicts `FiniteScan` reached while the body arrived (those arrays are not read
        again)."""
        if self.cfg.reject_nonfinite:
            for i, a in enumerate(frame.arrays):
                if is_float(a.dtype) and a.size:
                    finite = known.get(i) if known else None
                    if not (all_finite(a) if finite is None else finite):
                        raise Refuse(
                            422,
                            "nonfinite",
                            f"array {i} of frame {frame.msg_id} on {frame.channel!r} "
                            "contains NaN or Inf (reject_nonfinite=True on the "
                            "receiver)",
                        )
        if self.validator is not None:
            try:
                self.validator(frame)
            except FrameError as exc:
                raise Refuse(422, "invalid", f"frame refused by validator: {exc}") from None

    async def handle_stream(self, request: web.Request) -> web.StreamResponse:
        """``POST /tandem/v1/stream``: a frame stream (`streamserve`)."""
        return await serve_stream(self, request)

    async def handle_bye(self, request: web.Request) -> web.Response:
        try:
            sender = self.authenticate(request, BYE_PATH)
        except Refuse as r:
            return self.refusal(r).response()
        if request.content_length:
            return self.refusal(Refuse(400, "malformed", "a goodbye has no body")).response()
        await self.forget_incarnation(sender, request.headers.get(H_INC, ""))
        return web.Response(text="bye")

    async def forget_incarnation(self, sender: str, inc: str) -> None:
        """What a goodbye of ``sender``'s incarnation ``inc`` does: its late requests are
        refused, its partial messages dropped, and ``recv`` from it raises once drained."""
        self.retired.setdefault(sender, set()).add(inc)
        for (s, channel), state in list(self.streams.items()):
            if s == sender and state.incarnation == inc:
                async with state.lock:
                    self.drop_pending(s, channel, state)
        for (s, _), box in list(self.inboxes.items()):
            if s == sender:
                box.close()

    async def handle_health(self, request: web.Request) -> web.Response:
        """Liveness for anyone; this party's name and incarnation only for a peer that proves
        who it is (signed request, or client certificate)."""
        if self.caller_is_peer(request, HEALTH_PATH):
            return web.json_response(
                {"status": "ok", "party": self.cfg.name, "incarnation": self.incarnation}
            )
        return web.json_response({"status": "ok"})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self._metrics_text(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    def known_incarnation(self, peer: str) -> str | None:
        """The incarnation of ``peer`` we receive from (None: never heard from, or retired)."""
        retired = self.retired.get(peer, ())
        return next(
            (
                st.incarnation
                for (s, _), st in self.streams.items()
                if s == peer and st.incarnation and st.incarnation not in retired
            ),
            None,
        )


def _cert(request: web.Request) -> Any:
    transport = request.transport
    return transport.get_extra_info("peercert") if transport is not None else None


async def _hide_banner(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME
