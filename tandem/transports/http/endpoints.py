"""The HTTP endpoints of a receiver (`server.HttpServer`): ``POST /tandem/v1/frame`` (one
chunk of a frame, plain or bulk), ``POST /tandem/v1/stream`` (a frame stream, `streamserve`),
``POST /tandem/v1/bye`` (the sender closed), ``GET /healthz`` (liveness; names this party
and its incarnation only to an authenticated caller) and ``GET /metrics`` (Prometheus text,
rendered by the transport; only to a caller holding ``metrics_token`` or proving a peer's
identity, or on the separate ``metrics_listen`` address: anyone else gets 401 or 404 with an
empty body, never a name or a count). Each turns a request into the server's verdict and answers it;
every bad request gets its status and the next one is handled."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Protocol

import aiohttp
from aiohttp import web

from .. import auth
from .body import DRAIN_BYTES, Body, PlainBody
from .bulk import BulkBody
from .identity import Gate
from .protocol import (
    BULK_PROTOCOL,
    BYE_PATH,
    FRAME_PATH,
    H_BASE,
    H_CHANNEL,
    H_CHUNK,
    H_CHUNKS,
    H_ID,
    H_INC,
    H_OFFSET,
    H_SPEC,
    H_TOTAL,
    HEALTH_PATH,
    METRICS_PATH,
    MessageHead,
    Refuse,
    Reply,
    int_header,
)
from .streamserve import HttpServer as StreamReceiver
from .streamserve import serve_stream


class Receiver(StreamReceiver, Protocol):
    """What the endpoints need of their `server.HttpServer`: what a frame stream needs, and
    its identity (`identity.Gate`), this process's incarnation and goodbyes."""

    gate: Gate
    incarnation: str

    async def forget_incarnation(self, sender: str, inc: str) -> None: ...


class Endpoints:
    """The request handlers of ``server``; ``metrics_text()`` renders ``GET /metrics``."""

    def __init__(self, server: Receiver, metrics_text: Callable[[], str]) -> None:
        self.server = server
        self._metrics_text = metrics_text

    async def frame(self, request: web.Request) -> web.StreamResponse:
        """``POST /tandem/v1/frame``: a plain request (body in the HTTP message) or a bulk one
        (``Upgrade: tandem-frame/1``, body raw after the 101). Both run `receive`; only where
        the body comes from (`PlainBody`, `BulkBody`) and how the reply travels differ."""
        server = self.server
        bulk = request.headers.get("Upgrade", "").strip().lower() == BULK_PROTOCOL
        body: Body = (
            BulkBody(request)
            if bulk
            else PlainBody(
                request.content,
                request.content_length,
                request.transport,
                unread_limit=DRAIN_BYTES,
            )
        )
        try:
            reply = await self.receive(request, body)
        except Refuse as r:
            reply = server.refusal(r)
        except (ConnectionError, aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as exc:
            server.refused["disconnected"] = server.refused.get("disconnected", 0) + 1
            reply = Reply(400, f"request body incomplete: {exc}")
        except Exception as exc:  # the server must keep serving; report and move on
            server.quiet.error(
                "%s: internal error while receiving a frame", server.cfg.name, exc_info=exc
            )
            server.refused["internal"] = server.refused.get("internal", 0) + 1
            reply = Reply(500, "internal error (see the receiver's log)")
        finally:
            body.release()
        return body.respond(reply)

    async def receive(self, request: web.Request, body: Body) -> Reply:
        """A frame request's head, checked (closing 503, authentication, ``admit_stream``,
        headers 400), then `reassembly.Reassembler.receive_message`."""
        server = self.server
        if server.closed:
            raise Refuse(503, "closing", "receiver is closing")
        sender = server.authenticate(request, FRAME_PATH)
        h = request.headers
        channel = h.get(H_CHANNEL, "")
        if not channel:
            raise Refuse(400, "malformed", f"missing header {H_CHANNEL}")
        server.check_stream(sender, channel)
        inc = h.get(H_INC, "")
        if not inc:
            raise Refuse(400, "malformed", f"missing header {H_INC}")
        msg_id, chunk, chunks, offset, total = (
            int_header(h, k) for k in (H_ID, H_CHUNK, H_CHUNKS, H_OFFSET, H_TOTAL)
        )
        length = body.length()
        digest = h.get(auth.BODY_SHA, "") if server.verifier is not None else None
        if digest in (auth.DEFERRED, auth.DEFERRED_MAC):  # digest follows, in a signed trailer
            if not isinstance(body, BulkBody):
                raise Refuse(400, "malformed", f"{auth.BODY_SHA}: {digest} is for bulk bodies only")
            if digest == auth.DEFERRED_MAC:
                body.mac = server.gate.body_mac(h, sender)
            body.check_trailer = lambda line: server.gate.verify_trailer(h, line, sender)
        base = int_header(h, H_BASE) if H_BASE in h else msg_id
        head = MessageHead(sender, channel, inc, msg_id, chunk, chunks, offset, total, base)
        return await server.receive_message(head, length, h.get(H_SPEC, ""), body, digest)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """``POST /tandem/v1/stream``: a frame stream (`streamserve`)."""
        return await serve_stream(self.server, request)

    async def bye(self, request: web.Request) -> web.Response:
        server = self.server
        try:
            sender = server.authenticate(request, BYE_PATH)
        except Refuse as r:
            return server.refusal(r).response()
        if request.content_length:
            return server.refusal(Refuse(400, "malformed", "a goodbye has no body")).response()
        await server.forget_incarnation(sender, request.headers.get(H_INC, ""))
        return web.Response(text="bye")

    async def health(self, request: web.Request) -> web.Response:
        """Liveness for anyone; this party's name and incarnation only for a peer that proves
        who it is (signed request, or client certificate)."""
        server = self.server
        if server.gate.caller_is_peer(request, HEALTH_PATH):
            return web.json_response(
                {"status": "ok", "party": server.cfg.name, "incarnation": server.incarnation}
            )
        return web.json_response({"status": "ok"})

    def may_read_metrics(self, request: web.Request) -> bool:
        """Whether ``request`` may read ``/metrics`` on the main listener: its bearer token
        is ``metrics_token`` (constant-time compare), or it proves a peer's identity."""
        cfg = self.server.cfg
        given = request.headers.get("Authorization", "")
        if cfg.metrics_token is not None and given.startswith("Bearer "):
            # the header's raw bytes (aiohttp decodes them with surrogateescape), so a
            # token that is not UTF-8 is a wrong token, not an encoding error
            token = given[7:].strip().encode("utf-8", "surrogateescape")
            if hmac.compare_digest(token, cfg.metrics_token):
                return True
        return self.server.gate.caller_is_peer(request, METRICS_PATH)

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics`` on the main listener: 404 when a separate ``metrics_listen``
        serves them, 401 (empty, ``WWW-Authenticate: Bearer``) to a caller that may not read
        them."""
        if self.server.cfg.metrics_listen is not None:
            return web.Response(status=404)
        if not self.may_read_metrics(request):
            return web.Response(status=401, headers={"WWW-Authenticate": "Bearer"})
        return await self.metrics_document(request)

    async def metrics_document(self, request: web.Request) -> web.Response:
        """The metrics themselves (the ``metrics_listen`` listener serves this to anyone)."""
        return web.Response(
            text=self._metrics_text(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )


__all__ = ["Endpoints"]
