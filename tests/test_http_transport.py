"""HTTP-specific behaviour beyond the conformance suite: tiny chunks, retry across an outage,
receiver de-duplication, chunk order."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from tandem.errors import PeerUnavailableError
from tandem.transports import auth, codec
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, HttpConfig, HttpTransport

SECRET = b"k"


def cfg(name, **kw):
    return HttpConfig(name=name, secret=SECRET, backoff_base=0.005, backoff_max=0.05, **kw)


async def test_tiny_chunks_reassemble_exactly():
    async with (
        HttpTransport(cfg("a", chunk_bytes=7)) as a,
        HttpTransport(cfg("b", peers={"a": "http://127.0.0.1:9"})) as b,
    ):
        b.add_peer("a", a.url)
        a.add_peer("b", b.url)
        arrays = (
            np.arange(50, dtype=np.float64),
            np.array([], np.int8),
            np.arange(3, dtype=np.uint8),
        )
        await a.send("b", "c", Frame(meta={"x": 1}, arrays=arrays))
        got = await b.recv("a", "c")
        for x, y in zip(arrays, got.arrays, strict=True):
            np.testing.assert_array_equal(x, y)
        n_chunks = -(-codec.encoded_size(got) // 7)
        assert n_chunks > 60 and b.received_stats("a").frames == 1


async def test_send_retries_across_peer_outage_and_delivers_once():
    b = await HttpTransport(cfg("b", peers={"a": "http://127.0.0.1:9"})).start()
    port = int(b.url.rsplit(":", 1)[1])
    a = await HttpTransport(cfg("a", peers={"b": b.url}, retry_timeout=20.0)).start()
    b.add_peer("a", a.url)
    await a.send("b", "c", Frame(meta={"i": 0}))
    assert (await b.recv("a", "c")).meta == {"i": 0}
    await b.aclose()
    sending = asyncio.create_task(a.send("b", "c", Frame(meta={"i": 1})))
    await asyncio.sleep(0.1)  # the send is retrying against a closed port
    assert not sending.done()
    b2 = await HttpTransport(cfg("b", port=port, peers={"a": a.url})).start()
    await asyncio.wait_for(sending, 10)
    assert (await b2.recv("a", "c")).meta == {"i": 1}
    assert a.metrics_text().count("tandem_send_retries_total{") == 1
    for t in (a, b2):
        await t.aclose()


async def test_unreachable_peer_raises_after_retry_timeout():
    async with HttpTransport(cfg("a", peers={"b": "http://127.0.0.1:9"}, retry_timeout=0.2)) as a:
        with pytest.raises(PeerUnavailableError, match="retry_timeout"):
            await a.send("b", "c", Frame())


def _headers(body: bytes, msg_id: int, chunk=0, chunks=1, offset=0, total=None, *, to):
    """Signed routing headers of a hand-made request to the transport ``to``."""
    h = {
        "X-Tandem-Sender": "a",
        "X-Tandem-Incarnation": "i1",
        "X-Tandem-Channel": "c",
        "X-Tandem-Msg-Id": str(msg_id),
        "X-Tandem-Chunk": str(chunk),
        "X-Tandem-Chunks": str(chunks),
        "X-Tandem-Offset": str(offset),
        "X-Tandem-Total": str(len(body) if total is None else total),
        "X-Tandem-Spec": "",
    }
    return auth.sign(
        SECRET,
        "POST",
        FRAME_PATH,
        h,
        auth.body_digest([body]),
        receiver=to.name,
        to=to.incarnation,
    )


async def test_receiver_deduplicates_retries_and_refuses_out_of_order_chunks():
    async with (
        HttpTransport(cfg("b", peers={"a": "http://127.0.0.1:9"})) as b,
        aiohttp.ClientSession() as s,
    ):

        async def post(body, **kw):
            async with s.post(
                b.url + FRAME_PATH, data=body, headers=_headers(body, to=b, **kw)
            ) as r:
                return r.status, await r.text()

        f0 = codec.encode(Frame(sender="a", channel="c", msg_id=0, meta={"i": 0}))
        assert await post(f0, msg_id=0) == (200, "ok")
        assert await post(f0, msg_id=0) == (200, "duplicate")  # a retry: acknowledged only
        f1 = codec.encode(Frame(sender="a", channel="c", msg_id=1, meta={"i": 1}))
        half = len(f1) // 2
        status, text = await post(
            f1[half:], msg_id=1, chunk=1, chunks=2, offset=half, total=len(f1)
        )
        assert status == 409 and '"expect_chunk":0' in text
        assert await post(f1[:half], msg_id=1, chunk=0, chunks=2, total=len(f1)) == (200, "chunk")
        assert await post(f1[half:], msg_id=1, chunk=1, chunks=2, offset=half, total=len(f1)) == (
            200,
            "ok",
        )
        assert [(await b.recv("a", "c")).meta["i"] for _ in range(2)] == [0, 1]
        assert b.refused == {"out_of_order": 1}
