"""Bodies an outsider sends without credentials: compressed bombs (gzip, deflate, br) to every
route, and unsigned bodies of tens of MiB on many connections. The receiver refuses each from
its headers, reads no more than a small bounded amount of any of them, and its event loop stays
free: `/healthz` keeps answering and a job under attack trains to the same parameters."""

from __future__ import annotations

import asyncio
import time
import zlib

import aiohttp
import pytest

from hostile_helpers import assert_done, assert_same_params, make_job, run_pair

# attack tools bench.hostile uses too: not for the installed package, and bench cannot import tests/
from tandem.testing.hostile_bodies import BOMB_INFLATED, ROUTES, bomb, raw_request
from tandem.transports.http import HttpConfig, HttpTransport
from tandem.transports.http.server import DRAIN_BYTES

SECRET = b"s3cret"


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    out = {e: bomb(e) for e in ("gzip", "deflate")}
    out["br"] = out["gzip"]  # the bytes do not matter: a br body is refused from its headers
    return out


async def loop_lag(stop: asyncio.Event) -> float:
    """The longest the running loop went without running this task (ticks of 2 ms)."""
    worst, loop = 0.0, asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(0.002)
        worst = max(worst, loop.time() - t0 - 0.002)
    return worst


async def test_compressed_bodies_are_refused_from_their_headers_on_every_route(bombs):
    """A gzip, deflate or br body to any route gets 415 at once, is never inflated, and the
    receiver's loop is never held for more than a few milliseconds; an identity encoding
    is still served."""
    t = await HttpTransport(HttpConfig(name="b", secret=SECRET, peers={})).start()
    stop = asyncio.Event()
    lag = asyncio.ensure_future(loop_lag(stop))
    try:
        host, port = "127.0.0.1", int(t.url.rsplit(":", 1)[1])
        for encoding, body in bombs.items():
            for method, path in ROUTES:
                status, _, took = await raw_request(
                    host, port, method, path, {"Content-Encoding": encoding}, body
                )
                assert status == 415, (encoding, method, path, status)
                assert took < 1.0, (encoding, path, took)
        async with aiohttp.ClientSession() as s:
            async with s.get(t.url + "/healthz", headers={"Content-Encoding": "identity"}) as r:
                assert r.status == 200
    finally:
        stop.set()
        worst = await lag
        await t.aclose()
    assert worst < 0.1, f"the loop was held {worst * 1000:.0f} ms"
    assert t._server.refused.get("encoding", 0) == len(bombs) * len(ROUTES)


async def test_unsigned_bodies_are_not_drained(bombs):
    """64 connections each announcing 48 MiB, unsigned: each gets 401 from its headers and
    its connection is closed after at most a small bounded amount of its body was read (what
    the kernel's socket buffers hold aside), while ``/healthz`` keeps answering."""
    t = await HttpTransport(HttpConfig(name="b", secret=SECRET, peers={"a": "http://x"})).start()
    size, port = 48 << 20, int(t.url.rsplit(":", 1)[1])
    headers = {"X-Tandem-Sender": "a", "X-Tandem-Channel": "c"}
    try:
        results = await asyncio.gather(
            *(
                raw_request("127.0.0.1", port, "POST", "/tandem/v1/frame", headers, size)
                for _ in range(64)
            )
        )
        async with aiohttp.ClientSession() as s:
            t0 = time.perf_counter()
            async with s.get(t.url + "/healthz") as r:
                assert r.status == 200
            assert time.perf_counter() - t0 < 0.5
    finally:
        await t.aclose()
    assert [status for status, _, _ in results] == [401] * 64
    # a drained body would be written in full; socket buffers on loopback take a few MiB
    written = sorted(sent for _, sent, _ in results)
    assert written[-1] < size // 2, written
    assert DRAIN_BYTES <= 1 << 20


