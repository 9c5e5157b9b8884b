"""The body of an outgoing request as socket writes: pieces handed over one at a time, paced
by an emulated wire (link shaping), each pushing the attempt's watchdog."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from ..shaping import LinkShaper


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
