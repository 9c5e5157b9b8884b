"""The receiving side of a frame stream (``tandem-stream/1``, wire format in `framewire`).

`serve_stream` answers ``POST /tandem/v1/stream``: the handshake is authenticated as any
request (signature bound to this process, certificate identity, retired incarnations), then
the connection is taken from aiohttp and each record is checked (sizes, tag) and handed to
`reassembly.Reassembler.receive_message`, exactly the admission a POSTed frame passes; its
verdict goes back as an ack. A record that fails a check (oversize head, bad tag: forged, replayed,
reordered or moved from another stream) closes the stream at once, without an ack; the
records in flight are dropped with it and their senders send them again.

Bounds: a record's channel (`framewire.MAX_CHANNEL_BYTES`) and body (`MAX_RECORD_BODY`),
`OUTSTANDING` records being admitted at once (reading pauses beyond), ``keepalive_timeout``
without a record (the stream closes) and ``body_idle_timeout`` inside one.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Protocol

from aiohttp import web

from .. import auth
from . import framewire
from .body import Body
from .config import HttpConfig
from .framewire import MAX_RECORD_BODY, RECORD, TAG_BYTES, RecordHead, StreamMac
from .protocol import H_INC, H_STREAM_NONCE, H_STREAM_TAGS, STREAM_PATH, MessageHead, Refuse, Reply
from .quietlog import QuietLog


class HttpServer(Protocol):
    """What a frame stream needs of the receiver that upgraded it (`server.HttpServer`): its
    authentication, admission and refusal counting, the same a POSTed frame goes through."""

    cfg: HttpConfig
    frame_streams: set[asyncio.Transport]
    quiet: QuietLog
    refused: dict[str, int]
    refused_handshakes: dict[str, int]
    retired: dict[str, set[str]]
    verifier: Any

    @property
    def closed(self) -> bool: ...

    def authenticate(self, request: web.Request, path: str) -> str: ...

    def check_stream(self, sender: str, channel: str) -> None: ...

    def receive_now(self, head: MessageHead, body: memoryview) -> Reply | None: ...

    async def receive_message(
        self, head: MessageHead, length: int, spec: str | None, body: Body, digest: str | None
    ) -> Reply: ...

    def refusal(self, r: Refuse, *, handshake: bool = False) -> Reply: ...


OUTSTANDING = 64  # records of one stream admitted at once (each may wait for its turn)
READ_LIMIT = 1 << 16  # bytes buffered beyond the largest record before reading pauses


class RecordBody:
    """A record's body, already received and authenticated (a `body.Body`)."""

    def __init__(self, data: memoryview, transport: asyncio.Transport) -> None:
        self.data, self.transport = data, transport

    def length(self) -> int:
        return len(self.data)

    async def begin(self, buf: memoryview, offset: int, length: int, scan: object) -> str:
        return "stream"

    async def fill(self, view: memoryview, pos: int, end: int, step: int) -> int:
        start = end - len(self.data)
        view[pos:end] = self.data[pos - start :]
        return end

    def release(self) -> None:
        pass

    def abort(self) -> None:
        self.transport.abort()

    def respond(self, reply: Reply) -> web.StreamResponse:
        return reply.response()


