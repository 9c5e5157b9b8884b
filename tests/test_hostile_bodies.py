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
from tandem.transports.http import HttpConfig, HttpTransport
from tandem.transports.http.server import DRAIN_BYTES

SECRET = b"s3cret"
INFLATED = 1 << 30  # what each bomb would inflate to: 1 GiB of zeros
ROUTES = [
    ("POST", "/tandem/v1/frame"),
    ("POST", "/tandem/v1/bye"),
    ("POST", "/tandem/v1/stream"),
    ("POST", "/"),
    ("GET", "/healthz"),
    ("GET", "/metrics"),
]


def bomb(encoding: str) -> bytes:
    """``INFLATED`` zero bytes compressed with ``encoding`` (about 1 MiB)."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[encoding]
    z = zlib.compressobj(9, zlib.DEFLATED, wbits)
    block = bytes(16 << 20)
    return b"".join(z.compress(block) for _ in range(INFLATED // len(block))) + z.flush()


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


async def raw_request(
    host: str,
    port: int,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | int,
    *,
    limit: float = 10.0,
) -> tuple[int, int, float]:
    """Send a request by hand (``body``: bytes, or that many zero bytes), writing as long as
    the receiver reads (after its answer too, for up to ``limit`` s); returns ``(status, body
    bytes written, seconds to the status)``.
    Status 0: the connection closed before any answer."""
    reader, writer = await asyncio.open_connection(host, port)
    size = body if isinstance(body, int) else len(body)
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {size}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    t0 = time.perf_counter()
    sent = 0

    async def send() -> None:
        nonlocal sent
        writer.write(head.encode())
        piece = bytes(1 << 20) if isinstance(body, int) else b""
        while sent < size:
            data = piece[: size - sent] if isinstance(body, int) else body[sent : sent + (1 << 20)]
            writer.write(data)
            await writer.drain()
            sent += len(data)

    status, took = 0, limit
    sender = asyncio.ensure_future(send())
    try:
        async with asyncio.timeout(limit):
            line = await reader.readline()
            took = time.perf_counter() - t0
            if line.startswith(b"HTTP/1.1 "):
                status = int(line.split()[1])
            # an attacker keeps writing after the answer: how much more does the receiver take?
            await asyncio.wait([sender], timeout=max(0.0, limit - took))
    except (ConnectionError, TimeoutError):
        pass
    finally:
        sender.cancel()
        try:
            await sender
        except (asyncio.CancelledError, ConnectionError, OSError):
            pass
        writer.transport.abort()
    return status, sent, took


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
    with 415, /healthz answers within 50 ms at p99, and both parties export the parameters
    of the unattacked run."""
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
                async with s.get(job.url("follower") + "/healthz") as r:
                    assert r.status == 200
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.2)
        return statuses, health

    results, (statuses, health) = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert statuses and set(statuses) == {415}, statuses
    health.sort()
    assert health[int(0.99 * (len(health) - 1))] < 0.05, health[-5:]


def test_bomb_helper_really_inflates(bombs):
    """The attack is real: the gzip body inflates to ``INFLATED`` bytes."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    n = 0
    data = bombs["gzip"]
    for i in range(0, len(data), 1 << 16):
        n += len(d.decompress(data[i : i + (1 << 16)]))
    assert n == INFLATED
    assert len(data) < 8 << 20
