"""Transport benchmark: HTTP transport vs a raw asyncio socket, two processes on loopback.

    python -m bench.transport --json      # one JSON line

The receiver runs in a subprocess (``--role receiver``; started with ``subprocess``, nothing is
pickled). It serves a raw length-prefixed TCP sink and an `HttpTransport`. The sender, in this
process, sends the same 64 MiB payloads over both, in the same run:

* ``raw_MBps``: 64 MiB messages over one TCP socket, each acknowledged by one byte: the sender
  hands the whole message to ``loop.sock_sendall`` and the receiver ``sock_recv_into`` a fresh
  ``np.empty`` buffer, as the HTTP receiver does (no stream buffering, no per-chunk Python
  copies: the fairest baseline);
* ``http_MBps``: 64 MiB float32 frames via `HttpTransport.send` (receiver drains with recv);
* ``http_hmac_MBps``: the same with HMAC authentication (the BLAKE3 body digest: the sender
  hashes each body before sending it, the receiver while receiving it);
* ``small_frame_us``: mean time per sequential send of a 4 KiB frame (per-message overhead:
  each send waits for the receiver's answer before the next starts);
* ``small_frame_windowed_us``: the same frames with ``HttpConfig.send_window`` sends of the
  channel in flight at once (the engine's way), mean time per frame;
* ``http_requests``: the plain-HTTP sender's requests by path (``bulk``: the 64 MiB bodies,
  upgraded and received outside aiohttp's parser; ``stream``: small frames as records on a
  frame stream, `HttpConfig`'s default; ``plain``: each large frame's short last chunk, and
  the small frames with ``--no-frame-streams``); ``--no-bulk`` sends everything as plain
  POSTs (``--no-frame-streams`` as well for the small frames).

The variants are interleaved in ``rounds`` (raw, HTTP, HTTP+HMAC, small frames; ``repeats``
messages each, after one untimed warm-up message per variant); medians over the rounds are
reported, and every round in ``runs``. ``ratio_vs_raw`` is the median over rounds of
``http / raw`` measured in the same round (target >= 0.5), ``ratio_signed_vs_raw`` the same
for ``http_hmac / raw`` (target >= 0.8). ``cpu_ms_per_message``: per large-message variant,
the sender's and the receiver's CPU milliseconds per 64 MiB message (all rounds; process CPU
time, so it says where the time goes even when load makes the throughputs noisy; with both
processes busy on 2 cores, the throughput ratio follows the ratio of their sums). MB = 1e6
bytes. ``load`` records
``os.getloadavg()`` before and after: loopback throughput is CPU-bound, so compare only runs on
an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from tandem.errors import TransportClosedError
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig, HttpTransport

MiB = 1 << 20
SECRET = b"bench-secret"
WINDOW = HttpConfig.send_window  # concurrent sends of the windowed small-frame variant


def _raw_server() -> socket.socket:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.setblocking(False)
    return srv


async def _raw_sink(srv: socket.socket) -> None:
    """Serve one raw connection: u64 length, then that many bytes received straight into a
    new buffer (``sock_recv_into``: no intermediate copies); answer one byte. Each message gets
    a fresh ``np.empty`` buffer, as the HTTP receiver must (the application keeps the tensor):
    both pay the same page faults, so the comparison measures the protocol, not the pooling."""
    loop = asyncio.get_running_loop()
    conn, _ = await loop.sock_accept(srv)
    conn.setblocking(False)
    try:
        while True:
            head = bytearray()
            while len(head) < 8:
                chunk = await loop.sock_recv(conn, 8 - len(head))
                if not chunk:
                    return
                head += chunk
            n = int.from_bytes(head, "little")
            view = memoryview(np.empty(n, np.uint8))
            got = 0
            while got < n:
                k = await loop.sock_recv_into(conn, view[got:])
                if not k:
                    return
                got += k
            await loop.sock_sendall(conn, b"k")
    except ConnectionError:
        pass
    finally:
        conn.close()


async def _receiver(frame_streams: bool) -> int:
    raw = _raw_server()
    # the sender's address is unknown here (no probes: a slow run on a busy machine must not
    # declare the sender lost), and the sender says goodbye at the end
    peers = {"tx": "http://127.0.0.1:9"}
    common = {"peers": peers, "frame_streams": frame_streams, "peer_timeout": None}
    plain = await HttpTransport(HttpConfig(name="rx", **common)).start()
    signed = await HttpTransport(HttpConfig(name="rx", secret=SECRET, **common)).start()
    print(
        json.dumps({"raw_port": raw.getsockname()[1], "plain": plain.url, "signed": signed.url}),
        flush=True,
    )

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
            tg.create_task(_raw_sink(raw))
            for t in (plain, signed):
                for ch in ("big", "small", "small_windowed"):
                    tg.create_task(drain(t, ch))
            await until_stdin_closes()
            raise asyncio.CancelledError
    except asyncio.CancelledError:
        pass
    finally:
        await plain.aclose()
        await signed.aclose()
        raw.close()
    return 0


class _RawSender:
    """The baseline: one TCP connection, each message one ``sock_sendall`` of the whole
    payload (the kernel takes it as fast as the receiver drains it; no per-chunk Python work)
    and a one-byte acknowledgement, as each HTTP send waits for its response."""

    def __init__(self, port: int, payload: memoryview) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.payload = payload

    async def send(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, len(self.payload).to_bytes(8, "little"))
        await loop.sock_sendall(self.sock, self.payload)
        if not await loop.sock_recv(self.sock, 1):
            raise ConnectionError("raw sink closed early")

    def close(self) -> None:
        self.sock.close()


def _cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) of this process, or of process ``pid``
    (Linux ``/proc``; NaN elsewhere)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Cpu:
    """CPU seconds spent by the sender (this process) and the receiver (``pid``) per variant,
    summed over rounds: unlike throughput, they barely depend on the machine's load, so they
    say where a variant's time goes even on a busy machine."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.spent: dict[str, list[float]] = {}
        self.messages: dict[str, int] = {}

    async def measure(self, key: str, send, nbytes: int, repeats: int) -> float:
        """Throughput (MB/s) of ``repeats`` sends; their CPU time is added to ``key``'s."""
        c0 = (_cpu_seconds(), _cpu_seconds(self.pid))
        t0 = time.perf_counter()
        for _ in range(repeats):
            await send()
        dt = time.perf_counter() - t0
        c1 = (_cpu_seconds(), _cpu_seconds(self.pid))
        spent = self.spent.setdefault(key, [0.0, 0.0])
        spent[0] += c1[0] - c0[0]
        spent[1] += c1[1] - c0[1]
        self.messages[key] = self.messages.get(key, 0) + repeats
        return repeats * nbytes / dt / 1e6

    def report(self) -> dict[str, dict[str, float]]:
        """Per variant: sender and receiver CPU milliseconds per message."""
        return {
            k: {
                "sender_ms": round(s * 1e3 / self.messages[k], 2),
                "receiver_ms": round(r * 1e3 / self.messages[k], 2),
            }
            for k, (s, r) in self.spent.items()
        }


