"""HTTP transport security and robustness against a live server on loopback."""

from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import secrets
import ssl

import aiohttp
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.errors import (
    AuthenticationError,
    FrameError,
    PayloadTooLargeError,
    PeerUnavailableError,
)
from tandem.transports import auth, codec
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, HttpConfig, HttpTransport

SECRET = b"s3cret"


def cfg(name, **kw) -> HttpConfig:
    kw.setdefault("secret", SECRET)
    return HttpConfig(name=name, retry_timeout=0.5, backoff_base=0.005, backoff_max=0.05, **kw)


def good(i=0) -> Frame:
    return Frame(meta={"i": i}, arrays=(np.arange(4, dtype=np.float32),))


def routing(msg_id: int, body: bytes, **over) -> dict[str, str]:
    h = {
        "X-Tandem-Sender": "a",
        "X-Tandem-Incarnation": "raw",
        "X-Tandem-Channel": "c",
        "X-Tandem-Msg-Id": str(msg_id),
        "X-Tandem-Chunk": "0",
        "X-Tandem-Chunks": "1",
        "X-Tandem-Offset": "0",
        "X-Tandem-Total": str(len(body)),
        "X-Tandem-Spec": "",
    }
    h.update(over)
    return h


def bound(to: HttpTransport) -> dict[str, str]:
    """`auth.sign`'s receiver binding for requests to the transport ``to``."""
    return {"receiver": to.name, "to": to.incarnation}


def signed(to: HttpTransport, msg_id: int, body: bytes, secret=SECRET, **over) -> dict[str, str]:
    """Headers of a hand-made request to ``to``, signed for it."""
    return auth.sign(
        secret,
        "POST",
        FRAME_PATH,
        routing(msg_id, body, **over),
        auth.body_digest([body]),
        **bound(to),
    )


async def test_wrong_secret_is_refused_with_401_and_server_keeps_serving(http_pair):
    a, b = await http_pair(cfg, a_kw={"secret": b"wrong"})
    with pytest.raises(AuthenticationError, match="same secret"):
        await a.send("b", "c", good())
    assert b.refused == {"unauthenticated": 1}
    async with aiohttp.ClientSession() as s:  # 401 says nothing else
        body = codec.encode(good().replace(sender="a", channel="c"))
        async with s.post(
            b.url + FRAME_PATH, data=body, headers=signed(b, 0, body, secret=b"nope")
        ) as r:
            assert (r.status, await r.text()) == (401, "unauthorized")
    b.add_peer("a2", a.url)
    c = await HttpTransport(cfg("a2", peers={"b": b.url})).start()
    await c.send("b", "c", good(3))
    assert (await b.recv("a2", "c")).meta == {"i": 3}
    await c.aclose()


async def test_unknown_sender_gets_401():
    async with HttpTransport(cfg("b")) as b, HttpTransport(cfg("x", peers={})) as x:
        x.add_peer("b", b.url)  # b does not know x
        with pytest.raises(AuthenticationError):
            await x.send("b", "c", good())
        assert b.refused == {"unknown_peer": 1}


async def test_replayed_and_stale_requests_are_refused(http_pair):
    now = [1_000_000.0]
    a, b = await http_pair(cfg, b_kw={"clock": lambda: now[0], "auth_window": 30.0})
    body = codec.encode(good().replace(sender="a", channel="c", msg_id=0))
    headers = auth.sign(
        SECRET,
        "POST",
        FRAME_PATH,
        routing(0, body),
        auth.body_digest([body]),
        clock=lambda: now[0],
        **bound(b),
    )
    async with aiohttp.ClientSession() as s:
        async with s.post(b.url + FRAME_PATH, data=body, headers=headers) as r:
            assert r.status == 200
        async with s.post(b.url + FRAME_PATH, data=body, headers=headers) as r:
            assert r.status == 401  # the same request again: replay
        stale = auth.sign(
            SECRET,
            "POST",
            FRAME_PATH,
            routing(1, body),
            auth.body_digest([body]),
            clock=lambda: now[0] - 31,
            **bound(b),
        )
        async with s.post(b.url + FRAME_PATH, data=body, headers=stale) as r:
            assert r.status == 401
        tampered = signed(b, 2, body)
        tampered["X-Tandem-Channel"] = "other"
        async with s.post(b.url + FRAME_PATH, data=body, headers=tampered) as r:
            assert r.status == 401
    assert b.refused == {"unauthenticated": 3}
    assert (await b.recv("a", "c")).meta == {"i": 0}


