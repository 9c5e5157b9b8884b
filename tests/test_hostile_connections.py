"""Connections an attacker holds open: heads that never finish (more of them than the cap,
under ``ulimit -n 1024``), bodies that stall, a peer that freezes. The parties keep serving
``/healthz``, keep training and write their files; sends to a frozen peer give up."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from hostile_helpers import (
    ACT,
    GRAD,
    SECRET,
    assert_done,
    assert_same_params,
    frame_request,
    incarnation,
    make_job,
    run_pair,
    wait_healthy,
)
from tandem.errors import PeerUnavailableError
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, HttpConfig, HttpTransport


async def poll_health(url: str, until: asyncio.Event, limit: float) -> list[float | None]:
    """``GET /healthz`` every 0.1 s (each on a fresh connection, 5 s allowed: the machine may
    be loaded, and a locked-out server never answers at all): the seconds each took, None
    for a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    took: list[float | None] = []
    while not until.is_set() and loop.time() < deadline:
        t0 = loop.time()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    took.append(loop.time() - t0 if r.status == 200 else None)
        except (aiohttp.ClientError, OSError, TimeoutError):
            took.append(None)
        await asyncio.sleep(0.1)
    return took


@pytest.mark.slow
async def test_slow_loris_beyond_the_cap_under_ulimit_1024(tmp_path, hostile_reference):
    """Both parties run as processes with ``RLIMIT_NOFILE`` 1024 while 1000 connections keep
    sending request heads that never end to the follower (reopened as soon as it closes
    them): its ``/healthz`` keeps answering as long as it runs,
    training finishes, both parties write their checkpoints and export, and the parameters
    are those of the unattacked run."""
    job = make_job(tmp_path)
    # the polls below need the run to last a few seconds: the parties compile their kernels
    procs = {r: job.start(r, nofile=1024, compile_cache=False) for r in ("follower", "leader")}
    attacker = None
    try:
        await wait_healthy(job.url("follower"), 60)
        # the attacker is a process of its own: its thousand connections must not slow
        # down this loop's /healthz polls
        attacker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.hostile",
            "--loris",
            job.url("follower"),
            "1000",
            "90",
            stdout=asyncio.subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
        )
        done = asyncio.Event()

        async def watch() -> None:  # the follower serves until it has finished
            while procs["follower"].popen.poll() is None:
                await asyncio.sleep(0.1)
            done.set()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(watch())
            health = tg.create_task(poll_health(job.url("follower"), done, 90))
        attacker.terminate()
        said, _ = await attacker.communicate()
        results = {r: p.finish(30) for r, p in procs.items()}
    finally:
        if attacker is not None and attacker.returncode is None:
            attacker.kill()
            await attacker.wait()
        for p in procs.values():
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait()
    for role, (rc, out, err) in results.items():
        assert rc == 0 and out["status"] == "done", (role, err[-3000:])
        assert "Too many open files" not in err
    assert int(said.split()[-1]) >= 1000  # connections the attacker opened
    took = health.result()
    # every poll answered until the follower closed its transport at the end of its run
    last = max(i for i, t in enumerate(took) if t is not None)
    failed = [i for i in range(last) if took[i] is None]
    assert last >= 20 and not failed, f"{len(failed)} of {last} /healthz polls failed: {failed}"
    assert len(took) - last <= 30, "the follower stopped answering long before it exited"
    assert job.checkpoints("leader") == job.checkpoints("follower") != []
    assert_same_params(job, hostile_reference)


@pytest.mark.slow
async def test_stalled_bodies_never_block_a_stream(tmp_path, hostile_reference):
    """A peer's identity (secret and process incarnation) sends, on every stream the parties
    use, a request whose body stops after 10 bytes and whose connection stays open: the
    parties' own requests on those streams go through (the stalled one is cut off) and the
    job trains to the end, unaffected."""
    job = make_job(tmp_path)

    async def stall(url: str, headers: dict[str, str], hold: asyncio.Event) -> None:
        host, port = url.split("//")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            head = [f"POST {FRAME_PATH} HTTP/1.1", f"Host: {host}:{port}"]
            head += [f"{k}: {v}" for k, v in headers.items()]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + b"0123456789")
            await writer.drain()
            reading = asyncio.ensure_future(reader.read())
            waiting = asyncio.ensure_future(hold.wait())
            await asyncio.wait({reading, waiting}, return_when=asyncio.FIRST_COMPLETED)
            reading.cancel()
            waiting.cancel()
        finally:
            writer.transport.abort()

    async def attack(job, finished):
        lead, fol = job.url("leader"), job.url("follower")
        await wait_healthy(lead)
        await wait_healthy(fol)
        lead_inc = await incarnation(lead, "leader", "follower")
        fol_inc = await incarnation(fol, "follower", "leader")
        streams = [
            (lead, dict(receiver="leader", to=lead_inc, sender="follower"), fol_inc, "ctl"),
            (lead, dict(receiver="leader", to=lead_inc, sender="follower"), fol_inc, ACT),
            (fol, dict(receiver="follower", to=fol_inc, sender="leader"), lead_inc, "ctl"),
            (fol, dict(receiver="follower", to=fol_inc, sender="leader"), lead_inc, GRAD),
        ]
        rounds = 0
        while not finished.is_set() and rounds < 40:
            rounds += 1
            batch = []
            for url, who, inc, channel in streams:
                headers, _ = frame_request(
                    **who,
                    sender_inc=inc,
                    channel=channel,
                    msg_id=10**6 + rounds,
                    frame=Frame(arrays=(np.zeros((8, 4), np.float32),)),
                )
                headers["X-Tandem-Total"] = "4096"
                headers["Content-Length"] = "4096"
                batch.append(stall(url, headers, finished))
            try:
                async with asyncio.timeout(0.5):  # a new set of stalls every half second
                    await asyncio.gather(*batch)
            except (TimeoutError, OSError):
                pass
        return rounds

    results, rounds = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert rounds >= 2


