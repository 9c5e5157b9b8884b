"""`ByteBudget`: one bound on the inbound bytes a receiver holds, across all its streams.

A message takes its whole declared size from the budget when its first chunk is admitted (the
receive buffer is allocated then) and gives it back when it is dropped (refused, abandoned,
idle too long) or when the application takes the delivered frame (`recv`). A message that does
not fit waits (up to a timeout, in arrival order) for bytes to come back; the server then
answers 503 and the sender retries later.

Invariant: ``0 <= held <= capacity``. Use it from one event loop.
"""

from __future__ import annotations

import asyncio


class ByteBudget:
    """Bytes held against a fixed ``capacity``; see the module docstring."""

    __slots__ = ("capacity", "held", "peak", "_waiters")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"budget capacity must be >= 1 byte, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self.peak = 0  # the most bytes held at once (observability)
        # insertion-ordered: the waiter first in line is served first, so a large message is
        # not starved by a stream of small ones
        self._waiters: dict[asyncio.Future[None], int] = {}

    def fits(self, n: int) -> bool:
        return self.held + n <= self.capacity

    async def acquire(self, n: int, timeout: float) -> bool:
        """Take ``n`` bytes, waiting up to ``timeout`` s, behind earlier waiters; False (nothing
        taken) on timeout. Cancelling the wait takes nothing."""
        if n > self.capacity:
            return False
        if not self._waiters and self.fits(n):
            self._take(n)
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters[fut] = n
        granted = False
        try:
            async with asyncio.timeout(timeout):
                await fut
            granted = True
        except TimeoutError:
            pass
        finally:
            del self._waiters[fut]
            if not granted:
                if fut.done() and not fut.cancelled():
                    self.held -= n  # served just as the wait ended: give the bytes back
                else:
                    fut.cancel()
                self._wake()  # a later waiter may fit now that this one left the line
        return granted

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes now if they fit and nobody waits; False (nothing taken) otherwise."""
        if self._waiters or not self.fits(n):
            return False
        self._take(n)
        return True

    def release(self, n: int) -> None:
        """Give back ``n`` bytes taken by `acquire`."""
        self.held -= n
        self._wake()

    def _take(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def _wake(self) -> None:
        """Serve waiters in order while the first one fits (its bytes are taken for it)."""
        for fut, n in self._waiters.items():
            if fut.done():
                continue
            if not self.fits(n):
                break
            self._take(n)
            fut.set_result(None)
