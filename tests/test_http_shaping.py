"""`HttpConfig.shape_bandwidth` / `shape_latency`: in-transport link emulation on loopback.

Only lower bounds on time are asserted (pacing can never make a transfer faster than the
configured rate); upper bounds would depend on the machine's load."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig


async def shaped_pair(http_pair, **shape):
    """``(tx, rx)``: ``tx`` shapes what it sends to ``rx`` with ``shape``."""
    rx, tx = await http_pair(b_kw={"write_piece_bytes": 1 << 16, **shape}, names=("rx", "tx"))
    return tx, rx


async def test_bandwidth_is_shared_by_all_channels_to_a_peer(http_pair):
    tx, rx = await shaped_pair(http_pair, shape_bandwidth=4e6)
    payload = np.arange(100_000, dtype=np.float32)  # 400 kB per frame, 0.1 s at 4 MB/s
    t0 = time.perf_counter()
    await asyncio.gather(*(tx.send("rx", f"c{i}", Frame(arrays=(payload,))) for i in range(3)))
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.9 * 3 * payload.nbytes / 4e6  # one wire, not one per channel
    for i in range(3):
        np.testing.assert_array_equal((await rx.recv("tx", f"c{i}")).arrays[0], payload)


async def test_latency_is_paid_per_request(http_pair):
    tx, rx = await shaped_pair(http_pair, shape_latency=0.05)
    t0 = time.perf_counter()
    for i in range(3):
        await tx.send("rx", "c", Frame(meta={"i": i}))
    assert time.perf_counter() - t0 >= 0.9 * 3 * 0.05
    assert [(await rx.recv("tx", "c")).meta["i"] for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("bad", [{"shape_bandwidth": 0}, {"shape_latency": -1.0}])
def test_bad_shape_is_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        HttpConfig(name="x", **bad)
