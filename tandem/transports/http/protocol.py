"""The HTTP transport's wire protocol: paths, headers, and what a receiver answers.

Shared by the sending (`client`, `bulk`) and the receiving side (`server`, `body`, `bulk`);
docs/transports.md describes the protocol in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson
from aiohttp import web

FRAME_PATH = "/tandem/v1/frame"
BYE_PATH = "/tandem/v1/bye"
STREAM_PATH = "/tandem/v1/stream"  # the handshake of a frame stream (`framewire`)
HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"

H_SENDER = "X-Tandem-Sender"
H_INC = "X-Tandem-Incarnation"  # random per sender process
H_CHANNEL = "X-Tandem-Channel"
H_ID = "X-Tandem-Msg-Id"
#: the sender's lowest unsettled message id on the stream: every id below it was acknowledged
#: or abandoned (a cancelled send), so the receiver need not wait for the missing ones
H_BASE = "X-Tandem-Base"
H_CHUNK = "X-Tandem-Chunk"
H_CHUNKS = "X-Tandem-Chunks"
H_OFFSET = "X-Tandem-Offset"
H_TOTAL = "X-Tandem-Total"
H_SPEC = "X-Tandem-Spec"
H_REPLY = "X-Tandem-Reply-To"  # the sender's own base URL (lets `admit_unknown` learn it)
H_WAIT = "X-Tandem-Wait"  # seconds the receiver spent waiting for an inbox slot
H_LENGTH = "X-Tandem-Length"  # body length of a bulk request (its own Content-Length is 0)
H_REASON = "X-Tandem-Reason"  # why a request was refused (a `Refuse.reason`)
H_STREAM_NONCE = "X-Tandem-Stream-Nonce"  # the receiver's random value in a stream's 101
H_STREAM_TAGS = "X-Tandem-Stream-Tags"  # whether a stream's records and acks carry tags

BULK_PROTOCOL = "tandem-frame/1"  # the Upgrade token of the bulk path (see `bulk`)

# Below this many bytes, hashing and content checks run on the event loop: cheaper there than
# the hop to a worker thread.
INLINE_BYTES = 1 << 20


class Refuse(Exception):
    """Answer the request with ``status`` and ``text``; ``reason`` is the machine-readable
    cause (counted in ``tandem_refused_requests_total``, sent in ``X-Tandem-Reason``);
    ``extra`` fields turn the answer into a JSON object."""

    def __init__(self, status: int, reason: str, text: str, **extra: Any) -> None:
        super().__init__(text)
        self.status, self.reason, self.text, self.extra = status, reason, text, extra


class Answer(NamedTuple):
    """What the sender learns from one frame request, on either path."""

    status: int
    text: str
    waited: float  # seconds the receiver waited for an inbox slot (not transfer time)
    reason: str  # `Refuse.reason` of a refusal ("" when accepted, or a 401)


class Reply:
    """What the receiver answers to one frame request: an HTTP response on the plain path (and
    for refusals before a bulk upgrade), one JSON line after a bulk body."""

    __slots__ = ("status", "text", "waited", "content_type", "reason")

    def __init__(
        self,
        status: int,
        text: str,
        waited: float | None = None,
        content_type: str = "text/plain",
        reason: str = "",
    ) -> None:
        self.status, self.text, self.waited = status, text, waited
        self.content_type, self.reason = content_type, reason

    def response(self) -> web.Response:
        headers = {}
        if self.waited is not None:
            headers[H_WAIT] = f"{self.waited:.6f}"
        if self.reason:
            headers[H_REASON] = self.reason
        return web.Response(
            status=self.status, text=self.text, content_type=self.content_type, headers=headers
        )

    def line(self) -> bytes:
        reply: dict[str, Any] = {
            "status": self.status,
            "text": self.text,
            "wait": round(self.waited or 0.0, 6),
        }
        if self.reason:
            reply["reason"] = self.reason
        return orjson.dumps(reply) + b"\n"


def int_header(h: Mapping[str, str], key: str) -> int:
    """A non-negative integer header; `Refuse` (400) when missing or malformed."""
    raw = h.get(key)
    if raw is None:
        raise Refuse(400, "malformed", f"missing header {key}")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 20:
        raise Refuse(
            400, "malformed", f"header {key} must be a non-negative integer, got {raw[:40]!r}"
        )
    return int(raw)


def seconds(raw: str | None) -> float:
    """A seconds header (``X-Tandem-Wait``) as a float; 0 when absent or malformed (it only
    refines the sender's bandwidth estimate)."""
    try:
        return float(raw or 0)
    except ValueError:
        return 0.0


def spec_text(got: str, mine: str) -> str:
    return (
        f"frame spec hash {got!r} differs from this party's {mine!r}; both parties must "
        "negotiate the same task spec"
    )


class MessageHead(NamedTuple):
    """Where one chunk of a message belongs (from a request's headers or a stream record)."""

    sender: str
    channel: str
    incarnation: str
    msg_id: int
    chunk: int
    chunks: int
    offset: int
    total: int
    base: int