class _Closed(Exception):
    """The stream closes: a record failed a check (reason, text)."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason, self.text = reason, text


async def serve_stream(server: HttpServer, request: web.Request) -> web.StreamResponse:
    """``POST /tandem/v1/stream``: refusals as HTTP answers; after the 101, the stream's
    records until the sender closes it, it idles for ``keepalive_timeout``, or a record fails
    a check."""
    try:
        if server.closed:
            raise Refuse(503, "closing", "receiver is closing")
        sender = server.authenticate(request, STREAM_PATH)
        inc = request.headers.get(H_INC, "")
        if not inc:
            raise Refuse(400, "malformed", f"missing header {H_INC}")
        if inc in server.retired.get(sender, ()):
            raise Refuse(410, "retired", f"incarnation {inc} of {sender!r} has closed")
        if request.content_length:
            raise Refuse(400, "malformed", "a stream handshake carries no body")
    except Refuse as r:
        return server.refusal(r, handshake=True).response()
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client left before the upgrade")
    h = request.headers
    secret = server.cfg.keys().get(h.get(auth.KEY_ID, ""), b"") if server.verifier else b""
    # tagged whenever this receiver authenticates (never downgraded by a key's value); no
    # secret: it authenticates nothing, and its streams carry no tags
    tags = framewire.TAGS_HMAC if server.verifier is not None else framewire.TAGS_NONE
    stream_nonce = secrets.token_hex(framewire.NONCE_BYTES)
    # with a secret, the verifier checked that TO names this process and NONCE is fresh
    key = framewire.stream_key(
        secret,
        sender,
        inc,
        server.cfg.name,
        h.get(auth.TO, ""),
        h.get(auth.NONCE, ""),
        stream_nonce,
    )
    resp = web.StreamResponse(
        status=101,
        headers={
            "Connection": "Upgrade",
            "Upgrade": framewire.STREAM_PROTOCOL,
            H_STREAM_NONCE: stream_nonce,
            H_STREAM_TAGS: tags,
        },
    )
    resp.force_close()
    mac = framewire.mac_for(tags, key)
    session = _Session(server, sender, inc, mac, transport, transport.get_protocol())
    transport.set_protocol(session)
    try:
        await resp.prepare(request)
    except BaseException:
        transport.abort()
        raise
    if not transport.is_reading():
        transport.resume_reading()
    server.frame_streams.add(transport)
    try:
        await session.run()
    finally:
        server.frame_streams.discard(transport)
    return resp


class _Session(asyncio.Protocol):
    """One upgraded stream, and its connection's protocol: records are parsed as bytes arrive
    (`data_received`), each judged on the spot when its admission awaits nothing
    (`reassembly.Reassembler.receive_now`), else in a task of `run`'s TaskGroup; each verdict acked.

    ``mac``: the stream's tags (None: untagged, the receiver holds no secret).

    Invariants: ``seq`` is the number of records accepted (the next record's seq),
    ``ack_seq`` the number of acks written; ``_buf`` holds less than one whole record while
    fewer than `OUTSTANDING` records are being admitted (reading pauses otherwise, and while
    ``_buf`` exceeds `READ_LIMIT` beyond the largest record)."""

    def __init__(
        self,
        server: HttpServer,
        sender: str,
        inc: str,
        mac: StreamMac | None,
        transport: asyncio.Transport,
        owner: asyncio.BaseProtocol,
    ) -> None:
        self.server, self.sender, self.inc, self.mac = server, sender, inc, mac
        self.tag_bytes = TAG_BYTES if mac is not None else 0
        self.transport, self.owner = transport, owner
        self.seq = self.ack_seq = 0
        self.admitting = 0
        self._buf = bytearray()
        self._head: RecordHead | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._over: asyncio.Future[None] | None = None
        self._paused = False
        self._loop = loop = asyncio.get_running_loop()
        self._last = loop.time()  # the latest byte received
        self._timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        """Until the stream ends; records admitted meanwhile finish (or are cancelled when a
        record failed a check) before this returns."""
        loop = asyncio.get_running_loop()
        self._over = loop.create_future()
        self._timer = loop.call_later(self._idle_limit(), self._check_idle)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._parse()
                await self._over
        finally:
            self._timer.cancel()
            if not self.transport.is_closing():
                self.transport.close()

    def _end(self) -> None:
        if self._over is not None and not self._over.done():
            self._over.set_result(None)

    def _close(self, c: _Closed) -> None:
        """A record failed a check: abort the connection, drop the records being admitted."""
        server = self.server
        server.refused[c.reason] = server.refused.get(c.reason, 0) + 1
        server.quiet.info(
            "%s: closed the frame stream of %r (%s): %s",
            server.cfg.name,
            self.sender,
            c.reason,
            c.text,
        )
        self.transport.abort()
        for t in self._tasks:
            t.cancel()
        self._buf.clear()
        self._end()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._last = self._loop.time()
        if self._buf:
            self._buf += data
            self._parse()
        else:
            self._parse(data)

    def eof_received(self) -> bool:
        if self._buf:
            self._close(_Closed("disconnected", "stream ended inside a record"))
        self._end()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()
        self.owner.connection_lost(exc)

    # ----------------------------------------------------------------------------------------
    def _parse(self, fresh: bytes | None = None) -> None:
        """Take every whole record from ``_buf`` while admission slots are free; ``fresh``:
        bytes just received while ``_buf`` was empty, whose records are taken without a copy
        (what is left of them is kept in ``_buf``)."""
        buf = self._buf
        if self._tg is None or self.transport.is_closing():
            if fresh is not None:
                buf += fresh
            return  # before `run` (bytes that came with the 101's sending): kept for it
        src = buf if fresh is None else fresh
        mac, tag_bytes = self.mac, self.tag_bytes
        pos = 0
        try:
            while self.admitting < OUTSTANDING:
                left = len(src) - pos
                head = self._head
                if head is None:
                    if left < RECORD.size:
                        break
                    head = RecordHead(*RECORD.unpack_from(src, pos))
                    head = self._head = self._check_head(head)
                ch_end = RECORD.size + head.channel_len
                body_end = ch_end + head.body_len
                end = body_end + tag_bytes
                if left < end:
                    break
                # a record of immutable bytes is a view of them; one of _buf, a copy (_buf moves)
                record = memoryview(src)[pos : pos + end]
                if fresh is None:
                    record = memoryview(bytes(record))
                pos += end
                self._head = None
                if mac is not None:
                    tag = framewire.record_tag(
                        mac, self.seq, record[: RECORD.size], record[RECORD.size : body_end]
                    )
                    if not framewire.same_tag(record[body_end:], tag):
                        raise _Closed(
                            "unauthenticated",
                            f"record {self.seq} has a bad tag (forged, replayed, reordered or "
                            "from another stream)",
                        )
                try:
                    channel = bytes(record[RECORD.size : ch_end]).decode()
                except UnicodeDecodeError:
                    raise _Closed("malformed", "record channel is not UTF-8") from None
                seq = self.seq
                self.seq += 1
                msg = MessageHead(
                    self.sender, channel, self.inc, head.msg_id, 0, 1, 0, head.body_len, head.base
                )
                body = record[ch_end:body_end]
                reply = self._receive_now(msg, body)
                if reply is not None:
                    self._ack(seq, reply)
                    continue
                self.admitting += 1
                task = self._tg.create_task(self._admit(seq, msg, body))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except _Closed as c:
            self._close(c)
            return
        if fresh is None:
            del buf[:pos]
        elif pos < len(fresh):
            buf += memoryview(fresh)[pos:]
        full = self.admitting >= OUTSTANDING or len(buf) > MAX_RECORD_BODY + READ_LIMIT
        if full and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        elif not full and self._paused:
            self._paused = False
            self.transport.resume_reading()

    def _check_head(self, head: RecordHead) -> RecordHead:
        if not 0 < head.channel_len <= framewire.MAX_CHANNEL_BYTES:
            raise _Closed(
                "oversize_header",
                f"record channel of {head.channel_len} bytes (1..{framewire.MAX_CHANNEL_BYTES})",
            )
        if head.body_len > MAX_RECORD_BODY:  # below it, max_frame_bytes is judged as for a POST
            raise _Closed(
                "too_large", f"record body of {head.body_len} bytes exceeds {MAX_RECORD_BODY}"
            )
        return head

    def _idle_limit(self) -> float:
        cfg = self.server.cfg
        return cfg.body_idle_timeout if self._buf else cfg.keepalive_timeout

    def _check_idle(self) -> None:
        """The stream ends after ``keepalive_timeout`` without a record (none being admitted),
        or ``body_idle_timeout`` without a byte inside a record."""
        loop = asyncio.get_running_loop()
        due = self._last + self._idle_limit()
        if loop.time() >= due and (self._buf or self.admitting == 0):
            if self._buf:
                self._close(_Closed("body_timeout", "no byte of a record for body_idle_timeout"))
            else:
                self.transport.close()
                self._end()
            return
        self._timer = loop.call_later(max(due - loop.time(), 0.01), self._check_idle)

    def _receive_now(self, msg: MessageHead, body: memoryview) -> Reply | None:
        """The verdict on a record, judged on the spot: the receiver closing (503), the
        ``admit_stream`` hook (403), then `reassembly.Reassembler.receive_now`; None when its
        admission must wait (then `_admit` runs it in a task)."""
        server = self.server
        try:
            if server.closed:
                raise Refuse(503, "closing", "receiver is closing")
            server.check_stream(self.sender, msg.channel)
            return server.receive_now(msg, body)
        except Exception as exc:
            return self._refusal(exc)

    async def _admit(self, seq: int, msg: MessageHead, body: memoryview) -> None:
        """Judge record ``seq`` as a POSTed single-chunk message (its head and the stream
        admission hook already passed `_receive_now`), then ack the verdict."""
        try:
            try:
                reply = await self.server.receive_message(
                    msg, msg.total, None, RecordBody(body, self.transport), None
                )
            except Exception as exc:
                reply = self._refusal(exc)
            self._ack(seq, reply)
        finally:
            self.admitting -= 1
            self._last = self._loop.time()
            if self._paused or self._buf:
                self._parse()

    def _refusal(self, exc: Exception) -> Reply:
        """The answer to a record's refusal, or to an internal error (reported: the server
        keeps serving)."""
        server = self.server
        if isinstance(exc, Refuse):
            return server.refusal(exc)
        server.quiet.error("%s: internal error on a frame stream", server.cfg.name, exc_info=exc)
        server.refused["internal"] = server.refused.get("internal", 0) + 1
        return Reply(500, "internal error (see the receiver's log)")

    def _ack(self, seq: int, reply: Reply) -> None:
        if self.transport.is_closing():
            return
        data = framewire.ack(
            self.mac, self.ack_seq, seq, reply.status, reply.reason, reply.text, reply.waited or 0.0
        )
        self.ack_seq += 1
        self.transport.write(data)
