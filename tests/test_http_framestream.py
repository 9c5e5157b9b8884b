"""Frame streams (``tandem-stream/1``): small frames on one authenticated connection per peer.
Records delivered in order through the same admission as a POST; forged, replayed, reordered,
moved and oversize records refused with the stream closed; a stream lost mid-window resent
exactly once, in order; a peer that offers no stream gets POSTs."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import numpy as np
import pytest

from hostile_helpers import SECRET
from tandem.errors import AuthenticationError
from tandem.transports import auth
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig, HttpTransport, framewire
from tandem.transports.http.framestream import FrameStream, open_stream
from tandem.transports.http.framewire import RECORD
from tandem.transports.http.protocol import H_INC, H_SENDER, STREAM_PATH

CH = "c"


def config(name: str, **kw) -> HttpConfig:
    kw.setdefault("secret", SECRET)
    kw.setdefault("frame_streams", True)
    return HttpConfig(name, **kw)


def small(i: int) -> Frame:
    return Frame(meta={"i": i}, arrays=(np.full(1024, i, np.float32),))


async def test_small_frames_take_the_stream_in_order(http_pair):
    a, b = await http_pair(config)
    for i in range(20):
        await a.send("b", CH, small(i))
    got = [(await b.recv("a", CH)).meta["i"] for _ in range(20)]
    assert got == list(range(20))
    assert a._client.requests.get("stream") == 20
    assert "plain" not in a._client.requests
    assert b._server.requests.get("stream") == 20


async def test_without_a_secret_the_stream_carries_no_tags(http_pair):
    """Neither party holds a secret: records and acks go untagged (a tag under no secret
    authenticates nothing), in order, and every byte the receiver read is a record's."""
    a, b = await http_pair(config, a_kw={"secret": None}, b_kw={"secret": None})
    for i in range(5):
        await a.send("b", CH, small(i))
    assert [(await b.recv("a", CH)).meta["i"] for _ in range(5)] == list(range(5))
    stream = a._client._streams["b"]
    assert stream.mac is None and stream.tag_bytes == 0
    assert a._client.requests.get("stream") == 5
    body = len(encoded(a, 0))
    assert b._server.stats("a").bytes == 5 * body  # bodies only: no tags counted as payload
    rec = framewire.record(None, 0, CH, 0, 0, [encoded(a, 0)])
    assert len(rec) == RECORD.size + len(CH) + body  # the untagged format has no tag bytes


@pytest.mark.parametrize("who", ["sender", "receiver"])
async def test_a_secret_on_one_side_only_gets_no_stream(http_pair, who):
    """Tags need a secret on both ends: a sender with one facing a receiver without gets no
    stream (426 ``stream_tags``) and POSTs; a sender without one is refused by a receiver
    that has one (401), on the handshake and on the POST."""
    if who == "sender":
        a, b = await http_pair(config, b_kw={"secret": None})
        await a.send("b", CH, small(0))
        assert (await b.recv("a", CH)).meta["i"] == 0
        assert "stream" not in a._client.requests and a._client.requests["plain"] == 1
    else:
        a, b = await http_pair(config, a_kw={"secret": None})
        with pytest.raises(AuthenticationError):
            await a.send("b", CH, small(0))
        assert b.refused_handshakes.get("unauthenticated", 0) >= 1


