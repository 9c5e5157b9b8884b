"""Awaiting a party's work under a stop event: what `tandem.parties.split.process.standalone` runs
its negotiation and training through.

`until` abandons work once ``stop`` is set; `with_grace` gives it ``grace`` seconds more;
`unwrap` turns a task group's lone exception back into itself; `leaf` finds an exception of
a kind inside nested exception groups. None of them creates an event loop; every task they
start has a parent `asyncio.TaskGroup` and is cancelled or done when they return.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def leaf(err: BaseException, kind: type) -> BaseException | None:
    """The first exception of type ``kind`` in ``err`` or its (nested) exception groups."""
    if isinstance(err, kind):
        return err
    if isinstance(err, BaseExceptionGroup):
        for sub in err.exceptions:
            if (found := leaf(sub, kind)) is not None:
                return found
    return None


async def until(stop: asyncio.Event, coro: Coroutine[Any, Any, T]) -> T | None:
    """Await ``coro`` unless ``stop`` is set first (then cancel it and return None)."""
    with unwrap():
        async with asyncio.TaskGroup() as tg:
            work = tg.create_task(coro)
            waiter = tg.create_task(stop.wait())
            await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not work.done():
                work.cancel()
    return None if work.cancelled() else work.result()


async def with_grace(
    stop: asyncio.Event,
    grace: float,
    main: Coroutine[Any, Any, Any],
    helpers: list[Coroutine[Any, Any, Any]],
) -> bool:
    """Run ``main`` with ``helpers`` beside it (cancelled when it ends); once ``stop`` is set,
    ``main`` gets ``grace`` seconds before it is cancelled. True if it finished by itself;
    its exception, if any, propagates."""

    async def deadline(task: asyncio.Task) -> None:
        await stop.wait()
        await asyncio.sleep(grace)
        task.cancel()

    with unwrap():
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(main)
            others = [tg.create_task(h) for h in helpers]
            others.append(tg.create_task(deadline(task)))
            try:
                await asyncio.wait({task})
            finally:
                for t in others:
                    t.cancel()
    return not task.cancelled()


@contextlib.contextmanager
def unwrap() -> Iterator[None]:
    """Re-raise a task group's lone exception as itself (callers see `NegotiationError`,
    `TransportClosedError`, ... rather than an ExceptionGroup); several stay grouped."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise


__all__ = ["until", "with_grace", "unwrap", "leaf"]
