"""HTTP transport (aiohttp): every party serves frames and posts frames to its peers.

Implements `tandem.transports.base.Transport` with the same guarantees as `MemoryTransport`::

    async with HttpTransport(HttpConfig(name="server", peers={"c0": url})) as t:
        await t.send("c0", "updates", frame); f = await t.recv("c0", "model")

The package follows aiohttp's own split: `config` (`HttpConfig` and its validation), `client`
(sending, retry, backoff, error mapping), `server` (the receiving side's lifecycle and what
every request passes) with `endpoints` (the request handlers), `identity` (authentication,
certificate identity, admission of unknown peers), `checks` (a frame's checks and the
admission hooks), `reassembly` (chunks into messages, delivered in order) and `store`
(streams, bounded inboxes, sweeping), `connections` (accepting connections within caps and
timeouts), `budget` (the one bound on inbound bytes), `quietlog` (one
rate-limited line per refusal), `body` and `bulk` (how a request's body is read: a plain POST
through aiohttp, or the bulk path's raw upgraded connection), `scan` (the incremental NaN/Inf
check), `streams` (de-duplication state), `liveness` (peers' readiness, loss of a silent
peer), `metrics` (``GET /metrics``), `protocol` (paths, headers, answers), `framewire`,
`framestream` and `streamserve` (frame streams: the format, the sending and the receiving
side), and
`transport`, the `HttpTransport` facade over a client and a server.

Wire protocol (docs/transports.md has the full description):

* ``POST /tandem/v1/frame`` — body: one chunk of a `codec`-encoded frame; routing in headers
  ``X-Tandem-{Sender,Incarnation,Channel,Msg-Id,Chunk,Chunks,Offset,Total,Spec}``. Answers 200
  (delivered, or a duplicate already delivered), 400 malformed, 401 unauthenticated/unknown peer,
  409 spec-hash mismatch or chunk out of order, 410 retired sender incarnation, 411 no
  Content-Length, 413 too large, 422 refused content (NaN/Inf, validator, ``admit_frame``),
  403 a certificate of another identity or a stream ``admit_stream`` refuses, 408 a stalled
  body, 421 signed for another process of this party, 503 busy (no inbox slot or budget after
  ``backpressure_wait``) or closing (``X-Tandem-Reason`` tells which). Requests of at
  least ``bulk_min_bytes`` take the bulk path (`bulk`).
* ``POST /tandem/v1/stream`` — with ``frame_streams``: a signed handshake upgraded to
  ``tandem-stream/1``, then small frames as tagged records, each answered by a tagged ack.
* ``POST /tandem/v1/bye`` — the sender closed: recv from it raises once its frames are drained.
* ``GET /healthz`` (liveness; the party's name and incarnation only to a peer that signs the
  request or presents its certificate) and ``GET /metrics`` (Prometheus text); no
  authentication required. docs/security.md has the threat model and every limit.

The library never creates an event loop: construct and use the transport inside one.
"""

from .config import HttpConfig
from .protocol import BULK_PROTOCOL, BYE_PATH, FRAME_PATH, H_LENGTH
from .transport import HttpTransport

__all__ = ["HttpConfig", "HttpTransport", "FRAME_PATH", "BYE_PATH", "BULK_PROTOCOL", "H_LENGTH"]
