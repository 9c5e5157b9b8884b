"""The wire format of a frame stream (``tandem-stream/1``): a persistent, authenticated
connection per (sender, receiver) that carries small frames without an HTTP request each
(docs/transports.md, "Frame streams"). Pure: no asyncio.

After the handshake (a signed ``POST /tandem/v1/stream`` answered ``101``), both ends derive
the stream key::

    key = HMAC-SHA256(secret[key_id], "tandem-stream/1" \\n sender \\n sender incarnation
                      \\n receiver \\n receiver incarnation \\n request nonce \\n stream nonce)

(``request nonce``: the handshake signature's single-use nonce; ``stream nonce``: the random
value the receiver names in its 101.) Each record the sender writes::

    head (RECORD: channel length u16, body length u32, msg id u64, base u64; little-endian)
    channel (UTF-8)  body (one codec-encoded frame)  tag (16 bytes)
    tag = HMAC-SHA256(key, "c" + record seq u64 + head + channel + body)[:16]

and each answer (ack) of the receiver::

    head (ACK: record seq u64, status u16, reason length u8, text length u16, wait f32)
    reason  text  tag = HMAC-SHA256(key, "s" + ack seq u64 + head + reason + text)[:16]

``record seq`` / ``ack seq`` count the records / acks of this stream from 0 and are never
sent: a record replayed, reordered, reflected or moved to another stream fails its tag.

Tags authenticate, so they need a secret: a receiver without one (it accepts unsigned
requests) says ``none`` in its 101's `TAGS_HEADER` and both ends leave the tags out (a mac of
None below), as an unsigned POST carries no digest; with a secret, ``hmac-sha256-128``. A
sender whose own setting differs does not use the stream (`tags_for`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

STREAM_PROTOCOL = "tandem-stream/1"  # the Upgrade token of a frame stream
RECORD = struct.Struct("<HIQQ")  # channel length, body length, msg id, base
ACK = struct.Struct("<QHBHf")  # record seq, status, reason length, text length, wait
TAG_BYTES = 16
MAX_CHANNEL_BYTES = 256  # a longer channel name is an oversize header: the stream closes
MAX_ACK_TEXT = 4096  # the most text bytes an ack carries (longer refusals are cut)
NONCE_BYTES = 16
TAGS_HMAC = "hmac-sha256-128"  # records and acks carry tags (the receiver holds a secret)
TAGS_NONE = "none"  # no tags: a receiver without a secret authenticates nothing
MAX_RECORD_BODY = 1 << 20  # the largest frame a stream carries (larger ones are POSTed)


class RecordHead(NamedTuple):
    channel_len: int
    body_len: int
    msg_id: int
    base: int


class AckHead(NamedTuple):
    seq: int
    status: int
    reason_len: int
    text_len: int
    waited: float


def stream_key(
    secret: bytes,
    sender: str,
    sender_inc: str,
    receiver: str,
    receiver_inc: str,
    request_nonce: str,
    stream_nonce: str,
) -> bytes:
    """The key of one stream; both ends derive it from the handshake (see the module)."""
    fields = (STREAM_PROTOCOL, sender, sender_inc, receiver, receiver_inc)
    msg = "\n".join((*fields, request_nonce, stream_nonce)).encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


class StreamMac:
    """HMAC-SHA256 (RFC 2104) under one stream key, with the keyed inner and outer hash states
    computed once: a tag then costs two hash copies instead of a key schedule per record.
    ``tag`` equals ``HMAC-SHA256(key, direction + seq u64 + parts)[:TAG_BYTES]``."""

    __slots__ = ("key", "_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        self.key = key
        block = key if len(key) <= _BLOCK else hashlib.sha256(key).digest()
        block = block.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def tag(self, direction: bytes, seq: int, parts: Sequence[bytes | memoryview]) -> bytes:
        h = self._inner.copy()
        h.update(direction)
        h.update(seq.to_bytes(8, "little"))
        for p in parts:
            h.update(p)
        o = self._outer.copy()
        o.update(h.digest())
        return o.digest()[:TAG_BYTES]


_BLOCK = 64  # SHA-256's block size: the HMAC key is padded (or first hashed) to it


def tags_for(secret: bytes | None) -> str:
    """The tag setting of a stream end holding ``secret`` (`TAGS_HMAC` or `TAGS_NONE`)."""
    return TAGS_HMAC if secret else TAGS_NONE


def mac_for(tags: str, key: bytes) -> StreamMac | None:
    """The `StreamMac` of a stream whose tag setting is ``tags`` (None: untagged)."""
    return StreamMac(key) if tags == TAGS_HMAC else None


def _mac(key: bytes | StreamMac) -> StreamMac:
    return key if isinstance(key, StreamMac) else StreamMac(key)


def record(
    key: bytes | StreamMac | None,
    seq: int,
    channel: str,
    msg_id: int,
    base: int,
    body: Sequence[bytes | memoryview],
) -> bytes:
    """Record number ``seq`` of a stream: head, channel, body, tag (one buffer, one write);
    no tag when ``key`` is None (an untagged stream)."""
    ch = channel.encode()
    if len(ch) > MAX_CHANNEL_BYTES:
        raise ValueError(f"channel name of {len(ch)} bytes exceeds {MAX_CHANNEL_BYTES}")
    size = 0
    for b in body:
        size += len(b)
    parts = [RECORD.pack(len(ch), size, msg_id, base), ch, *body]
    if key is not None:
        parts.append(_mac(key).tag(b"c", seq, parts))
    return b"".join(parts)


def record_tag(
    key: bytes | StreamMac, seq: int, head: bytes | memoryview, rest: bytes | memoryview
) -> bytes:
    """The tag record ``seq`` must carry (``rest``: its channel and body)."""
    return _mac(key).tag(b"c", seq, (head, rest))


def ack(
    key: bytes | StreamMac | None,
    ack_seq: int,
    seq: int,
    status: int,
    reason: str,
    text: str,
    waited: float,
) -> bytes:
    """Ack number ``ack_seq`` of a stream, answering record ``seq`` (untagged when ``key`` is
    None)."""
    r = reason.encode()[:255]
    t = text.encode()[:MAX_ACK_TEXT]
    parts = [ACK.pack(seq, status, len(r), len(t), waited), r, t]
    if key is not None:
        parts.append(_mac(key).tag(b"s", ack_seq, parts))
    return b"".join(parts)


def ack_tag(
    key: bytes | StreamMac, ack_seq: int, head: bytes | memoryview, rest: bytes | memoryview
) -> bytes:
    """The tag ack ``ack_seq`` must carry (``rest``: its reason and text)."""
    return _mac(key).tag(b"s", ack_seq, (head, rest))


def same_tag(a: bytes | memoryview, b: bytes) -> bool:
    return hmac.compare_digest(bytes(a), b)