@pytest.mark.slow
async def test_a_job_under_bombs_trains_to_the_same_parameters(tmp_path, hostile_reference, bombs):
    """A gzip bomb to the follower every 0.2 s while the job trains: every bomb is refused
    with 415, /healthz keeps answering at once, and both parties export the parameters of the
    unattacked run."""
    job = make_job(tmp_path)

    async def attack(job, finished: asyncio.Event) -> tuple[list[int], list[float]]:
        host, port = "127.0.0.1", job.ports["follower"]
        statuses: list[int] = []
        health: list[float] = []
        async with aiohttp.ClientSession() as s:
            while not finished.is_set() and len(statuses) < 200:
                try:
                    status, _, _ = await raw_request(
                        host, port, "POST", "/", {"Content-Encoding": "gzip"}, bombs["gzip"]
                    )
                except OSError:  # not listening yet
                    await asyncio.sleep(0.05)
                    continue
                statuses.append(status)
                t0 = time.perf_counter()
                try:
                    async with s.get(job.url("follower") + "/healthz") as r:
                        assert r.status == 200
                except aiohttp.ClientConnectionError:
                    # the follower finished (before the leader, so `finished` is not set yet)
                    # and closed; had a bomb crashed it, `assert_done` below fails the test
                    break
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.2)
        return statuses, health

    results, (statuses, health) = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert statuses and set(statuses) == {415}, statuses
    # the parties train in this process too, so a poll also waits for their kernels: the
    # median is held to 50 ms, and no poll may wait as an inflating bomb would (seconds)
    health.sort()
    assert health[len(health) // 2] < 0.05 and health[-1] < 1.0, health


def test_bomb_helper_really_inflates(bombs):
    """The attack is real: each body is a whole, valid stream (its checksum verified) that
    inflates to ``BOMB_INFLATED`` bytes from about 1 MiB. Inflated 1 MiB at a time: the same
    bytes through zlib, without a fresh 64 MiB output object for every 64 KiB of input."""
    for encoding, wbits in (("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS)):
        d = zlib.decompressobj(wbits)
        data, n = bombs[encoding], 0
        pending = data
        while not d.eof:
            out = d.decompress(pending, 1 << 20)
            assert out or d.eof, "the stream ended before its end marker"
            n += len(out)
            pending = d.unconsumed_tail
        assert d.eof and not d.unused_data and not pending
        assert n == BOMB_INFLATED
        assert len(data) < 2 << 20


class _Transport(asyncio.Transport):
    """A transport that only records whether it is being read."""

    def __init__(self) -> None:
        super().__init__()
        self.reading, self.closing = True, False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def is_closing(self) -> bool:
        return self.closing


class _Inner(asyncio.Protocol):
    """aiohttp's handler, as far as the guard sees it: the bytes handed to it."""

    def __init__(self) -> None:
        self.got = 0

    def data_received(self, data: bytes) -> None:
        self.got += len(data)


async def test_a_body_is_not_buffered_before_its_handler_decides():
    """Outside a request the guard hands aiohttp at most PRE_REQUEST_LIMIT bytes, then stops
    reading; a route that reads no body leaves it stopped; a refused body is dropped as it
    arrives (never handed to aiohttp) up to its bound, then reading stops again while the
    peer may still read its answer."""
    from tandem.transports.http.connections import PRE_REQUEST_LIMIT, ConnectionGuard, Listener

    listener = Listener(lambda: inner, max_connections=8, max_per_address=8,
                        header_timeout=5.0, keepalive_timeout=5.0)  # fmt: skip
    inner, transport = _Inner(), _Transport()
    guard = ConnectionGuard(listener, "127.0.0.1", lambda: inner)
    guard.connection_made(transport)
    head = b"POST /tandem/v1/frame HTTP/1.1\r\nContent-Length: 50331648\r\n\r\n"
    guard.data_received(head + bytes(1000))
    piece = bytes(256 << 10)  # what one read of the loop brings
    while transport.reading:
        guard.data_received(piece)
    assert inner.got <= PRE_REQUEST_LIMIT + len(piece)
    listener.begin(transport, release=False)  # a refusal from the head: nothing more is read
    assert not transport.reading and listener.holds(transport)
    done = guard.discard(DRAIN_BYTES)
    assert transport.reading and not done.done()
    before = inner.got
    while transport.reading:
        guard.data_received(piece)
    assert inner.got == before and not done.done()  # the peer may still read the answer
    guard.eof_received()  # it did, and closed its side
    assert done.done()
    guard.connection_lost(None)

    # a request whose handler reads its body: reading resumes at its start
    inner, transport = _Inner(), _Transport()
    guard = ConnectionGuard(listener, "127.0.0.1", lambda: inner)
    guard.connection_made(transport)
    guard.data_received(head + bytes(PRE_REQUEST_LIMIT))
    assert not transport.reading
    listener.begin(transport)
    assert transport.reading and not listener.holds(transport)
    guard.data_received(piece * 8)  # inside the request: all of it is the handler's
    assert inner.got == len(head) + PRE_REQUEST_LIMIT + 8 * len(piece)
    guard.connection_lost(None)
