"""The bulk path of the HTTP transport: a frame request upgraded to ``tandem-frame/1`` whose
body travels raw after the ``101`` and is received outside aiohttp, straight into the frame
buffer (docs/transports.md, "Bulk path").

Receiving side: `BulkBody` (a `body.Body`) and `BulkSink` (the connection's protocol once
upgraded). Sending side: `post_bulk` and the small HTTP/1.1 helpers it needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping

import orjson
from aiohttp import web

from tandem.errors import TransportError

from ..bodymac import BodyMac
from .protocol import (
    BULK_PROTOCOL,
    FRAME_PATH,
    H_LENGTH,
    H_REASON,
    H_WAIT,
    Answer,
    Refuse,
    Reply,
    int_header,
    seconds,
)
from .scan import SCAN_STEP, FiniteScan

HEAD_LIMIT = 1 << 16  # the most bytes a bulk client reads for a response head or reply
TRAILER_LIMIT = 1 << 12  # the most bytes of a body trailer (a signed JSON line)
CONNECT_TIMEOUT = 10.0  # seconds to open a bulk connection (as the session's sock_connect)


class BulkBody:
    """The body of a bulk request (``Upgrade: tandem-frame/1``), received outside aiohttp.

    Until `begin` the request is an ordinary HTTP request (every refusal is an HTTP response).
    `begin` installs a `BulkSink` as the connection's protocol, then sends ``101``: the client
    writes the body only after reading the 101, so no body byte can reach aiohttp's parser.
    The sink receives straight into the frame buffer (`asyncio.BufferedProtocol`: the kernel's
    copy is the only one). `respond` writes the reply line on the raw connection and hands
    aiohttp the 101 response, which has no body and closes the connection (``force_close``)
    once the handler returns."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.sink: BulkSink | None = None
        self.switched: web.StreamResponse | None = None
        #: set before `begin` when a trailer follows the body (the head's digest is
        #: `auth.DEFERRED`): it authenticates the trailer line and returns its body digest
        self.check_trailer: Callable[[bytes], str] | None = None
        #: the body's GMAC when the head's digest is `auth.DEFERRED_MAC` (set with
        #: ``check_trailer``): what the body is fed to instead of a BLAKE3 hasher
        self.mac: BodyMac | None = None

    def length(self) -> int:
        if self.request.content_length:
            raise Refuse(
                400,
                "malformed",
                f"a bulk (Upgrade) request carries no HTTP body; its length goes in {H_LENGTH}",
            )
        return int_header(self.request.headers, H_LENGTH)

    async def begin(
        self, buf: memoryview, offset: int, length: int, scan: FiniteScan | None
    ) -> str:
        request = self.request
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client left before the upgrade")
        # the connection's protocol: aiohttp's request handler, or the `connections` guard
        # wrapping it, which must hear of the connection's end to count it out
        owner = transport.get_protocol()
        sink = BulkSink(memoryview(buf)[offset : offset + length], owner, transport, scan, offset)
        sink.trailer = bytearray() if self.check_trailer is not None else None
        sink.mac = self.mac
        resp = web.StreamResponse(
            status=101, headers={"Connection": "Upgrade", "Upgrade": BULK_PROTOCOL}
        )
        resp.force_close()
        transport.set_protocol(sink)
        self.sink = sink
        try:
            await resp.prepare(request)  # writes the 101 head at once
        except BaseException:
            transport.abort()
            raise
        self.switched = resp
        if not transport.is_reading():
            transport.resume_reading()
        return "bulk"

    async def fill(self, view: memoryview, pos: int, end: int, step: int) -> int:
        """Wait until the sink holds ``step`` bytes more than ``pos`` (or the whole body);
        returns the new position."""
        assert self.sink is not None
        start = end - len(self.sink.view)
        await self.sink.wait(min(pos + step, end) - start)
        return start + self.sink.pos

    async def trailer_digest(self, idle: float | None) -> str:
        """The body digest of the trailer line after the body (at most `TRAILER_LIMIT`
        bytes), authenticated by ``check_trailer``; `Refuse` 408 when the line does not come
        within ``idle`` seconds."""
        assert self.sink is not None and self.check_trailer is not None
        try:
            async with asyncio.timeout(idle):
                line = await self.sink.wait_trailer()
        except TimeoutError:
            self.abort()
            raise Refuse(
                408, "body_timeout", f"no body trailer within body_idle_timeout={idle} s"
            ) from None
        return self.check_trailer(line)

    def release(self) -> None:
        """After `endpoints.Endpoints.receive`: a body not completely received (error,
        cancellation) leaves no connection behind that could still write into the frame
        buffer."""
        sink = self.sink
        if sink is not None and sink.pos < len(sink.view):
            sink.transport.abort()

    def abort(self) -> None:
        transport = self.sink.transport if self.sink is not None else self.request.transport
        if transport is not None:
            transport.abort()

    def respond(self, reply: Reply) -> web.StreamResponse:
        if self.switched is None or self.sink is None:
            return reply.response()
        transport = self.sink.transport
        if not transport.is_closing():
            transport.write(reply.line())
        return self.switched


