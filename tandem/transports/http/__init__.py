"""HTTP transport (aiohttp): every party serves frames and posts frames to its peers.

Implements `tandem.transports.base.Transport` with the same guarantees as `MemoryTransport`::

    async with HttpTransport(HttpConfig(name="server", peers={"c0": url})) as t:
        await t.send("c0", "updates", frame); f = await t.recv("c0", "model")

The package follows aiohttp's own split: `config` (`HttpConfig` and its validation), `client`
(sending, retry, backoff, error mapping), `server` (the aiohttp application, admission,
receiving into bounded inboxes), `body` and `bulk` (how a request's body is read: a plain POST
through aiohttp, or the bulk path's raw upgraded connection), `scan` (the incremental NaN/Inf
check), `streams` (de-duplication state), `liveness` (loss of a silent peer), `metrics`
(``GET /metrics``), `protocol` (paths, headers, answers), and `transport`, the `HttpTransport`
facade over a client and a server.

Wire protocol (docs/transports.md has the full description):

* ``POST /tandem/v1/frame`` — body: one chunk of a `codec`-encoded frame; routing in headers
  ``X-Tandem-{Sender,Incarnation,Channel,Msg-Id,Chunk,Chunks,Offset,Total,Spec}``. Answers 200
  (delivered, or a duplicate already delivered), 400 malformed, 401 unauthenticated/unknown peer,
  409 spec-hash mismatch or chunk out of order, 410 retired sender incarnation, 411 no
  Content-Length, 413 too large, 422 refused content (NaN/Inf, validator), 503 busy (inbox full
  after ``backpressure_wait``) or closing (``X-Tandem-Reason`` tells which). Requests of at
  least ``bulk_min_bytes`` take the bulk path (`bulk`).
* ``POST /tandem/v1/bye`` — the sender closed: recv from it raises once its frames are drained.
* ``GET /healthz`` and ``GET /metrics`` (Prometheus text); no authentication.

The library never creates an event loop: construct and use the transport inside one.
"""

from .config import HttpConfig
from .protocol import BULK_PROTOCOL, BYE_PATH, FRAME_PATH, H_LENGTH
from .transport import HttpTransport

__all__ = ["HttpConfig", "HttpTransport", "FRAME_PATH", "BYE_PATH", "BULK_PROTOCOL", "H_LENGTH"]
