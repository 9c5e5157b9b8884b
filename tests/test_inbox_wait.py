"""`Inbox.wait_item`: waits for an item (or the close) up to a time limit, takes nothing, and
leaves no waiter behind however it ends."""

from __future__ import annotations

import asyncio

import pytest

from tandem.transports.inbox import Inbox


def _filled(*items: int) -> Inbox[int]:
    box: Inbox[int] = Inbox(4)
    for item in items:
        assert box.try_reserve()
        box.deliver(item)
    return box


async def test_an_item_already_queued_answers_at_once_and_stays_queued():
    box = _filled(7)
    assert await box.wait_item(0)
    assert list(box.items) == [7]


async def test_running_out_of_time_answers_false_and_takes_nothing():
    box: Inbox[int] = Inbox(2)
    assert box.try_reserve()
    assert not await box.wait_item(0.01)
    assert len(box) == 0 and box.reserved == 1 and not box._waiters


async def test_an_item_delivered_meanwhile_wakes_it_and_is_left_for_pop():
    box: Inbox[int] = Inbox(2)
    assert box.try_reserve()
    waiting = asyncio.ensure_future(box.wait_item(60))
    await asyncio.sleep(0)
    assert not waiting.done()
    box.deliver(3)
    assert await waiting
    assert box.pop() == 3 and not box._waiters


async def test_the_close_wakes_it_with_nothing_to_take():
    box: Inbox[int] = Inbox(2)
    waiting = asyncio.ensure_future(box.wait_item(60))
    await asyncio.sleep(0)
    box.close()
    assert await waiting
    assert len(box) == 0 and await box.get() is None


async def test_cancelling_it_loses_nothing_and_leaves_no_waiter():
    box: Inbox[int] = Inbox(2)
    waiting = asyncio.ensure_future(box.wait_item(60))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not box._waiters
    assert box.try_reserve()
    box.deliver(5)
    assert await box.wait_item(0) and box.pop() == 5


async def test_a_wake_without_an_item_keeps_waiting_until_the_same_deadline():
    box: Inbox[int] = Inbox(2)
    assert box.try_reserve()
    waiting = asyncio.ensure_future(box.wait_item(0.05))
    await asyncio.sleep(0)
    box.unreserve()  # wakes the waiters; still no item
    assert not await waiting
    assert not box._waiters


async def test_waits_answered_by_items_share_one_timer():
    """A channel that waits once per item arms no timer per wait: the deadline timer armed by
    the first wait serves the later ones (their deadlines are later)."""
    box: Inbox[int] = Inbox(2)
    timers = set()
    for i in range(20):
        assert box.try_reserve()
        waiting = asyncio.ensure_future(box.wait_item(30))
        await asyncio.sleep(0)
        timers.add(id(box._timer))
        box.deliver(i)
        assert await waiting and box.pop() == i
    assert len(timers) == 1 and box._timer is not None
    box.close()
    assert box._timer is None


async def test_a_shorter_wait_after_a_longer_one_runs_out_on_its_own_deadline():
    box: Inbox[int] = Inbox(2)
    loop = asyncio.get_running_loop()
    long_wait = asyncio.ensure_future(box.wait_item(60))
    await asyncio.sleep(0)
    start = loop.time()
    assert not await box.wait_item(0.02)
    assert loop.time() - start < 1.0
    assert not long_wait.done()
    # the timer rests on the long wait's deadline now
    assert box._timer is not None and box._timer.when() > loop.time() + 50
    box.close()
    assert await long_wait