async def test_a_stalled_attempt_is_taken_over_by_its_retry():
    """The first attempt of a message stalls after 10 body bytes (its connection stays open);
    the sender's own request for the same message and chunk takes over at once instead of
    waiting for the stalled one."""
    async with (
        HttpTransport(HttpConfig(name="b", secret=SECRET, peers={"a": "http://127.0.0.1:9"})) as b,
        HttpTransport(HttpConfig(name="a", secret=SECRET, peers={"b": b.url})) as a,
    ):
        b.add_peer("a", a.url)
        x = np.arange(4096, dtype=np.float32)
        headers, body = frame_request(
            receiver="b",
            to=b.incarnation,
            sender="a",
            sender_inc=a.incarnation,
            channel="c",
            msg_id=0,
            frame=Frame(arrays=(x,)),
        )
        host, port = b.url.split("//")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            head = [f"POST {FRAME_PATH} HTTP/1.1", f"Host: {host}:{port}"]
            head += [f"{k}: {v}" for k, v in headers.items()]
            head.append(f"Content-Length: {len(body)}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body[:10])
            await writer.drain()
            await asyncio.sleep(0.2)  # the stalled attempt holds message 0
            t0 = time.monotonic()
            await a.send("b", "c", Frame(arrays=(x,)))  # message 0 again: takes over
            assert time.monotonic() - t0 < 5
            np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
            assert await asyncio.wait_for(reader.read(), 5) is not None  # cut off
        finally:
            writer.transport.abort()


async def test_a_frozen_peer_cannot_hang_a_send():
    """A peer that accepts connections and then never answers (a stopped process, a network
    split without a reset): each attempt gives up after ``read_timeout`` without progress and
    the send fails after ``retry_timeout``, with the usual backoff between attempts."""
    frozen = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = frozen.getsockname()[1]
    try:
        cfg = HttpConfig(
            name="a",
            secret=SECRET,
            peers={"b": f"http://127.0.0.1:{port}"},
            read_timeout=0.3,
            retry_timeout=1.0,
            backoff_base=0.01,
            backoff_max=0.05,
        )
        async with HttpTransport(cfg) as a:
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailableError, match="unreachable"):
                await a.send("b", "c", Frame(arrays=(np.zeros(10, np.float32),)))
            took = time.monotonic() - t0
            assert 1.0 <= took < 5.0, took
            assert a.send_retries["b"] >= 2
    finally:
        frozen.close()


async def test_connection_caps_and_head_timeouts():
    """With ``max_connections=8``: 20 connections that never finish their heads hold at most
    8 descriptors (the oldest are replaced), a prompt ``GET /healthz`` still gets in, and a
    head that is still unfinished after ``header_timeout`` is closed."""
    cfg = HttpConfig(
        name="srv",
        peers={"a": "http://127.0.0.1:9"},
        max_connections=8,
        max_connections_per_address=8,
        header_timeout=0.5,
    )
    async with HttpTransport(cfg) as srv:
        host, port = srv.url.split("//")[1].split(":")
        held = []
        try:
            for _ in range(20):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                held.append((reader, writer))
                await asyncio.sleep(0.01)
            listener = srv._server.listener
            assert listener is not None and len(listener) <= 8
            async with aiohttp.ClientSession() as s:
                async with s.get(srv.url + "/healthz") as r:
                    assert r.status == 200 and await r.json() == {"status": "ok"}
                    assert r.headers["Server"] == "tandem"
            assert listener.evicted >= 12
            # every held head is closed: replaced, or after header_timeout
            ends = await asyncio.gather(*(asyncio.wait_for(reader.read(), 3) for reader, _ in held))
            assert all(end == b"" for end in ends)
            assert 'cause="head_timeout"' in srv.metrics_text()
        finally:
            for _, writer in held:
                writer.transport.abort()


