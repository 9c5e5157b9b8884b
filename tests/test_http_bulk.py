"""The HTTP transport's bulk path (``bulk_min_bytes``): a request upgraded to
``tandem-frame/1`` whose body is received outside aiohttp, straight into the frame buffer.

Every guarantee of the plain path is checked here on the bulk path too (the conformance suite
also runs with every request bulk, see test_transport_conformance.py). Each test asserts on
`HttpTransport.frame_requests`, so a silent fall-back to the plain path fails it. The main
scenarios run on both event loops: asyncio's (the tests' default) and uvloop (the CLI's): the
receiving protocol is swapped under the loop's own transport, so both are exercised.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import numpy as np
import orjson
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_helpers import open_pair
from hypothesis_profiles import examples
from tandem.errors import (
    AuthenticationError,
    FrameError,
    PayloadTooLargeError,
    PeerUnavailableError,
    TransportError,
)
from tandem.transports import auth, codec
from tandem.transports.base import Frame
from tandem.transports.http import BULK_PROTOCOL, FRAME_PATH, H_LENGTH, HttpConfig, HttpTransport
from test_http_security import SECRET, _mutate, bound, live_server, make_cert, routing

MiB = 1 << 20
LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    """Runs a scenario coroutine on a fresh loop of each kind."""
    return LOOPS[request.param]


def cfg(name, **kw) -> HttpConfig:
    kw.setdefault("secret", SECRET)
    kw.setdefault("bulk_min_bytes", 64 << 10)
    kw.setdefault("retry_timeout", 2.0)
    return HttpConfig(name=name, backoff_base=0.005, backoff_max=0.05, **kw)


def tensor(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)


def bulk(t: HttpTransport, direction: str) -> int:
    return t.frame_requests.get((direction, "bulk"), 0)


def _unwrapped(protocol):
    """aiohttp's request handler behind the server's connection guard."""
    return getattr(protocol, "inner", protocol)


async def no_connections_left(t: HttpTransport) -> None:
    """aiohttp forgets every connection taken over by the bulk path once it closes (the bulk
    sink passes connection_lost on); only plain keep-alive connections may remain."""

    def taken_over():
        return [
            h
            for h in t._server.runner.server.connections
            if h.transport is None or _unwrapped(h.transport.get_protocol()) is not h
        ]

    for _ in range(200):
        if not taken_over():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(taken_over())} bulk connections left behind")


# -- a hand-made bulk client: what a buggy or hostile peer can send -----------------------------


def bulk_headers(
    to, msg_id: int, body: bytes, *, digest_of: bytes | None = None, secret=SECRET, **over
) -> dict[str, str]:
    h = routing(msg_id, body, **over)
    h = auth.sign(
        secret,
        "POST",
        FRAME_PATH,
        h,
        auth.body_digest([body if digest_of is None else digest_of]),
        **bound(to),
    )
    h.setdefault(H_LENGTH, str(len(body)))
    return h


async def bulk_post(
    url: str, headers: dict[str, str], body: bytes, *, close_after: int | None = None
) -> tuple[str, int, str]:
    """``("http", status, text)`` when refused before the upgrade, ``("line", status, text)``
    for the reply after the body; ``close_after``: drop the connection after that many body
    bytes (``("closed", 0, "")``)."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = [
            f"POST {FRAME_PATH} HTTP/1.1",
            f"Host: {host}:{port}",
            "Content-Length: 0",
            "Connection: Upgrade",
            f"Upgrade: {BULK_PROTOCOL}",
        ]
        head += [f"{k}: {v}" for k, v in headers.items() if k != "Content-Length"]
        if "Content-Length" in headers:
            head[2] = f"Content-Length: {headers['Content-Length']}"
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        raw = await reader.readuntil(b"\r\n\r\n")
        status = int(raw.split(b" ", 2)[1])
        if status != 101:
            lines = raw.decode().lower().split("\r\n")
            n = next(int(x.split(":")[1]) for x in lines if x.startswith("content-length:"))
            return "http", status, (await reader.readexactly(n)).decode()
        assert b"upgrade: " + BULK_PROTOCOL.encode() in raw.lower()
        if close_after is not None:
            writer.write(body[:close_after])
            await writer.drain()
            writer.transport.abort()
            return "closed", 0, ""
        writer.write(body)
        await writer.drain()
        reply = orjson.loads(await reader.readuntil(b"\n"))
        return "line", reply["status"], reply["text"]
    finally:
        writer.close()


def encoded(x: np.ndarray, msg_id: int = 0, channel: str = "c", spec: str = "") -> bytes:
    return codec.encode(
        Frame(arrays=(x,)).replace(sender="a", channel=channel, msg_id=msg_id, spec_hash=spec)
    )