async def test_non_ascii_signature_or_token_is_refused_not_a_500(http_pair):
    """A signature or bearer token that is not ASCII (raw bytes >= 0x80 in the header) is
    refused like any other wrong one, on every route, never answered 500."""
    a, b = await http_pair(cfg, b_kw={"metrics_token": b"tok"})
    port = int(b.url.rsplit(":", 1)[1])
    routes = [("POST", FRAME_PATH), ("POST", "/tandem/v1/bye"), ("POST", "/tandem/v1/stream")]
    routes += [("GET", "/healthz"), ("GET", "/metrics")]
    for method, path in routes:
        h = auth.sign(SECRET, method, path, routing(0, b""), auth.EMPTY_SHA, **bound(b))
        del h["X-Tandem-Signature"]
        for bad in (b"X-Tandem-Signature: \xff\xfe", b"Authorization: Bearer \xff"):
            head = "".join(f"{k}: {v}\r\n" for k, v in h.items()).encode()
            if bad.startswith(b"Authorization"):  # a valid signature beside the bad token
                head += f"X-Tandem-Signature: {'0' * 64}\r\n".encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"{method} {path} HTTP/1.1\r\nHost: b\r\nContent-Length: 0\r\n".encode()
                + head
                + bad
                + b"\r\n\r\n"
            )
            status = (await asyncio.wait_for(reader.readline(), 5)).split()[1]
            writer.close()
            assert status != b"500", (path, bad)
    await a.send("b", "c", good())  # still serving
    assert (await b.recv("a", "c")).meta == {"i": 0}


def test_verifier_bounded_nonce_memory_never_forgets_into_a_replay():
    now = [100.0]
    v = auth.Verifier(b"k", window=50, max_nonces=3, clock=lambda: now[0])
    reqs = [
        auth.sign(b"k", "POST", "/p", {}, auth.EMPTY_SHA, clock=lambda i=i: now[0] + i * 1e-3)
        for i in range(5)
    ]
    for h in reqs:
        v.verify("POST", "/p", h)
    assert len(v) == 3
    for h in reqs:  # forgotten or remembered: every replay is refused
        with pytest.raises(AuthenticationError, match="replay"):
            v.verify("POST", "/p", h)


