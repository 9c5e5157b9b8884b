"""Reading a frame request's body into the message buffer.

Two kinds of body share one interface (`Body`): `PlainBody`, a POST body read through
aiohttp, and `bulk.BulkBody`, received outside aiohttp after an upgrade. `read_into` drives
either while hashing (HMAC digest) and NaN/Inf-scanning what arrives, and closes a body that
stalls (``idle`` seconds without a byte) or whose claim on the message was revoked.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from aiohttp import web

from .protocol import INLINE_BYTES, Refuse, Reply
from .scan import SCAN_STEP, FiniteScan
from .streams import Claim

HASH_STEP = 4 << 20  # received bytes handed to the hashing thread at a time (see read_into)
#: the most of a body left unread by its answer (a refusal, a duplicate) that is read and
#: dropped so that the caller sees the answer; a longer remainder closes the connection
DRAIN_BYTES = 256 << 10


class Body(Protocol):
    """Where a frame request's body comes from, and how its answer travels back."""

    def length(self) -> int:
        """The body's declared length; `Refuse` when it is missing or inconsistent."""
        ...

    async def begin(
        self, buf: memoryview, offset: int, length: int, scan: FiniteScan | None
    ) -> str:
        """Start receiving into ``buf[offset:offset + length]``; returns the path's name
        (``"plain"`` or ``"bulk"``)."""
        ...

    async def fill(self, view: memoryview, pos: int, end: int, step: int) -> int:
        """Receive more bytes at ``view[pos:]`` (about ``step``, never past ``end``); returns
        the new position."""
        ...

    def release(self) -> None:
        """After the request is judged: free what receiving held (called in every case)."""
        ...

    def abort(self) -> None:
        """Close the request's connection at once (a stalled body, or a revoked claim): no
        further byte of it reaches the frame buffer."""
        ...

    def respond(self, reply: Reply) -> web.StreamResponse:
        """The response aiohttp sends for ``reply``."""
        ...


class PlainBody:
    """The body of a plain POST: aiohttp's chunks, copied into the frame buffer.

    From its making until `begin` (or `release`) the connection is not read: a request waiting
    for admission (the stream's lock, an inbox slot, the byte budget) holds what its first read
    brought and leaves the rest of its body in the kernel, instead of filling aiohttp's read
    buffer (up to twice ``read_bufsize``) on every waiting connection."""

    def __init__(
        self,
        content: Any,
        content_length: int | None,
        transport: Any = None,
        *,
        unread_limit: int | None = None,
    ) -> None:
        self.content, self.content_length, self.transport = content, content_length, transport
        self.claim: Claim | None = None  # checked before every copy into the frame buffer
        # a body refused before `begin` stays unread when longer than ``unread_limit`` (its
        # connection is closed; see `release`); None: reading resumes after any refusal
        self.unread_limit = unread_limit
        self.begun = False
        # paused here only when it was reading: a pause of aiohttp's own is aiohttp's to lift
        self.paused = transport is not None and transport.is_reading()
        if self.paused:
            transport.pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def length(self) -> int:
        if self.content_length is None:
            raise Refuse(411, "malformed", "Content-Length is required")
        return self.content_length

    async def begin(
        self, buf: memoryview, offset: int, length: int, scan: FiniteScan | None
    ) -> str:
        self.begun = True
        self.resume()
        return "plain"

    async def fill(self, view: memoryview, pos: int, end: int, step: int) -> int:
        """Copy the next received piece to ``view[pos:]``; returns the new position."""
        # readchunk hands over aiohttp's buffered chunks one by one; readany would first join
        # them into a new bytes object (a second copy of every body byte)
        data, _ = await self.content.readchunk()
        if self.claim is not None and not self.claim.live:
            raise ConnectionResetError("a newer request for this chunk took over")
        if not data:
            raise Refuse(400, "malformed", f"body ended {end - pos} bytes short")
        n = len(data)
        if pos + n > end:
            raise Refuse(400, "malformed", "body longer than Content-Length")
        view[pos : pos + n] = data
        return pos + n

    def release(self) -> None:
        """Reading resumes, except for a body refused before `begin` and longer than
        ``unread_limit``: none of it is read into aiohttp's buffer (its connection is closed
        once the answer is out, `server.HttpServer._close_unread`)."""
        limit, length = self.unread_limit, self.content_length
        if self.begun or limit is None or (length is not None and length <= limit):
            self.resume()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def respond(self, reply: Reply) -> web.StreamResponse:
        return reply.response()


