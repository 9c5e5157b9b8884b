"""The sending side of a frame stream (``tandem-stream/1``, wire format in `framewire`).

`open_stream` makes the handshake (a signed ``POST /tandem/v1/stream`` on a connection of its
own, answered ``101``); `FrameStream.send` writes one record and waits for its ack. There is no
reader task: the stream is the connection's protocol and resolves each send as its ack arrives.
Any error (connection loss, the receiver closing the stream, a bad ack, ``read_timeout``
without an ack: one watchdog timer per stream checks the oldest waiting send) closes the
stream and fails every send waiting on it with `ConnectionResetError`; their callers retry,
on a new stream or a POST.
"""

from __future__ import annotations

import asyncio
import ssl
import string
from collections.abc import Mapping, Sequence
from typing import cast

from tandem.errors import TransportError

from . import framewire
from .bulk import CONNECT_TIMEOUT, request_upgrade
from .framewire import ACK, TAG_BYTES, AckHead, StreamMac
from .protocol import H_STREAM_NONCE, H_STREAM_TAGS, STREAM_PATH, Answer

OUTSTANDING = 64  # records of one stream awaiting their acks at once (more sends wait)


class FrameStream(asyncio.Protocol):
    """An open stream to one peer, and the protocol of its connection once upgraded: acks are
    parsed as they arrive (`data_received`) and resolve the sends they answer. ``mac``: the
    stream's tags (None: untagged, neither end holds a secret).

    Invariants: ``seq`` is the number of records written (the next record's seq), ``ack_seq``
    the number of acks read; ``waiting`` maps the seq of each record whose sender still waits
    to that sender's future and the loop time its record was written (in seq order, so the
    first entry is the oldest); ``_watchdog`` is armed whenever ``waiting`` is not empty; once
    ``error`` is set the connection is closed and every later `send` raises it. ``_buf``
    holds less than one ack (its head and at most `framewire.MAX_ACK_TEXT` + 271 bytes)."""

    def __init__(
        self,
        peer: str,
        mac: StreamMac | None,
        writer: asyncio.StreamWriter,
        read_timeout: float,
    ) -> None:
        self.peer, self.mac = peer, mac
        self.tag_bytes = TAG_BYTES if mac is not None else 0
        self.writer = writer  # kept: a StreamWriter closes its transport when collected
        self.transport = cast(asyncio.Transport, writer.transport)
        self.read_timeout = read_timeout
        self.seq = self.ack_seq = 0
        self.waiting: dict[int, tuple[asyncio.Future[Answer], float]] = {}
        self.error: ConnectionResetError | None = None
        self._loop = asyncio.get_running_loop()
        self._watchdog: asyncio.TimerHandle | None = None
        self._slots = asyncio.Semaphore(OUTSTANDING)
        self._buf = bytearray()

    @property
    def usable(self) -> bool:
        return self.error is None and not self.transport.is_closing()

    async def send(
        self, channel: str, msg_id: int, base: int, body: Sequence[bytes | memoryview]
    ) -> Answer:
        """Write one record and return the receiver's verdict (as a POST's `Answer`)."""
        async with self._slots:
            if self.error is not None:
                raise self.error
            seq = self.seq
            data = framewire.record(self.mac, seq, channel, msg_id, base, body)
            self.seq += 1
            loop = self._loop
            fut: asyncio.Future[Answer] = loop.create_future()
            self.waiting[seq] = (fut, loop.time())
            if self._watchdog is None:
                self._watchdog = loop.call_later(self.read_timeout, self._check_waiting)
            try:
                self.transport.write(data)  # whole: a cancelled send leaves no partial record
                return await fut
            finally:
                del self.waiting[seq]
                if fut.done() and not fut.cancelled():
                    fut.exception()  # retrieved: raised above, or set by `fail` for this send

    def _check_waiting(self) -> None:
        """The watchdog: fail the stream once its oldest waiting send has had no ack for
        ``read_timeout`` seconds; re-armed for the oldest one otherwise."""
        self._watchdog = None
        if not self.waiting or self.error is not None:
            return
        _, written = next(iter(self.waiting.values()))
        due = written + self.read_timeout
        if self._loop.time() >= due:
            self.fail(f"no answer for read_timeout={self.read_timeout:g} s")
            return
        self._watchdog = self._loop.call_at(due, self._check_waiting)

    # -- asyncio.Protocol --------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if not buf and len(data) >= ACK.size:
            head = AckHead(*ACK.unpack_from(data))
            if len(data) == ACK.size + head.reason_len + head.text_len + self.tag_bytes:
                try:  # the common case, one whole ack: no copy through the buffer
                    self._check_head(head)
                    self._resolve(head, data)
                except TransportError as exc:
                    self.fail(f"{exc} from {self.peer!r}")
                return
        buf += data
        try:
            while len(buf) >= ACK.size:
                head = self._check_head(AckHead(*ACK.unpack_from(buf)))
                end = ACK.size + head.reason_len + head.text_len + self.tag_bytes
                if len(buf) < end:
                    return
                raw = bytes(buf[:end])
                del buf[:end]
                self._resolve(head, raw)
        except TransportError as exc:
            self.fail(f"{exc} from {self.peer!r}")

    def _check_head(self, head: AckHead) -> AckHead:
        if head.text_len > framewire.MAX_ACK_TEXT or head.seq >= self.seq:
            raise TransportError(f"malformed ack (record {head.seq})")
        return head

    def _resolve(self, head: AckHead, raw: bytes) -> None:
        text_end = len(raw) - self.tag_bytes
        if self.mac is not None:
            tag = framewire.ack_tag(
                self.mac, self.ack_seq, raw[: ACK.size], raw[ACK.size : text_end]
            )
            if not framewire.same_tag(raw[text_end:], tag):
                raise TransportError(f"ack {self.ack_seq} has a bad tag")
        self.ack_seq += 1
        waiter = self.waiting.get(head.seq)
        fut = waiter[0] if waiter is not None else None
        if fut is not None and not fut.done():
            start = ACK.size + head.reason_len
            reason = raw[ACK.size : start].decode("utf-8", "replace")
            text = raw[start:text_end].decode("utf-8", "replace")
            fut.set_result(Answer(head.status, text, float(head.waited), reason))

    def eof_received(self) -> bool:
        self.fail("the receiver closed the stream")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(f"connection lost ({exc})" if exc else "connection closed")

    # ----------------------------------------------------------------------------------------
    def fail(self, why: str) -> ConnectionResetError:
        """Close the stream; every waiting send fails with the returned error."""
        if self.error is None:
            self.error = ConnectionResetError(f"frame stream to {self.peer!r} lost: {why}")
            self.transport.abort()
            self.writer.close()
            self._fail_waiting()
        return self.error

    def close(self) -> None:
        """Close the connection (the receiver sees the stream end between records)."""
        if self.error is None:
            self.error = ConnectionResetError(f"frame stream to {self.peer!r} closed")
            self._fail_waiting()
        self.writer.close()

    def _fail_waiting(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for fut, _ in self.waiting.values():
            if not fut.done():
                fut.set_exception(cast(ConnectionResetError, self.error))


async def open_stream(
    peer: str,
    url: str,
    headers: Mapping[str, str],
    key_material: tuple[bytes, str, str, str, str, str],
    ssl_context: ssl.SSLContext | None,
    read_timeout: float,
) -> FrameStream | Answer:
    """The handshake with ``peer`` at ``url`` (``headers``: the signed request's); the open
    `FrameStream`, or the receiver's `Answer` when it does not upgrade (a refusal, or a peer
    that offers no streams, or a 426 ``stream_tags`` when its tag setting is not this end's:
    one side holds a secret and the other none). ``key_material``: (secret, sender, sender
    incarnation, receiver, receiver incarnation, request nonce), with the receiver's stream
    nonce the stream key. Connection problems raise `OSError`/`EOFError`/`TimeoutError`."""
    async with asyncio.timeout(read_timeout + CONNECT_TIMEOUT):
        upgraded = await request_upgrade(
            peer, url, STREAM_PATH, framewire.STREAM_PROTOCOL, headers, ssl_context
        )
    if isinstance(upgraded, Answer):
        return upgraded
    writer = upgraded.writer
    nonce = upgraded.headers.get(H_STREAM_NONCE.lower(), "")
    if len(nonce) != 2 * framewire.NONCE_BYTES or not set(nonce) <= set(string.hexdigits):
        writer.transport.abort()
        raise TransportError(f"peer {peer!r} named no valid stream nonce ({nonce[:40]!r})")
    tags = upgraded.headers.get(H_STREAM_TAGS.lower(), framewire.TAGS_HMAC)
    if tags != framewire.tags_for(key_material[0]):
        writer.transport.abort()
        return Answer(
            426,
            f"peer {peer!r} offers a frame stream with tags {tags!r}, this end needs "
            f"{framewire.tags_for(key_material[0])!r}: give both parties the same secret",
            0.0,
            "stream_tags",
        )
    mac = framewire.mac_for(tags, framewire.stream_key(*key_material, nonce))
    stream = FrameStream(peer, mac, writer, read_timeout)
    stream.transport.set_protocol(stream)  # no ack can precede a record: nothing is buffered
    return stream
