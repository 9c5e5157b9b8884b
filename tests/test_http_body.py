"""The HTTP receiver's body path (`HttpTransport._read_into`, `_BodyJob`, `_FiniteScan`): the
worker thread that copies, hashes and NaN/Inf-checks large bodies keeps every guarantee."""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading

import aiohttp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from transports import auth, codec
from transports.base import Frame
from transports.errors import FrameError
from transports.http import (_BATCH_BYTES, _HELD_BYTES, _INLINE_BYTES, FRAME_PATH, HttpConfig,
                             HttpTransport, _FiniteScan)
from transports.inbound import Partial

from test_http_security import cfg, pair, signed

MiB = 1 << 20


class _Content:
    """A stand-in for aiohttp's StreamReader: hands out ``body`` in ``step``-byte chunks; after
    ``stall_after`` bytes it waits forever (a sender that stopped mid-body)."""

    def __init__(self, body: bytes, step: int, stall_after: int | None = None) -> None:
        self.body, self.step, self.stall_after = body, step, stall_after
        self.pos = 0
        self.stalled = asyncio.Event()
        self.on_read = lambda pos: None

    async def readchunk(self) -> tuple[bytes, bool]:
        if self.stall_after is not None and self.pos >= self.stall_after:
            self.stalled.set()
            await asyncio.Event().wait()
        data = self.body[self.pos:self.pos + self.step]
        self.pos += len(data)
        self.on_read(self.pos)
        return data, False


class _Request:
    def __init__(self, content: _Content) -> None:
        self.content = content


class _GatedHasher:
    """A SHA-256 whose ``update`` (run by the worker thread) can be held back by the test."""

    def __init__(self) -> None:
        self.inner = hashlib.sha256()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fed = 0

    def update(self, data) -> None:
        self.entered.set()
        self.gate.wait()
        self.inner.update(data)
        self.fed += len(data)


def _encoded(*arrays) -> bytes:
    return codec.encode(Frame(arrays=arrays).replace(sender="a", channel="c", msg_id=0))


async def test_read_into_copies_and_hashes_every_byte_in_order():
    body = np.random.default_rng(1).integers(0, 256, 5 * MiB + 12345, np.uint8).tobytes()
    t = HttpTransport(HttpConfig(name="rx"))
    for step in (1000, 256 << 10, 3 * MiB):
        part = Partial(0, 1, len(body))
        hasher = hashlib.sha256()
        await t._read_into(_Request(_Content(body, step)), part, 0, len(body), hasher)
        assert bytes(part.buffer) == body
        assert hasher.hexdigest() == hashlib.sha256(body).hexdigest()
        assert t._body_jobs == 0


