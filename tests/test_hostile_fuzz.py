"""Raw HTTP, generated: request lines, heads and bodies a hostile client may write on the
socket (some signed properly, so they reach the checks behind authentication), against a
live server. No answer is a 5xx, the server never stops serving, and a frame sent afterwards
is delivered."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.transports import auth, codec
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig
from test_http_security import live_server

SECRET = b"s3cret"
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
numbers = st.one_of(st.integers(-(2**70), 2**70).map(str), printable)
HEADERS = [
    "X-Tandem-Sender",
    "X-Tandem-Incarnation",
    "X-Tandem-Channel",
    "X-Tandem-Msg-Id",
    "X-Tandem-Chunk",
    "X-Tandem-Chunks",
    "X-Tandem-Offset",
    "X-Tandem-Total",
    "X-Tandem-Spec",
    "X-Tandem-Length",
    "Content-Length",
    "Transfer-Encoding",
    "Upgrade",
    "Connection",
    "Expect",
    "Host",
]


@pytest.fixture(scope="module")
def live():
    config = HttpConfig(
        name="srv",
        secret=SECRET,
        peers={"a": "http://127.0.0.1:9"},
        capacity=10_000,
        body_idle_timeout=0.3,
        header_timeout=0.3,
        bulk_min_bytes=64,
    )
    yield from live_server(config)


@st.composite
def requests(draw):
    """``(method, path, version, headers, body, sign)``: mostly well-formed HTTP (so that the
    tandem checks are reached) with random tandem headers, sometimes anything at all; a body
    of random bytes, or a real frame, possibly cut or grown; some signed properly."""
    wellformed = draw(st.integers(0, 3)) > 0
    if wellformed:
        method = draw(st.sampled_from(["POST", "POST", "POST", "GET"]))
        path = draw(st.sampled_from(["/tandem/v1/frame"] * 4 + ["/tandem/v1/bye", "/healthz"]))
        version = "HTTP/1.1"
    else:
        method = draw(st.sampled_from(["POST", "GET", "PUT", "HEAD", "P\x00ST", ""]))
        path = draw(
            st.sampled_from(["/tandem/v1/frame", "/healthz", "/metrics", "/x"])
            | printable.map(lambda p: "/" + p.replace(" ", ""))
        )
        version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1\x01", ""]))
    names = HEADERS if not wellformed else [h for h in HEADERS if h.startswith("X-")]
    headers = {
        name: draw(
            numbers
            if name.startswith(
                ("X-Tandem-M", "X-Tandem-C", "X-Tandem-O", "X-Tandem-T", "X-Tandem-L", "Content")
            )
            else printable
        )
        for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=10))
    }
    frame = codec.encode(
        Frame(sender="a", channel="c", msg_id=1, arrays=(np.arange(8, dtype=np.float32),))
    )
    body = draw(
        st.one_of(
            st.binary(max_size=300),
            st.just(frame),
            st.integers(0, len(frame)).map(lambda n: frame[:n]),
            st.binary(min_size=1, max_size=20).map(lambda b: frame + b),
        )
    )
    if wellformed:
        headers["Host"] = "x"
        headers["Content-Length"] = str(len(body))
    sign = wellformed and draw(st.booleans())
    if sign:  # valid routing for sender "a", so the checks behind authentication are reached
        headers.update(
            {
                "X-Tandem-Sender": "a",
                "X-Tandem-Incarnation": draw(st.sampled_from(["i1", "i2"])),
                "X-Tandem-Channel": draw(st.sampled_from(["c", "d"])),
                "X-Tandem-Chunk": draw(st.sampled_from(["0", "0", "1"])),
                "X-Tandem-Chunks": draw(st.sampled_from(["1", "1", "2"])),
                "X-Tandem-Offset": "0",
                "X-Tandem-Total": str(len(body) + draw(st.sampled_from([0, 0, 0, 1, -1]))),
            }
        )
        headers.setdefault("X-Tandem-Msg-Id", str(draw(st.integers(0, 5))))
        if draw(st.booleans()):  # the bulk path: the body follows the 101
            headers.update(
                {
                    "Upgrade": "tandem-frame/1",
                    "Connection": "Upgrade",
                    "X-Tandem-Length": str(len(body)),
                    "Content-Length": "0",
                }
            )
    return method, path, version, headers, body, sign


async def exchange(url: str, raw: bytes) -> bytes:
    """Write ``raw``, read the answer (b"" when the server closes without one). A request
    that stops short is closed by the server's header or body timeout."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(1 << 16), 5)
        except (ConnectionError, TimeoutError):
            return b""
    except ConnectionError:
        return b""
    finally:
        writer.transport.abort()


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(requests())
def test_raw_requests_never_get_a_5xx(live, req):
    runner, server = live
    method, path, version, headers, body, sign = req
    if sign:
        headers = auth.sign(
            SECRET,
            method or "POST",
            path,
            dict(headers),
            auth.body_digest([body]),
            receiver="srv",
            to=server.incarnation,
        )
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    raw = head.encode("latin-1", "replace") + b"\r\n" + body
    answer = runner.run(exchange(server.url, raw))
    if answer:
        line = answer.split(b"\r\n", 1)[0].decode("latin-1")
        assert line.startswith("HTTP/1."), line
        status = int(line.split()[1])
        assert status < 500, answer[:300]
        assert b"aiohttp" not in answer.split(b"\r\n\r\n")[0]
    while server._server.inboxes.get(("a", "c")) and len(server._server.inboxes[("a", "c")]):
        runner.run(server.recv("a", "c"))  # a request that happened to be valid: take it


def test_server_still_serves_after_fuzzing(live):
    runner, server = live
    body = codec.encode(
        Frame(sender="a", channel="after", msg_id=0, meta={"ok": 1}).replace(spec_hash="")
    )
    headers = {
        "X-Tandem-Sender": "a",
        "X-Tandem-Incarnation": "fresh",
        "X-Tandem-Channel": "after",
        "X-Tandem-Msg-Id": "0",
        "X-Tandem-Chunk": "0",
        "X-Tandem-Chunks": "1",
        "X-Tandem-Offset": "0",
        "X-Tandem-Total": str(len(body)),
        "X-Tandem-Spec": "",
        "Content-Length": str(len(body)),
        "Host": "x",
    }
    auth.sign(
        SECRET,
        "POST",
        "/tandem/v1/frame",
        headers,
        auth.body_digest([body]),
        receiver="srv",
        to=server.incarnation,
    )
    raw = (
        "POST /tandem/v1/frame HTTP/1.1\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "\r\n"
    ).encode() + body
    answer = runner.run(exchange(server.url, raw))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert runner.run(server.recv("a", "after")).meta == {"ok": 1}
