"""The HTTP transport's send window: several messages of one (peer, channel) in flight, delivered
strictly in id order, exactly once, through out-of-order arrival, a full reorder buffer, a lost
connection and a cancelled send."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from hostile_helpers import SECRET, frame_request, post
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig, HttpTransport

CH = "c"


def config(name: str, **kw) -> HttpConfig:
    kw.setdefault("secret", SECRET)
    return HttpConfig(name, **kw)


def raw(b: HttpTransport, msg_id: int, base: int, inc: str = "raw-1") -> tuple[dict, bytes]:
    """A signed one-chunk request from ``a`` (process ``inc``) to ``b`` carrying ``msg_id``."""
    return frame_request(
        receiver="b",
        to=b.incarnation,
        sender="a",
        sender_inc=inc,
        channel=CH,
        msg_id=msg_id,
        frame=Frame(meta={"i": msg_id}, arrays=(np.full(4, msg_id, np.float32),)),
        base=base,
    )


def queued(b: HttpTransport) -> list[int]:
    """The ids of the frames from ``a`` waiting in ``b``'s inbox, in order."""
    box = b._server.inboxes.get(("a", CH))
    return [f.meta["i"] for f in box.items] if box is not None else []


async def held(b: HttpTransport, msg_id: int) -> None:
    """Until ``b`` holds complete message ``msg_id`` from ``a`` in its reorder buffer."""
    while msg_id not in getattr(b._server.streams.get(("a", CH)), "ready", {}):
        await asyncio.sleep(0.005)


def test_send_window_is_validated():
    for bad in (0, 257, 2.5):
        with pytest.raises(ValueError, match="send_window"):
            HttpConfig("a", send_window=bad)


async def test_a_message_arriving_early_waits_for_the_one_before_it(http_pair):
    # a long backpressure_wait: the held message must still be waiting when 0 arrives, however
    # slowly a loaded machine runs this test
    a, b = await http_pair(config, b_kw={"backpressure_wait": 30.0})
    async with aiohttp.ClientSession() as s:
        early = asyncio.create_task(post(s, b.url, *raw(b, 1, base=0)))
        await held(b, 1)
        assert not early.done()  # held in the reorder buffer: not delivered, not answered
        assert queued(b) == []
        assert await post(s, b.url, *raw(b, 0, base=0)) == (200, "ok")
        assert await early == (200, "ok")
    assert queued(b) == [0, 1]
    got = [(await b.recv("a", CH)).meta["i"] for _ in range(2)]
    assert got == [0, 1]


async def test_the_reorder_buffer_holds_at_most_the_window(http_pair):
    a, b = await http_pair(config, b_kw={"send_window": 2, "backpressure_wait": 0.2})
    async with aiohttp.ClientSession() as s:
        status, text = await post(s, b.url, *raw(b, 2, base=0))  # 2 ids ahead of 0
        assert status == 503 and "send_window=2" in text
        status, _ = await post(s, b.url, *raw(b, 1, base=0))  # held, then "wait and retry"
        assert status == 503
        assert b.refused.get("ahead", 0) >= 1
        assert queued(b) == []
        assert await post(s, b.url, *raw(b, 0, base=0)) == (200, "ok")
        assert queued(b) == [0, 1]  # 1 was kept: its retry needs no body
        assert await post(s, b.url, *raw(b, 1, base=0)) == (200, "duplicate")
        assert await post(s, b.url, *raw(b, 2, base=0)) == (200, "ok")
    assert queued(b) == [0, 1, 2]


async def test_inbox_slots_are_kept_for_the_messages_before(http_pair):
    """With room for two frames, a message two ahead may not take the last free slot: the
    message before it would find none and the stream would stall."""
    a, b = await http_pair(config, b_kw={"capacity": 2, "backpressure_wait": 0.2})
    async with aiohttp.ClientSession() as s:
        status, text = await post(s, b.url, *raw(b, 2, base=0))
        assert status == 503 and "kept for the messages before" in text
        one = asyncio.create_task(post(s, b.url, *raw(b, 1, base=0)))
        await held(b, 1)
        assert await post(s, b.url, *raw(b, 0, base=0)) == (200, "ok")
        assert await one == (200, "ok")
    assert queued(b) == [0, 1]