class BulkSink(asyncio.BufferedProtocol):
    """Receives a bulk body straight into ``view`` (a slice of the frame buffer).

    Takes over the connection from aiohttp's request handler (``owner``); its
    ``connection_lost`` is passed on to it so that aiohttp forgets the connection (and, with
    ``handler_cancellation``, cancels the handler, as it does for a plain request). Reading
    pauses once the body is complete; bytes beyond it are an error. With ``scan``, the bytes
    are NaN/Inf-scanned as they land, while still in cache (``base``: the view's offset in
    the message); with ``mac``, fed to it as they land as well."""

    def __init__(
        self,
        view: memoryview,
        owner: asyncio.BaseProtocol,
        transport: asyncio.Transport,
        scan: FiniteScan | None = None,
        base: int = 0,
    ) -> None:
        self.view, self.owner, self.transport = view, owner, transport
        self.scan, self.base, self.scanned = scan, base, 0
        self.pos = 0
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._want = 0
        self._spare: bytearray | None = None
        self.trailer: bytearray | None = None  # the trailer line as it comes (when expected)
        #: fed every body byte as it lands, while it is in cache (a GMAC: `bodymac`)
        self.mac: BodyMac | None = None
        self.trailer_done = False

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self.pos < len(self.view):
            return self.view[self.pos :]
        if self._spare is None:  # the trailer, or a misbehaving client's excess
            self._spare = bytearray(TRAILER_LIMIT + 1)
        return self._spare

    def buffer_updated(self, nbytes: int) -> None:
        if self.pos < len(self.view):
            if self.mac is not None:
                self.mac.update(self.view[self.pos : self.pos + nbytes])
            self.pos += nbytes
            if self.pos == len(self.view) and self.trailer is None:
                self.transport.pause_reading()
            if self.scan is not None and (
                self.pos - self.scanned >= SCAN_STEP or self.pos == len(self.view)
            ):
                self.scan.advance(self.base + self.pos)
                self.scanned = self.pos
        elif self.trailer is not None and not self.trailer_done:
            self._trailer_bytes(nbytes)
        elif self.error is None:
            self.error = Refuse(400, "malformed", "body longer than its declared length")
            self.transport.pause_reading()
        self._wake()

    def _trailer_bytes(self, nbytes: int) -> None:
        assert self.trailer is not None and self._spare is not None
        self.trailer += self._spare[:nbytes]
        end = self.trailer.find(b"\n")
        if end >= 0 and end == len(self.trailer) - 1:
            del self.trailer[end:]
            self.trailer_done = True
            self.transport.pause_reading()
        elif end >= 0 or len(self.trailer) > TRAILER_LIMIT:
            self.error = Refuse(400, "malformed", "oversized body trailer, or bytes after it")
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._fail(
            ConnectionResetError(
                f"the client closed after {self.pos} of {len(self.view)} body bytes"
            )
        )
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            ConnectionResetError(
                f"connection lost after {self.pos} of {len(self.view)} body bytes"
                + (f" ({exc})" if exc else "")
            )
        )
        self.owner.connection_lost(exc)

    def _fail(self, exc: BaseException) -> None:
        incomplete = self.pos < len(self.view) or (
            self.trailer is not None and not self.trailer_done
        )
        if self.error is None and incomplete:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done() and (self._ready() or self.error is not None):
            w.set_result(None)

    def _ready(self) -> bool:
        if self._want < 0:  # waiting for the trailer
            return self.trailer_done
        return self.pos >= self._want

    async def wait_trailer(self) -> bytes:
        """The trailer line once it is complete; raises the connection's error first."""
        while not self.trailer_done:
            if self.error is not None:
                raise self.error
            self._want = -1
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        assert self.trailer is not None
        return bytes(self.trailer)

    async def wait(self, want: int) -> None:
        """Until ``pos >= want``; raises the connection's error if it comes first."""
        while self.pos < want:
            if self.error is not None:
                raise self.error
            self._want = want
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.error is not None:
            raise self.error


