"""Compute lanes: where a party's kernels run.

`ThreadLane` runs each op on one dedicated worker thread, so the event loop keeps sending and
receiving while JAX computes. Its ``run`` is cancellation-safe: a cancelled caller still waits
for the op in flight to finish before the cancellation propagates, so no thread is left busy.
`VirtualLane` runs ops inline after sleeping a given cost; on a virtual clock it reproduces the
simulator's timing exactly (used by the simulator-vs-runtime tests and the overhead benchmark).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from .plan import Op

T = TypeVar("T")


class _Job:
    """One op handed to a `ThreadLane`'s thread. ``finished`` is set (on the loop thread) once
    ``fn`` returned or raised; ``waiter`` lets a cancelled caller wait for that."""

    __slots__ = ("fn", "fut", "finished", "waiter", "result", "error")

    def __init__(self, fn: Callable[[], T], fut: asyncio.Future) -> None:
        self.fn, self.fut = fn, fut
        self.finished = False
        self.waiter: asyncio.Future | None = None
        self.result = self.error = None


def _resolve(job: _Job) -> None:  # on the loop thread
    job.finished = True
    if not job.fut.done():
        if job.error is not None:
            job.fut.set_exception(job.error)
        else:
            job.fut.set_result(job.result)
    if job.waiter is not None and not job.waiter.done():
        job.waiter.set_result(None)


class ThreadLane:
    """One dedicated worker thread fed by a `queue.SimpleQueue`. Use as
    ``async with ThreadLane(name) as lane``.

    A hand-off costs one queue put and one ``call_soon_threadsafe``: two thread wake-ups, which
    on a busy machine cost more than the engine's bookkeeping of an op. So the runtime hands a
    ThreadLane a whole batch's compute loop at once (``drives_batches``; see
    `tandem.engine.runtime.PartyRuntime`): the thread picks its next op itself, and sleeps only when
    no op is ready.
    """

    #: the runtime may run a batch's whole compute loop as one job on this lane
    drives_batches = True

    def __init__(self, name: str = "tandem-compute") -> None:
        self._name = name
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    async def __aenter__(self) -> ThreadLane:
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._work,
            args=(self._queue, asyncio.get_running_loop()),
            name=self._name,
            daemon=True,
        )
        self._thread.start()
        return self

    async def __aexit__(self, *exc) -> None:
        q, thread = self._queue, self._thread
        self._queue = self._thread = None
        if q is not None and thread is not None:
            # nothing is in flight here (run() never returns early), so this does not block
            q.put(None)
            thread.join()

    @staticmethod
    def _work(q: queue.SimpleQueue, loop: asyncio.AbstractEventLoop) -> None:
        while (job := q.get()) is not None:
            try:
                job.result = job.fn()
            except BaseException as e:  # handed to the caller, re-raised there
                job.error = e
            job.fn = None
            try:
                loop.call_soon_threadsafe(_resolve, job)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    async def run(
        self, op: Op | None, fn: Callable[[], T], *, on_cancel: Callable[[], None] | None = None
    ) -> T:
        """Run ``fn`` on the lane's thread; return its result or raise its exception.

        If the caller is cancelled, ``on_cancel`` (if given) is called on the loop thread, e.g.
        to ask a long ``fn`` to return early; then the cancellation waits for ``fn`` to finish,
        so no thread is left busy."""
        if self._queue is None:
            raise RuntimeError("ThreadLane used outside 'async with'")
        job = _Job(fn, asyncio.get_running_loop().create_future())
        self._queue.put(job)
        try:
            return await job.fut
        except asyncio.CancelledError:
            if on_cancel is not None and not job.finished:
                on_cancel()
            while not job.finished:  # finish the op in flight first: no thread left busy
                job.waiter = asyncio.get_running_loop().create_future()
                try:
                    await job.waiter
                except asyncio.CancelledError:
                    pass
            raise


class VirtualLane:
    """Sleeps ``cost(op)`` seconds on the event loop's clock, then runs ``fn`` inline."""

    drives_batches = False

    def __init__(self, cost: Callable[[Op], float]) -> None:
        self._cost = cost

    async def __aenter__(self) -> VirtualLane:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def run(self, op: Op, fn: Callable[[], T]) -> T:
        await asyncio.sleep(self._cost(op))
        return fn()