async def read_into(
    body: Body,
    buf: memoryview,
    offset: int,
    length: int,
    hasher: Any = None,
    scan: FiniteScan | None = None,
    *,
    idle: float | None = None,
    claim: Claim | None = None,
) -> None:
    """Read exactly ``length`` body bytes into ``buf[offset:]``; with ``hasher``, also feed
    it every byte read, in order (the caller compares the digest afterwards); with
    ``scan``, NaN/Inf-scan the bytes as they come in (on the loop: see `FiniteScan`).

    ``idle``: when no byte arrives for that many seconds the connection is closed and
    `Refuse` (408) raised. ``claim``: the request's right to write into ``buf``; once revoked
    (a newer request for the same chunk took over) reading stops with `ConnectionResetError`
    before anything more is written or scanned.

    Hashing runs in a worker thread on the part already received while the loop keeps
    receiving (at most one update in flight, each over >= ``HASH_STEP`` bytes; the hasher
    releases the GIL), so the body digest stays off the critical path of a signed request
    rather than following the transfer. When this returns or raises
    (cancellation included), no update is running: a thread cannot be interrupted, so the
    update in flight is awaited (shielded) before the exception propagates."""
    view = memoryview(buf)
    pos, end = offset, offset + length
    hashed, pending = offset, None  # view[offset:hashed] is in hasher (or being added)
    step = HASH_STEP if hasher is not None else length  # bytes per wake-up (bulk)
    scanned = offset
    loop = asyncio.get_running_loop()
    # no watchdog for a body already in memory (idle None): it cannot stall
    dog = None if idle is None else asyncio.timeout(loop.time() + idle)
    try:
        try:
            async with dog or contextlib.nullcontext():
                while pos < end:
                    pos = await body.fill(view, pos, end, step)
                    if dog is not None and idle is not None:
                        dog.reschedule(loop.time() + idle)
                    if claim is not None and not claim.live:
                        raise ConnectionResetError("a newer request for this chunk took over")
                    if scan is not None and pos - scanned >= SCAN_STEP:
                        scan.advance(pos)  # (the bulk sink scans as it receives: nothing left)
                        scanned = pos
                    if (
                        hasher is not None
                        and pos - hashed >= HASH_STEP
                        and (pending is None or pending.done())
                    ):
                        if pending is not None:
                            pending.result()
                        pending = loop.run_in_executor(None, hasher.update, view[hashed:pos])
                        hashed = pos
        except TimeoutError:
            body.abort()
            raise Refuse(
                408,
                "body_timeout",
                f"no body byte for body_idle_timeout={idle:g} s after {pos - offset} of "
                f"{length} bytes; the connection was closed",
            ) from None
        if scan is not None:
            scan.advance(end)
        if hasher is not None:
            if pending is not None:
                await asyncio.shield(pending)  # unshielded, a cancel would orphan the thread
            if end - hashed < INLINE_BYTES:
                hasher.update(view[hashed:end])
            else:
                pending = loop.run_in_executor(None, hasher.update, view[hashed:end])
                await asyncio.shield(pending)
    finally:
        if pending is not None and not pending.done():
            await wait_uncancelled(pending)


async def wait_uncancelled(fut: asyncio.Future) -> None:
    """Wait for ``fut`` (a thread's job: it cannot be interrupted) even if cancelled meanwhile;
    its outcome is dropped (the caller is already leaving with an exception). A cancellation
    that arrived during the wait is raised once the job is done, so it is never lost."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            break
    if cancelled:
        raise asyncio.CancelledError