# -- the sending side ------------------------------------------------------------------------


@dataclasses.dataclass
class Upgraded:
    """A connection the receiver switched to ``protocol`` (``101``); ``headers`` its answer's."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    headers: dict[str, str]


async def request_upgrade(
    peer: str,
    url: str,
    path: str,
    protocol: str,
    headers: Mapping[str, str],
    ssl_context: ssl.SSLContext | None,
) -> Upgraded | Answer:
    """Open a connection to ``peer`` at ``url`` (TLS with ``ssl_context`` for https peers) and
    ask for ``Upgrade: protocol`` on ``path`` with ``headers`` (the signed request's, no
    body): the `Upgraded` connection, or the receiver's `Answer` when it answers otherwise (the
    connection then closed). A 101 to another protocol raises `TransportError`, an oversized
    answer head too; connection problems raise `OSError`/`EOFError`/`TimeoutError`. Any error
    or cancellation aborts the connection: nothing is left open but what is returned."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or ""
    https = u.scheme == "https"
    port = u.port or (443 if https else 80)
    ctx = (ssl_context or ssl.create_default_context()) if https else None
    head = request_head(
        "POST", path, u.netloc, {**headers, "Connection": "Upgrade", "Upgrade": protocol}
    )
    async with asyncio.timeout(CONNECT_TIMEOUT):
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ctx, server_hostname=host if ctx else None, limit=HEAD_LIMIT
        )
    try:
        writer.write(head)
        status, _, rh = await read_response_head(reader)
        if status != 101:
            text = await read_response_text(reader, rh)
            writer.close()
            return Answer(
                status, text, seconds(rh.get(H_WAIT.lower())), rh.get(H_REASON.lower(), "")
            )
        if rh.get("upgrade", "").strip().lower() != protocol:
            raise TransportError(
                f"peer {peer!r} answered 101 without upgrading to {protocol} "
                f"({rh.get('upgrade')!r})"
            )
    except asyncio.LimitOverrunError:
        writer.transport.abort()
        raise TransportError(f"peer {peer!r} sent an oversized {protocol} answer") from None
    except BaseException:
        writer.transport.abort()
        raise
    return Upgraded(reader, writer, rh)