async def test_a_message_resent_after_its_connection_was_lost_is_delivered_once(http_pair):
    a, b = await http_pair(config)
    headers, body = raw(b, 1, base=0)
    async with aiohttp.ClientSession() as s:
        lost = asyncio.create_task(post(s, b.url, headers, body))
        await held(b, 1)  # body in, waiting for message 0
        lost.cancel()  # the connection closes while the receiver holds the message
        with pytest.raises(asyncio.CancelledError):
            await lost
        assert await post(s, b.url, *raw(b, 0, base=0)) == (200, "ok")
        assert queued(b) == [0, 1]  # delivered in order though nobody waited for its answer
        assert await post(s, b.url, *raw(b, 1, base=0)) == (200, "duplicate")
        assert await post(s, b.url, *raw(b, 0, base=0)) == (200, "duplicate")
    assert queued(b) == [0, 1]


async def test_a_sender_restarted_mid_window_starts_a_fresh_stream(http_pair):
    a, b = await http_pair(config)
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, b.url, *raw(b, 1, base=0, inc="raw-1")))
        await held(b, 1)
        assert await post(s, b.url, *raw(b, 5, base=5, inc="raw-2")) == (200, "ok")
        status, _ = await first
        assert status == 410  # its incarnation was replaced: the held message is dropped
    assert queued(b) == [5]
    assert b._server.budget.held == b._server.held[("a", CH)][0]  # only the delivered frame


async def test_concurrent_sends_arrive_in_order_exactly_once(http_pair):
    a, b = await http_pair(config, a_kw={"shape_latency": 0.02})
    n = 24

    async def one(i: int) -> None:
        await a.send("b", CH, Frame(meta={"i": i}, arrays=(np.full(8, i, np.float32),)))

    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(one(i))
    got = [(await b.recv("a", CH)).meta["i"] for _ in range(n)]
    assert got == list(range(n))
    assert queued(b) == []
    stream = b._server.streams[("a", CH)]
    assert stream.next_id == n and not stream.ready and not stream.partials


async def test_a_send_cancelled_mid_window_is_skipped_and_the_rest_keep_order(http_pair):
    a, b = await http_pair(config, a_kw={"shape_latency": 0.5}, b_kw={"backpressure_wait": 0.2})
    sends = [
        asyncio.create_task(a.send("b", CH, Frame(meta={"i": i}, arrays=(np.zeros(4),))))
        for i in range(5)
    ]
    await asyncio.sleep(0)  # every send took its id and waits out the link's latency
    sends[2].cancel()
    done = await asyncio.gather(*sends, return_exceptions=True)
    assert isinstance(done[2], asyncio.CancelledError)
    assert [d for i, d in enumerate(done) if i != 2] == [None] * 4
    got = [(await b.recv("a", CH)).meta["i"] for _ in range(4)]
    assert got == [0, 1, 3, 4]
    assert queued(b) == []
    assert b._server.streams[("a", CH)].next_id == 5


async def test_a_chunked_message_goes_alone_and_keeps_its_place(http_pair):
    a, b = await http_pair(config, a_kw={"chunk_bytes": 1000, "shape_latency": 0.01})
    sizes = [10, 2000, 10, 3000, 10]

    async def one(i: int) -> None:
        x = np.full(sizes[i], i, np.uint8)
        await a.send("b", CH, Frame(meta={"i": i}, arrays=(x,)))

    async with asyncio.TaskGroup() as tg:
        for i in range(len(sizes)):
            tg.create_task(one(i))
    for i, size in enumerate(sizes):
        f = await b.recv("a", CH)
        assert f.meta["i"] == i and f.arrays[0].shape == (size,) and (f.arrays[0] == i).all()


async def test_bodies_of_one_stream_take_the_wire_one_after_the_other():
    from tandem.transports.http.sendorder import WireTurn as _WireTurn

    lock = asyncio.Lock()
    order: list[str] = []

    async def pieces(tag: str):
        for i in range(3):
            order.append(f"{tag}{i}")
            yield memoryview(b"x")

    first, second = _WireTurn(lock), _WireTurn(lock)
    a, b = first.hold(pieces("a")), second.hold(pieces("b"))
    await anext(a)  # the first body took the wire
    b_first = asyncio.create_task(anext(b))
    await asyncio.sleep(0)
    assert not b_first.done()  # the second waits for the wire
    async for _ in a:
        pass
    await b_first
    assert order == ["a0", "a1", "a2", "b0"]
    second.end()  # the attempt ended mid-body: the wire is free again
    assert not lock.locked()
    late = _WireTurn(lock)
    late.end()  # an attempt that ended before its first piece never takes the wire
    assert [p async for p in late.hold(pieces("c"))] == [] and not lock.locked()
