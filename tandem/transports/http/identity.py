"""Who is asking: authentication of a request's sender (signature with a shared secret, TLS
client certificate), the certificate identities a peer may use, and the admission of unknown
senders as peers (``admit_unknown``).

Refusals, in order: an unknown sender (401, or 503 ``too_many_peers`` past ``max_peers``), a
bad signature (401; 421 when correctly signed for another incarnation of this receiver), a
certificate naming another identity (403) or none where one is required (401).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from tandem.errors import AuthenticationError, IdentityError, MissingExtraError

from .. import auth
from ..bodymac import BodyMac
from .config import HttpConfig, check_peer
from .protocol import FRAME_PATH, H_REPLY, H_SENDER, Refuse

log = logging.getLogger("tandem.transports.http.server")


def cert_identities(cert: Mapping[str, Any] | None) -> set[str]:
    """The identities a verified peer certificate (``ssl.SSLSocket.getpeercert()``) names:
    its subject's commonName values and every subjectAltName value (DNS, URI, IP, email)."""
    if not cert:
        return set()
    ids = {
        value
        for rdn in cert.get("subject", ())
        for key, value in rdn
        if key == "commonName" and isinstance(value, str)
    }
    ids.update(v for _, v in cert.get("subjectAltName", ()) if isinstance(v, str))
    return ids


def peer_cert(request: web.Request) -> Any:
    """The verified client certificate of ``request``'s connection (None without one)."""
    transport = request.transport
    return transport.get_extra_info("peercert") if transport is not None else None


