"""The signed bulk body's deferred digest (``auth.DEFERRED``): the sender hashes while it sends
and signs the digest in a trailer line after the body; the receiver accepts the frame only
when the trailer is signed for this message and its digest is the body's. And the BLAKE3 body
digest's header format: an older Tandem's SHA-256 header is refused from the headers."""

from __future__ import annotations

import hashlib

import numpy as np
import orjson
import pytest

from tandem.transports import auth
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, H_LENGTH
from test_http_bulk import bulk, bulk_post, cfg, encoded, no_connections_left, tensor
from test_http_security import SECRET, bound, routing, signed

MiB = 1 << 20


def deferred_head(to, msg_id: int, body: bytes, **over) -> dict[str, str]:
    h = auth.sign(
        SECRET, "POST", FRAME_PATH, routing(msg_id, body, **over), auth.DEFERRED, **bound(to)
    )
    h[H_LENGTH] = str(len(body))
    return h


def trailer(to, head, body: bytes, *, secret=SECRET, digest=None, **changes) -> bytes:
    t = {k: head[k] for k in auth.SIGNED_HEADERS if k in head}
    t.update(changes)
    digest = auth.body_digest([body]) if digest is None else digest
    auth.sign(secret, auth.TRAILER, FRAME_PATH, t, digest, **bound(to))
    return orjson.dumps(t) + b"\n"


def test_body_digest_is_blake3_and_the_same_on_all_cores():
    body = np.random.default_rng(0).integers(0, 256, 9 * MiB, np.uint8).tobytes()
    pieces = [memoryview(body)[: 5 * MiB], memoryview(body)[5 * MiB :]]
    one = auth.body_hasher()
    one.update(body)
    assert auth.body_digest(pieces) == auth.digest_of(one) == auth.body_digest([body])
    assert auth.body_digest([body]).startswith("blake3:") and len(auth.EMPTY_SHA) == 7 + 64


async def test_signed_bulk_sends_defer_the_digest_to_a_trailer(http_pair):
    a, b = await http_pair(cfg)
    xs = [tensor(3 * MiB, seed=i) for i in range(3)]
    for x in xs:
        await a.send("b", "c", Frame(arrays=(x,)))
    for x in xs:
        np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
    assert bulk(a, "sent") == bulk(b, "received") == 3 and b.refused == {}
    await no_connections_left(b)


async def test_deferred_digest_refusals(http_pair):
    """A body altered under an honest trailer, a trailer for another message, one signed with
    another secret, a replayed trailer, a malformed one: 401 after the body; a missing one
    (connection closed) leaves nothing behind; the server keeps serving."""
    a, b = await http_pair(cfg)
    body = encoded(tensor(MiB))
    altered = bytearray(body)
    altered[len(altered) // 2] ^= 1
    h = deferred_head(b, 0, body)
    assert await bulk_post(b.url, h, bytes(altered) + trailer(b, h, body)) == (
        "line",
        401,
        "unauthorized",
    )
    h = deferred_head(b, 0, body)
    other = trailer(b, h, body, **{"X-Tandem-Msg-Id": "7"})
    assert await bulk_post(b.url, h, body + other) == ("line", 401, "unauthorized")
    h = deferred_head(b, 0, body)
    forged = trailer(b, h, body, secret=b"other")
    assert await bulk_post(b.url, h, body + forged) == ("line", 401, "unauthorized")
    h = deferred_head(b, 0, body)
    again = trailer(b, h, body, digest=auth.DEFERRED)
    assert await bulk_post(b.url, h, body + again) == ("line", 401, "unauthorized")
    h = deferred_head(b, 0, body)
    assert await bulk_post(b.url, h, body + b"[1, 2]\n") == ("line", 401, "unauthorized")
    h = deferred_head(b, 0, body)
    assert await bulk_post(b.url, h, body, close_after=len(body)) == ("closed", 0, "")
    h = deferred_head(b, 0, body)
    honest = trailer(b, h, body)
    assert await bulk_post(b.url, h, body + honest) == ("line", 200, "ok")
    h2 = deferred_head(b, 1, body)
    assert await bulk_post(b.url, h2, body + honest) == (
        "line",
        401,
        "unauthorized",
    )  # not its trailer
    assert b.refused.get("unauthenticated") == 6
    assert (await b.recv("a", "c")).msg_id == 0  # the honest hand-made one
    good = np.ones(MiB // 4, np.float32)
    await a.send("b", "c", Frame(arrays=(good,)))
    np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], good)
    await no_connections_left(b)


async def test_deferred_digest_on_a_plain_post_is_refused(http_pair):
    a, b = await http_pair(cfg)
    body = encoded(tensor(4096))
    h = deferred_head(b, 0, body)
    del h[H_LENGTH]
    async with a._client.session.post(b.url + FRAME_PATH, headers=h, data=body) as resp:
        assert resp.status == 400 and "bulk bodies only" in await resp.text()


@pytest.mark.parametrize("how", ["legacy_header", "bare_hex"])
async def test_an_older_tandems_sha256_digest_is_refused_from_the_headers(http_pair, how):
    a, b = await http_pair(cfg)
    body = encoded(tensor(4096))
    h = signed(b, 0, body)
    if how == "legacy_header":
        h[auth.LEGACY_BODY_SHA] = hashlib.sha256(body).hexdigest()
        del h[auth.BODY_SHA]
    else:
        h[auth.BODY_SHA] = hashlib.sha256(body).hexdigest()
    refused = []
    b.on_auth_refused = lambda who, why: refused.append(why)
    async with a._client.session.post(b.url + FRAME_PATH, headers=h, data=body) as resp:
        assert resp.status == 401
    assert len(refused) == 1
    assert ("older Tandem" if how == "legacy_header" else "64 lower-case hex") in refused[0]