async def test_body_digest_covers_every_byte_of_a_large_body(http_pair):
    """The receiver hashes a large body while reading it (in steps, off the loop): a body
    altered in its first, a middle, or its last byte is refused (401); the original passes."""
    a, b = await http_pair(cfg)
    x = np.arange((10 << 20) // 4, dtype=np.float32)  # 10 MiB: several hashing steps
    body = codec.encode(Frame(arrays=(x,)).replace(sender="a", channel="c", msg_id=0))
    async with aiohttp.ClientSession() as s:
        for pos in (0, len(body) // 2 + 3, len(body) - 1):
            bad = bytearray(body)
            bad[pos] ^= 1
            async with s.post(
                b.url + FRAME_PATH, data=io.BytesIO(bad), headers=signed(b, 0, body)
            ) as r:
                assert (r.status, await r.text()) == (401, "unauthorized"), pos
        async with s.post(
            b.url + FRAME_PATH, data=io.BytesIO(body), headers=signed(b, 0, body)
        ) as r:
            assert r.status == 200
    assert b.refused == {"unauthenticated": 3}
    assert np.array_equal((await b.recv("a", "c")).arrays[0], x)


async def test_nan_refused_422_then_good_frame_delivered(http_pair):
    a, b = await http_pair(cfg)
    bad = Frame(arrays=(np.array([1.0, np.nan], dtype=np.float32),))
    with pytest.raises(FrameError, match="NaN or Inf"):
        await a.send("b", "c", bad)
    with pytest.raises(FrameError, match="NaN or Inf"):
        await a.send("b", "c", Frame(arrays=(np.array([np.inf]),)))
    await a.send("b", "c", good(1))
    assert (await b.recv("a", "c")).meta == {"i": 1}
    assert b.refused == {"nonfinite": 2}


@pytest.mark.parametrize("dtype", ["<f2", "<f4", "<f8", "<c8", "<c16"])
def test_all_finite_agrees_with_isfinite(dtype):
    """`all_finite` (a sum, then the exact check) against the reference
    ``np.isfinite(a).all()``: NaN/Inf anywhere, Inf of both signs, and finite values whose sum
    overflows (must still be accepted)."""
    from tandem.transports.http.scan import all_finite

    dt = np.dtype(dtype)
    big = np.finfo(dt).max
    cases = [np.arange(1000, dtype=dt), np.full(1000, big, dt), np.full(1000, -big, dt)]
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, 517, 999):
            a = np.ones(1000, dt)
            a[pos] = bad
            cases.append(a)
            if dt.kind == "c":
                c = np.ones(1000, dt)
                c[pos] = complex(1.0, bad)  # non-finite imaginary part only
                cases.append(c)
    both = np.ones(1000, dt)
    both[3], both[700] = np.inf, -np.inf  # sums to NaN
    cases.append(both)
    for a in cases:
        assert all_finite(a.reshape(10, 100)) == bool(np.isfinite(a).all())


async def test_nan_in_large_frame_refused_422(http_pair):
    """A frame large enough to be checked off the event loop (>= 1 MiB): Inf in its last
    element is still refused."""
    a, b = await http_pair(cfg)
    x = np.zeros((2 << 20) // 4, np.float32)
    x[-1] = np.inf
    with pytest.raises(FrameError, match="NaN or Inf"):
        await a.send("b", "c", Frame(arrays=(np.zeros(3, np.int32), x)))
    assert b.refused == {"nonfinite": 1}
    x[-1] = 0.0
    await a.send("b", "c", Frame(arrays=(x,)))
    assert not (await b.recv("a", "c")).arrays[0].any()


async def test_spec_hash_mismatch_409_names_both_hashes(http_pair):
    a, b = await http_pair(cfg, a_kw={"spec_hash": "aaa111"}, b_kw={"spec_hash": "bbb222"})
    with pytest.raises(FrameError, match="aaa111.*bbb222"):
        await a.send("b", "c", good())
    b.spec_hash = "aaa111"
    await a.send("b", "c", good(2))
    got = await b.recv("a", "c")
    assert got.spec_hash == "aaa111" and got.meta == {"i": 2}


async def test_validator_and_max_frame_bytes(http_pair):
    def only_float32(frame: Frame) -> None:
        for x in frame.arrays:
            if x.dtype != np.float32:
                raise FrameError(f"expected float32, got {x.dtype}")

    a, b = await http_pair(cfg, b_kw={"validator": only_float32, "max_frame_bytes": 4096})
    with pytest.raises(FrameError, match="expected float32"):
        await a.send("b", "c", Frame(arrays=(np.arange(3),)))
    with pytest.raises(PayloadTooLargeError, match="max_frame_bytes"):
        await a.send("b", "c", Frame(arrays=(np.zeros(2000, np.float32),)))
    await a.send("b", "c", good(4))
    assert (await b.recv("a", "c")).meta == {"i": 4}


async def test_an_inline_validator_runs_on_the_loop_and_others_in_a_thread(http_pair):
    """An `InlineValidator` judges a small frame on the event loop (no worker thread per
    frame), refusing the same way; any other validator runs in a worker thread."""
    import threading

    from tandem.transports.base import InlineValidator

    seen: list[tuple[str, bool]] = []

    class Inline:
        inline = True

        def __call__(self, frame: Frame) -> None:
            seen.append(("inline", threading.get_ident() == loop_thread))
            if frame.meta["i"] < 0:
                raise FrameError("negative i")

    def plain(frame: Frame) -> None:
        seen.append(("plain", threading.get_ident() == loop_thread))

    loop_thread = threading.get_ident()
    assert isinstance(Inline(), InlineValidator) and not isinstance(plain, InlineValidator)
    a, b = await http_pair(cfg, b_kw={"validator": Inline()})
    await a.send("b", "c", good(1))
    assert (await b.recv("a", "c")).meta == {"i": 1}
    with pytest.raises(FrameError, match="negative i"):
        await a.send("b", "c", good(-1))
    b.validator = plain
    await a.send("b", "c", good(2))
    assert (await b.recv("a", "c")).meta == {"i": 2}
    assert seen == [("inline", True), ("inline", True), ("plain", False)]


def make_cert(tmp_path, name: str, ca=None):
    """A self-signed certificate for 127.0.0.1 (or one signed by ``ca``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    )
    cert = builder.sign(key, hashes.SHA256())
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


async def test_tls_and_mutual_tls(tmp_path):
    srv_cert, srv_key = make_cert(tmp_path, "server")
    cli_cert, cli_key = make_cert(tmp_path, "client")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(srv_cert, srv_key)
    server_ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS
    server_ctx.load_verify_locations(cli_cert)
    client_ctx = ssl.create_default_context(cafile=srv_cert)
    client_ctx.load_cert_chain(cli_cert, cli_key)
    b = await HttpTransport(
        cfg("b", ssl_server=server_ctx, peer_identities={"a": ["client"]})
    ).start()
    a = await HttpTransport(cfg("a", ssl_client=client_ctx, peers={"b": b.url})).start()
    no_cert = await HttpTransport(
        cfg("a", ssl_client=ssl.create_default_context(cafile=srv_cert), peers={"b": b.url})
    ).start()
    try:
        assert b.url.startswith("https://")
        b.add_peer("a", a.url)
        await a.send("b", "c", good(5))
        assert (await b.recv("a", "c")).meta == {"i": 5}
        with pytest.raises(PeerUnavailableError):  # no client certificate: handshake refused
            await no_cert.send("b", "c", good(6))
    finally:
        for t in (a, no_cert, b):
            await t.aclose()


async def test_healthz_needs_no_auth_and_metrics_a_peer(http_pair):
    a, b = await http_pair(cfg)
    b.add_metrics_source(lambda: 'tandem_n_groups{party="b"} 4')
    await a.send("b", "c", good())
    async with aiohttp.ClientSession() as s:
        async with s.get(b.url + "/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(b.url + "/metrics") as r:  # a stranger: nothing
            assert r.status == 401 and await r.text() == ""
        as_a = auth.sign(
            SECRET, "GET", "/metrics", {"X-Tandem-Sender": "a"}, auth.EMPTY_SHA, receiver="b"
        )
        async with s.get(b.url + "/metrics", headers=as_a) as r:
            text = await r.text()
    assert r.status == 200
    assert 'tandem_received_frames_total{party="b",peer="a"} 1' in text
    assert 'tandem_inbound_queue_depth{party="b",peer="a",channel="c"} 1' in text
    assert "# TYPE tandem_refused_requests_total counter" in text
    assert 'tandem_n_groups{party="b"} 4' in text
    assert 'tandem_sent_frames_total{party="a",peer="b"} 1' in a.metrics_text()


# -- fuzzing a live server: hypothesis drives synchronous examples on one persistent loop ----


def live_server(config: HttpConfig):
    """Generator for a module fixture: ``(runner, server)``, an `HttpTransport` serving on its
    own loop (`asyncio.Runner`) so that synchronous hypothesis examples can drive it; closed
    after the last test."""
    runner = asyncio.Runner()
    server = runner.run(HttpTransport(config).start())
    try:
        yield runner, server
    finally:
        runner.run(server.aclose())
        runner.close()


@pytest.fixture(scope="module")
def live():
    for runner, server in live_server(
        cfg("srv", peers={"a": "http://127.0.0.1:9"}, capacity=10_000)
    ):
        session = runner.run(_session())
        yield runner, server, session, {"id": 0}
        runner.run(session.close())


async def _session():
    return aiohttp.ClientSession()


async def _post(session, url, body, headers):
    async with session.post(url + FRAME_PATH, data=body, headers=headers) as r:
        return r.status, await r.text()


def _mutate(raw: bytes, data) -> bytes:
    raw = bytearray(raw)
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "random"]))
    if how == "flip":
        # positions are drawn as fractions so that draws do not depend on the frame's length
        i = int(data.draw(st.floats(0, 1)) * (len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[: int(data.draw(st.floats(0, 1)) * (len(raw) - 1))]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=16))
    else:
        raw = bytearray(data.draw(st.binary(max_size=200)))
    return bytes(raw)


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzzed_bodies_get_4xx_and_server_keeps_serving(live, data):
    runner, server, session, state = live
    state["id"] += 1
    frame = Frame(
        sender="a",
        channel="c",
        msg_id=state["id"],
        meta={"k": data.draw(st.text(max_size=5))},
        arrays=(np.arange(data.draw(st.integers(0, 8)), dtype=np.float32),),
    )
    body = _mutate(codec.encode(frame), data)
    status, text = runner.run(_post(session, server.url, body, signed(server, state["id"], body)))
    if status == 200:  # a mutation that left a valid frame is accepted; drain it
        runner.run(server.recv("a", "c"))
    else:
        assert 400 <= status < 500 and text, (status, text)


header_names = st.sampled_from(
    list(auth.SIGNED_HEADERS) + [auth.TIMESTAMP, auth.NONCE, auth.BODY_SHA, auth.SIGNATURE]
)
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24)


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(overrides=st.dictionaries(header_names, header_values, max_size=5), resign=st.booleans())
def test_fuzzed_headers_get_4xx_and_server_keeps_serving(live, overrides, resign):
    runner, server, session, state = live
    state["id"] += 1
    body = codec.encode(good().replace(sender="a", channel="c", msg_id=state["id"]))
    headers = routing(state["id"], body)
    if resign:  # routing headers altered, then properly signed: the parser sees them
        headers.update({k: v for k, v in overrides.items() if k in headers})
        headers = auth.sign(
            SECRET, "POST", FRAME_PATH, headers, auth.body_digest([body]), **bound(server)
        )
    else:  # any header altered after signing: authentication must refuse it
        headers = auth.sign(
            SECRET, "POST", FRAME_PATH, headers, auth.body_digest([body]), **bound(server)
        )
        headers.update(overrides)
    status, text = runner.run(_post(session, server.url, body, headers))
    if status == 200:
        if text == "ok":
            runner.run(server.recv(headers["X-Tandem-Sender"], headers["X-Tandem-Channel"]))
    else:
        assert 400 <= status < 500 or status == 503, (status, text)


def test_server_still_delivers_after_fuzzing(live):
    runner, server, session, state = live
    state["id"] += 1
    body = codec.encode(good(9).replace(sender="a", channel="after", msg_id=state["id"]))
    # A fresh incarnation: the header fuzzing may have announced a restarted "a" (another
    # incarnation), after which the server rightly refuses the old one with 410.
    fresh = {"X-Tandem-Channel": "after", "X-Tandem-Incarnation": secrets.token_hex(8)}
    assert runner.run(
        _post(session, server.url, body, signed(server, state["id"], body, **fresh))
    ) == (
        200,
        "ok",
    )
    assert runner.run(server.recv("a", "after")).meta == {"i": 9}


def test_old_incarnation_is_refused_410_after_a_restart(live):
    runner, server, session, state = live
    for inc, expect in (("first", 200), ("second", 200), ("first", 410)):
        state["id"] += 1
        body = codec.encode(good().replace(sender="a", channel="restart", msg_id=state["id"]))
        status, _ = runner.run(
            _post(
                session,
                server.url,
                body,
                signed(
                    server,
                    state["id"],
                    body,
                    **{"X-Tandem-Channel": "restart", "X-Tandem-Incarnation": inc},
                ),
            )
        )
        assert status == expect, (inc, status)
        if status == 200:
            runner.run(server.recv("a", "restart"))


async def test_admit_unknown_accepts_signed_senders_and_learns_their_url():
    async with (
        HttpTransport(cfg("coord", admit_unknown=True)) as coord,
        HttpTransport(cfg("w9", peers={})) as w,
        HttpTransport(cfg("intruder", secret=b"wrong")) as bad,
    ):
        w.add_peer("coord", coord.url)
        bad.add_peer("coord", coord.url)
        await w.send("coord", "hb", good(1))
        assert "w9" in coord.peers
        assert (await coord.recv("w9", "hb")).meta == {"i": 1}
        await coord.send("w9", "welcome", good(2))  # the learned URL works for replies
        assert (await w.recv("coord", "welcome")).meta == {"i": 2}
        with pytest.raises(AuthenticationError):
            await bad.send("coord", "hb", good(3))
        assert "intruder" not in coord.peers and coord.refused == {"unauthenticated": 1}


def test_admit_unknown_requires_a_secret():
    with pytest.raises(ValueError, match="admit_unknown needs a secret"):
        HttpConfig(name="c", admit_unknown=True)
