"""A receive waiting on a peer that died without a goodbye (kill -9, lost machine) does not wait
forever: past ``peer_timeout``, or once a new process answers at the peer's address, the peer
counts as gone and ``recv`` raises as after a clean close. A silent but live peer, and a peer
never heard from (perhaps not started yet), are waited for."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.errors import TransportClosedError
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig, HttpTransport


def cfg(name, **kw):
    return HttpConfig(name=name, secret=b"k", backoff_base=0.005, backoff_max=0.05, **kw)


async def crash(t: HttpTransport) -> None:
    """Stop ``t`` the way kill -9 would: no goodbye, its port simply stops answering."""
    await t._server.stop()
    await t._client.session.close()
    t._closed = True


async def pair(http_pair, timeout=0.6):
    """``a`` (with ``peer_timeout=timeout``) and ``b``, after one frame from ``b`` to ``a``."""
    a, b = await http_pair(cfg, a_kw={"peer_timeout": timeout})
    await b.send("a", "c", Frame(meta={"i": 0}))
    assert (await a.recv("b", "c")).meta == {"i": 0}  # a now knows b's incarnation
    return a, b


async def test_a_silent_live_peer_is_waited_for(http_pair):
    a, b = await pair(http_pair, timeout=1.5)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(a.recv("b", "c"), 3.5)  # > 2 x peer_timeout of probes
    await b.send("a", "c", Frame(meta={"i": 1}))
    assert (await a.recv("b", "c")).meta == {"i": 1}


async def test_a_killed_peer_is_gone_after_peer_timeout(http_pair):
    a, b = await pair(http_pair)
    await crash(b)
    t0 = time.monotonic()
    with pytest.raises(TransportClosedError, match=r"has not answered .*peer_timeout=0.6"):
        await asyncio.wait_for(a.recv("b", "c"), 10)
    assert 0.5 < time.monotonic() - t0 < 5
    with pytest.raises(TransportClosedError):  # and stays gone, at once
        await asyncio.wait_for(a.recv("b", "other"), 1)


async def test_a_restarted_peer_ends_the_wait_and_its_new_frames_flow(http_pair):
    a, b = await pair(http_pair, timeout=30.0)  # the restart is seen long before the timeout
    port = int(b.url.rsplit(":", 1)[1])
    await crash(b)
    # the new process takes over the address the peer had (the port the old one was given)
    b2 = await HttpTransport(cfg("b", port=port, peers={"a": a.url})).start()
    try:
        with pytest.raises(TransportClosedError, match="restarted"):
            await asyncio.wait_for(a.recv("b", "c"), 10)
        await b2.send("a", "c", Frame(meta={"i": 7}))  # the new incarnation reopens the stream
        assert (await asyncio.wait_for(a.recv("b", "c"), 10)).meta == {"i": 7}
    finally:
        await b2.aclose()


async def test_a_restarted_peer_that_does_not_know_us_yet_ends_the_wait():
    """Like a restarted FL server: it admits its clients as they send (``admit_unknown``), so
    its ``/healthz`` names no incarnation to a client that has not sent to it yet."""
    server_cfg = {"admit_unknown": True, "admit_names": frozenset({"a"})}
    async with HttpTransport(cfg("b", **server_cfg)) as b:
        port = int(b.url.rsplit(":", 1)[1])
        async with HttpTransport(cfg("a", peer_timeout=30.0, peers={"b": b.url})) as a:
            await a.send("b", "up", Frame(meta={"hello": 1}))  # b admits a, and can answer it
            assert (await b.recv("a", "up")).meta == {"hello": 1}
            await b.send("a", "c", Frame(meta={"i": 0}))
            assert (await a.recv("b", "c")).meta == {"i": 0}  # a knows b's incarnation
            await crash(b)
            async with HttpTransport(cfg("b", port=port, **server_cfg)) as b2:
                with pytest.raises(TransportClosedError, match="restarted"):
                    await asyncio.wait_for(a.recv("b", "c"), 10)
                await a.send("b", "up", Frame(meta={"hello": 2}))  # re-signed for b2: admitted
                assert (await asyncio.wait_for(b2.recv("a", "up"), 10)).meta == {"hello": 2}
                await b2.send("a", "c", Frame(meta={"i": 7}))
                assert (await asyncio.wait_for(a.recv("b", "c"), 10)).meta == {"i": 7}


async def test_a_peer_never_heard_from_is_waited_for():
    async with HttpTransport(cfg("a", peer_timeout=0.3, peers={"b": "http://127.0.0.1:9"})) as a:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(a.recv("b", "c"), 1.5)


def test_peer_timeout_must_be_positive():
    with pytest.raises(ValueError, match="peer_timeout"):
        HttpConfig(name="a", peer_timeout=0)
