"""A bounded FIFO of received items, shared by the memory and the HTTP transports.

Invariant: ``len(items) + reserved <= capacity``. A producer first *reserves* a slot (waiting
while none is free), then either `Inbox.deliver`s an item into it or `Inbox.unreserve`s it; a
consumer takes items in order with `Inbox.get` (or looks at the first with `Inbox.peek` and
takes it with `Inbox.pop`). The buffer never grows past ``capacity``: a producer that finds no
slot waits, which is the transports' backpressure.

A closed inbox refuses new reservations; its queued items stay readable, and once it is empty
`get` and `peek` answer None. Closing wakes every waiter. Waiters wake in the order they
began to wait (producers queued for a slot keep their order). Cancelling a waiting `reserve`,
`peek` or `get` changes nothing (no slot taken, no item lost). Use it from one event loop.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: seconds within which a `wait_item` deadline counts as come: event loop timers may fire up
#: to a millisecond early (uvloop keeps milliseconds), and re-arming for less would spin
TIMER_SLACK = 1e-3


class Inbox(Generic[T]):
    """Bounded FIFO with slot reservation. See the module docstring for the invariant."""

    __slots__ = ("capacity", "items", "reserved", "closed", "on_take", "_waiters", "_timer")

    def __init__(
        self,
        capacity: int,
        *,
        closed: bool = False,
        on_take: Callable[[T], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"inbox capacity must be >= 1 item, got {capacity}")
        self.capacity = capacity
        self.items: collections.deque[T] = collections.deque()
        self.reserved = 0
        self.closed = closed
        self.on_take = on_take  # called with each item as a consumer takes it
        # insertion-ordered: waiters wake in the order they began waiting, so producers that
        # queue for a slot take slots in that order; the value is a `wait_item` waiter's
        # deadline (loop time), None for the others
        self._waiters: dict[asyncio.Future[Any], float | None] = {}
        # the one timer of the `wait_item` deadlines: armed for the earliest one or earlier,
        # re-armed when it fires (not one timer per wait: a busy channel waits per item)
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        """Items waiting to be taken (reserved slots not counted)."""
        return len(self.items)

    def has_slot(self) -> bool:
        return len(self.items) + self.reserved < self.capacity

    async def reserve(self, timeout: float | None = None) -> bool:
        """Take one slot, waiting up to ``timeout`` s for one to free (None: no limit).

        False, with no slot taken, on timeout or when the inbox is (or becomes) closed."""
        if self.has_slot() and not self.closed:  # the common case: no timer to arm
            self.reserved += 1
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._wait(lambda: self.has_slot() or self.closed)
        except TimeoutError:
            return False
        if self.closed:
            return False
        self.reserved += 1
        return True

    def try_reserve(self, keep_free: int = 0) -> bool:
        """Take one slot now if one is free with ``keep_free`` more slots left free after it
        (without waiting); False otherwise."""
        if self.closed:
            return False
        if len(self.items) + self.reserved + 1 + keep_free > self.capacity:
            return False
        self.reserved += 1
        return True

    def unreserve(self) -> None:
        """Give back a reserved slot that will not be filled."""
        self.reserved -= 1
        self._wake()

    def deliver(self, item: T) -> None:
        """Fill a reserved slot with ``item`` (queued behind the items already there)."""
        self.reserved -= 1
        self.items.append(item)
        self._wake()

    async def peek(self) -> T | None:
        """The first item, left in place; None once the inbox is closed and empty."""
        await self._wait(lambda: self.items or self.closed)
        return self.items[0] if self.items else None

    def pop(self) -> T:
        """Remove and return the first item (there must be one), freeing its slot."""
        item = self.items.popleft()
        if self.on_take is not None:
            self.on_take(item)
        self._wake()
        return item

    async def get(self) -> T | None:
        """Remove and return the first item; None once the inbox is closed and empty."""
        await self._wait(lambda: self.items or self.closed)
        return self.pop() if self.items else None

    async def wait_item(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until an item is queued or the inbox is closed; False when
        the time ran out first. Nothing is taken (`pop` takes the item), so cancelling it, or
        the time running out, loses nothing."""
        if self.items or self.closed:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (self.items or self.closed):
            # the inbox's timer answers the waiter (True) at its deadline: cheaper than a
            # timeout that cancels us, and than a timer of its own armed and cancelled per wait
            waiter: asyncio.Future[bool | None] = loop.create_future()
            self._waiters[waiter] = deadline
            timer = self._timer
            if timer is None or timer.when() > deadline:
                self._arm(loop, deadline)
            try:
                expired = await waiter
            finally:
                del self._waiters[waiter]
            if expired and not (self.items or self.closed):
                return False
        return True

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._expire_due, loop)

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: answer True to each `wait_item` waiter whose deadline has come, and
        re-arm for the earliest deadline still ahead (none: the timer rests)."""
        self._timer = None
        now, ahead = loop.time() + TIMER_SLACK, None
        for waiter, deadline in self._waiters.items():
            if deadline is None or waiter.done():
                continue
            if deadline <= now:
                waiter.set_result(True)
            elif ahead is None or deadline < ahead:
                ahead = deadline
        if ahead is not None:
            self._arm(loop, ahead)

    def close(self) -> None:
        """Refuse new reservations and wake every waiter; queued items stay readable."""
        self.closed = True
        self._wake()
        if self._timer is not None:  # the woken waiters return: no deadline is left to keep
            self._timer.cancel()
            self._timer = None

    def reopen(self) -> None:
        """Accept reservations again (a peer came back)."""
        self.closed = False

    async def _wait(self, ready: Callable[[], object]) -> None:
        while not ready():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[waiter] = None
            try:
                await waiter
            finally:
                del self._waiters[waiter]

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
