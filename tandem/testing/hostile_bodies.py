"""The outsider's body attacks of `bench.hostile` (and their tools, shared with
tests/test_hostile_bodies.py; `tandem.testing`): no credentials needed.

* ``bomb``: a compressed body (gzip, deflate, br; about 1 MiB inflating to 1 GiB) sent
  unsigned to every route, again and again while the job trains (expect 415 from the headers,
  the body never read nor inflated);
* ``drained``: rounds of 64 connections each announcing an unsigned 48 MiB body and writing it
  for as long as the receiver reads (expect 401, and each connection closed after at most a
  small bounded part of its body: ``max_body_mib_taken`` is the most any connection managed to
  write, the kernel's socket buffers included).
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
BOMB_INFLATED = 1 << 30  # what each bomb inflates to
ROUTES = (
    ("POST", "/tandem/v1/frame"),
    ("POST", "/tandem/v1/bye"),
    ("POST", "/tandem/v1/stream"),
    ("POST", "/"),
    ("GET", "/healthz"),
    ("GET", "/metrics"),
)
DRAINED_BODY = 48 * MiB
DRAINED_CONNECTIONS = 64


def bomb(encoding: str, inflated: int = BOMB_INFLATED) -> bytes:
    """``inflated`` zero bytes (a multiple of 16 MiB) compressed as ``encoding`` ("gzip" or
    "deflate"): a valid stream with its checksum, made in about a second. Zeros compress to
    the same bytes block after block once flushed, so one block's output is repeated."""
    block = bytes(16 * MiB)
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)  # raw deflate: headers added below
    first = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)
    steady = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)
    blocks = inflated // len(block)
    data = first + steady * (blocks - 1) + z.flush()
    if encoding == "gzip":
        crc = 0
        for _ in range(blocks):
            crc = zlib.crc32(block, crc)
        head = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
        return head + data + struct.pack("<II", crc, inflated & 0xFFFFFFFF)
    if encoding == "deflate":
        adler = 1
        for _ in range(blocks):
            adler = zlib.adler32(block, adler)
        return b"\x78\xda" + data + struct.pack(">I", adler)
    raise ValueError(f"unknown encoding {encoding!r}; use gzip or deflate")


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
    bytes written, seconds to the status)``. Status 0: the connection closed before any
    answer. Raises `OSError` when nothing listens."""
    reader, writer = await asyncio.open_connection(host, port)
    size = body if isinstance(body, int) else len(body)
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {size}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    t0 = time.perf_counter()
    sent = 0

    async def send() -> None:
        nonlocal sent
        writer.write(head.encode())
        zeros = bytes(MiB) if isinstance(body, int) else b""
        while sent < size:
            data = zeros[: size - sent] if isinstance(body, int) else body[sent : sent + MiB]
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


def _address(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split(":")
    return host, int(port)


async def attack_bomb(ctx: Any, refused: Callable[[list[int], set[int]], dict[str, Any]]):
    """Bombs in every encoding to every route of the follower, one after another, while the
    job runs (at most 10 rounds)."""
    host, port = _address(ctx.job.url("follower"))
    bombs = {e: await asyncio.to_thread(bomb, e) for e in ("gzip", "deflate")}
    bombs["br"] = bombs["gzip"]  # refused from its header: the bytes do not matter
    statuses: list[int] = []
    slowest = 0.0
    rounds = 0
    while ctx.going() and rounds < 10:
        for encoding, body in bombs.items():
            for method, path in ROUTES:
                try:
                    status, _, took = await raw_request(
                        host, port, method, path, {"Content-Encoding": encoding}, body, limit=5
                    )
                except OSError:  # not listening (yet, or any more)
                    await asyncio.sleep(0.05)
                    continue
                if status:
                    statuses.append(status)
                    slowest = max(slowest, took)
        rounds += 1
    out = refused(statuses, {415})
    out.update(rounds=rounds, slowest_answer_ms=round(slowest * 1000, 2))
    return out


async def attack_drained(ctx: Any, refused: Callable[[list[int], set[int]], dict[str, Any]]):
    """Rounds of 64 unsigned 48 MiB bodies at once to the follower (at most 5 rounds)."""
    host, port = _address(ctx.job.url("follower"))
    headers = {"X-Tandem-Sender": "leader", "X-Tandem-Channel": "act/bottom_follower->top"}
    statuses: list[int] = []
    taken = unanswered = 0
    rounds = 0
    while ctx.going() and rounds < 5:
        got = await asyncio.gather(
            *(
                raw_request(host, port, "POST", "/tandem/v1/frame", headers, DRAINED_BODY)
                for _ in range(DRAINED_CONNECTIONS)
            ),
            return_exceptions=True,
        )
        for g in got:
            if isinstance(g, tuple):
                taken = max(taken, g[1])
                if g[0]:
                    statuses.append(g[0])
                else:  # closed unanswered: over the connection caps, or the party finished
                    unanswered += 1
        rounds += 1
        await asyncio.sleep(0.5)  # the receiver closes the last round's connections
    out = refused(statuses, {401})
    out.update(rounds=rounds, unanswered=unanswered, max_body_mib_taken=round(taken / MiB, 1))
    out["refused_ok"] = out["refused_ok"] and taken < DRAINED_BODY // 2
    return out