async def test_pipelined_refusals_unread_stop_the_reading():
    """One connection pipelining unsigned frame requests (each refused 401 from its head) and
    never reading the answers: the server stops reading it within a few MiB instead of taking
    every request into its memory, and keeps serving others."""
    cfg = HttpConfig(name="srv", secret=SECRET, peers={"a": "http://127.0.0.1:9"})
    async with HttpTransport(cfg) as srv:
        host, port = srv.url.split("//")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"POST {FRAME_PATH} HTTP/1.1\r\nHost: x\r\nX-Tandem-Sender: a\r\n"
        chunk = (head + "Content-Length: 0\r\n\r\n").encode() * 10_000  # ~1 MiB
        taken = 0
        try:
            while taken < 64 << 20:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 3)
                taken += len(chunk)
        except TimeoutError:
            pass
        finally:
            writer.transport.abort()
        assert taken < 32 << 20, f"the server took {taken >> 20} MiB of pipelined requests"
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/healthz") as r:
                assert r.status == 200


async def test_no_handler_until_the_first_head_ends():
    """A connection whose head never ends gets no aiohttp handler (a slow-loris costs an
    accept and a timer); a head sent a byte at a time is answered once it ends, and a head
    beyond the hold limit goes to aiohttp, which refuses it."""
    from tandem.transports.http.connections import HEAD_HOLD_LIMIT

    cfg = HttpConfig(name="srv", peers={"a": "http://127.0.0.1:9"}, header_timeout=5.0)
    async with HttpTransport(cfg) as srv:
        host, port = srv.url.split("//")[1].split(":")
        listener = srv._server.listener
        assert listener is not None
        slow = await asyncio.open_connection(host, int(port))
        slow[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        drip = await asyncio.open_connection(host, int(port))
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        try:
            for i in range(len(head) - 1):
                drip[1].write(head[i : i + 1])
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
            assert len(listener) == 2 and all(g.inner is None for g in listener.guards)
            drip[1].write(head[-1:])
            answer = await asyncio.wait_for(drip[0].read(), 5)
            assert answer.startswith(b"HTTP/1.1 200")
            huge = await asyncio.open_connection(host, int(port))
            huge[1].write(b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * HEAD_HOLD_LIMIT)
            answer = await asyncio.wait_for(huge[0].read(), 5)
            assert answer.split(b" ")[1] == b"400"  # aiohttp's own refusal of the head
            huge[1].transport.abort()
            assert [g.inner for g in listener.guards if g.phase == "head"][:1] == [None]
        finally:
            slow[1].transport.abort()
            drip[1].transport.abort()


def test_the_connection_cap_leaves_descriptors_for_the_partys_files(monkeypatch):
    import resource

    from tandem.errors import ConfigError
    from tandem.transports.http.connections import connection_cap

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert connection_cap(1000) == 1024 - 256  # a quarter kept free
    assert connection_cap(100) == 100
    monkeypatch.setattr(resource, "getrlimit", lambda _: (130, 4096))
    with pytest.raises(ConfigError, match="ulimit -n"):
        connection_cap(100)


async def test_a_connection_accepted_as_the_listener_stops_is_closed_not_leaked(monkeypatch):
    """The accept wait may be cancelled (`Listener.stop`) after a connection was accepted
    but before the loop resumed the wait: that socket is closed then (with
    ``loop.sock_accept`` it was lost unclosed; its peer never saw the end of the stream)."""
    from tandem.transports.http.connections import Listener

    listener = Listener(asyncio.Protocol, max_connections=8, max_per_address=8,
                        header_timeout=5.0, keepalive_timeout=5.0)  # fmt: skip
    port = await listener.start("127.0.0.1", 0)
    assert listener._task is not None
    listener._task.cancel()  # the accept loop; the test drives one wait itself
    with pytest.raises(asyncio.CancelledError):
        await listener._task
    client = socket.create_connection(("127.0.0.1", port), timeout=5)  # in the backlog now
    loop = asyncio.get_running_loop()
    # the reader's callback runs one loop turn after the wait suspends, as on a real event
    monkeypatch.setattr(loop, "add_reader", lambda fd, cb: loop.call_soon(cb))
    monkeypatch.setattr(loop, "remove_reader", lambda fd: True)
    waiting = asyncio.create_task(listener._accept_one())
    await asyncio.sleep(0)  # the wait suspends on its future; the callback is queued
    await asyncio.sleep(0)  # the callback accepted the connection and set the result
    assert not waiting.done()  # ... but the wait has not resumed yet: cancel it now
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    monkeypatch.undo()
    await listener.stop()
    client.settimeout(5)
    assert client.recv(1) == b""  # the accepted socket was closed, not left open
    client.close()