async def _small_us(t: HttpTransport, n: int) -> float:
    small = Frame(arrays=(np.zeros(1024, np.float32),))  # 4 KiB
    t0 = time.perf_counter()
    for _ in range(n):
        await t.send("rx", "small", small)
    return (time.perf_counter() - t0) / n * 1e6


async def _small_windowed_us(t: HttpTransport, n: int, depth: int) -> float:
    """Mean time per 4 KiB frame when ``depth`` sends of the channel are in flight at once (as
    the engine's send lanes issue them; the transport's send window keeps their order)."""
    small = Frame(arrays=(np.zeros(1024, np.float32),))
    slots = asyncio.Semaphore(depth)

    async def one() -> None:
        try:
            await t.send("rx", "small_windowed", small)
        finally:
            slots.release()

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(n):
            await slots.acquire()
            tg.create_task(one())
    return (time.perf_counter() - t0) / n * 1e6


def _log(msg: str) -> None:
    print(f"[bench.transport] {msg}", file=sys.stderr, flush=True)


async def _sender(args: argparse.Namespace) -> dict:
    load_start = list(os.getloadavg())
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.transport", "--role", "receiver"]
        + (["--frame-streams"] if args.frame_streams else ["--no-frame-streams"]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    raw = None
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line:
            raise RuntimeError(f"the receiver exited (code {proc.wait()}); its error is above")
        addr = json.loads(line)
        big = np.random.default_rng(0).standard_normal(args.mib * MiB // 4, dtype=np.float32)
        raw = _RawSender(addr["raw_port"], memoryview(big).cast("B"))
        frame = Frame(arrays=(big,))
        bulk: dict = {"bulk_min_bytes": None} if args.no_bulk else {}
        bulk["frame_streams"] = args.frame_streams
        async with (
            HttpTransport(HttpConfig(name="tx", peers={"rx": addr["plain"]}, **bulk)) as plain,
            HttpTransport(
                HttpConfig(name="tx", secret=SECRET, peers={"rx": addr["signed"]}, **bulk)
            ) as signed,
        ):
            senders = {
                "raw": raw.send,
                "http": lambda: plain.send("rx", "big", frame),
                "http_hmac": lambda: signed.send("rx", "big", frame),
            }
            for send in senders.values():  # warm-up: connections, allocations
                await send()
            for t in (plain, signed):
                await _small_us(t, 20)
            await _small_windowed_us(plain, 20, WINDOW)
            # rounds interleave the variants, so load drifting on a shared machine hits all
            runs: dict[str, list[float]] = {
                k: [] for k in (*senders, "small_us", "small_hmac_us", "small_windowed_us")
            }
            cpu = _Cpu(proc.pid)
            for r in range(args.rounds):
                for key, send in senders.items():
                    runs[key].append(await cpu.measure(key, send, big.nbytes, args.repeats))
                runs["small_us"].append(await _small_us(plain, args.small))
                runs["small_hmac_us"].append(await _small_us(signed, args.small))
                small_windowed = await _small_windowed_us(plain, args.small, WINDOW)
                runs["small_windowed_us"].append(small_windowed)
                _log(
                    f"round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items())
                )
            requests = {p: n for (_, p), n in sorted(plain.frame_requests.items())}
    finally:
        if raw is not None:
            raw.close()
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [h / r for h, r in zip(runs["http"], runs["raw"], strict=True)]
    signed = [h / r for h, r in zip(runs["http_hmac"], runs["raw"], strict=True)]
    return {
        "bench": "transport",
        "tensor_MiB": args.mib,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "raw_MBps": round(med["raw"], 1),
        "http_MBps": round(med["http"], 1),
        "ratio_vs_raw": round(statistics.median(ratios), 3),
        "http_hmac_MBps": round(med["http_hmac"], 1),
        "ratio_signed_vs_raw": round(statistics.median(signed), 3),
        "cpu_ms_per_message": cpu.report(),
        "small_frame_us": round(med["small_us"], 1),
        "small_frame_hmac_us": round(med["small_hmac_us"], 1),
        "small_frame_windowed_us": round(med["small_windowed_us"], 1),
        "http_requests": requests,
        "frame_streams": args.frame_streams,
        "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "load": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.transport",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=4, help="large frames per variant per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    p.add_argument("--small", type=int, default=500, help="4 KiB frames for the overhead")
    p.add_argument(
        "--no-bulk",
        action="store_true",
        help="send every HTTP request as a plain POST (bulk_min_bytes=None)",
    )
    p.add_argument(
        "--frame-streams",
        action=argparse.BooleanOptionalAction,
        default=HttpConfig.frame_streams,
        help="small frames on frame streams (HttpConfig.frame_streams, both parties; default "
        "%(default)s); --no-frame-streams: POSTs only",
    )
    p.add_argument(
        "--role", choices=["sender", "receiver"], default="sender", help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    from tandem.parties.cli import run_async

    if args.role == "receiver":
        return run_async(lambda: _receiver(args.frame_streams))
    if not args.json:
        print(
            f"sending {args.repeats} x {args.mib} MiB over a raw socket and HTTP ...",
            file=sys.stderr,
        )
    result = run_async(lambda: _sender(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
