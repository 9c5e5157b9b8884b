"""The receiving half of the HTTP transport: the aiohttp application, authentication and
admission of requests, reassembly of chunked messages into bounded inboxes, and the checks a
frame passes before delivery.

Endpoints: ``POST /tandem/v1/frame`` (one chunk of a frame, plain or bulk), ``POST
/tandem/v1/bye`` (the sender closed), ``GET /healthz`` (names this process's incarnation) and
``GET /metrics`` (Prometheus text, rendered by the transport). A request for a new message
first reserves a slot in its stream's inbox, waiting up to ``backpressure_wait`` (then 503);
refusals keep their order: authentication (401), sizes (413/400), spec (409), retired
incarnation (410), then, once the body is in, its digest (401), the decoding (400), NaN/Inf
and the validator (422). De-duplication follows `streams`. The server keeps serving whatever
arrives: every bad request gets its status and the next one is handled.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp
import orjson
from aiohttp import web

from tandem.errors import AuthenticationError, FrameError, PayloadTooLargeError

from .. import auth, codec
from ..base import Frame, LinkStats
from ..inbox import Inbox
from .body import Body, PlainBody, read_into
from .bulk import BulkBody
from .config import HttpConfig, check_peer
from .protocol import (
    BULK_PROTOCOL,
    BYE_PATH,
    FRAME_PATH,
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
    Refuse,
    Reply,
    int_header,
    spec_text,
)
from .scan import FiniteScan, all_finite
from .streams import Partial, StreamState

log = logging.getLogger(__name__)


class HttpServer:
    """Serves one party's endpoints and keeps what it received. Built by `HttpTransport`;
    `start` inside a running loop, `close` then `stop` once.

    ``peers`` (name -> base URL) is shared with the transport: a request from a sender not in
    it is refused (401) unless ``admit_unknown`` admits it, which adds it there. ``spec_hash``
    and ``validator`` may be replaced at any time (after negotiation)."""

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
        self.verifier = (
            auth.Verifier(
                config.secret,
                window=config.auth_window,
                max_nonces=config.max_nonces,
                clock=config.clock,
            )
            if config.secret
            else None
        )
        self.inboxes: dict[tuple[str, str], Inbox[Frame]] = {}
        self.streams: dict[tuple[str, str], StreamState] = {}
        self.retired: dict[str, set[str]] = {}  # sender -> incarnations that said goodbye
        self.received: dict[str, LinkStats] = {}
        self.refused: dict[str, int] = {}  # reason -> refused requests
        self.requests: dict[str, int] = {}  # path (plain|bulk) -> bodies accepted for reading
        self.lost: dict[str, str] = {}  # peer -> why it was taken as gone (see `liveness`)
        self.down_since: dict[str, float] = {}  # peer -> loop time its probes began failing
        self.runner: web.AppRunner | None = None
        self.closed = False
        self._metrics_text = metrics_text

    async def start(self) -> int:
        """Serve on ``host:port`` (port 0: any free port); returns the port bound."""
        cfg = self.cfg
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post(FRAME_PATH, self.handle_frame)
        app.router.add_post(BYE_PATH, self.handle_bye)
        app.router.add_get(HEALTH_PATH, self.handle_health)
        app.router.add_get(METRICS_PATH, self.handle_metrics)
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            read_bufsize=cfg.read_bufsize,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=cfg.ssl_server)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.runner = runner
        return int(runner.addresses[0][1])

    def close(self) -> None:
        """Refuse further frames (503 closing); receives drain what is queued, then fail."""
        self.closed = True
        for box in self.inboxes.values():
            box.close()

    async def stop(self) -> None:
        """Stop serving and close every connection."""
        if self.runner is not None:
            await self.runner.cleanup()

    def stats(self, peer: str) -> LinkStats:
        return self.received.setdefault(peer, LinkStats())

    def inbox(self, peer: str, channel: str) -> Inbox[Frame]:
        """The inbox of frames from ``peer`` on ``channel`` (made on first use)."""
        box = self.inboxes.get((peer, channel))
        if box is None:
            box = self.inboxes[(peer, channel)] = Inbox(self.cfg.capacity, closed=self.closed)
        return box

    def refusal(self, r: Refuse) -> Reply:
        self.refused[r.reason] = self.refused.get(r.reason, 0) + 1
        if r.status == 401:
            log.info("%s: refused request (401): %s", self.cfg.name, r.text)
            return Reply(401, "unauthorized")
        if r.extra:
            return Reply(
                r.status,
                orjson.dumps({"error": r.text, **r.extra}).decode(),
                content_type="application/json",
                reason=r.reason,
            )
        return Reply(r.status, r.text, reason=r.reason)

    def authenticate(self, request: web.Request, path: str) -> str:
        sender = request.headers.get(H_SENDER, "")
        if sender not in self.peers:
            return self.admit(request, path, sender)
        if self.verifier is not None:
            try:
                self.verifier.verify(request.method, path, request.headers)
            except AuthenticationError as exc:
                raise Refuse(401, "unauthenticated", f"from {sender!r}: {exc}") from None
        return sender

    def admit(self, request: web.Request, path: str, sender: str) -> str:
        """An unknown sender becomes a peer only under ``admit_unknown`` with a valid signature."""
        if not (self.cfg.admit_unknown and self.verifier is not None and path == FRAME_PATH):
            raise Refuse(401, "unknown_peer", f"unknown sender {sender!r}")
        names = self.cfg.admit_names
        if names is not None and sender not in names:
            raise Refuse(401, "unknown_peer", f"sender {sender!r} is not in the roster")
        try:
            self.verifier.verify(request.method, path, request.headers)
        except AuthenticationError as exc:
            raise Refuse(401, "unauthenticated", f"unknown {sender!r}: {exc}") from None
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

    async def handle_frame(self, request: web.Request) -> web.StreamResponse:
        """``POST /tandem/v1/frame``: a plain request (body in the HTTP message) or a bulk one
        (``Upgrade: tandem-frame/1``, body raw after the 101). Both run `receive`; only where
        the body comes from (`PlainBody`, `BulkBody`) and how the reply travels differ."""
        bulk = request.headers.get("Upgrade", "").strip().lower() == BULK_PROTOCOL
        body: Body = (
            BulkBody(request) if bulk else PlainBody(request.content, request.content_length)
        )
        try:
            reply = await self.receive(request, body)
        except Refuse as r:
            reply = self.refusal(r)
        except (ConnectionError, aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as exc:
            self.refused["disconnected"] = self.refused.get("disconnected", 0) + 1
            reply = Reply(400, f"request body incomplete: {exc}")
        except Exception:  # the server must keep serving; report and move on
            log.exception("%s: internal error while receiving a frame", self.cfg.name)
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
        inc = h.get(H_INC, "")
        if not inc:
            raise Refuse(400, "malformed", f"missing header {H_INC}")
        msg_id, chunk, chunks, offset, total = (
            int_header(h, k) for k in (H_ID, H_CHUNK, H_CHUNKS, H_OFFSET, H_TOTAL)
        )
        length = body.length()
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
        spec = h.get(H_SPEC, "")
        if self.spec_hash and spec != self.spec_hash:
            raise Refuse(409, "spec_mismatch", spec_text(spec, self.spec_hash))
        if inc in self.retired.get(sender, ()):
            raise Refuse(410, "retired", f"incarnation {inc} of {sender!r} has closed")
        state = self.streams.setdefault((sender, channel), StreamState())
        async with state.lock:
            if state.incarnation != inc:  # a (re)started sender: fresh de-duplication state
                self.lost.pop(sender, None)
                self.down_since.pop(sender, None)
                if state.incarnation:
                    self.retired.setdefault(sender, set()).add(state.incarnation)
                self.drop_partial(sender, channel, state)
                state.incarnation, state.next_id = inc, None
                box = self.inbox(sender, channel)
                if box.closed and not self.closed:
                    box.reopen()
            if state.next_id is not None and msg_id < state.next_id:
                return Reply(200, "duplicate")
            box = self.inbox(sender, channel)
            part = state.partial
            waited = 0.0
            if part is not None and part.msg_id == msg_id and chunk < part.next_chunk:
                return Reply(200, "duplicate")
            if chunk == 0:
                self.drop_partial(sender, channel, state)  # abandoned older message
                t0 = time.monotonic()
                if not await box.reserve(self.cfg.backpressure_wait):
                    reason = "closing" if box.closed else "busy"
                    raise Refuse(
                        503,
                        reason,
                        f"receiver {reason}: inbox of {channel!r} is full"
                        if reason == "busy"
                        else "receiver is closing",
                    )
                waited = time.monotonic() - t0
                part = state.partial = Partial(msg_id, chunks, total)
                if self.cfg.reject_nonfinite and total >= INLINE_BYTES:
                    part.scan = FiniteScan(part.buffer)
            elif part is None or part.msg_id != msg_id or chunk != part.next_chunk:
                expect = part.next_chunk if part is not None and part.msg_id == msg_id else 0
                raise Refuse(
                    409,
                    "out_of_order",
                    f"chunk {chunk} of message {msg_id} is out of order; expected chunk {expect}",
                    expect_chunk=expect,
                )
            if part.chunks != chunks or part.total != total or offset != part.filled:
                self.drop_partial(sender, channel, state)
                raise Refuse(
                    400,
                    "malformed",
                    "chunk headers disagree with the message's "
                    f"first chunk (chunks {chunks}, total {total}, offset {offset})",
                )
            t_read = time.monotonic()
            hasher = hashlib.sha256() if self.verifier is not None else None
            if part.scan is not None:
                part.scan.rewind(offset)  # a chunk received again: forget its earlier bytes
            path = await body.begin(part.buffer, offset, length, part.scan)  # bulk: 101 here
            self.requests[path] = self.requests.get(path, 0) + 1
            await read_into(body, part.buffer, offset, length, hasher, part.scan)
            if hasher is not None:
                if hasher.hexdigest() != h.get(auth.BODY_SHA):
                    raise Refuse(401, "unauthenticated", "body digest does not match")
            stats = self.stats(sender)
            stats.bytes += length
            stats.busy_seconds += time.monotonic() - t_read
            part.filled += length
            part.next_chunk += 1
            if part.next_chunk < part.chunks:
                return Reply(200, "chunk", waited)
            state.partial = None
            try:
                frame = await self.check_frame(sender, channel, msg_id, part.buffer, part.scan)
            except BaseException:
                box.unreserve()
                raise
            box.deliver(frame)
            state.next_id = msg_id + 1
            stats.frames += 1
            return Reply(200, "ok", waited)

    def drop_partial(self, sender: str, channel: str, state: StreamState) -> None:
        if state.partial is not None:
            state.partial = None
            self.inbox(sender, channel).unreserve()

    async def check_frame(
        self,
        sender: str,
        channel: str,
        msg_id: int,
        buffer: memoryview,
        scan: FiniteScan | None = None,
    ) -> Frame:
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
        if self.cfg.reject_nonfinite or self.validator is not None:
            known = scan.verdicts(frame) if scan is not None else {}
            unknown = sum(a.nbytes for i, a in enumerate(frame.arrays) if i not in known)
            if unknown < INLINE_BYTES and self.validator is None:
                self.validate(frame, known)
            else:
                await asyncio.to_thread(self.validate, frame, known)
        return frame

    def validate(self, frame: Frame, known: Mapping[int, bool] | None = None) -> None:
        """NaN/Inf check, then the ``validator`` hook. ``known``: array index -> finite, the
        verdicts `FiniteScan` reached while the body arrived (those arrays are not read
        again)."""
        if self.cfg.reject_nonfinite:
            for i, a in enumerate(frame.arrays):
                if a.dtype.kind in "fc" and a.size:
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

    async def handle_bye(self, request: web.Request) -> web.Response:
        try:
            sender = self.authenticate(request, BYE_PATH)
        except Refuse as r:
            return self.refusal(r).response()
        await self.forget_incarnation(sender, request.headers.get(H_INC, ""))
        return web.Response(text="bye")

    async def forget_incarnation(self, sender: str, inc: str) -> None:
        """What a goodbye of ``sender``'s incarnation ``inc`` does: its late requests are
        refused, its partial messages dropped, and ``recv`` from it raises once drained."""
        self.retired.setdefault(sender, set()).add(inc)
        for (s, channel), state in list(self.streams.items()):
            if s == sender and state.incarnation == inc:
                async with state.lock:
                    self.drop_partial(s, channel, state)
        for (s, _), box in list(self.inboxes.items()):
            if s == sender:
                box.close()

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "party": self.cfg.name, "incarnation": self.incarnation}
        )

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
