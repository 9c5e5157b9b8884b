"""Testing utilities: a virtual-clock event loop, like trio's ``MockClock(autojump)``.

`VirtualClockLoop` never sleeps: when every task waits and a timer is pending, the clock jumps
to that timer. If every task waits and *no* timer is pending, the program could never progress,
so the loop raises `Deadlock` instead of hanging. Use it with `VirtualLane` (threads would run
in real time): ``run_virtual(main())``. This is for tests and simulations only; the library
itself never creates an event loop.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable
from typing import TypeVar

from tandem.errors import EngineError

T = TypeVar("T")


class Deadlock(EngineError):
    """Every task waits and nothing is scheduled: the program can never progress."""


class _VirtualSelector(selectors.BaseSelector):
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self.now = 0.0

    def register(self, fileobj, events, data=None):
        return self._sel.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._sel.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._sel.modify(fileobj, events, data)

    def get_key(self, fileobj):
        return self._sel.get_key(fileobj)

    def get_map(self):
        return self._sel.get_map()

    def close(self) -> None:
        self._sel.close()

    def select(self, timeout=None):
        events = self._sel.select(0)
        if events:
            return events
        if timeout is None:
            raise Deadlock("deadlock: every task is waiting and no timer is pending")
        if timeout > 0:
            self.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual and jumps to the next timer when idle."""

    def __init__(self) -> None:
        self._vsel = _VirtualSelector()
        super().__init__(selector=self._vsel)

    def time(self) -> float:
        return self._vsel.now


def run_virtual(main: Awaitable[T]) -> T:
    """Run ``main`` to completion on a fresh `VirtualClockLoop` and close it."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