async def post_bulk(
    peer: str,
    url: str,
    headers: Mapping[str, str],
    body: AsyncIterator[memoryview],
    ssl_context: ssl.SSLContext | None,
    trailer: Callable[[], bytes] | None = None,
) -> Answer:
    """One bulk request to ``peer`` at ``url``: the receiver's `Answer`.

    ``trailer``: called once the body is written, its line (a signed JSON object ending in a
    newline) follows the body (heads whose digest is `auth.DEFERRED`).

    On a new connection (TLS with ``ssl_context`` for https peers): the request head
    (``Upgrade: tandem-frame/1``, no body); a refusal comes back as an ordinary HTTP
    response; after ``101`` the pieces of ``body`` are written raw, then the receiver's reply
    is one JSON line. The connection is closed afterwards, aborted
    on any error or cancellation (nothing is left running). Connection problems raise
    `OSError`/`EOFError`/`TimeoutError` (retried by the caller); a reply that is not this
    protocol raises `TransportError`."""
    upgraded = await request_upgrade(peer, url, FRAME_PATH, BULK_PROTOCOL, headers, ssl_context)
    if isinstance(upgraded, Answer):
        if upgraded.status == 200 and upgraded.text != "duplicate":
            # accepted without reading a body: a receiver that ignores the upgrade
            raise TransportError(
                f"peer {peer!r} does not support the bulk path ({BULK_PROTOCOL}): "
                "update it, or set bulk_min_bytes=None on this sender"
            )
        return upgraded
    reader, writer = upgraded.reader, upgraded.writer
    done = False
    try:
        async for piece in body:
            _write(writer, piece)
            await writer.drain()
        if trailer is not None:
            _write(writer, trailer())
        answer = parse_bulk_reply(await reader.readuntil(b"\n"))
        done = True
        return answer
    except asyncio.LimitOverrunError:
        raise TransportError(f"peer {peer!r} sent an oversized bulk response") from None
    finally:
        if done:
            writer.close()
        else:
            writer.transport.abort()


def _write(writer: asyncio.StreamWriter, data: bytes | memoryview) -> None:
    """``writer.write(data)``, or `ConnectionResetError` when the peer has already closed the
    connection (uvloop raises RuntimeError on a closed transport, asyncio drops the bytes)."""
    if writer.transport.is_closing():
        raise ConnectionResetError("the peer closed the bulk connection")
    writer.write(data)


def request_head(method: str, path: str, host: str, headers: Mapping[str, str]) -> bytes:
    """An HTTP/1.1 request head; refuses CR/LF in names and values (header injection), as
    aiohttp's client does."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    for k, v in headers.items():
        if any(c in k or c in v for c in "\r\n"):
            raise ValueError(f"newline or carriage return in header {k!r}: {v!r}")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_response_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    """``(status, reason, headers with lower-case names)`` of an HTTP/1.x response head."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise TransportError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, sep, v = line.partition(":")
            if not sep:
                raise TransportError(f"malformed response header line {line[:80]!r}")
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers


async def read_response_text(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> str:
    """The (short) body of a refusal: by Content-Length, else up to the connection's end."""
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > HEAD_LIMIT:
            raise TransportError(f"unexpected Content-Length {length[:40]!r} in a refusal")
        data = await reader.readexactly(int(length))
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        raise TransportError("chunked refusal bodies are not expected from a tandem peer")
    else:
        data = await reader.read(HEAD_LIMIT)
    return data.decode("utf-8", "replace")


def parse_bulk_reply(line: bytes) -> Answer:
    """The receiver's verdict on a bulk body:
    ``{"status": int, "text": str, "wait": float, "reason": str (refusals only)}``."""
    try:
        reply = orjson.loads(line)
        status, text = reply["status"], reply["text"]
        wait, reason = reply.get("wait", 0.0), reply.get("reason", "")
    except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
        raise TransportError(f"malformed bulk reply {line[:80]!r}") from None
    if not (
        isinstance(status, int)
        and isinstance(text, str)
        and isinstance(wait, (int, float))
        and isinstance(reason, str)
    ):
        raise TransportError(f"malformed bulk reply {line[:80]!r}")
    return Answer(status, text, float(wait), reason)
