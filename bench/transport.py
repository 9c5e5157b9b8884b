"""Transport benchmark: HTTP transport vs a raw asyncio socket, two processes on loopback.

    python -m bench.transport --json      # one JSON line

The receiver runs in a subprocess (``--role receiver``; started with ``subprocess``, nothing is
pickled). It serves a raw length-prefixed TCP sink and an `HttpTransport`. The sender, in this
process, sends the same 64 MiB payloads over both, in the same run:

* ``raw_MBps``: 64 MiB messages over one asyncio stream, each acknowledged by one byte;
* ``http_MBps``: 64 MiB float32 frames via `HttpTransport.send` (receiver drains with recv);
* ``http_hmac_MBps``: the same with HMAC authentication (SHA-256 of every body, both sides);
* ``small_frame_us``: mean time per sequential send of a 4 KiB frame (per-message overhead).

``ratio_vs_raw = http_MBps / raw_MBps`` (target >= 0.5). MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

from transports.base import Frame
from transports.errors import TransportClosedError
from transports.http import HttpConfig, HttpTransport

MiB = 1 << 20
SECRET = b"bench-secret"


async def _raw_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    buf = bytearray(80 * MiB)
    try:
        while True:
            head = await reader.readexactly(8)
            n = int.from_bytes(head, "little")
            view = memoryview(buf)[:n] if n <= len(buf) else memoryview(bytearray(n))
            got = 0
            while got < n:
                chunk = await reader.read(min(n - got, 4 * MiB))
                if not chunk:
                    return
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
            writer.write(b"k")
            await writer.drain()
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


async def _receiver() -> int:
    raw = await asyncio.start_server(_raw_sink, "127.0.0.1", 0, limit=4 * MiB)
    plain = await HttpTransport(HttpConfig(name="rx", peers={"tx": "http://127.0.0.1:9"})).start()
    signed = await HttpTransport(HttpConfig(name="rx", secret=SECRET,
                                            peers={"tx": "http://127.0.0.1:9"})).start()
    print(json.dumps({"raw_port": raw.sockets[0].getsockname()[1], "plain": plain.url,
                      "signed": signed.url}), flush=True)

    async def drain(t: HttpTransport, channel: str) -> None:
        try:
            while True:
                await t.recv("tx", channel)
        except TransportClosedError:
            pass  # the sender said goodbye: this measurement is over

    async def until_stdin_closes() -> None:
        await asyncio.to_thread(sys.stdin.read)

    try:
        async with asyncio.TaskGroup() as tg:
            for t in (plain, signed):
                for ch in ("big", "small"):
                    tg.create_task(drain(t, ch))
            await until_stdin_closes()
            raise asyncio.CancelledError
    except asyncio.CancelledError:
        pass
    finally:
        await plain.aclose()
        await signed.aclose()
        raw.close()
        await raw.wait_closed()
    return 0


async def _bench_raw(port: int, payload: memoryview, repeats: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    n = len(payload)

    async def one() -> None:
        writer.write(n.to_bytes(8, "little"))
        for start in range(0, n, MiB):
            writer.write(payload[start:start + MiB])
            await writer.drain()
        await reader.readexactly(1)

    await one()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        await one()
    dt = time.perf_counter() - t0
    writer.close()
    await writer.wait_closed()
    return repeats * n / dt / 1e6


async def _bench_http(url: str, secret: bytes | None, big: np.ndarray, repeats: int,
                      small_n: int) -> tuple[float, float]:
    async with HttpTransport(HttpConfig(name="tx", secret=secret, peers={"rx": url})) as t:
        frame = Frame(arrays=(big,))
        await t.send("rx", "big", frame)  # warm-up (connection, allocations)
        t0 = time.perf_counter()
        for _ in range(repeats):
            await t.send("rx", "big", frame)
        mbps = repeats * big.nbytes / (time.perf_counter() - t0) / 1e6
        small = Frame(arrays=(np.zeros(1024, np.float32),))  # 4 KiB
        for _ in range(20):
            await t.send("rx", "small", small)
        t0 = time.perf_counter()
        for _ in range(small_n):
            await t.send("rx", "small", small)
        us = (time.perf_counter() - t0) / small_n * 1e6
    return mbps, us


async def _sender(args: argparse.Namespace) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "bench.transport", "--role", "receiver"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        addr = json.loads(line)
        big = np.random.default_rng(0).standard_normal(args.mib * MiB // 4, dtype=np.float32)
        payload = memoryview(big).cast("B")
        raw = await _bench_raw(addr["raw_port"], payload, args.repeats)
        http, small_us = await _bench_http(addr["plain"], None, big, args.repeats, args.small)
        hmac_mbps, hmac_small_us = await _bench_http(addr["signed"], SECRET, big, args.repeats,
                                                     args.small)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"bench": "transport", "tensor_MiB": args.mib, "repeats": args.repeats,
            "raw_MBps": round(raw, 1), "http_MBps": round(http, 1),
            "ratio_vs_raw": round(http / raw, 3), "http_hmac_MBps": round(hmac_mbps, 1),
            "small_frame_us": round(small_us, 1), "small_frame_hmac_us": round(hmac_small_us, 1),
            "loop": type(asyncio.get_running_loop()).__module__.split(".")[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=8, help="large frames per measurement")
    p.add_argument("--small", type=int, default=500, help="4 KiB frames for the overhead")
    p.add_argument("--role", choices=["sender", "receiver"], default="sender",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from parties.cli import run_async
    if args.role == "receiver":
        return run_async(_receiver)
    if not args.json:
        print(f"sending {args.repeats} x {args.mib} MiB over a raw socket and HTTP ...",
              file=sys.stderr)
    result = run_async(lambda: _sender(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