# -- end to end, both loops --------------------------------------------------------------------


@pytest.mark.parametrize("secret", [SECRET, None], ids=["hmac", "plain"])
def test_large_frames_travel_bulk_and_small_ones_plain(run, secret):
    async def scenario():
        # POSTs only (frame_streams=False): this test counts requests by path, and a frame
        # stream would carry the small frame as a record instead of a plain POST
        a, b = await open_pair(
            cfg,
            {"secret": secret, "chunk_bytes": 2 * MiB + 5, "frame_streams": False},
            {"secret": secret},
        )
        try:
            xs = [tensor(5 * MiB + 4 * i, seed=i) for i in range(3)]
            for x in xs:
                await a.send("b", "c", Frame(arrays=(x,)))
            for x in xs:
                np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
            assert bulk(a, "sent") == bulk(b, "received") == 9  # 3 chunks >= 64 KiB each
            await a.send("b", "small", Frame(arrays=(np.zeros(16, np.float32),)))
            await b.recv("a", "small")
            assert a.frame_requests == {("sent", "bulk"): 9, ("sent", "plain"): 1}
            sent, got = a.sent_stats("b"), b.received_stats("a")
            assert (
                sent.bytes
                == got.bytes
                == sum(
                    codec.encoded_size(
                        Frame(arrays=(x,)).replace(sender="a", channel="c", msg_id=i)
                    )
                    for i, x in enumerate(xs)
                )
                + codec.encoded_size(
                    Frame(arrays=(np.zeros(16, np.float32),)).replace(
                        sender="a", channel="small", msg_id=0
                    )
                )
            )
            assert sent.frames == got.frames == 4 and got.busy_seconds > 0
            assert (
                'tandem_frame_requests_total{party="b",direction="received",path="bulk"} 9'
                in b.metrics_text()
            )
            assert b.refused == {}
            await no_connections_left(b)
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())


def test_tls_and_mutual_tls_on_the_bulk_path(run, tmp_path):
    srv_cert, srv_key = make_cert(tmp_path, "server")
    cli_cert, cli_key = make_cert(tmp_path, "client")

    async def scenario():
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(srv_cert, srv_key)
        server_ctx.verify_mode = ssl.CERT_REQUIRED
        server_ctx.load_verify_locations(cli_cert)
        client_ctx = ssl.create_default_context(cafile=srv_cert)
        client_ctx.load_cert_chain(cli_cert, cli_key)
        b = await HttpTransport(
            cfg("b", ssl_server=server_ctx, peer_identities={"a": ["client"]})
        ).start()
        a = await HttpTransport(cfg("a", ssl_client=client_ctx, peers={"b": b.url})).start()
        no_cert = await HttpTransport(
            cfg(
                "a",
                ssl_client=ssl.create_default_context(cafile=srv_cert),
                peers={"b": b.url},
                retry_timeout=0.3,
            )
        ).start()
        try:
            b.add_peer("a", a.url)
            x = tensor(3 * MiB)
            await a.send("b", "c", Frame(arrays=(x,)))
            np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
            assert bulk(a, "sent") == bulk(b, "received") == 1
            with pytest.raises(PeerUnavailableError):  # no client certificate
                await no_cert.send("b", "c", Frame(arrays=(x,)))
            assert bulk(b, "received") == 1
            await no_connections_left(b)
        finally:
            for t in (a, no_cert, b):
                await t.aclose()

    run(scenario())


class _CuttingProxy:
    """Forwards TCP connections to ``target``; the first ``cuts`` connections that carry more
    than ``after`` bytes towards the target are cut there (both sides aborted)."""

    def __init__(self, target_port: int, after: int, cuts: int = 1) -> None:
        self.target_port, self.after, self.cuts = target_port, after, cuts
        self.cut = 0
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, cr, cw) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        cut = self.cut < self.cuts

        async def pump(r, w, limit):
            moved = 0
            try:
                while data := await r.read(1 << 16):
                    if limit is not None and moved + len(data) > limit:
                        self.cut += 1
                        w.write(data[: limit - moved])
                        cw.transport.abort()
                        sw.transport.abort()
                        return
                    moved += len(data)
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(pump(cr, sw, self.after if cut else None))
            tg.create_task(pump(sr, cw, None))

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def test_connection_dropped_mid_body_is_retried_and_delivered_once(run):
    async def scenario():
        # POSTs only (frame_streams=False): this test counts the connections the bulk path
        # took over, and a live frame stream (persistent by design) is one as well
        a, b = await open_pair(cfg, {"frame_streams": False})
        proxy = _CuttingProxy(int(b.url.rsplit(":", 1)[1]), after=2 * MiB)
        a.add_peer("b", await proxy.start())
        try:
            x = tensor(6 * MiB)
            await a.send("b", "c", Frame(arrays=(x,)))
            assert proxy.cut == 1
            await a.send("b", "c", Frame(meta={"next": 1}, arrays=(x[:10],)))
            np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
            assert (await b.recv("a", "c")).meta == {"next": 1}  # delivered once: no copy
            assert b.received_stats("a").frames == 2
            assert a.send_retries["b"] >= 1
            assert bulk(a, "sent") >= 2 and bulk(b, "received") >= 2  # the cut one, the retry
            await no_connections_left(b)
        finally:
            await a.aclose()
            await b.aclose()
            await proxy.close()

    run(scenario())


