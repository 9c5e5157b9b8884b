"""One conformance suite for every `Transport` (the guarantees of `tandem.transports.base`).

Subclass `TransportConformance` and provide an async ``harness`` fixture yielding an object with:

* ``capacity``: the inbound capacity (frames per (peer, channel)) of the transports it makes;
* ``async pair() -> (a, b)``: two started transports named "a" and "b" that know each other;
* ``async restart(name) -> Transport``: after party ``name`` closed (was lost), a fresh transport
  with the same name and address, known to the other party as before.

The harness closes what it made. Tests never sleep to wait for a result: a short sleep is used
only to show that something does *not* happen (a blocked send stays blocked).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tandem.errors import TransportClosedError, UnknownPeerError
from tandem.transports import codec
from tandem.transports.base import Frame, Transport

SETTLE = 0.15  # seconds given to a send that must stay blocked


def frame(i: int, n: int = 3) -> Frame:
    return Frame(meta={"i": i, "tag": f"m{i}"}, arrays=(np.full(n, i, dtype=np.int64),))


def index(f: Frame) -> int:
    return int(f.meta["i"])


async def settled(task: asyncio.Task) -> bool:
    """True when ``task`` finishes within SETTLE seconds (used to show that it does not)."""
    done, _ = await asyncio.wait({task}, timeout=SETTLE)
    return bool(done)


async def _recv_after_a_pause(t, peer: str, channel: str, n: int) -> list[Frame]:
    await asyncio.sleep(0.05)  # let the senders fill the inbox and queue behind it
    return [await t.recv(peer, channel) for _ in range(n)]


class TransportConformance:
    async def test_implements_protocol(self, harness):
        a, b = await harness.pair()
        assert isinstance(a, Transport) and isinstance(b, Transport)
        assert (a.name, b.name) == ("a", "b")
        assert "b" in a.peers and "a" in b.peers

    async def test_fifo_per_channel_exactly_once(self, harness):
        a, b = await harness.pair()
        n = 2 * harness.capacity + 3

        async def producer():
            for i in range(n):
                await a.send("b", "ch", frame(i))

        async def consumer():
            return [await b.recv("a", "ch") for _ in range(n)]

        async with asyncio.TaskGroup() as tg:
            tg.create_task(producer())
            got = tg.create_task(consumer())
        frames = got.result()
        assert [index(f) for f in frames] == list(range(n))
        assert [f.msg_id for f in frames] == sorted({f.msg_id for f in frames})
        for i, f in enumerate(frames):
            assert f.sender == "a" and f.channel == "ch"
            np.testing.assert_array_equal(f.arrays[0], np.full(3, i, dtype=np.int64))
            assert f.meta == {"i": i, "tag": f"m{i}"}

    async def test_concurrent_sends_on_a_channel_arrive_in_call_order(self, harness):
        """Sends started one after another without awaiting each (the runtime's send window,
        `tandem.engine.runtime.SEND_DEPTH`) arrive in the order they were started, also while they
        wait for a full inbox."""
        a, b = await harness.pair()
        n = 2 * harness.capacity + 3
        async with asyncio.TaskGroup() as tg:
            for i in range(n):  # tasks start in creation order; none is awaited before the next
                tg.create_task(a.send("b", "ch", frame(i)))
            got = tg.create_task(_recv_after_a_pause(b, "a", "ch", n))
        assert [index(f) for f in got.result()] == list(range(n))

    async def test_dtypes_shapes_meta_roundtrip(self, harness):
        a, b = await harness.pair()
        arrays = (
            np.arange(12, dtype=np.float32).reshape(3, 4),
            np.array([], dtype=np.int8),
            np.array(True),
            np.arange(6, dtype=">i4"),
            np.ones((2, 0, 3), np.complex64),
            np.arange(10, dtype=np.float64)[::2],
        )
        sent = Frame(meta={"nested": {"x": [1, 2.5, "s"]}, "none": None}, arrays=arrays)
        await a.send("b", "mixed", sent)
        got = await b.recv("a", "mixed")
        assert got.meta == sent.meta
        assert len(got.arrays) == len(arrays)
        for x, y in zip(arrays, got.arrays, strict=True):
            assert y.shape == x.shape  # byte order may be normalised to little-endian:
            assert (y.dtype.kind, y.dtype.itemsize) == (x.dtype.kind, x.dtype.itemsize)
            np.testing.assert_array_equal(x, y)

    async def test_channels_are_independent(self, harness):
        a, b = await harness.pair()
        for i in range(harness.capacity):  # fill channel x; nobody reads it
            await a.send("b", "x", frame(i))
        blocked = asyncio.create_task(a.send("b", "x", frame(99)))
        assert not await settled(blocked)
        await a.send("b", "y", frame(7))  # y still flows while x is full
        assert index(await b.recv("a", "y")) == 7
        assert not blocked.done()
        assert index(await b.recv("a", "x")) == 0
        await blocked
        assert [index(await b.recv("a", "x")) for _ in range(harness.capacity)] == list(
            range(1, harness.capacity)
        ) + [99]

    async def test_full_duplex(self, harness):
        a, b = await harness.pair()
        n = harness.capacity * 2

        async def pump(src, dst, base):
            for i in range(n):
                await src.send(dst.name, "d", frame(base + i))

        async def drain(dst, src):
            return [index(await dst.recv(src.name, "d")) for _ in range(n)]

        async with asyncio.TaskGroup() as tg:
            tg.create_task(pump(a, b, 0))
            tg.create_task(pump(b, a, 1000))
            at_b = tg.create_task(drain(b, a))
            at_a = tg.create_task(drain(a, b))
        assert at_b.result() == list(range(n))
        assert at_a.result() == list(range(1000, 1000 + n))

    async def test_bounded_capacity_backpressure(self, harness):
        a, b = await harness.pair()
        cap = harness.capacity
        for i in range(cap):
            await a.send("b", "bp", frame(i))  # fits: never blocks
        extra = asyncio.create_task(a.send("b", "bp", frame(cap)))
        assert not await settled(extra), "send must wait while the peer's inbox is full"
        assert index(await b.recv("a", "bp")) == 0
        await extra  # a slot opened
        got = [index(await b.recv("a", "bp")) for _ in range(cap)]
        assert got == list(range(1, cap + 1))

    async def test_close_semantics(self, harness):
        a, b = await harness.pair()
        pending_recv = asyncio.create_task(a.recv("b", "c"))
        for i in range(harness.capacity):
            await a.send("b", "full", frame(i))
        pending_send = asyncio.create_task(a.send("b", "full", frame(-1)))
        assert not await settled(pending_recv) and not pending_send.done()
        await a.aclose()
        with pytest.raises(TransportClosedError):
            await pending_recv
        with pytest.raises(TransportClosedError):
            await pending_send
        with pytest.raises(TransportClosedError):
            await a.send("b", "c", frame(0))
        with pytest.raises(TransportClosedError):
            await a.recv("b", "c")
        await a.aclose()  # idempotent

    async def test_peer_loss(self, harness):
        a, b = await harness.pair()
        await b.send("a", "up", frame(1))
        await b.aclose()
        # frames sent before the loss are still delivered, then recv reports the loss
        assert index(await a.recv("b", "up")) == 1
        with pytest.raises(TransportClosedError):
            await asyncio.wait_for(a.recv("b", "up"), 10)
        with pytest.raises(TransportClosedError):
            await asyncio.wait_for(a.send("b", "down", frame(2)), 10)

    async def test_peer_loss_wakes_blocked_sender(self, harness):
        a, b = await harness.pair()
        for i in range(harness.capacity):
            await a.send("b", "full", frame(i))
        blocked = asyncio.create_task(a.send("b", "full", frame(-1)))
        assert not await settled(blocked)
        await b.aclose()
        with pytest.raises(TransportClosedError):
            await asyncio.wait_for(blocked, 10)

    async def test_reconnect_after_peer_loss(self, harness):
        a, b = await harness.pair()
        for i in range(3):
            await a.send("b", "ch", frame(i))
            await b.send("a", "ch", frame(100 + i))
        assert index(await b.recv("a", "ch")) == 0
        await b.aclose()
        b2 = await harness.restart("b")
        await a.send("b", "ch", frame(10))
        await b2.send("a", "ch", frame(110))
        # frames the lost party had received died with it; frames it sent remain, in order
        assert index(await b2.recv("a", "ch")) == 10
        assert [index(await a.recv("b", "ch")) for _ in range(4)] == [100, 101, 102, 110]

    async def test_cancel_recv_loses_nothing(self, harness):
        a, b = await harness.pair()
        waiting = asyncio.create_task(b.recv("a", "c"))
        assert not await settled(waiting)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await a.send("b", "c", frame(5))
        await a.send("b", "c", frame(6))
        assert [index(await b.recv("a", "c")) for _ in range(2)] == [5, 6]

    async def test_cancel_send_is_all_or_nothing(self, harness):
        a, b = await harness.pair()
        cap = harness.capacity
        for i in range(cap):
            await a.send("b", "c", frame(i))
        blocked = asyncio.create_task(a.send("b", "c", frame(-1)))
        assert not await settled(blocked)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await b.recv("a", "c")  # free a slot (the cancelled frame may take it)
        nxt = asyncio.create_task(a.send("b", "c", frame(cap)))
        got: list[int] = []
        while cap not in got:
            got.append(index(await b.recv("a", "c")))
        await nxt
        # the cancelled frame arrived whole, in its place, or not at all
        assert got in (list(range(1, cap + 1)), list(range(1, cap)) + [-1, cap]), got

    async def test_large_frames(self, harness):
        a, b = await harness.pair()
        rng = np.random.default_rng(0)
        big = rng.standard_normal(3 << 20 >> 2, dtype=np.float32).reshape(-1, 256)  # 3 MiB
        await a.send("b", "big", Frame(arrays=(big, np.arange(5))))
        got = await b.recv("a", "big")
        np.testing.assert_array_equal(got.arrays[0], big)
        np.testing.assert_array_equal(got.arrays[1], np.arange(5))

    async def test_unknown_peer(self, harness):
        a, b = await harness.pair()
        with pytest.raises(UnknownPeerError, match="nobody"):
            await a.send("nobody", "c", frame(0))
        with pytest.raises(UnknownPeerError, match="nobody"):
            await a.recv("nobody", "c")
        with pytest.raises(UnknownPeerError):
            await a.send("a", "c", frame(0))  # not its own peer

    async def test_byte_counters(self, harness):
        a, b = await harness.pair()
        assert a.sent_stats("b").frames == 0 and a.sent_stats("b").bandwidth() is None
        sizes = []
        for i, n in enumerate((1, 1000, 50_000)):
            f = frame(i, n)
            await a.send("b", "s", f)
            got = await b.recv("a", "s")
            sizes.append(codec.encoded_size(got))
        sent, received = a.sent_stats("b"), b.received_stats("a")
        assert sent.frames == received.frames == 3
        assert sent.bytes == received.bytes == sum(sizes)
        assert sent.busy_seconds >= 0 and received.busy_seconds >= 0
        assert b.sent_stats("a").frames == 0 and a.received_stats("b").frames == 0
