"""The sending half of the HTTP transport: chunked frame requests, retry with backoff, the
mapping of refusals to exceptions, goodbyes and liveness probes.

Up to ``send_window`` messages in flight per (peer, channel): ids count from 0 per sender
incarnation in the order `send` is called, and each concurrent `send` posts its message at
once (a chunked message waits for the ones before it and holds back the ones after it); the
receiver delivers them in id order. Every request names the stream's *base* (its lowest
unsettled id) so the receiver skips the ids of cancelled sends instead of waiting for them. A
`send` returns once the receiver has delivered its message to its inbox, in order. A chunk
is retried with exponential backoff and seeded jitter on connection loss, 503 and an attempt
that makes no progress for ``read_timeout`` seconds (a frozen peer), until ``retry_timeout``
seconds without reaching the peer (`PeerUnavailableError`); a peer that is busy but alive is
waited for (backpressure). Chunks of at least ``bulk_min_bytes`` take the bulk path
(`bulk.post_bulk`); its answers are handled exactly as the plain POST's.

With a secret, every request is signed for its receiver: the peer's name and the incarnation
of its process, learnt from its first answer (421 naming it) and again after it restarts.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import AsyncIterator, Iterable

import aiohttp
import orjson

from tandem.errors import (
    FrameError,
    PeerUnavailableError,
    TransportClosedError,
    TransportError,
)

from .. import auth, bodymac, chunking, codec
from ..base import Frame, LinkStats
from ..bodymac import BodyMac
from ..shaping import LinkShape, LinkShaper
from . import bulk, framewire
from .config import HttpConfig
from .framestream import FrameStream, open_stream
from .framewire import MAX_RECORD_BODY
from .outbody import hashing, paced, progress, trailer_line, unpaced
from .protocol import (
    BYE_PATH,
    FRAME_PATH,
    H_BASE,
    H_CHANNEL,
    H_CHUNK,
    H_CHUNKS,
    H_ID,
    H_INC,
    H_LENGTH,
    H_OFFSET,
    H_REASON,
    H_REPLY,
    H_SENDER,
    H_SPEC,
    H_TOTAL,
    H_WAIT,
    HEALTH_PATH,
    INLINE_BYTES,
    STREAM_PATH,
    Answer,
    seconds,
)
from .refusals import ResendFrom, error_for
from .sendorder import OutStream, WireTurn


class _Route:
    """Where one message goes and what it is: its stream record's fields, and (`headers`,
    made only for a POST) the routing headers of its requests."""

    __slots__ = ("client", "channel", "msg_id", "chunks", "total", "spec", "channel_fits")

    def __init__(
        self,
        client: HttpClient,
        channel: str,
        msg_id: int,
        chunks: list[tuple[int, list[memoryview]]],
        spec: str,
    ) -> None:
        self.client, self.channel, self.msg_id, self.spec = client, channel, msg_id, spec
        self.chunks = len(chunks)
        total = 0
        for _, views in chunks:
            total += chunking.total_size(views)
        self.total = total  # of a single chunk: that chunk's size
        self.channel_fits = len(channel.encode()) <= framewire.MAX_CHANNEL_BYTES

    def headers(self) -> dict[str, str]:
        client = self.client
        return {
            H_SENDER: client.cfg.name,
            H_INC: client.incarnation,
            H_CHANNEL: self.channel,
            H_ID: str(self.msg_id),
            H_CHUNKS: str(self.chunks),
            H_TOTAL: str(self.total),
            H_SPEC: self.spec,
            H_REPLY: client.cfg.advertise_url or client.reply_url,
        }


#: seconds a peer that did not upgrade a frame stream handshake gets POSTs before the next try
STREAM_RETRY_AFTER = 30.0

#: consecutive 421 answers (misdirected: signed for another incarnation) a request may get
MAX_REBINDS = 3


class HttpClient:
    """Sends frames to peers over one persistent `aiohttp.ClientSession` (and bulk connections
    of their own). Built by `HttpTransport`; `open` inside a running loop, `close` once."""

    def __init__(self, config: HttpConfig, incarnation: str) -> None:
        self.cfg = config
        self.incarnation = incarnation
        self.spec_hash = config.spec_hash  # stamped on outgoing frames when non-empty
        self.reply_url = ""  # our own base URL, sent as X-Tandem-Reply-To (set once serving)
        self.sent: dict[str, LinkStats] = {}
        self.retries: dict[str, int] = {}
        self.requests: dict[str, int] = {}  # path (plain|bulk) -> requests sent, retries included
        self.closed = False
        self.peer_incarnations: dict[str, str] = {}  # what our signatures are bound to
        self._rng = random.Random(config.seed)
        self._out: dict[tuple[str, str], OutStream] = {}
        self._busy_until: dict[str, float] = {}  # peer -> end of the latest answered request
        self._wires: dict[str, LinkShaper] = {}  # peer -> emulated wire (shaping only)
        self._bulk_ssl: ssl.SSLContext | None = None
        self._streams: dict[str, FrameStream] = {}  # peer -> its frame stream (`framestream`)
        self._stream_opening: dict[str, asyncio.Lock] = {}  # one handshake per peer at a time
        self._no_stream_until: dict[str, float] = {}  # peer -> loop time to try a stream again
        # streams carry no emulated link: shaped sends stay on POSTs (`outbody.paced`)
        self._stream_eligible = (
            config.offers_streams and config.shape_bandwidth is None and not config.shape_latency
        )
        self._session: aiohttp.ClientSession | None = None
        self._closed_event: asyncio.Event | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise TransportError(f"transport of {self.cfg.name!r} is not started; use `async with`")
        return self._session

    async def open(self) -> None:
        """Open the client session (inside the running loop)."""
        cfg = self.cfg
        self._closed_event = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0, ssl=cfg.ssl_client if cfg.ssl_client else True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, cfg.read_timeout)),
            read_bufsize=1 << 16,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self, peer_urls: Iterable[tuple[str, str]]) -> None:
        """Fail pending and later sends, say goodbye to ``peer_urls`` (``(name, url)`` pairs,
        best effort), close the session."""
        self.closed = True
        if self._closed_event is not None:
            self._closed_event.set()
        for stream in self._streams.values():
            stream.close()
        if self._session is not None:
            await asyncio.gather(*(self._say_bye(peer, url) for peer, url in peer_urls))
            await self._session.close()

    def stats(self, peer: str) -> LinkStats:
        stats = self.sent.get(peer)
        if stats is None:
            stats = self.sent[peer] = LinkStats()
        return stats

    def _check_open(self) -> None:
        if self.closed:
            raise TransportClosedError(f"transport of {self.cfg.name!r} is closed")

    async def send(self, peer: str, url: str, channel: str, frame: Frame) -> None:
        """Deliver ``frame`` to ``peer`` at ``url``; returns once the peer has delivered it to
        its inbox, after every message sent before it on ``channel``. Concurrent calls on one
        channel keep up to ``send_window`` messages in flight, in call order (the id is taken
        before the first suspension)."""
        self._check_open()
        cfg = self.cfg
        out = self._out.get((peer, channel))
        if out is None:
            out = self._out[(peer, channel)] = OutStream()
        msg_id = out.next_id  # taken below, before anything is awaited
        spec = self.spec_hash or frame.spec_hash
        if type(frame) is Frame:  # its header fields stamped as it is encoded
            parts = codec.encode_parts_as(frame, cfg.name, channel, msg_id, spec)
        else:  # a subclass keeps its own fields: `replace` copies them
            frame = frame.replace(sender=cfg.name, channel=channel, msg_id=msg_id, spec_hash=spec)
            parts = codec.encode_parts(frame)
        chunks = chunking.split(parts, cfg.chunk_bytes)
        out.assign(chunked=len(chunks) > 1)
        try:
            route = _Route(self, channel, msg_id, chunks, spec)
            if not out.may_start(msg_id, cfg.send_window):
                await out.turn(msg_id, cfg.send_window)
            self._check_open()
            digests: dict[int, str] = {}
            i = 0
            while i < len(chunks):
                i = await self._post_chunk(peer, url, out, route, chunks, i, digests)
            self.stats(peer).frames += 1
        finally:
            out.settle(msg_id)

    async def _post_chunk(
        self,
        peer: str,
        url: str,
        out: OutStream,
        route: _Route,
        chunks: list[tuple[int, list[memoryview]]],
        i: int,
        digests: dict[int, str],
    ) -> int:
        """Post chunk ``i`` until acknowledged; returns the index of the next chunk to send."""
        cfg = self.cfg
        offset, views = chunks[i]
        size = route.total if route.chunks == 1 else chunking.total_size(views)
        use_bulk = cfg.bulk_min_bytes is not None and size >= cfg.bulk_min_bytes
        use_stream = (
            self._stream_eligible
            and not use_bulk
            and len(chunks) == 1
            and size <= MAX_RECORD_BODY
            and route.channel_fits
        )
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        attempt = rebinds = 0
        while True:
            if self.closed:
                raise TransportClosedError(f"transport of {cfg.name!r} closed during send")
            t0 = loop.time()
            try:
                if cfg.signs and peer not in self.peer_incarnations:
                    await self._learn(peer, url)  # whom to sign for: the peer's process
                    t0 = loop.time()
                if use_stream:
                    answer = await self._stream_attempt(peer, url, route, out.base(), views)
                else:
                    answer = await self._post_attempt(
                        peer, url, out, route, (i, offset, size), views, use_bulk, digests
                    )
            except (aiohttp.ClientError, OSError, TimeoutError, EOFError) as exc:
                # EOFError: asyncio.IncompleteReadError, a bulk connection closed early
                deadline, attempt = await self._unreachable(peer, url, exc, deadline, attempt)
                continue
            if answer is None:  # the peer offers no frame stream: POST
                use_stream = False
                continue
            if answer.status == 421 and rebinds < MAX_REBINDS and self._rebind(peer, answer):
                rebinds += 1  # signed for a process that is not (or no more) there: re-sign
                continue
            if answer.status == 200:
                self._count_sent(peer, size, t0, answer.waited)
                return i + 1
            if answer.status == 503:
                deadline = self._busy_deadline(peer, answer, deadline)
                attempt = await self._backoff(peer, attempt)
                continue
            err = error_for(peer, cfg.name, answer.status, answer.text, answer.reason)
            if isinstance(err, ResendFrom) and err.index <= i:
                return err.index  # the receiver lost the message's start: resend in order
            raise FrameError(str(err)) if isinstance(err, ResendFrom) else err

    async def _stream_attempt(
        self, peer: str, url: str, route: _Route, base: int, views: list[memoryview]
    ) -> Answer | None:
        """One attempt on the peer's frame stream; None when the peer offers none."""
        stream = self._streams.get(peer)
        if stream is not None and stream.usable:  # the common case, inline
            self.requests["stream"] = self.requests.get("stream", 0) + 1
            return await stream.send(route.channel, route.msg_id, base, views)
        return await self._stream_send(peer, url, route, base, views)

    async def _post_attempt(
        self,
        peer: str,
        url: str,
        out: OutStream,
        route: _Route,
        where: tuple[int, int, int],
        views: list[memoryview],
        use_bulk: bool,
        digests: dict[int, str],
    ) -> Answer:
        """One POST (plain or bulk) of chunk ``where = (index, offset, size)``, signed with
        its body digest (computed once per chunk, in ``digests``, off the loop when large)."""
        i, offset, size = where
        headers = route.headers()
        headers[H_CHUNK], headers[H_OFFSET] = str(i), str(offset)
        headers[H_BASE] = str(out.base())
        if use_bulk:
            headers["Content-Length"] = "0"
            headers[H_LENGTH] = str(size)
        else:
            headers["Content-Length"] = str(size)
            headers["Content-Type"] = "application/octet-stream"
        hasher: auth.BodyHasher | BodyMac | None = None
        signer = self.cfg.signer if self.cfg.signs else None
        if isinstance(signer, bytes) and use_bulk and bodymac.available():
            # a shared secret: the body's GMAC, computed as it is sent, follows the body
            self._sign("POST", FRAME_PATH, peer, headers, auth.DEFERRED_MAC)
            hasher = auth.body_mac(signer, "POST", FRAME_PATH, headers)
        elif signer is not None and use_bulk:  # hashed while sent; the digest follows
            self._sign("POST", FRAME_PATH, peer, headers, auth.DEFERRED)
            hasher = auth.body_hasher(parallel=True)
        elif self.cfg.signs:
            if i not in digests:
                digests[i] = (
                    auth.body_digest(views)
                    if size < INLINE_BYTES
                    else await asyncio.to_thread(auth.body_digest, views)
                )
            self._sign("POST", FRAME_PATH, peer, headers, digests[i])
        path = "bulk" if use_bulk else "plain"
        self.requests[path] = self.requests.get(path, 0) + 1
        return await self._post(peer, url, out, headers, views, use_bulk, hasher)

    def _count_sent(self, peer: str, size: int, t0: float, waited: float) -> None:
        """Count an acknowledged chunk of ``size`` bytes whose attempt began at ``t0``."""
        stats = self.stats(peer)
        stats.bytes += size
        # concurrent requests overlap: count the time the link was busy once
        now = asyncio.get_running_loop().time()
        start = max(t0, self._busy_until.get(peer, t0))
        stats.busy_seconds += max(now - start - waited, 0.0)
        self._busy_until[peer] = max(now, self._busy_until.get(peer, now))

    def _busy_deadline(self, peer: str, answer: Answer, deadline: float | None) -> float | None:
        """After a 503: a peer shutting down is waited for like a lost link (until
        ``retry_timeout``, then `PeerUnavailableError`); one busy but alive, indefinitely
        (backpressure: None)."""
        if answer.reason != "closing":
            return None
        now = asyncio.get_running_loop().time()
        deadline = deadline if deadline is not None else now + self.cfg.retry_timeout
        if now >= deadline:
            raise PeerUnavailableError(f"peer {peer!r} is shutting down: {answer.text}")
        return deadline

    async def _stream_send(
        self, peer: str, url: str, route: _Route, base: int, views: list[memoryview]
    ) -> Answer | None:
        """One attempt on ``peer``'s frame stream (opened first when there is none): the
        receiver's answer; the handshake's answer when it was refused as misdirected (421: the
        caller re-signs); None when the peer offers no stream (the caller POSTs)."""
        loop = asyncio.get_running_loop()
        stream = self._streams.get(peer)
        if stream is None or not stream.usable:
            if loop.time() < self._no_stream_until.get(peer, 0.0):
                return None
            async with self._stream_opening.setdefault(peer, asyncio.Lock()):
                stream = self._streams.get(peer)
                if stream is None or not stream.usable:
                    if stream is not None:
                        stream.close()
                    opened = await self._open_stream(peer, url)
                    if isinstance(opened, Answer):
                        if opened.status == 421:
                            return opened
                        self._no_stream_until[peer] = loop.time() + STREAM_RETRY_AFTER
                        return None
                    if self.closed:
                        opened.close()
                        raise TransportClosedError(f"transport of {self.cfg.name!r} closed")
                    stream = self._streams[peer] = opened
        self.requests["stream"] = self.requests.get("stream", 0) + 1
        return await stream.send(route.channel, route.msg_id, base, views)

    async def _open_stream(self, peer: str, url: str) -> FrameStream | Answer:
        """The signed handshake of a frame stream to ``peer`` (docs/transports.md)."""
        cfg = self.cfg
        headers = {
            H_SENDER: cfg.name,
            H_INC: self.incarnation,
            H_REPLY: cfg.advertise_url or self.reply_url,
            "Content-Length": "0",
        }
        if cfg.secret:
            self._sign("POST", STREAM_PATH, peer, headers, auth.EMPTY_SHA)
        material = (
            cfg.secret or b"",
            cfg.name,
            self.incarnation,
            peer,
            headers.get(auth.TO, ""),
            headers.get(auth.NONCE, ""),
        )
        ctx = self._bulk_context() if url.startswith("https://") else None
        return await open_stream(peer, url, headers, material, ctx, cfg.read_timeout)

    def _sign(
        self, method: str, path: str, peer: str, headers: dict[str, str], digest: str
    ) -> None:
        """Sign ``headers`` for ``peer`` (its name and the incarnation we know of it)."""
        cfg = self.cfg
        auth.sign(
            cfg.signer,
            method,
            path,
            headers,
            digest,
            clock=cfg.clock,
            key_id=cfg.key_id,
            receiver=peer,
            to=self.peer_incarnations.get(peer, ""),
        )

    async def _unreachable(
        self, peer: str, url: str, exc: BaseException, deadline: float | None, attempt: int
    ) -> tuple[float, int]:
        """After a failed attempt: `PeerUnavailableError` once ``retry_timeout`` has passed
        since the first failure (``deadline``), else back off; returns the deadline and the
        next attempt's number."""
        if self.closed:
            raise TransportClosedError(f"transport of {self.cfg.name!r} closed during send")
        now = asyncio.get_running_loop().time()
        deadline = deadline if deadline is not None else now + self.cfg.retry_timeout
        if now >= deadline:
            raise PeerUnavailableError(
                f"peer {peer!r} at {url} unreachable for {self.cfg.retry_timeout}s "
                f"({type(exc).__name__}: {exc}); is it running? (retry_timeout)"
            ) from None
        return deadline, await self._backoff(peer, attempt)

    async def _learn(self, peer: str, url: str) -> None:
        """Ask ``peer``'s ``/healthz`` (signed) which process answers there. A peer that does
        not name it (it does not know us yet: ``admit_unknown``; or it is no Tandem peer)
        names it in its 421 answer to our first request instead. Connection errors propagate
        (the attempt failed)."""
        try:  # a one-off question: no connection is kept for it
            inc = await self.probe(peer, url, self.cfg.read_timeout, keep_alive=False)
        except ValueError:  # an answer, but not a Tandem /healthz
            inc = None
        self.peer_incarnations[peer] = inc or ""

    def _rebind(self, peer: str, answer: Answer) -> bool:
        """Learn ``peer``'s incarnation from its 421 answer; False when it names none."""
        try:
            inc = orjson.loads(answer.text).get("incarnation")
        except (orjson.JSONDecodeError, AttributeError):
            return False
        if not isinstance(inc, str) or not inc or inc == self.peer_incarnations.get(peer):
            return False
        self.peer_incarnations[peer] = inc
        return True

    async def _post(
        self,
        peer: str,
        url: str,
        out: OutStream,
        headers: dict[str, str],
        views: list[memoryview],
        use_bulk: bool,
        hasher: auth.BodyHasher | BodyMac | None = None,
    ) -> Answer:
        """One attempt (``hasher``: a bulk body hashed as it is sent, its signed digest in a
        trailer after it, `outbody.trailer_line`). It fails with `TimeoutError` when
        ``read_timeout`` seconds pass without progress: no body piece written, or no answer
        after the last one."""
        loop = asyncio.get_running_loop()
        idle = self.cfg.read_timeout
        cfg = self.cfg
        if (
            not use_bulk
            and len(out.pending) == 1  # alone on its stream: no wire turn to wait for
            and cfg.shape_bandwidth is None
            and not cfg.shape_latency
            and chunking.total_size(views) <= cfg.write_piece_bytes
        ):
            # one socket write: the body goes as bytes (no per-piece generator or watchdog
            # pushes; a small body costs less to join than to stream)
            async with asyncio.timeout(idle):
                data = views[0] if len(views) == 1 else b"".join(views)
                async with self.session.post(url + FRAME_PATH, headers=headers, data=data) as resp:
                    return Answer(
                        resp.status,
                        await resp.text(),
                        seconds(resp.headers.get(H_WAIT)),
                        resp.headers.get(H_REASON, ""),
                    )
        turn = WireTurn(out.wire)
        try:
            async with asyncio.timeout(loop.time() + idle) as watchdog:
                body = progress(turn.hold(self._body(peer, views)), watchdog, idle)
                if use_bulk:
                    ctx = self._bulk_context() if url.startswith("https://") else None
                    if hasher is None:
                        return await bulk.post_bulk(peer, url, headers, body, ctx)
                    return await bulk.post_bulk(
                        peer,
                        url,
                        headers,
                        hashing(body, hasher),
                        ctx,
                        lambda: trailer_line(self.cfg, peer, headers, hasher),
                    )
                async with self.session.post(url + FRAME_PATH, headers=headers, data=body) as resp:
                    return Answer(
                        resp.status,
                        await resp.text(),
                        seconds(resp.headers.get(H_WAIT)),
                        resp.headers.get(H_REASON, ""),
                    )
        finally:
            turn.end()

    def _bulk_context(self) -> ssl.SSLContext:
        """TLS context of bulk connections to https peers (made once: loading the system's
        CA certificates takes tens of milliseconds)."""
        if self._bulk_ssl is None:
            self._bulk_ssl = self.cfg.ssl_client or ssl.create_default_context()
        return self._bulk_ssl

    def _body(self, peer: str, views: list[memoryview]) -> AsyncIterator[memoryview]:
        """The body's socket writes (``write_piece_bytes`` each), paced by the peer's emulated
        wire when ``shape_bandwidth`` / ``shape_latency`` are set."""
        pieces = chunking.pieces(views, self.cfg.write_piece_bytes)
        cfg = self.cfg
        if cfg.shape_bandwidth is None and not cfg.shape_latency:
            return unpaced(pieces)
        wire = self._wires.get(peer)
        if wire is None:
            shape = LinkShape(cfg.shape_bandwidth, cfg.shape_latency)
            wire = self._wires[peer] = LinkShaper(shape)
        return paced(wire, pieces)

    async def _backoff(self, peer: str, attempt: int) -> int:
        """Wait before retry number ``attempt + 1`` (cut short by `close`); returns it."""
        self.retries[peer] = self.retries.get(peer, 0) + 1
        cfg = self.cfg
        delay = min(cfg.backoff_max, cfg.backoff_base * (2**attempt))
        delay *= 0.5 + 0.5 * self._rng.random()
        if self._closed_event is not None:
            try:
                await asyncio.wait_for(self._closed_event.wait(), delay)
            except TimeoutError:
                pass
        return attempt + 1

    async def _say_bye(self, peer: str, url: str) -> None:
        """Best effort (a peer that is gone needs no goodbye): one request, and one more when
        the peer names its incarnation (421) first."""
        for _ in range(2):
            headers = {H_SENDER: self.cfg.name, H_INC: self.incarnation, "Content-Length": "0"}
            if self.cfg.signs:
                self._sign("POST", BYE_PATH, peer, headers, auth.EMPTY_SHA)
            try:
                async with self.session.post(
                    url + BYE_PATH, headers=headers, timeout=aiohttp.ClientTimeout(total=0.5)
                ) as resp:
                    answer = Answer(resp.status, await resp.text(), 0.0, "")
            except (aiohttp.ClientError, OSError, TimeoutError):
                return
            if answer.status != 421 or not self._rebind(peer, answer):
                return

    async def probe(
        self, peer: str, url: str, timeout: float, *, keep_alive: bool = True
    ) -> str | None:
        """The incarnation a peer's ``GET /healthz`` names (None if it names none: it does
        only to a caller it can authenticate). Raises `aiohttp.ClientError`, `OSError`,
        `TimeoutError` or `ValueError` when it does not answer properly."""
        headers = {H_SENDER: self.cfg.name}
        if not keep_alive:
            headers["Connection"] = "close"
        if self.cfg.signs:
            self._sign("GET", HEALTH_PATH, peer, headers, auth.EMPTY_SHA)
        async with self.session.get(
            url + HEALTH_PATH, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            info = await resp.json(content_type=None)
        inc = info.get("incarnation") if isinstance(info, dict) else None
        return inc if isinstance(inc, str) and inc else None
