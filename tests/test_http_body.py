"""The HTTP receiver's body path (`body.read_into` and the checks after it): large
bodies, hashed on a worker thread while they arrive, keep every guarantee."""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading

import aiohttp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.errors import FrameError
from tandem.transports import codec
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH
from tandem.transports.http.body import HASH_STEP, PlainBody, read_into, wait_uncancelled
from tandem.transports.http.scan import FiniteScan, all_finite
from test_http_bulk import bulk_post
from test_http_security import cfg, signed

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
        data = self.body[self.pos : self.pos + self.step]
        self.pos += len(data)
        self.on_read(self.pos)
        return data, False


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


def _encoded(*arrays, msg_id: int = 0) -> bytes:
    return codec.encode(Frame(arrays=arrays).replace(sender="a", channel="c", msg_id=msg_id))


async def test_read_into_copies_and_hashes_every_byte_in_order():
    body = np.random.default_rng(1).integers(0, 256, 5 * MiB + 12345, np.uint8).tobytes()
    for step in (1000, 256 << 10, 3 * MiB):
        buf = memoryview(bytearray(len(body)))
        hasher = hashlib.sha256()
        await read_into(PlainBody(_Content(body, step), len(body)), buf, 0, len(body), hasher)
        assert bytes(buf) == body
        assert hasher.hexdigest() == hashlib.sha256(body).hexdigest()