def test_cancelled_bulk_send_leaves_nothing_running(run):
    async def scenario():
        # paced to 20 MB/s: the 8 MiB body takes ~0.4 s, cancelled once the receiver has
        # taken the request (however long a loaded machine takes to get there)
        a, b = await open_pair(cfg, {"shape_bandwidth": 20e6, "write_piece_bytes": 1 << 16})
        try:
            before = asyncio.all_tasks()
            x = tensor(8 * MiB)
            sending = asyncio.ensure_future(a.send("b", "c", Frame(arrays=(x,))))
            for _ in range(1000):
                if bulk(b, "received") or sending.done():
                    break
                await asyncio.sleep(0.01)
            assert not sending.done()
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            await no_connections_left(b)
            assert asyncio.all_tasks() <= before  # no task of the send or the receiver remains
            assert bulk(b, "received") == 1 and b.received_stats("a").frames == 0
            small = tensor(MiB, seed=3)
            await a.send("b", "c", Frame(arrays=(small,)))
            np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], small)
            assert b.received_stats("a").frames == 1
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())


def test_full_inbox_pushes_bulk_senders_back(run):
    async def scenario():
        a, b = await open_pair(cfg, b_kw={"capacity": 1, "backpressure_wait": 0.05})
        try:
            x = tensor(MiB)
            await a.send("b", "c", Frame(meta={"i": 0}, arrays=(x,)))
            second = asyncio.ensure_future(a.send("b", "c", Frame(meta={"i": 1}, arrays=(x,))))
            await asyncio.sleep(0.3)
            assert not second.done()  # 503 and backoff: nothing read, nothing buffered
            assert b.refused.get("busy", 0) >= 1 and bulk(b, "received") == 1
            assert (await b.recv("a", "c")).meta == {"i": 0}
            await asyncio.wait_for(second, 5)
            assert (await b.recv("a", "c")).meta == {"i": 1}
            assert bulk(b, "received") == 2
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())


# -- refusals: the same statuses as the plain path, in the same order --------------------------


async def test_refusals_before_the_upgrade_are_plain_http(http_pair):
    a, b = await http_pair(cfg, b_kw={"max_frame_bytes": 4 * MiB, "spec_hash": "s1"})
    body = encoded(tensor(MiB), spec="s1")
    # wrong secret: 401 and nothing else, never a 101
    assert await bulk_post(
        b.url, bulk_headers(b, 0, body, secret=b"nope", **{"X-Tandem-Spec": "s1"}), body
    ) == ("http", 401, "unauthorized")
    # spec mismatch: 409 naming both hashes
    kind, status, text = await bulk_post(b.url, bulk_headers(b, 0, body), body)
    assert (kind, status) == ("http", 409) and "s1" in text
    # too large: 413 before a byte of the body is accepted
    kind, status, text = await bulk_post(
        b.url,
        bulk_headers(b, 0, body, **{"X-Tandem-Total": str(5 * MiB), "X-Tandem-Spec": "s1"}),
        body,
    )
    assert (kind, status) == ("http", 413) and "max_frame_bytes" in text
    # a body in the upgrade request itself, or no declared length: 400
    h = bulk_headers(b, 0, body, **{"X-Tandem-Spec": "s1"})
    h["Content-Length"] = "10"
    assert (await bulk_post(b.url, h, body))[:2] == ("http", 400)
    h = bulk_headers(b, 0, body, **{"X-Tandem-Spec": "s1"})
    del h[H_LENGTH]
    kind, status, text = await bulk_post(b.url, h, body)
    assert (kind, status) == ("http", 400) and H_LENGTH in text
    assert bulk(b, "received") == 0
    # accepted once, then a retry of the same message is a duplicate (no second 101)
    h = {"X-Tandem-Spec": "s1"}
    assert await bulk_post(b.url, bulk_headers(b, 0, body, **h), body) == ("line", 200, "ok")
    assert await bulk_post(b.url, bulk_headers(b, 0, body, **h), body) == (
        "http",
        200,
        "duplicate",
    )
    assert bulk(b, "received") == 1
    assert b.refused == {
        "unauthenticated": 1,
        "spec_mismatch": 1,
        "too_large": 1,
        "malformed": 2,
    }
    await no_connections_left(b)