@pytest.mark.parametrize("waiting_on", ["socket", "worker"])
async def test_cancelled_mid_body_leaves_no_worker_job_and_drops_the_rest(waiting_on):
    """Cancelling the request while the worker is busy, with the reader waiting for more body
    (``socket``) or for the worker (``worker``, backpressure): the reader waits for the running
    job (which stops at its next chunk), drops the bytes not yet handed over, and returns with
    no job in flight; the thread writes nothing afterwards."""
    body = bytes(range(256)) * (40 * MiB // 256)
    t = HttpTransport(HttpConfig(name="rx"))
    part = Partial(0, 1, len(body))
    hasher = _GatedHasher()
    content = _Content(body, 256 << 10, stall_after=4 * MiB if waiting_on == "socket" else None)
    task = asyncio.ensure_future(t._read_into(_Request(content), part, 0, len(body), hasher))
    await asyncio.to_thread(hasher.entered.wait)  # a job is running, blocked in the hasher
    if waiting_on == "socket":
        await content.stalled.wait()  # the reader holds what the worker has not taken yet
    else:
        for _ in range(5):
            await asyncio.sleep(0)
        assert content.pos >= _HELD_BYTES and not task.done()
    assert t._body_jobs == 1
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()  # it waits for the thread rather than leave it writing
    hasher.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert t._body_jobs == 0
    fed = hasher.fed
    assert fed == _BATCH_BYTES  # the running job's bytes; the 3 MiB held were dropped
    await asyncio.sleep(0.01)
    assert hasher.fed == fed


async def test_reading_waits_for_a_slow_worker():
    """Backpressure: bytes read but not yet written stay below two hand-offs' worth."""
    body = bytes(64 * MiB)
    step = 256 << 10
    t = HttpTransport(HttpConfig(name="rx"))
    part = Partial(0, 1, len(body))
    hasher = _GatedHasher()
    content = _Content(body, step)
    worst = []
    content.on_read = lambda pos: worst.append(pos - hasher.fed)
    reader = asyncio.ensure_future(t._read_into(_Request(content), part, 0, len(body), hasher))
    await asyncio.to_thread(hasher.entered.wait)
    for _ in range(50):  # let the reader run ahead as far as it will
        await asyncio.sleep(0)
    assert content.pos <= 2 * (_HELD_BYTES + step)
    hasher.gate.set()
    await reader
    assert max(worst) <= 2 * (_HELD_BYTES + step) + step
    assert bytes(part.buffer) == body and t._body_jobs == 0


def _first_bad(arrays) -> int | None:
    for i, a in enumerate(arrays):
        if a.dtype.kind in "fc" and a.size and not np.isfinite(a).all():
            return i
    return None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_finite_scan_agrees_with_the_reference(data):
    """`_FiniteScan` advanced in arbitrary steps (elements split across steps) finds the same
    first non-finite array as ``np.isfinite`` on the decoded frame."""
    dtypes = ["<f2", "<f4", "<f8", "<c8", "<c16", "<i4", "|u1"]
    arrays = []
    for _ in range(data.draw(st.integers(1, 4))):
        dt = np.dtype(data.draw(st.sampled_from(dtypes)))
        n = data.draw(st.integers(0, 300))
        a = np.arange(n).astype(dt)
        if n and dt.kind in "fc" and data.draw(st.booleans()):
            a[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from(
                [np.nan, np.inf, -np.inf, np.finfo(dt).max]))
        arrays.append(a)
    body = _encoded(*arrays)
    part = Partial(0, 1, len(body))
    part.buffer[:] = body
    scan = _FiniteScan(part.buffer)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    for c in [*cuts, len(body)]:
        scan.advance(c)
    assert scan.complete(len(arrays))
    assert scan.bad == _first_bad(arrays)


def test_finite_scan_gives_up_on_a_malformed_header():
    body = bytearray(_encoded(np.ones(10, np.float32)))
    body[9] = ord("]")  # breaks the JSON header
    part = Partial(0, 1, len(body))
    part.buffer[:] = body
    scan = _FiniteScan(part.buffer)
    scan.advance(len(body))
    assert scan.failed and not scan.complete(1)


async def test_nonfinite_anywhere_in_a_big_chunked_tensor_is_refused_422():
    """Inf/NaN in the first, a chunk-straddling or the last element of a tensor spread over
    several requests (chunk size not a multiple of the element size) is refused; finite values
    whose sum overflows are accepted."""
    a, b = await pair(a_kw={"chunk_bytes": 3 * MiB + 1})
    try:
        n = (10 * MiB) // 4
        for pos, bad in ((0, np.nan), ((3 * MiB) // 4 - 1, np.inf), (n - 1, -np.inf)):
            x = np.ones(n, np.float32)
            x[pos] = bad
            with pytest.raises(FrameError, match="array 1 .* NaN or Inf"):
                await a.send("b", "c", Frame(arrays=(np.zeros(3, np.int32), x)))
        assert b.refused == {"nonfinite": 3}
        big = np.full(n, np.finfo(np.float32).max, np.float32)
        await a.send("b", "c", Frame(arrays=(big,)))
        assert np.array_equal((await b.recv("a", "c")).arrays[0], big)
        assert b._body_jobs == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_corrupted_middle_chunk_is_refused_401_then_resent():
    """A three-request message whose middle request has one altered byte: 401 for that
    request (nothing accepted); the intact request then completes the message."""
    a, b = await pair()
    try:
        x = np.random.default_rng(2).standard_normal((9 * MiB) // 4).astype(np.float32)
        body = _encoded(x)
        bounds = [0, 3 * MiB, 6 * MiB, len(body)]
        chunks = [body[lo:hi] for lo, hi in zip(bounds, bounds[1:])]

        def headers(i, chunk):
            return signed(0, chunk, **{"X-Tandem-Chunk": str(i), "X-Tandem-Chunks": "3",
                                       "X-Tandem-Offset": str(bounds[i]),
                                       "X-Tandem-Total": str(len(body))})

        async with aiohttp.ClientSession() as s:
            async def post(i, data):
                async with s.post(b.url + FRAME_PATH, data=io.BytesIO(data),
                                  headers=headers(i, chunks[i])) as r:
                    return r.status, await r.text()
            assert await post(0, chunks[0]) == (200, "chunk")
            bad = bytearray(chunks[1])
            bad[len(bad) // 2 + 1] ^= 0x40
            assert await post(1, bytes(bad)) == (401, "unauthorized")
            assert await post(1, chunks[1]) == (200, "chunk")
            assert await post(2, chunks[2]) == (200, "ok")
        assert np.array_equal((await b.recv("a", "c")).arrays[0], x)
        assert b.refused == {"unauthenticated": 1} and b._body_jobs == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_bad_digest_wins_over_nonfinite_content():
    """A large body that is both altered and non-finite is refused as unauthenticated (401):
    nothing about its content is judged before the digest over the whole body matches."""
    a, b = await pair()
    try:
        x = np.ones((4 * MiB) // 4, np.float32)
        x[-1] = np.nan
        body = _encoded(x)
        bad = bytearray(body)
        bad[len(bad) // 3] ^= 1
        async with aiohttp.ClientSession() as s:
            async with s.post(b.url + FRAME_PATH, data=io.BytesIO(bytes(bad)),
                              headers=signed(0, body)) as r:
                assert r.status == 401
            async with s.post(b.url + FRAME_PATH, data=io.BytesIO(body),
                              headers=signed(0, body)) as r:
                assert r.status == 422
        assert b.refused == {"unauthenticated": 1, "nonfinite": 1}
    finally:
        await a.aclose()
        await b.aclose()


async def test_disconnect_mid_body_leaves_the_server_serving():
    """A client that drops its connection halfway through a large body: no worker job stays
    behind and the next frame is delivered."""
    a, b = await pair()
    try:
        x = np.ones((8 * MiB) // 4, np.float32)
        body = _encoded(x)
        sent_half = asyncio.Event()

        async def half():
            yield body[:len(body) // 2]
            sent_half.set()
            await asyncio.Event().wait()

        async with aiohttp.ClientSession() as s:
            post = asyncio.ensure_future(s.post(b.url + FRAME_PATH, data=half(),
                                                headers=signed(0, body)))
            await sent_half.wait()
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post
        await a.send("b", "c", Frame(arrays=(x,)))
        assert np.array_equal((await b.recv("a", "c")).arrays[0], x)
        assert b._body_jobs == 0
    finally:
        await a.aclose()
        await b.aclose()