class Gate:
    """Authenticates the requests of one receiver. ``peers`` (name -> base URL) is shared with
    the transport: a sender not in it is refused (401) unless ``admit_unknown`` admits it,
    which adds it there. ``rebinds`` counts 421 answers (signed for another incarnation: how a
    sender learns whom to sign for, not a refusal)."""

    def __init__(self, config: HttpConfig, peers: dict[str, str], incarnation: str) -> None:
        self.cfg = config
        self.peers = peers
        self.verifier = (
            auth.Verifier(
                config.keys() or None,
                roster=config.roster,
                name=config.name,
                incarnation=incarnation,
                window=config.auth_window,
                future_skew=config.max_clock_skew,
                max_nonces=config.max_nonces,
                max_senders=max(config.max_peers, len(peers)) + 64,
                clock=config.clock,
            )
            if config.signs
            else None
        )
        self.rebinds = 0
        #: called with (peer, reason) when a request naming a configured peer fails its
        #: signature check (before the 401 goes out); must not raise or block
        self.on_auth_refused: Callable[[str, str], None] | None = None

    def authenticate(self, request: web.Request, path: str) -> str:
        """The sender of a request: a known peer (or one ``admit_unknown`` admits) whose
        signature (with a secret) and certificate (with TLS client certificates) prove it."""
        sender = request.headers.get(H_SENDER, "")
        if sender not in self.peers:
            sender = self.admit(request, path, sender)
        elif self.verifier is not None:
            self.verify(request, path, sender)
        self.check_identity(request, sender)
        return sender

    def verify(self, request: web.Request, path: str, who: str) -> None:
        assert self.verifier is not None
        try:
            auth.check_digest(request.headers)
            self.verifier.verify(request.method, path, request.headers)
        except auth.MisdirectedError as exc:
            self.rebinds += 1
            raise Refuse(
                421, "misdirected", f"from {who!r}: {exc}", incarnation=exc.incarnation
            ) from None
        except AuthenticationError as exc:
            if self.on_auth_refused is not None and who in self.peers:
                self.on_auth_refused(who, str(exc))
            if isinstance(exc, IdentityError):
                raise Refuse(403, "identity", f"from {who!r}: {exc}") from None
            raise Refuse(401, "unauthenticated", f"from {who!r}: {exc}") from None

    def verify_trailer(self, head: Mapping[str, str], line: bytes, who: str) -> str:
        """The body digest a bulk body's trailer ``line`` carries (`auth.DEFERRED` heads): a
        JSON object of the head's routing headers and the digest, signed as method
        `auth.TRAILER` on the frame path (its own nonce: single use). `Refuse` 401 when it is
        malformed, unsigned, or names another message than ``head``."""
        assert self.verifier is not None
        try:
            trailer = orjson.loads(line)
        except orjson.JSONDecodeError:
            trailer = None
        if not (
            isinstance(trailer, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in trailer.items())
        ):
            raise Refuse(401, "unauthenticated", f"from {who!r}: malformed body trailer")
        for k in auth.SIGNED_HEADERS:
            if trailer.get(k, "") != head.get(k, ""):
                raise Refuse(
                    401, "unauthenticated", f"from {who!r}: the body trailer's {k} differs"
                )
        try:
            auth.check_digest(trailer, trailer=True)
            self.verifier.verify(auth.TRAILER, FRAME_PATH, trailer)
        except AuthenticationError as exc:
            if isinstance(exc, IdentityError):
                raise Refuse(403, "identity", f"from {who!r}: body trailer: {exc}") from None
            raise Refuse(401, "unauthenticated", f"from {who!r}: body trailer: {exc}") from None
        digest = trailer.get(auth.BODY_SHA, "")
        if digest in (auth.DEFERRED, auth.DEFERRED_MAC):
            raise Refuse(401, "unauthenticated", f"from {who!r}: the trailer defers again")
        return digest

    def body_mac(self, head: Mapping[str, str], who: str) -> BodyMac:
        """The GMAC a verified bulk head whose digest is `auth.DEFERRED_MAC` announces: 401
        under per-party keys (no shared secret to key it), 400 when this process lacks the
        ``cryptography`` package."""
        assert self.verifier is not None
        try:
            return self.verifier.body_mac("POST", FRAME_PATH, head)
        except AuthenticationError as exc:
            raise Refuse(401, "unauthenticated", f"from {who!r}: {exc}") from None
        except MissingExtraError as exc:
            raise Refuse(400, "malformed", f"from {who!r}: {exc}") from None

    def check_identity(self, request: web.Request, sender: str) -> None:
        """With a TLS client certificate, it must name one of ``sender``'s identities (403);
        a server that asks for certificates and holds no secret refuses a request without
        one (401)."""
        cert = peer_cert(request)
        if not cert:
            ctx = self.cfg.ssl_server
            if self.verifier is None and ctx is not None and ctx.verify_mode != ssl.CERT_NONE:
                raise Refuse(401, "unauthenticated", f"{sender!r} sent no client certificate")
            return
        ids = cert_identities(cert)
        allowed = list((self.cfg.peer_identities or {}).get(sender) or [sender])
        if not ids.intersection(allowed):
            raise Refuse(
                403,
                "identity",
                f"the TLS client certificate (names {sorted(ids)}) does not belong to "
                f"sender {sender!r} (accepted names: {allowed}); issue the certificate to "
                "that name or map it under peer_identities",
            )

    def admit(self, request: web.Request, path: str, sender: str) -> str:
        """An unknown sender becomes a peer only under ``admit_unknown`` with a valid signature."""
        if not (self.cfg.admit_unknown and self.verifier is not None and path == FRAME_PATH):
            raise Refuse(401, "unknown_peer", f"unknown sender {sender[:80]!r}")
        names = self.cfg.admit_names
        if names is not None and sender not in names:
            raise Refuse(401, "unknown_peer", f"sender {sender[:80]!r} is not in the roster")
        self.verify(request, path, f"unknown {sender}")
        url = request.headers.get(H_REPLY, "")
        if len(self.peers) >= self.cfg.max_peers:
            raise Refuse(
                503,
                "too_many_peers",
                f"{self.cfg.name!r} already has max_peers={self.cfg.max_peers} peers",
            )
        try:
            self.peers[sender] = check_peer(self.cfg.name, sender, url)
        except ValueError as exc:
            raise Refuse(400, "malformed", f"cannot admit {sender!r}: {exc}") from None
        log.info("%s: admitted peer %r at %s", self.cfg.name, sender, url)
        return sender

    def caller_is_peer(self, request: web.Request, path: str) -> bool:
        """Whether a ``GET`` caller proves to be a peer (signature, or certificate), without
        refusing it: for answers that say more to peers than to strangers."""
        sender = request.headers.get(H_SENDER, "")
        if sender not in self.peers:
            return False
        try:
            if self.verifier is not None:
                self.verifier.verify(request.method, path, request.headers, bound=False)
            elif not peer_cert(request) and self.cfg.ssl_server is not None:
                return self.cfg.ssl_server.verify_mode == ssl.CERT_NONE
            self.check_identity(request, sender)
        except (AuthenticationError, Refuse):
            return False
        return True


__all__ = ["Gate", "cert_identities", "peer_cert"]
