"""The memory transport's link emulation keeps its configured bandwidth when timers fire late."""

import asyncio

import numpy as np
import pytest

import tandem.transports.memory as memory
from tandem.engine.testing import run_virtual
from tandem.transports import MemoryNetwork, codec
from tandem.transports.base import Frame


def shaped_pair(tx: float):
    """Endpoints ``a`` and ``b`` of a `MemoryNetwork` whose ``a -> b`` direction carries the
    returned frame in ``tx`` seconds."""
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    frame = Frame(meta={"m": 0}, arrays=(np.zeros(1000, np.float32),))
    size = codec.encoded_size(frame.replace(sender="a", channel="c", msg_id=0))
    net.shape("a", "b", bandwidth=size / tx)
    return a, b, frame


@pytest.mark.parametrize("late", [0.0, 0.002])
def test_back_to_back_frames_take_bytes_over_bandwidth_however_late_the_timers(monkeypatch, late):
    real_sleep = asyncio.sleep

    async def late_sleep(delay, result=None):  # every timer fires `late` seconds late
        return await real_sleep(delay + late if delay > 0 else delay, result)

    monkeypatch.setattr(memory.asyncio, "sleep", late_sleep)
    frames, tx = 10, 0.01

    async def main():
        a, b, frame = shaped_pair(tx)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(frames):
            await a.send("b", "c", frame)
        elapsed = loop.time() - t0
        got = [await b.recv("a", "c") for _ in range(frames)]
        return elapsed, len(got), a.sent_stats("b").busy_seconds

    elapsed, n, busy = run_virtual(main())
    assert n == frames
    assert busy == pytest.approx(frames * tx)
    # lateness is credited to the next frame: only the last frame's lateness remains
    assert elapsed == pytest.approx(frames * tx + late, abs=1e-9)


def test_frames_waiting_for_the_wire_follow_each_other_however_late_the_loop():
    """A frame offered while the wire is busy starts at the previous frame's ideal end, even when
    the loop handles other work (here: the receiver, taking ``hog`` seconds per frame) between
    that frame's timer and the next frame's turn: queued frames leave no idle wire."""
    frames, tx, hog = 6, 0.01, 0.004

    async def main():
        a, b, frame = shaped_pair(tx)
        loop = asyncio.get_running_loop()
        arrived = []

        async def receive():
            for _ in range(frames):
                await b.recv("a", "c")
                arrived.append(loop.time())
                loop._vsel.now += hog  # a callback that keeps the loop busy for `hog` s

        async with asyncio.TaskGroup() as tg:
            tg.create_task(receive())
            for _ in range(frames):  # every frame offered at once, as a send window does
                tg.create_task(a.send("b", "c", frame))
        return arrived

    arrived = run_virtual(main())
    # the receiver's work (hog < tx) fits inside the next frame's transmission
    assert arrived == pytest.approx([(k + 1) * tx for k in range(frames)], abs=1e-9)
