"""`HttpTransport`: one party's HTTP endpoint, the facade over `client.HttpClient` (sending)
and `server.HttpServer` (receiving)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping

from tandem.errors import FrameError, TransportClosedError, TransportError, UnknownPeerError

from ..base import Frame, LinkStats
from . import liveness, metrics
from .client import HttpClient
from .config import HttpConfig, check_peer
from .server import HttpServer

log = logging.getLogger("tandem.transports.http")


class HttpTransport:
    """One party's HTTP endpoint. Implements `tandem.transports.base.Transport` and every
    optional capability there: `WindowedTransport`, `AdmittingTransport`,
    `PeerWaitingTransport`, `AddressingTransport` and `MetricsTransport`.

    Use ``async with HttpTransport(cfg) as t`` (or ``await t.start()`` / ``await t.aclose()``).
    ``spec_hash``, ``validator``, ``admit_stream`` and ``admit_frame`` are plain attributes,
    settable after negotiation (the application's admission checks; see `HttpServer`).
    """

    def __init__(self, config: HttpConfig) -> None:
        self._cfg = config
        self._peers: dict[str, str] = {}
        for peer, url in config.peers.items():
            self.add_peer(peer, url)
        incarnation = secrets.token_hex(8)  # identity, deliberately not seeded
        self._metrics_sources: list[Callable[[], str]] = []
        self._client = HttpClient(config, incarnation)
        self._server = HttpServer(config, self._peers, incarnation, self.metrics_text)
        self._started = False
        self._closed = False
        self._port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> HttpTransport:
        """Start serving and open the client session. Must run inside an event loop."""
        if self._started:
            return self
        if self._closed:
            raise TransportClosedError(f"transport of {self.name!r} is closed; make a new one")
        self._port = await self._server.start()
        if self._cfg.secret:
            log.info(
                "%s: shared-secret HMAC authentication: every party trusts every other "
                "(any holder of the secret can sign as any party); per-party keys bind each "
                "signature to its sender (docs/security.md)",
                self.name,
            )
        self._client.reply_url = self.url
        await self._client.open()
        self._started = True
        return self

    async def __aenter__(self) -> HttpTransport:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close: tell peers goodbye (best effort), stop serving, close connections. Idempotent.

        Pending and later `send`/`recv` raise `TransportClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        await self._client.close(self._peers.items())
        await self._server.stop()

    # -- the Transport protocol --------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._cfg.name

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def send_window(self, peer: str) -> int:
        """`tandem.transports.base.WindowedTransport`: ``HttpConfig.send_window``, the same
        for every peer."""
        return self._cfg.send_window

    @property
    def metrics_url(self) -> str | None:
        """Base URL of the separate ``metrics_listen`` listener (None without one)."""
        port = self._server.metrics_port
        return None if port is None else f"http://{self._cfg.metrics_address()[0]}:{port}"

    @property
    def url(self) -> str:
        """Base URL this transport serves on (valid after `start`; with ``port=0`` it names
        the port the system picked)."""
        if self._port is None:
            raise TransportError("transport not started: use `async with HttpTransport(cfg)`")
        scheme = "https" if self._cfg.ssl_server else "http"
        return f"{scheme}://{self._cfg.host}:{self._port}"

    def address(self) -> str:
        """`tandem.transports.base.AddressingTransport`: `url`."""
        return self.url

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def spec_hash(self) -> str:
        """Stamped on outgoing frames when non-empty; inbound frames must carry it (409)."""
        return self._server.spec_hash

    @spec_hash.setter
    def spec_hash(self, value: str) -> None:
        self._client.spec_hash = self._server.spec_hash = value

    @property
    def validator(self) -> Callable[[Frame], None] | None:
        """Called with each decoded inbound frame; raise `FrameError` to refuse it (422)."""
        return self._server.validator

    @validator.setter
    def validator(self, value: Callable[[Frame], None] | None) -> None:
        self._server.validator = value

    @property
    def admit_stream(self) -> Callable[[str, str], None] | None:
        """Called with ``(sender, channel)`` of each inbound request head, before its body is
        read or memory reserved; raise `AdmissionError` (or `FrameError`) to refuse it (403)."""
        return self._server.admit_stream

    @admit_stream.setter
    def admit_stream(self, value: Callable[[str, str], None] | None) -> None:
        self._server.admit_stream = value

    @property
    def admit_size(self) -> Callable[[str, str, int], None] | None:
        """Called with ``(sender, channel, total bytes)`` of each inbound message head, before
        its body is read or memory reserved; raise `AdmissionError` (or `FrameError`) to
        refuse it as too large (413)."""
        return self._server.admit_size

    @admit_size.setter
    def admit_size(self, value: Callable[[str, str, int], None] | None) -> None:
        self._server.admit_size = value

    @property
    def admit_frame(self) -> Callable[[Frame], None] | None:
        """Called on the event loop with each complete inbound frame that passed every other
        check, just before it is delivered; raise `AdmissionError` naming the field (or
        `FrameError`) to refuse it (422). Nothing is awaited between it and the delivery."""
        return self._server.admit_frame

    @admit_frame.setter
    def admit_frame(self, value: Callable[[Frame], None] | None) -> None:
        self._server.admit_frame = value

    @property
    def on_auth_refused(self) -> Callable[[str, str], None] | None:
        """Called on the event loop with ``(peer, reason)`` each time a request naming a
        configured peer fails its signature check (it gets 401): the party decides what to
        tell its user. Must not raise or block."""
        return self._server.gate.on_auth_refused

    @on_auth_refused.setter
    def on_auth_refused(self, value: Callable[[str, str], None] | None) -> None:
        self._server.gate.on_auth_refused = value

    @property
    def incarnation(self) -> str:
        """This process's random identity (what signed requests to it are bound to)."""
        return self._server.incarnation

    def add_peer(self, name: str, url: str) -> None:
        """Address ``name`` at ``url`` (``http(s)://host:port``); replaces an older URL."""
        self._peers[name] = check_peer(self._cfg.name, name, url)

    async def wait_for_peers(self, timeout: float, peers: Iterable[str] | None = None) -> None:
        """`tandem.transports.base.PeerWaitingTransport`: until each peer's ``GET /healthz``
        answers 200 (`liveness.wait_ready`); `PeersUnreachableError` after ``timeout`` s."""
        names = list(self._peers) if peers is None else list(peers)
        urls = {p: self._check(p) for p in names}
        await liveness.wait_ready(self.name, self._client.session, urls, timeout)

    def add_metrics_source(self, source: Callable[[], str]) -> None:
        """Append ``source()`` (Prometheus text lines) to every ``GET /metrics`` answer."""
        self._metrics_sources.append(source)

    def sent_stats(self, peer: str) -> LinkStats:
        return self._client.stats(peer)

    def received_stats(self, peer: str) -> LinkStats:
        return self._server.stats(peer)

    def _check(self, peer: str) -> str:
        if self._closed:
            raise TransportClosedError(f"transport of {self.name!r} is closed")
        if not self._started:
            raise TransportError(f"transport of {self.name!r} is not started; use `async with`")
        url = self._peers.get(peer)
        if url is None:
            raise UnknownPeerError(
                f"{self.name!r} has no peer {peer!r}; known peers: {sorted(self._peers)} "
                "(add it with add_peer(name, url))"
            )
        return url

    async def send(self, peer: str, channel: str, frame: Frame) -> None:
        """Deliver ``frame``; returns once the peer has queued it. See `Transport.send`."""
        url = self._check(peer)
        if not isinstance(channel, str) or not channel or "\n" in channel:
            raise FrameError(f"channel must be a non-empty single-line string, got {channel!r}")
        await self._client.send(peer, url, channel, frame)

    async def recv(self, peer: str, channel: str) -> Frame:
        """Next frame from ``peer`` on ``channel``; cancelling it loses no frame. While it
        waits, the peer's liveness is checked (``HttpConfig.peer_timeout``)."""
        url = self._check(peer)
        box = self._server.inbox(peer, channel)
        frame = await liveness.next_frame(
            self._server, self._client, peer, url, box, self._cfg.peer_timeout
        )
        if frame is None:
            if self._closed:
                raise TransportClosedError(f"transport of {self.name!r} is closed")
            why = self._server.lost.get(peer)
            raise TransportClosedError(
                f"{why}; no frame pending on {channel!r}"
                if why
                else f"peer {peer!r} closed its transport with no frame pending on {channel!r}"
            )
        return frame

    # -- observability -----------------------------------------------------------------------
    def metrics_text(self) -> str:
        """The ``GET /metrics`` document (Prometheus text format)."""
        return metrics.render(self._client, self._server, self._metrics_sources)

    @property
    def refused(self) -> Mapping[str, int]:
        """Refused inbound requests by reason (read-only view for tests and tooling); each
        refused frame counts once (a refused frame stream handshake counts in
        `refused_handshakes`: its sender then POSTs the frame, judged and counted here)."""
        return dict(self._server.refused)

    @property
    def refused_handshakes(self) -> Mapping[str, int]:
        """Refused frame stream handshakes by reason (read-only view)."""
        return dict(self._server.refused_handshakes)

    @property
    def frame_requests(self) -> Mapping[tuple[str, str], int]:
        """Frame requests by ``(direction, path)``: ``("sent", "bulk")`` counts bulk attempts
        (retries included), ``("received", "bulk")`` bulk bodies this receiver accepted and
        started to read (answered 101); likewise ``"plain"`` for ordinary POST bodies."""
        return metrics.frame_requests(self._client, self._server)

    @property
    def send_retries(self) -> Mapping[str, int]:
        """Send retries per peer (``tandem_send_retries_total``)."""
        return dict(self._client.retries)