async def test_a_streamed_frame_holds_writable_aligned_arrays_of_its_own(http_pair):
    """Each received frame owns its bytes: its arrays are writable, aligned for their dtype
    (numpy reductions need no copy), and not views of another frame's record."""
    a, b = await http_pair(config)
    arrays = (
        np.arange(7, dtype=np.complex128),
        np.arange(12, dtype=np.float64).reshape(3, 4),
        np.arange(5, dtype=np.int16),
    )
    for i in range(2):
        await a.send("b", CH, Frame(meta={"i": i}, arrays=arrays))
    first, second = (await b.recv("a", CH)), (await b.recv("a", CH))
    assert a._client.requests.get("stream") == 2
    for got, want in zip(first.arrays, arrays, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert got.flags.writeable and got.flags.aligned
    first.arrays[1][0, 0] = -1.0
    assert second.arrays[1][0, 0] == 0.0


async def test_a_window_of_sends_on_several_channels_keeps_each_channel_in_order(http_pair):
    a, b = await http_pair(config)
    await asyncio.gather(*(a.send("b", ch, small(i)) for i in range(16) for ch in ("x", "y")))
    for ch in ("x", "y"):
        assert [(await b.recv("a", ch)).meta["i"] for _ in range(16)] == list(range(16))


async def test_a_stream_the_receiver_closed_when_idle_is_opened_again(http_pair):
    a, b = await http_pair(config, b_kw={"keepalive_timeout": 0.1})
    await a.send("b", CH, small(0))
    first = a._client._streams["b"]
    while first.error is None:  # the receiver closes the idle stream
        await asyncio.sleep(0.01)
    await a.send("b", CH, small(1))
    assert a._client._streams["b"] is not first
    assert a._client.requests["stream"] == 2 and a._client.retries.get("b", 0) == 0
    assert [(await b.recv("a", CH)).meta["i"] for _ in range(2)] == [0, 1]


async def test_a_refused_frame_counts_once_and_its_handshake_apart(http_pair):
    """A sender with the wrong secret: its handshake is refused, then its POST; the frame
    counts once among refused requests, the handshake among refused handshakes."""
    a, b = await http_pair(config, a_kw={"secret": b"not the secret"})
    with pytest.raises(AuthenticationError):
        await a.send("b", CH, small(0))
    assert b.refused == {"unauthenticated": 1}
    assert b.refused_handshakes == {"unauthenticated": 1}
    assert (
        'tandem_refused_stream_handshakes_total{party="b",reason="unauthenticated"} 1'
        in b.metrics_text()
    )


async def test_a_peer_that_offers_no_stream_gets_posts(http_pair):
    a, b = await http_pair(config, b_kw={"frame_streams": False})
    for i in range(3):
        await a.send("b", CH, small(i))
    assert [(await b.recv("a", CH)).meta["i"] for _ in range(3)] == [0, 1, 2]
    assert a._client.requests.get("plain") == 3
    assert "stream" not in a._client.requests


async def test_stream_frames_pass_the_same_admission_as_posts(http_pair):
    a, b = await http_pair(config, b_kw={"spec_hash": "theirs"})
    from tandem.errors import FrameError

    with pytest.raises(FrameError, match="spec"):
        await a.send("b", CH, small(0))
    assert b.refused.get("spec_mismatch") == 1

    def no_odd(frame: Frame) -> None:
        from tandem.errors import AdmissionError

        if frame.meta["i"] % 2:
            raise AdmissionError("odd frames are not admitted", field="meta.i")

    b._server.spec_hash = ""
    b._server.admit_frame = no_odd
    await a.send("b", CH, small(2))
    with pytest.raises(FrameError, match="odd"):
        await a.send("b", CH, small(3))
    assert (await b.recv("a", CH)).meta["i"] == 2


# -- hostile records ---------------------------------------------------------------------------


async def handshake(a: HttpTransport, b: HttpTransport) -> FrameStream:
    """A stream opened by hand from ``a``'s identity (as `HttpClient._open_stream` does)."""
    client = a._client
    if "b" not in client.peer_incarnations:
        client.peer_incarnations["b"] = b.incarnation
    stream = await client._open_stream("b", b.url)
    assert isinstance(stream, FrameStream)
    return stream


def encoded(a: HttpTransport, i: int) -> bytes:
    from tandem.transports import codec

    frame = small(i).replace(sender="a", channel=CH, msg_id=i)
    return b"".join(bytes(p) for p in codec.encode_parts(frame))


async def closed_by_receiver(stream: FrameStream) -> None:
    """Until the receiver closes the stream (it must, without answering)."""
    acks = stream.ack_seq
    try:
        async with asyncio.timeout(5):
            while stream.error is None:
                await asyncio.sleep(0.005)
    finally:
        stream.close()
    assert "the receiver closed the stream" in str(stream.error)
    assert stream.ack_seq == acks


async def test_a_forged_record_is_refused_and_closes_the_stream(http_pair):
    a, b = await http_pair(config)
    stream = await handshake(a, b)
    forged = framewire.record(b"not the key" * 3, 0, CH, 0, 0, [encoded(a, 0)])
    stream.transport.write(forged)
    await closed_by_receiver(stream)
    assert b.refused.get("unauthenticated") == 1
    assert b._server.inboxes.get(("a", CH)) is None or not b._server.inboxes[("a", CH)].items


async def test_a_replayed_record_is_refused_and_closes_the_stream(http_pair):
    a, b = await http_pair(config)
    stream = await handshake(a, b)
    rec = framewire.record(stream.mac, 0, CH, 0, 0, [encoded(a, 0)])
    answer = await stream.send(CH, 0, 0, [encoded(a, 0)])
    assert (answer.status, answer.text) == (200, "ok")
    stream.transport.write(rec)  # record 0 again, as record 1: its tag is record 0's
    await closed_by_receiver(stream)
    assert b.refused.get("unauthenticated") == 1
    assert (await b.recv("a", CH)).meta["i"] == 0
    assert len(b._server.inboxes[("a", CH)].items) == 0


async def test_reordered_records_are_refused_and_close_the_stream(http_pair):
    a, b = await http_pair(config)
    stream = await handshake(a, b)
    r0 = framewire.record(stream.mac, 0, CH, 0, 0, [encoded(a, 0)])
    r1 = framewire.record(stream.mac, 1, CH, 1, 0, [encoded(a, 1)])
    stream.transport.write(r1 + r0)
    await closed_by_receiver(stream)
    assert b.refused.get("unauthenticated") == 1
    assert b._server.inboxes.get(("a", CH)) is None or not b._server.inboxes[("a", CH)].items


async def test_a_record_moved_to_another_stream_is_refused(http_pair):
    a, b = await http_pair(config)
    one, other = await handshake(a, b), await handshake(a, b)
    assert one.mac.key != other.mac.key
    other.transport.write(framewire.record(one.mac, 0, CH, 0, 0, [encoded(a, 0)]))
    await closed_by_receiver(other)
    assert b.refused.get("unauthenticated") == 1
    one.close()


async def test_records_split_across_reads_or_sharing_one_are_each_admitted_in_order(http_pair):
    a, b = await http_pair(config)
    stream = await handshake(a, b)
    records = [framewire.record(stream.mac, i, CH, i, 0, [encoded(a, i)]) for i in range(4)]
    stream.seq = len(records)  # written by hand below: the acks answer these
    wire = b"".join(records)
    cut = len(records[0]) + 10  # record 0 whole with the start of record 1, then the rest
    pieces = [wire[:cut], wire[cut : cut + 3], wire[cut + 3 : cut + 40], wire[cut + 40 :]]
    for piece in pieces:
        stream.transport.write(piece)
        await asyncio.sleep(0.01)  # (separate reads or not: the records are the same)
    async with asyncio.timeout(5):
        for i in range(len(records)):
            assert (await b.recv("a", CH)).meta["i"] == i
        while stream.ack_seq < len(records):
            await asyncio.sleep(0.005)
    assert stream.error is None and not b.refused
    stream.close()


async def test_an_oversize_header_is_refused_and_closes_the_stream(http_pair):
    a, b = await http_pair(config)
    stream = await handshake(a, b)
    stream.transport.write(RECORD.pack(framewire.MAX_CHANNEL_BYTES + 1, 4, 0, 0))
    await closed_by_receiver(stream)
    assert b.refused.get("oversize_header") == 1
    stream2 = await handshake(a, b)
    stream2.transport.write(RECORD.pack(1, framewire.MAX_RECORD_BODY + 1, 0, 0))
    await closed_by_receiver(stream2)
    assert b.refused.get("too_large") == 1


async def test_an_unsigned_or_replayed_handshake_is_refused(http_pair):
    a, b = await http_pair(config)
    headers = {H_SENDER: "a", H_INC: a.incarnation, "Content-Length": "0"}
    material = (SECRET, "a", a.incarnation, "b", "", "")
    answer = await open_stream("b", b.url, headers, material, None, 5.0)
    assert not isinstance(answer, FrameStream) and answer.status == 401
    auth.sign(SECRET, "POST", STREAM_PATH, headers, auth.EMPTY_SHA, receiver="b", to=b.incarnation)
    first = await open_stream("b", b.url, dict(headers), material, None, 5.0)
    assert isinstance(first, FrameStream)
    again = await open_stream("b", b.url, dict(headers), material, None, 5.0)
    assert not isinstance(again, FrameStream) and again.status == 401
    first.close()


async def test_a_stream_lost_mid_window_is_resent_exactly_once_in_order(http_pair):
    # an inbox of 2: the window's later records wait for a slot when the stream is cut
    a, b = await http_pair(
        config,
        a_kw={"backoff_base": 0.001},
        b_kw={"capacity": 2, "backpressure_wait": 5.0},
    )
    sends = asyncio.gather(*(a.send("b", CH, small(i)) for i in range(8)))
    while (
        len(b._server.inboxes.get(("a", CH), ()).items if ("a", CH) in b._server.inboxes else ())
        < 2
    ):
        await asyncio.sleep(0.005)
    (cut,) = b._server.frame_streams
    cut.abort()
    got = [(await b.recv("a", CH)).meta["i"] for _ in range(8)]
    await sends
    assert got == list(range(8))
    assert b._server.stats("a").frames == 8
    assert a._client.requests["stream"] > 8  # the ones cut off went again
    assert len(b._server.inboxes[("a", CH)].items) == 0


async def test_a_forged_ack_closes_the_stream_and_the_send_retries():
    """A receiver (or a network attacker) answering with an ack whose tag is wrong: the send
    never takes it for a verdict; the stream is closed and the send fails to be retried."""
    nonce = "ab" * framewire.NONCE_BYTES
    served = asyncio.Event()

    async def fake_receiver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await fake_answers(reader, writer)
        finally:
            writer.close()
            await writer.wait_closed()
            served.set()

    async def fake_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
            b"Upgrade: tandem-stream/1\r\nX-Tandem-Stream-Nonce: " + nonce.encode() + b"\r\n\r\n"
        )
        await reader.readexactly(RECORD.size)
        writer.write(framewire.ack(b"wrong key", 0, 0, 200, "", "ok", 0.0))
        await reader.read()

    server = await asyncio.start_server(fake_receiver, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        headers = {H_SENDER: "a", H_INC: "inc", "Content-Length": "0"}
        material = (SECRET, "a", "inc", "b", "", "")
        stream = await open_stream("b", f"http://127.0.0.1:{port}", headers, material, None, 5.0)
        assert isinstance(stream, FrameStream)
        with pytest.raises(ConnectionResetError, match="bad tag"):
            await stream.send(CH, 0, 0, [b"x" * 64])
        assert not stream.usable
        async with asyncio.timeout(10):  # the fake receiver saw the stream closed and ended
            await served.wait()


@pytest.mark.parametrize("key_len", [0, 32, 64, 65, 200])
def test_stream_mac_is_hmac_sha256(key_len: int) -> None:
    """The precomputed tag is exactly the HMAC-SHA256 the wire format names, whatever the key
    length (longer than a block: hashed first), and split parts tag as their concatenation."""
    key = bytes(range(256))[:key_len]
    mac = framewire.StreamMac(key)
    msg = bytes(range(256)) * 20
    expected = hmac.new(key, b"c" + (7).to_bytes(8, "little") + msg, hashlib.sha256).digest()
    assert mac.tag(b"c", 7, [msg[:5], memoryview(msg)[5:]]) == expected[: framewire.TAG_BYTES]
    assert mac.tag(b"s", 7, [msg]) != mac.tag(b"c", 7, [msg])
