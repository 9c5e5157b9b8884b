"""Messages above 2 GiB: one uint8 array of 2**31 + 12345 bytes crosses each transport intact.

Memory: the sender's array and the receiver's buffer (about 2 GiB each) plus one 64 MiB pattern
block; the content is checked block by block against the pattern (no third copy). The pattern
repeats every ``_PERIOD`` bytes, a length coprime with the chunk size, so a chunk written at a
wrong offset, dropped or repeated shows up as a mismatch.
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.errors import PayloadTooLargeError
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig, HttpTransport
from tandem.transports.memory import MemoryNetwork

pytestmark = pytest.mark.slow

SIZE = 2**31 + 12345
_PERIOD = (64 << 20) + 7  # not a multiple of any power-of-two chunk size
_BLOCK = 64 << 20


def _pattern() -> np.ndarray:
    return np.random.default_rng(20261122).integers(0, 256, _PERIOD, dtype=np.uint8)


def _make(pattern: np.ndarray) -> np.ndarray:
    a = np.empty(SIZE, np.uint8)
    for start in range(0, SIZE, _PERIOD):
        n = min(_PERIOD, SIZE - start)
        a[start : start + n] = pattern[:n]
    return a


def _check(got: np.ndarray, pattern: np.ndarray) -> None:
    assert got.dtype == np.uint8 and got.shape == (SIZE,)
    same = np.empty(_BLOCK, np.bool_)  # one comparison buffer for every block (no 64 MiB
    # temporary mapped and faulted in afresh per block: 2 GiB of page faults in all)

    def equal(a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.equal(a, b, out=same[: a.size]).all())

    for start in range(0, SIZE, _BLOCK):
        end = min(start + _BLOCK, SIZE)
        pos = start % _PERIOD
        first = min(end - start, _PERIOD - pos)  # the block may wrap around the period once
        ok = equal(got[start : start + first], pattern[pos : pos + first])
        if first < end - start:
            ok = ok and equal(got[start + first : end], pattern[: end - start - first])
        assert ok, f"bytes [{start}, {end}) differ from what was sent"


async def test_http_frame_above_2_gib_arrives_intact():
    pattern = _pattern()
    big = _make(pattern)
    limit = SIZE + (1 << 20)  # the default max_frame_bytes (2 GiB) would refuse it with 413
    async with (
        HttpTransport(
            HttpConfig(name="rx", max_frame_bytes=limit, peers={"tx": "http://127.0.0.1:9"})
        ) as rx,
        HttpTransport(HttpConfig(name="tx", peers={"rx": "http://127.0.0.1:9"})) as tx,
    ):
        rx.add_peer("tx", tx.url)
        tx.add_peer("rx", rx.url)
        async with HttpTransport(HttpConfig(name="rx", peers={"tx": tx.url})) as strict:
            tx.add_peer("strict", strict.url)
            # the first chunk announces the total, so the refusal comes before 2 GiB travel
            with pytest.raises(PayloadTooLargeError, match="max_frame_bytes"):
                await tx.send("strict", "big", Frame(arrays=(big,)))
        await tx.send("rx", "big", Frame(meta={"n": SIZE}, arrays=(big,)))
        del big  # the receiver's buffer is the only full copy from here on
        got = await rx.recv("tx", "big")
        assert got.meta == {"n": SIZE}
        _check(got.arrays[0], pattern)
        assert rx.received_stats("tx").bytes > SIZE
        assert rx.received_stats("tx").frames == 1
        del got


async def test_memory_frame_above_2_gib_arrives_intact():
    pattern = _pattern()
    big = _make(pattern)
    net = MemoryNetwork(copy=False)  # copy=True would hold a second 2 GiB copy; same code path
    tx, rx = net.endpoint("tx"), net.endpoint("rx")
    await tx.send("rx", "big", Frame(arrays=(big,)))
    del big
    got = await rx.recv("tx", "big")
    _check(got.arrays[0], pattern)
    assert tx.sent_stats("rx").bytes > SIZE
