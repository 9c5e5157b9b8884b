"""The GMAC tag of bulk bodies signed with a shared secret (``auth.DEFERRED_MAC``,
`tandem.transports.bodymac`): keyed by the secret and the signed head, carried in the signed
trailer, checked as the bytes land; refused when the body, the key or the tag's kind differs,
and under per-party keys (which keep the BLAKE3 digest)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from tandem.errors import AuthenticationError
from tandem.transports import auth, bodymac
from tandem.transports.base import Frame
from tandem.transports.http import FRAME_PATH, H_LENGTH
from test_http_bulk import bulk, bulk_post, cfg, encoded, no_connections_left, tensor
from test_http_security import SECRET, bound, routing

MiB = 1 << 20


def mac_head(to, msg_id: int, body: bytes, secret=SECRET) -> dict[str, str]:
    h = auth.sign(secret, "POST", FRAME_PATH, routing(msg_id, body), auth.DEFERRED_MAC, **bound(to))
    h[H_LENGTH] = str(len(body))
    return h


def mac_of(head: dict[str, str], body: bytes, secret=SECRET) -> str:
    signed = {k: v for k, v in head.items() if k != H_LENGTH}
    mac = auth.body_mac(secret, "POST", FRAME_PATH, signed)
    mac.update(body)
    return auth.digest_of(mac)


def trailer(to, head, digest: str, secret=SECRET) -> bytes:
    t = {k: head[k] for k in auth.SIGNED_HEADERS if k in head}
    auth.sign(secret, auth.TRAILER, FRAME_PATH, t, digest, **bound(to))
    return orjson.dumps(t) + b"\n"


def test_the_tag_is_the_same_in_any_pieces_and_single_use_per_head():
    body = np.random.default_rng(0).integers(0, 256, 3 * MiB + 5, np.uint8).tobytes()
    head = auth.sign(SECRET, "POST", FRAME_PATH, {"X-Tandem-Sender": "a"}, auth.DEFERRED_MAC)
    whole = auth.body_mac(SECRET, "POST", FRAME_PATH, head)
    whole.update(body)
    pieces = auth.body_mac(SECRET, "POST", FRAME_PATH, head)
    for i in range(0, len(body), 777_777):
        pieces.update(memoryview(body)[i : i + 777_777])
    tag = auth.digest_of(whole)
    assert tag == auth.digest_of(pieces) and bodymac.is_tag(tag) and tag.startswith("gmac:")
    assert whole.hexdigest() == whole.hexdigest()  # idempotent once finished
    with pytest.raises(RuntimeError):
        whole.update(b"more")
    other_head = auth.sign(SECRET, "POST", FRAME_PATH, dict(head), auth.DEFERRED_MAC)
    assert mac_of(other_head, body) != tag  # a new nonce: a new key
    assert mac_of(head, body, secret=b"other") != tag
    flipped = bytearray(body)
    flipped[-1] ^= 1
    assert mac_of(head, bytes(flipped)) != tag
    # a head may defer to a MAC but never carry a tag itself; a trailer may
    auth.check_digest({auth.BODY_SHA: auth.DEFERRED_MAC})
    auth.check_digest({auth.BODY_SHA: tag}, trailer=True)
    with pytest.raises(AuthenticationError):
        auth.check_digest({auth.BODY_SHA: tag})


async def test_secret_signed_bulk_sends_carry_a_gmac(http_pair, monkeypatch):
    made = []
    real = auth.body_mac
    monkeypatch.setattr(auth, "body_mac", lambda *a: made.append(1) or real(*a))
    a, b = await http_pair(cfg)
    xs = [tensor(3 * MiB, seed=i) for i in range(2)]
    for x in xs:
        await a.send("b", "c", Frame(arrays=(x,)))
    for x in xs:
        np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
    assert bulk(a, "sent") == bulk(b, "received") == 2 and b.refused == {}
    assert len(made) == 4  # one per body on each end
    await no_connections_left(b)


async def test_gmac_refusals(http_pair):
    """A body altered under an honest tag, a tag keyed by another head or another secret, a
    BLAKE3 digest or another deferral in the trailer: 401 after the body; the honest one is
    delivered and the server keeps serving."""
    a, b = await http_pair(cfg)
    body = encoded(tensor(MiB))
    altered = bytearray(body)
    altered[len(altered) // 2] ^= 1
    unauthorized = ("line", 401, "unauthorized")
    h = mac_head(b, 0, body)
    assert await bulk_post(b.url, h, bytes(altered) + trailer(b, h, mac_of(h, body))) == (
        unauthorized
    )
    h, other = mac_head(b, 0, body), mac_head(b, 0, body)
    assert await bulk_post(b.url, h, body + trailer(b, h, mac_of(other, body))) == unauthorized
    h = mac_head(b, 0, body)
    wrong_key = trailer(b, h, mac_of(h, body, secret=b"other"))
    assert await bulk_post(b.url, h, body + wrong_key) == unauthorized
    for digest in (auth.body_digest([body]), auth.DEFERRED_MAC, auth.DEFERRED):
        h = mac_head(b, 0, body)
        assert await bulk_post(b.url, h, body + trailer(b, h, digest)) == unauthorized
    h = mac_head(b, 0, body)
    assert await bulk_post(b.url, h, body + trailer(b, h, mac_of(h, body))) == (
        "line",
        200,
        "ok",
    )
    assert b.refused.get("unauthenticated") == 6
    assert (await b.recv("a", "c")).msg_id == 0
    await no_connections_left(b)


async def test_a_gmac_head_under_per_party_keys_is_refused(http_pair, tmp_path):
    from tandem.transports.keys import Roster, SigningKey, generate

    pairs = {n: generate(n, tmp_path) for n in ("a", "b")}
    roster = Roster.from_files({n: [pairs[n][1]] for n in pairs})

    def keyed(name, **more):
        signing = SigningKey.from_file(pairs[name][0])
        return cfg(name, secret=None, signing_key=signing, roster=roster, **more)

    a, b = await http_pair(keyed)
    x = tensor(MiB)
    await a.send("b", "c", Frame(arrays=(x,)))  # a keyed party's bulk body: BLAKE3
    np.testing.assert_array_equal((await b.recv("a", "c")).arrays[0], x)
    assert bulk(b, "received") == 1
    body = encoded(tensor(MiB), msg_id=1)
    h = auth.sign(
        SigningKey.from_file(pairs["a"][0]),
        "POST",
        FRAME_PATH,
        routing(1, body),
        auth.DEFERRED_MAC,
        **bound(b),
    )
    h[H_LENGTH] = str(len(body))
    assert await bulk_post(b.url, h, body) == ("http", 401, "unauthorized")
    assert b.refused == {"unauthenticated": 1}
    with pytest.raises(AuthenticationError, match="needs a shared secret"):
        b._server.gate.verifier.body_mac("POST", FRAME_PATH, h)
