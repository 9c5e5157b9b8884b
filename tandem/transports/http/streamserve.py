"""The receiving side of a frame stream (``tandem-stream/1``, wire format in `framewire`).

`serve_stream` answers ``POST /tandem/v1/stream``: the handshake is authenticated as any
request (signature bound to this process, certificate identity, retired incarnations), then
the connection is taken from aiohttp and each record is checked (sizes, tag) and handed to
`HttpServer.receive_message`, exactly the admission a POSTed frame passes; its verdict goes
back as an ack. A record that fails a check (oversize head, bad tag: forged, replayed,
reordered or moved from another stream) closes the stream at once, without an ack; the
records in flight are dropped with it and their senders send them again.

Bounds: a record's channel (`framewire.MAX_CHANNEL_BYTES`) and body (`MAX_RECORD_BODY`),
`OUTSTANDING` records being admitted at once (reading pauses beyond), ``keepalive_timeout``
without a record (the stream closes) and ``body_idle_timeout`` inside one.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import TYPE_CHECKING

from aiohttp import web

from .. import auth
from . import framewire
from .framewire import MAX_RECORD_BODY, RECORD, TAG_BYTES, RecordHead
from .protocol import H_INC, H_STREAM_NONCE, STREAM_PATH, Refuse, Reply

if TYPE_CHECKING:
    from .server import HttpServer

OUTSTANDING = 64  # records of one stream admitted at once (each may wait for its turn)
READ_LIMIT = 1 << 16  # the stream's read buffer pauses reading past twice this


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


class _StreamProtocol(asyncio.Protocol):
    """The connection's protocol once upgraded: bytes into a bounded `asyncio.StreamReader`.
    ``connection_lost`` is passed on to aiohttp's handler (``owner``) so that it forgets the
    connection, as for a bulk body."""

    def __init__(self, reader: asyncio.StreamReader, owner: asyncio.BaseProtocol) -> None:
        self.reader, self.owner = reader, owner

    def data_received(self, data: bytes) -> None:
        self.reader.feed_data(data)

    def eof_received(self) -> bool:
        self.reader.feed_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.reader.feed_eof()
        else:
            self.reader.set_exception(ConnectionResetError(f"stream connection lost ({exc})"))
        self.owner.connection_lost(exc)


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
        return server.refusal(r).response()
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client left before the upgrade")
    h = request.headers
    secret = server.cfg.keys().get(h.get(auth.KEY_ID, ""), b"") if server.verifier else b""
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
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    resp = web.StreamResponse(
        status=101,
        headers={
            "Connection": "Upgrade",
            "Upgrade": framewire.STREAM_PROTOCOL,
            H_STREAM_NONCE: stream_nonce,
        },
    )
    resp.force_close()
    transport.set_protocol(_StreamProtocol(reader, transport.get_protocol()))
    reader.set_transport(transport)
    try:
        await resp.prepare(request)
    except BaseException:
        transport.abort()
        raise
    if not transport.is_reading():
        transport.resume_reading()
    server.frame_streams.add(transport)
    try:
        await _Session(server, sender, inc, key, reader, transport).run()
    finally:
        server.frame_streams.discard(transport)
    return resp


class _Session:
    """One upgraded stream: reads records in order, admits up to `OUTSTANDING` at once, acks
    each verdict. Invariant: ``seq`` is the number of records accepted so far (the next
    record's seq), ``ack_seq`` the number of acks written."""

    def __init__(
        self,
        server: HttpServer,
        sender: str,
        inc: str,
        key: bytes,
        reader: asyncio.StreamReader,
        transport: asyncio.Transport,
    ) -> None:
        self.server, self.sender, self.inc, self.key = server, sender, inc, key
        self.reader, self.transport = reader, transport
        self.seq = self.ack_seq = 0

    async def run(self) -> None:
        slots = asyncio.Semaphore(OUTSTANDING)
        tasks: set[asyncio.Task[None]] = set()
        try:
            async with asyncio.TaskGroup() as tg:
                while True:
                    try:
                        record = await self.next_record()
                    except _Closed as c:
                        self.refuse(c)
                        for t in tasks:
                            t.cancel()
                        return
                    if record is None:
                        return
                    await slots.acquire()
                    task = tg.create_task(self.admit(self.seq, *record, slots))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self.seq += 1
        finally:
            if not self.transport.is_closing():
                self.transport.close()

    def refuse(self, c: _Closed) -> None:
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

    async def next_record(self) -> tuple[RecordHead, str, memoryview] | None:
        """The next record (head, channel, body), its tag checked; None when the stream
        ends between records (closed by the sender, lost, or idle)."""
        cfg = self.server.cfg
        try:
            async with asyncio.timeout(cfg.keepalive_timeout):
                raw = await self.reader.readexactly(RECORD.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise _Closed("malformed", "stream ended inside a record head") from None
            return None
        except (TimeoutError, ConnectionError):
            return None
        head = RecordHead(*RECORD.unpack(raw))
        if not 0 < head.channel_len <= framewire.MAX_CHANNEL_BYTES:
            raise _Closed(
                "oversize_header",
                f"record channel of {head.channel_len} bytes (1..{framewire.MAX_CHANNEL_BYTES})",
            )
        if head.body_len > MAX_RECORD_BODY:  # below it, max_frame_bytes is judged as for a POST
            raise _Closed(
                "too_large", f"record body of {head.body_len} bytes exceeds {MAX_RECORD_BODY}"
            )
        try:
            async with asyncio.timeout(cfg.body_idle_timeout):
                rest = await self.reader.readexactly(head.channel_len + head.body_len + TAG_BYTES)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            raise _Closed("disconnected", "stream ended inside a record") from None
        view = memoryview(rest)
        tag = framewire.record_tag(self.key, self.seq, raw, view[:-TAG_BYTES])
        if not framewire.same_tag(view[-TAG_BYTES:], tag):
            raise _Closed(
                "unauthenticated",
                f"record {self.seq} has a bad tag (forged, replayed, reordered or from "
                "another stream)",
            )
        try:
            channel = bytes(view[: head.channel_len]).decode()
        except UnicodeDecodeError:
            raise _Closed("malformed", "record channel is not UTF-8") from None
        return head, channel, view[head.channel_len : -TAG_BYTES]

    async def admit(
        self,
        seq: int,
        head: RecordHead,
        channel: str,
        body: memoryview,
        slots: asyncio.Semaphore,
    ) -> None:
        """Judge record ``seq`` as a POSTed single-chunk message, then ack the verdict."""
        from .server import MessageHead  # the server imports this module

        server = self.server
        try:
            try:
                if server.closed:
                    raise Refuse(503, "closing", "receiver is closing")
                server.check_stream(self.sender, channel)
                msg = MessageHead(
                    self.sender, channel, self.inc, head.msg_id, 0, 1, 0, head.body_len, head.base
                )
                reply = await server.receive_message(
                    msg, head.body_len, None, RecordBody(body, self.transport), None
                )
            except Refuse as r:
                reply = server.refusal(r)
            except Exception as exc:  # the server keeps serving; report and move on
                server.quiet.error(
                    "%s: internal error on a frame stream", server.cfg.name, exc_info=exc
                )
                server.refused["internal"] = server.refused.get("internal", 0) + 1
                reply = Reply(500, "internal error (see the receiver's log)")
            self.write_ack(seq, reply)
        finally:
            slots.release()

    def write_ack(self, seq: int, reply: Reply) -> None:
        if self.transport.is_closing():
            return
        data = framewire.ack(
            self.key, self.ack_seq, seq, reply.status, reply.reason, reply.text, reply.waited or 0.0
        )
        self.ack_seq += 1
        self.transport.write(data)
