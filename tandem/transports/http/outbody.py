"""The body of an outgoing request as socket writes: pieces handed over one at a time, paced
by an emulated wire (link shaping), each pushing the attempt's watchdog; a signed bulk body
hashed as it is written, and its signed trailer line."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import orjson

from .. import auth
from ..bodymac import BodyMac
from ..shaping import LinkShaper
from .config import HttpConfig
from .protocol import FRAME_PATH

HASH_STEP = 4 << 20  # written bytes handed to the hashing thread at a time (see `hashing`)


async def progress(
    pieces: AsyncIterator[memoryview], watchdog: asyncio.Timeout, idle: float
) -> AsyncIterator[memoryview]:
    """``pieces``, pushing ``watchdog``'s deadline ``idle`` seconds past each one handed to
    the socket (a piece is asked for only once the one before it was written)."""
    loop = asyncio.get_running_loop()
    async for piece in pieces:
        watchdog.reschedule(loop.time() + idle)
        yield piece
    watchdog.reschedule(loop.time() + idle)


async def unpaced(pieces: Iterator[memoryview]) -> AsyncIterator[memoryview]:
    for piece in pieces:
        yield piece


async def paced(wire: LinkShaper, pieces: Iterator[memoryview]) -> AsyncIterator[memoryview]:
    """Each request waits the link's latency before its first byte; each piece is released at
    the end of its transmission on the peer's wire, shared by every channel to that peer."""
    loop = asyncio.get_running_loop()
    if wire.shape.latency:
        await asyncio.sleep(wire.shape.latency)
    for piece in pieces:
        if wire.shape.bandwidth is not None:
            async with wire.transmit(len(piece), offered=loop.time()):
                pass
        yield piece


async def hashing(
    pieces: AsyncIterator[memoryview], hasher: auth.BodyHasher | BodyMac
) -> AsyncIterator[memoryview]:
    """``pieces``, each also fed to ``hasher`` in order once the consumer asked for the next
    one (it was written). A `BodyMac` takes each piece on the loop; a BLAKE3 hasher
    is fed by a worker thread that hashes what was written (>= ``HASH_STEP`` bytes
    at a time, one update in flight) while the loop writes on, so a signed bulk body is
    hashed while it is sent, not before. When the pieces are exhausted every byte is in
    ``hasher``."""
    if isinstance(hasher, BodyMac):  # fast enough for the loop: each piece while in cache
        async for piece in pieces:
            yield piece
            hasher.update(piece)
        return
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[None] | None = None
    batch: list[memoryview] = []
    size = 0
    async for piece in pieces:
        yield piece
        batch.append(piece)
        size += len(piece)
        if size >= HASH_STEP:
            if pending is not None:
                await pending
            pending = loop.run_in_executor(None, _update, hasher, batch)
            batch, size = [], 0
    if pending is not None:
        await pending
    if batch:
        await loop.run_in_executor(None, _update, hasher, batch)


def trailer_line(
    cfg: HttpConfig, peer: str, head: dict[str, str], hasher: auth.BodyHasher | BodyMac
) -> bytes:
    """The signed trailer line of a bulk body to ``peer`` whose signed ``head`` deferred its
    digest (`auth.DEFERRED` or `auth.DEFERRED_MAC`): the head's routing headers, signed as
    method `auth.TRAILER` for the same receiver and incarnation with the digest (or MAC tag)
    of what ``hasher`` was fed."""
    trailer = {k: head[k] for k in auth.SIGNED_HEADERS if k in head}
    auth.sign(
        cfg.signer,
        auth.TRAILER,
        FRAME_PATH,
        trailer,
        auth.digest_of(hasher),
        clock=cfg.clock,
        key_id=cfg.key_id,
        receiver=peer,
        to=head.get(auth.TO, ""),
    )
    return orjson.dumps(trailer) + b"\n"


def _update(hasher: auth.BodyHasher, views: list[memoryview]) -> None:
    for v in views:
        hasher.update(v)