async def test_refusals_after_the_body_come_as_the_reply_line_in_order(http_pair):
    """Digest before decoding before NaN/Inf, as on the plain path; the server keeps serving."""
    a, b = await http_pair(cfg)
    x = np.ones(MiB // 4, np.float32)
    x[-1] = np.nan
    nan_body = encoded(x)
    altered = bytearray(nan_body)
    altered[len(altered) // 2] ^= 1
    assert await bulk_post(b.url, bulk_headers(b, 0, nan_body), bytes(altered)) == (
        "line",
        401,
        "unauthorized",
    )
    kind, status, text = await bulk_post(b.url, bulk_headers(b, 0, nan_body), nan_body)
    assert (kind, status) == ("line", 422) and "NaN or Inf" in text
    garbage = bytes(range(256)) * 4096
    kind, status, text = await bulk_post(b.url, bulk_headers(b, 0, garbage), garbage)
    assert (kind, status) == ("line", 400) and "malformed frame" in text
    assert b.refused == {"unauthenticated": 1, "nonfinite": 1, "malformed": 1}
    assert bulk(b, "received") == 3
    good = np.ones(MiB // 4, np.float32)
    await a.send("b", "c", Frame(arrays=(good,)))
    np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], good)
    assert bulk(a, "sent") == 1


async def test_sender_maps_bulk_refusals_to_the_plain_path_errors(http_pair):
    a, b = await http_pair(cfg, b_kw={"max_frame_bytes": 2 * MiB})
    wrong = await HttpTransport(cfg("a", secret=b"other", peers={"b": b.url})).start()
    try:
        x = np.ones(MiB // 4, np.float32)
        x[3] = np.inf
        with pytest.raises(FrameError, match="NaN or Inf"):
            await a.send("b", "c", Frame(arrays=(x,)))
        with pytest.raises(PayloadTooLargeError, match="max_frame_bytes"):
            await a.send("b", "c", Frame(arrays=(tensor(3 * MiB),)))
        with pytest.raises(AuthenticationError, match="same secret"):
            await wrong.send("b", "c", Frame(arrays=(tensor(MiB),)))
        assert b.refused == {"nonfinite": 1, "too_large": 1, "unauthenticated": 1}
        assert bulk(a, "sent") == 2 and bulk(wrong, "sent") == 1 and bulk(b, "received") == 1
    finally:
        await wrong.aclose()


async def test_replayed_bulk_request_is_refused(http_pair):
    a, b = await http_pair(cfg)
    body = encoded(tensor(MiB))
    h = bulk_headers(b, 0, body)
    assert await bulk_post(b.url, h, body) == ("line", 200, "ok")
    h2 = dict(h, **{"X-Tandem-Msg-Id": "1"})  # same nonce, other message: not signed
    assert await bulk_post(b.url, h2, body) == ("http", 401, "unauthorized")
    assert await bulk_post(b.url, h, body) == ("http", 401, "unauthorized")  # replay
    assert b.refused == {"unauthenticated": 2} and bulk(b, "received") == 1


@pytest.mark.parametrize("cut", [0, 1, MiB // 2, MiB - 1])
async def test_client_gone_mid_body_leaves_the_server_serving(http_pair, cut):
    """A client that drops the upgraded connection anywhere in the body (hashing may be in
    flight): nothing is delivered, no connection stays behind, the next message arrives."""
    a, b = await http_pair(cfg)
    body = encoded(tensor(MiB))
    assert await bulk_post(b.url, bulk_headers(b, 0, body), body, close_after=cut) == (
        "closed",
        0,
        "",
    )
    await no_connections_left(b)
    assert b.received_stats("a").frames == 0 and bulk(b, "received") == 1
    assert await bulk_post(b.url, bulk_headers(b, 0, body), body) == ("line", 200, "ok")
    assert b.received_stats("a").frames == 1


async def test_client_that_sends_before_the_101_cannot_wedge_the_server(http_pair):
    """The protocol says: body only after the 101. A client that writes head and body at once
    may lose the bytes that aiohttp's parser saw first; its request then waits for the missing
    bytes until it gives up. Closing frees everything and the server keeps serving."""
    a, b = await http_pair(cfg)
    body = encoded(tensor(MiB))
    host, port = b.url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = [
        f"POST {FRAME_PATH} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Length: 0",
        "Connection: Upgrade",
        f"Upgrade: {BULK_PROTOCOL}",
    ]
    head += [f"{k}: {v}" for k, v in bulk_headers(b, 0, body).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    try:
        await asyncio.wait_for(reader.read(), 0.5)
    except TimeoutError:
        pass
    writer.transport.abort()
    await no_connections_left(b)
    assert await bulk_post(b.url, bulk_headers(b, 0, body), body) == ("line", 200, "ok")
    assert b.received_stats("a").frames == 1


@pytest.fixture(scope="module")
def live():
    for runner, server in live_server(
        cfg("srv", peers={"a": "http://127.0.0.1:9"}, capacity=10_000)
    ):
        yield runner, server, {"id": 0}


@settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), honest_digest=st.booleans())
def test_fuzzed_bulk_bodies_get_4xx_and_server_keeps_serving(live, data, honest_digest):
    """Mutated bodies on the bulk path: signed over the mutated bytes (authentic but malformed:
    400/422, or 200 if still a valid frame) or over the original ones (401)."""
    runner, server, state = live
    state["id"] += 1
    n = data.draw(st.integers(0, 40_000))
    frame = Frame(
        sender="a", channel="c", msg_id=state["id"], arrays=(np.arange(n, dtype=np.float32),)
    )
    original = codec.encode(frame)
    body = _mutate(original, data)
    if not body:
        body = b"\0"
    h = bulk_headers(server, state["id"], body, digest_of=None if honest_digest else original)
    kind, status, text = runner.run(bulk_post(server.url, h, body))
    if kind == "http":  # refused before the upgrade (e.g. total too small for a frame)
        assert 400 <= status < 500, (status, text)
    elif status == 200:
        runner.run(server.recv("a", "c"))
    else:
        assert 400 <= status < 500 and text, (status, text)
        if not honest_digest and body != original:
            assert (status, text) == (401, "unauthorized")


def test_server_still_delivers_bulk_after_fuzzing(live):
    runner, server, state = live
    state["id"] += 1
    x = tensor(MiB)
    body = encoded(x, state["id"], channel="after")
    assert runner.run(
        bulk_post(
            server.url,
            bulk_headers(server, state["id"], body, **{"X-Tandem-Channel": "after"}),
            body,
        )
    ) == ("line", 200, "ok")
    np.testing.assert_array_equal(runner.run(server.recv("a", "after")).arrays[0], x)
    assert bulk(server, "received") >= 1


async def test_a_receiver_that_ignores_the_upgrade_is_reported_not_trusted():
    """An older receiver treats the bulk request as a plain POST with an empty body and may
    answer 200 "chunk": the sender must not count that chunk as delivered."""
    from aiohttp import web

    async def old_receiver(request):
        return web.Response(text="chunk")

    app = web.Application()
    app.router.add_post(FRAME_PATH, old_receiver)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    a = await HttpTransport(cfg("a", peers={"b": f"http://127.0.0.1:{port}"})).start()
    try:
        with pytest.raises(TransportError, match="does not support the bulk path"):
            await a.send("b", "c", Frame(arrays=(tensor(MiB),)))
        assert a.sent_stats("b").bytes == 0
    finally:
        await a.aclose()
        await runner.cleanup()


# -- shaping and configuration ----------------------------------------------------------------


async def test_link_shaping_paces_bulk_bodies(http_pair):
    a, b = await http_pair(cfg, {"shape_bandwidth": 40e6, "shape_latency": 0.05})
    x = tensor(4 * MiB)
    t0 = time.perf_counter()
    await a.send("b", "c", Frame(arrays=(x,)))
    assert time.perf_counter() - t0 >= 0.9 * (x.nbytes / 40e6 + 0.05)
    np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
    assert bulk(a, "sent") == 1


async def test_bulk_can_be_switched_off(http_pair):
    a, b = await http_pair(cfg, {"bulk_min_bytes": None})
    await a.send("b", "c", Frame(arrays=(tensor(3 * MiB),)))
    await b.recv("a", "c")
    assert a.frame_requests == {("sent", "plain"): 1}
    assert b.frame_requests == {("received", "plain"): 1}


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_bulk_min_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="bulk_min_bytes"):
        HttpConfig(name="x", bulk_min_bytes=bad)


def test_default_threshold_keeps_small_frames_on_the_plain_path():
    assert HttpConfig(name="x").bulk_min_bytes == MiB