async def test_cancelled_mid_body_leaves_no_hashing_thread_running():
    """Cancelling a signed request while a hash update runs on the worker thread: the reader
    waits for that update (a thread cannot be interrupted) before the cancellation propagates,
    and hashes nothing afterwards."""
    body = bytes(range(256)) * (40 * MiB // 256)
    buf = memoryview(bytearray(len(body)))
    hasher = _GatedHasher()
    content = _Content(body, 256 << 10, stall_after=HASH_STEP + 2 * MiB)
    task = asyncio.ensure_future(
        read_into(PlainBody(content, len(body)), buf, 0, len(body), hasher)
    )
    try:
        await asyncio.to_thread(hasher.entered.wait)  # an update runs, blocked in the hasher
        await content.stalled.wait()
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()  # it waits for the thread rather than leave it running
    finally:
        hasher.gate.set()  # never leave the thread blocked (the test would hang at exit)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hasher.fed == HASH_STEP
    await asyncio.sleep(0.01)
    assert hasher.fed == HASH_STEP


async def test_nonfinite_anywhere_in_a_big_chunked_tensor_is_refused_422(http_pair):
    """Inf/NaN in the first, a chunk-straddling or the last element of a tensor spread over
    several requests (chunk size not a multiple of the element size) is refused; finite values
    whose sum overflows are accepted."""
    a, b = await http_pair(cfg, a_kw={"chunk_bytes": 3 * MiB + 1})
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


async def test_corrupted_middle_chunk_is_refused_401_then_resent(http_pair):
    """A three-request message whose middle request has one altered byte: 401 for that
    request (nothing accepted); the intact request then completes the message."""
    a, b = await http_pair(cfg)
    x = np.random.default_rng(2).standard_normal((9 * MiB) // 4).astype(np.float32)
    body = _encoded(x)
    bounds = [0, 3 * MiB, 6 * MiB, len(body)]
    chunks = [body[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]

    def headers(i, chunk):
        return signed(
            b,
            0,
            chunk,
            **{
                "X-Tandem-Chunk": str(i),
                "X-Tandem-Chunks": "3",
                "X-Tandem-Offset": str(bounds[i]),
                "X-Tandem-Total": str(len(body)),
            },
        )

    async with aiohttp.ClientSession() as s:

        async def post(i, data):
            async with s.post(
                b.url + FRAME_PATH, data=io.BytesIO(data), headers=headers(i, chunks[i])
            ) as r:
                return r.status, await r.text()

        assert await post(0, chunks[0]) == (200, "chunk")
        bad = bytearray(chunks[1])
        bad[len(bad) // 2 + 1] ^= 0x40
        assert await post(1, bytes(bad)) == (401, "unauthorized")
        assert await post(1, chunks[1]) == (200, "chunk")
        assert await post(2, chunks[2]) == (200, "ok")
    assert np.array_equal((await b.recv("a", "c")).arrays[0], x)
    assert b.refused == {"unauthenticated": 1}


async def test_bad_digest_wins_over_nonfinite_content(http_pair):
    """A large body that is both altered and non-finite is refused as unauthenticated (401):
    nothing about its content is judged before the digest over the whole body matches."""
    a, b = await http_pair(cfg)
    x = np.ones((4 * MiB) // 4, np.float32)
    x[-1] = np.nan
    body = _encoded(x)
    bad = bytearray(body)
    bad[len(bad) // 3] ^= 1
    async with aiohttp.ClientSession() as s:
        async with s.post(
            b.url + FRAME_PATH, data=io.BytesIO(bytes(bad)), headers=signed(b, 0, body)
        ) as r:
            assert r.status == 401
        async with s.post(
            b.url + FRAME_PATH, data=io.BytesIO(body), headers=signed(b, 0, body)
        ) as r:
            assert r.status == 422
    assert b.refused == {"unauthenticated": 1, "nonfinite": 1}


async def test_disconnect_mid_body_leaves_the_server_serving(http_pair):
    """A client that drops its connection halfway through a large body: no worker job stays
    behind and the next frame is delivered."""
    a, b = await http_pair(cfg)
    x = np.ones((8 * MiB) // 4, np.float32)
    body = _encoded(x)
    sent_half = asyncio.Event()

    async def half():
        yield body[: len(body) // 2]
        sent_half.set()
        await asyncio.Event().wait()

    async with aiohttp.ClientSession() as s:
        # Content-Length as a real sender gives it (the receiver refuses a body without
        # one, 411, before reading any of it; a generator alone is sent chunked)
        post = asyncio.ensure_future(
            s.post(
                b.url + FRAME_PATH,
                data=half(),
                headers={**signed(b, 0, body), "Content-Length": str(len(body))},
            )
        )
        halfway = asyncio.ensure_future(sent_half.wait())
        await asyncio.wait({post, halfway}, return_when=asyncio.FIRST_COMPLETED)
        if post.done():  # answered before half the body was read: not the case under test
            halfway.cancel()
            async with post.result() as r:
                pytest.fail(
                    f"the receiver answered {r.status} {await r.text()!r} before "
                    "half the body arrived"
                )
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
    await a.send("b", "c", Frame(arrays=(x,)))
    assert np.array_equal((await b.recv("a", "c")).arrays[0], x)


async def test_wait_uncancelled_finishes_the_thread_job_and_keeps_the_cancellation():
    release, finished = threading.Event(), threading.Event()

    def job():
        release.wait(5)
        finished.set()

    fut = asyncio.get_running_loop().run_in_executor(None, job)
    waiter = asyncio.ensure_future(wait_uncancelled(fut))
    await asyncio.sleep(0.01)
    waiter.cancel()  # arrives while the thread is still busy
    await asyncio.sleep(0.01)
    assert not waiter.done()  # it keeps waiting for the uninterruptible job
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter  # ...and then the cancellation is not lost
    assert finished.is_set()


# -- the NaN/Inf scan run while the body arrives (FiniteScan) ----------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data())
def test_finite_scan_agrees_with_isfinite_whatever_the_pieces_and_rewinds(data):
    """Pieces of any size, rewinds to any earlier offset with different bytes written again
    (a failed attempt, then another): once every byte is in, the scan's verdicts are exactly
    ``np.isfinite(a).all()`` of what the buffer finally holds."""
    dtypes = ["<f2", "<f4", "<f8", "<c8", "<i4", "|u1"]
    arrays = []
    for _ in range(data.draw(st.integers(1, 3))):
        dt = np.dtype(data.draw(st.sampled_from(dtypes)))
        arrays.append(np.ones(data.draw(st.integers(0, 300)), dt))

    def poisoned():
        out = []
        for a in arrays:
            a = a.copy()
            if a.dtype.kind in "fc" and a.size and data.draw(st.booleans()):
                a[data.draw(st.integers(0, a.size - 1))] = data.draw(
                    st.sampled_from([np.nan, np.inf, -np.inf])
                )
            out.append(a)
        return codec.encode(Frame(sender="a", channel="c", arrays=tuple(out)))

    final = poisoned()
    n = len(final)
    buf = memoryview(bytearray(n))
    scan = FiniteScan(buf)
    pos = 0
    # events drawn as fractions of the frame (few draws, any piece boundary)
    for rewind, frac in data.draw(st.lists(st.tuples(st.booleans(), st.floats(0, 1)), max_size=10)):
        if rewind and pos:  # an attempt fails after writing other bytes: rewind, resend
            to = int(frac * pos)
            scan.rewind(to)
            other = poisoned()
            buf[to:pos] = other[to:pos]
            scan.advance(pos)
            scan.rewind(to)
            pos = to
        else:
            nxt = pos + int(frac * (n - pos))
            buf[pos:nxt] = final[pos:nxt]
            scan.advance(nxt)
            pos = nxt
    buf[pos:] = final[pos:]
    scan.advance(n)
    frame = codec.decode(buf)
    known = scan.verdicts(frame)
    for i, a in enumerate(frame.arrays):
        if a.dtype.kind in "fc" and a.size:
            assert known[i] == bool(np.isfinite(a).all()), (i, a)
        else:
            assert i not in known


def test_finite_scan_gives_no_verdict_for_an_unreadable_header_or_another_layout():
    body = codec.encode(Frame(sender="a", channel="c", arrays=(np.ones(8, np.float32),)))
    bad = bytearray(body)
    bad[0] ^= 1  # not a frame: decode refuses it, the scan gives up
    scan = FiniteScan(memoryview(bad))
    scan.advance(len(bad))
    assert scan.off and scan.verdicts(codec.decode(body)) == {}
    scan = FiniteScan(memoryview(bytearray(body)))
    scan.advance(len(body))
    other = Frame(arrays=(np.ones(8, np.float64),))  # arrays that are not the scanned ones
    assert scan.verdicts(codec.decode(body)) == {0: True} and scan.verdicts(other) == {}


@pytest.mark.parametrize("path", ["bulk", "plain"])
async def test_a_resent_chunk_is_judged_on_its_new_bytes(http_pair, path):
    """The scan runs before the digest is checked: a failed attempt's NaN must not condemn the
    intact resend, and a failed attempt's finite bytes must not excuse a NaN resent."""
    a, b = await http_pair(cfg)
    x = np.ones((3 * MiB) // 4, np.float32)
    bounds = [0, MiB + 3, 2 * MiB + 1, len(_encoded(x))]  # chunks straddle elements

    def chunks(msg_id):
        body = _encoded(x, msg_id=msg_id)
        good = [body[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
        bad = bytearray(good[1])
        bad[4001:4005] = np.array([np.nan], np.float32).tobytes()
        return good, bytes(bad)

    async def post(s, msg_id, i, data, signed_bytes=None):
        """Chunk ``i`` carrying ``data``, signed over ``signed_bytes`` (default: data)."""
        h = signed(
            b,
            msg_id,
            data if signed_bytes is None else signed_bytes,
            **{
                "X-Tandem-Chunk": str(i),
                "X-Tandem-Chunks": "3",
                "X-Tandem-Offset": str(bounds[i]),
                "X-Tandem-Total": str(bounds[3]),
            },
        )
        if path == "plain":
            async with s.post(b.url + FRAME_PATH, data=io.BytesIO(data), headers=h) as r:
                return r.status, await r.text()
        h["X-Tandem-Length"] = str(len(data))
        _, status, text = await bulk_post(b.url, h, data)
        return status, text

    async with aiohttp.ClientSession() as s:
        # a NaN in a failed attempt (401), then the intact resend: delivered
        good, bad = chunks(0)
        assert await post(s, 0, 0, good[0]) == (200, "chunk")
        assert await post(s, 0, 1, bad, signed_bytes=good[1]) == (401, "unauthorized")
        assert await post(s, 0, 1, good[1]) == (200, "chunk")
        assert await post(s, 0, 2, good[2]) == (200, "ok")
        np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
        # finite bytes in a failed attempt (401), then a signed resend holding a NaN: 422
        good, bad = chunks(1)
        assert await post(s, 1, 0, good[0]) == (200, "chunk")
        assert await post(s, 1, 1, good[1], signed_bytes=bad) == (401, "unauthorized")
        assert await post(s, 1, 1, bad) == (200, "chunk")
        status, text = await post(s, 1, 2, good[2])
        assert status == 422 and "NaN or Inf" in text
    assert b.refused == {"unauthenticated": 2, "nonfinite": 1}
    assert b.frame_requests[("received", path)] == 8


@pytest.mark.parametrize("size", [1, 1000, (1 << 13) + 1, 1 << 15])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_all_finite_is_isfinite_on_small_and_large_arrays(size: int, dtype) -> None:
    """Both of `all_finite`'s ways (small arrays at once, large ones by their sum): finite
    values whose sum overflows are finite; one NaN or Inf anywhere is not."""
    big = np.full(size, np.finfo(np.dtype(dtype).type(0).real.dtype).max / 2, dtype)
    assert all_finite(big) and all_finite(np.zeros(size, dtype))
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, size - 1):
            x = np.zeros(size, dtype)
            x[pos] = bad
            assert not all_finite(x), (bad, pos)
