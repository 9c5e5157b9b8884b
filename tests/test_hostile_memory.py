"""Inbound memory under partial uploads: one budget bounds every byte held across streams,
idle partial messages are dropped, channels nobody uses are refused before any body byte."""

from __future__ import annotations

import asyncio
import re
import threading

import aiohttp
import numpy as np
import pytest

from hostile_helpers import (
    SECRET,
    assert_done,
    assert_same_params,
    incarnation,
    make_job,
    metrics_headers,
    rss_mb,
    run_pair,
    wait_healthy,
)
from tandem.transports import auth
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, HttpConfig, HttpTransport

MiB = 1 << 20
DECLARED, SENT, UPLOADS = 64 * MiB, 48 * MiB, 50


async def partial_upload(
    url: str, headers: dict[str, str], body: memoryview, declared: int
) -> int | None:
    """POST a body declared ``declared`` bytes long, send ``body`` (less), then close.
    Returns the status if the server answered meanwhile (a refusal, after which it may close
    the connection), else None."""
    host, port = url.split("//")[1].split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return None
    answer: asyncio.Future[bytes] | None = None
    try:
        head = [f"POST {FRAME_PATH} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head += [f"Content-Length: {declared}", "Content-Type: application/octet-stream"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = asyncio.ensure_future(reader.readline())
        try:
            for pos in range(0, len(body), MiB):
                if answer.done():
                    break
                writer.write(body[pos : pos + MiB])
                await writer.drain()
        except (ConnectionError, OSError):
            # a receiver closes a refused request's connection once it has answered: the
            # answer, when there was one, is already read
            await asyncio.sleep(0)
        if not answer.done():
            await asyncio.sleep(0.05)  # a refusal sent as the body ended
        status = None
        if answer.done() and not answer.exception():  # (retrieved either way)
            line = answer.result().decode("latin-1")
            status = int(line.split()[1]) if line.startswith("HTTP/") else None
        return status
    except (ConnectionError, OSError):
        return None
    finally:
        if answer is not None:
            answer.cancel()
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved: the connection's end is expected here
        writer.transport.abort()


def signed_headers(receiver: HttpTransport, sender: str, inc: str, channel: str, msg_id: int):
    headers = {
        "X-Tandem-Sender": sender,
        "X-Tandem-Incarnation": inc,
        "X-Tandem-Channel": channel,
        "X-Tandem-Msg-Id": str(msg_id),
        "X-Tandem-Chunk": "0",
        "X-Tandem-Chunks": "1",
        "X-Tandem-Offset": "0",
        "X-Tandem-Total": str(DECLARED),
        "X-Tandem-Spec": "",
    }
    # the digest of a body that never arrives whole: checked only once it is complete
    return auth.sign(
        SECRET,
        "POST",
        FRAME_PATH,
        headers,
        auth.DIGEST_PREFIX + "0" * 64,
        receiver=receiver.name,
        to=receiver.incarnation,
    )


class RssPeak:
    """The highest RSS of this process, sampled every 5 ms on a thread while active."""

    def __init__(self) -> None:
        self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mb())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def test_partial_uploads_across_streams_stay_within_the_budget():
    """50 signed uploads on 50 channels, each declaring 64 MiB and sending 48 MiB before
    closing: at most ``inbound_budget`` bytes are ever held (the others get 503 before their
    body), the process grows by at most the budget plus what is in flight per connection
    plus a constant, the abandoned
    partial messages are dropped after ``partial_timeout`` (the budget is whole again), and a
    frame sent afterwards is delivered."""
    budget = 256 * MiB
    rx = await HttpTransport(
        HttpConfig(
            name="rx",
            secret=SECRET,
            peers={"tx": "http://127.0.0.1:9"},
            inbound_budget=budget,
            max_frame_bytes=DECLARED,
            partial_timeout=1.0,
            backpressure_wait=0.3,
        )
    ).start()
    tx = await HttpTransport(HttpConfig(name="tx", secret=SECRET, peers={"rx": rx.url})).start()
    rx.add_peer("tx", tx.url)
    try:
        payload = memoryview(np.ones(SENT, np.uint8))  # touched: part of the baseline
        await asyncio.sleep(0)
        base = rss_mb()
        with RssPeak() as rss:
            statuses = await asyncio.gather(
                *(
                    partial_upload(
                        rx.url,
                        signed_headers(rx, "tx", "attacker", f"u{i}", 0),
                        payload,
                        DECLARED,
                    )
                    for i in range(UPLOADS)
                )
            )
        grown = rss.peak - base
        # the budget, plus per connection one 1 MiB piece in flight on each side (the attacker
        # runs in this process: its transport keeps a piece the socket has not taken yet, the
        # receiver reads one), plus a constant; far below the 2.4 GiB the attackers send
        allowance = budget / MiB + UPLOADS * 2 + 64
        assert grown <= allowance, f"grew {grown:.0f} MiB over {base:.0f} MiB"
        assert statuses.count(503) >= UPLOADS - budget // DECLARED, statuses
        # abandoned partial messages are held until partial_timeout (on a loaded machine the
        # first may already be dropped by the time the last upload is refused)
        assert _held(rx) <= budget
        for _ in range(200):
            if _held(rx) == 0:
                break
            await asyncio.sleep(0.05)
        assert _held(rx) == 0
        assert _metric(rx, "tandem_partials_dropped_total") >= 1
        x = np.arange(10, dtype=np.float32)
        await tx.send("rx", "after", Frame(arrays=(x,)))
        np.testing.assert_array_equal((await rx.recv("tx", "after")).arrays[0], x)
    finally:
        await tx.aclose()
        await rx.aclose()


def _held(t: HttpTransport) -> int:
    return _metric(t, "tandem_inbound_bytes_held")


def _metric(t: HttpTransport, name: str) -> int:
    m = re.search(rf'^{name}\{{party="rx"\}} (\d+)$', t.metrics_text(), re.M)
    assert m is not None, f"{name} not in the metrics"
    return int(m.group(1))


@pytest.mark.slow
async def test_uploads_on_channels_nobody_uses_are_refused_before_their_body(
    tmp_path, hostile_reference
):
    """The same 50 uploads against a training party, on channels its task does not use:
    each is refused (403) at its head, nothing of it is held, and the job trains on."""
    job = make_job(tmp_path)

    async def attack(job, finished):
        lead = job.url("leader")
        await wait_healthy(lead)
        await wait_healthy(job.url("follower"))
        inc = await incarnation(lead, "leader", "follower")
        fol_inc = await incarnation(job.url("follower"), "follower", "leader")

        class Leader:  # what `signed_headers` needs of the receiver
            name, incarnation = "leader", inc

        payload = memoryview(np.ones(SENT, np.uint8))
        statuses = await asyncio.gather(
            *(
                partial_upload(
                    lead,
                    signed_headers(Leader, "follower", fol_inc, f"junk{i}", 10**6),  # type: ignore[arg-type]
                    payload,
                    DECLARED,
                )
                for i in range(UPLOADS)
            )
        )
        async with aiohttp.ClientSession() as s:
            async with s.get(lead + "/metrics", headers=metrics_headers("leader", "follower")) as r:
                text = await r.text()
        return statuses, text

    results, (statuses, text) = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert statuses == [403] * UPLOADS, statuses
    assert re.search(r'^tandem_inbound_bytes_held\{party="leader"\} (\d+)$', text, re.M)
