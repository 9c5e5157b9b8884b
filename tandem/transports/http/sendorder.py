"""The order of a sender's messages on one (peer, channel): ids in call order with at most
``send_window`` unsettled (`OutStream`), and one request body at a time on the way out
(`WireTurn`). Pure asyncio bookkeeping: no I/O."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class OutStream:
    """Sending state of one (peer, channel): ids in call order, at most ``window`` unsettled.

    Invariant: ``pending`` holds the ids assigned and not yet settled (acknowledged, refused
    or abandoned); a message starts only when its id is below ``min(pending) + window``, it
    is not chunked or is the lowest pending id, and no chunked message before it is pending.
    """

    __slots__ = ("next_id", "pending", "chunked", "wire", "_waiters")

    def __init__(self) -> None:
        self.wire = asyncio.Lock()  # one request body at a time on the way out (`WireTurn`)
        self.next_id = 0
        self.pending: set[int] = set()
        self.chunked: set[int] = set()  # pending ids of messages of several chunks
        self._waiters: list[asyncio.Future[None]] = []

    def assign(self, chunked: bool) -> int:
        msg_id = self.next_id
        self.next_id += 1  # consumed even if this send fails or is cancelled (a gap)
        self.pending.add(msg_id)
        if chunked:
            self.chunked.add(msg_id)
        return msg_id

    def base(self) -> int:
        """The lowest unsettled id (every id below it was acknowledged or abandoned)."""
        return min(self.pending, default=self.next_id)

    def may_start(self, msg_id: int, window: int) -> bool:
        base = self.base()
        if msg_id - base >= window:
            return False
        chunked = self.chunked
        if not chunked:
            return True
        if msg_id in chunked:
            return msg_id == base
        return not any(k < msg_id for k in chunked)

    async def turn(self, msg_id: int, window: int) -> None:
        """Wait until ``msg_id`` may start (see the invariant)."""
        loop = asyncio.get_running_loop()
        while not self.may_start(msg_id, window):
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                self._waiters.remove(fut)

    def settle(self, msg_id: int) -> None:
        self.pending.discard(msg_id)
        self.chunked.discard(msg_id)
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)


class WireTurn:
    """One attempt's turn to write its body on its stream's wire: taken when the body's first
    piece is asked for, given back after its last one, or when the attempt ends (whichever
    comes first). Bodies of one stream thus leave one after the other, in the order their
    requests reach the socket, while their answers are awaited together: a window keeps the
    wire busy without splitting it between messages (the first one finishes first)."""

    __slots__ = ("lock", "held", "over")

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock
        self.held = False
        self.over = False  # the attempt ended: a late first piece must not take the wire

    async def hold(self, pieces: AsyncIterator[memoryview]) -> AsyncIterator[memoryview]:
        await self.lock.acquire()
        self.held = True
        try:
            if self.over:
                return
            async for piece in pieces:
                yield piece
        finally:
            self.release()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.lock.release()

    def end(self) -> None:
        self.over = True
        self.release()
