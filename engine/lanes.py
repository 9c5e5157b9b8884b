"""Compute lanes: where a party's kernels run.

`ThreadLane` runs each op on one dedicated worker thread, so the event loop keeps sending and
receiving while JAX computes. Its ``run`` is cancellation-safe: a cancelled caller still waits
for the op in flight to finish before the cancellation propagates, so no thread is left busy.
`VirtualLane` runs ops inline after sleeping a given cost; on a virtual clock it reproduces the
simulator's timing exactly (used by the simulator-vs-runtime tests and the overhead benchmark).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable, TypeVar

from .plan import Op

T = TypeVar("T")


class ThreadLane:
    """One worker thread. Use as ``async with ThreadLane(name) as lane``."""

    def __init__(self, name: str = "tandem-compute") -> None:
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def __aenter__(self) -> "ThreadLane":
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self._name)
        return self

    async def __aexit__(self, *exc) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            # nothing is in flight here (run() never returns early), so this does not block
            pool.shutdown(wait=True, cancel_futures=True)

    async def run(self, op: Op, fn: Callable[[], T]) -> T:
        if self._pool is None:
            raise RuntimeError("ThreadLane used outside 'async with'")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        cancelled = False
        while True:
            try:
                await asyncio.wait([fut])
                break
            except asyncio.CancelledError:
                cancelled = True  # finish the op in flight first: no thread left busy
        if cancelled:
            raise asyncio.CancelledError
        return fut.result()


class VirtualLane:
    """Sleeps ``cost(op)`` seconds on the event loop's clock, then runs ``fn`` inline."""

    def __init__(self, cost: Callable[[Op], float]) -> None:
        self._cost = cost

    async def __aenter__(self) -> "VirtualLane":
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def run(self, op: Op, fn: Callable[[], T]) -> T:
        await asyncio.sleep(self._cost(op))
        return fn()
