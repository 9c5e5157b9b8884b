"""`HttpConfig`: one party's HTTP transport settings, validated on construction."""

from __future__ import annotations

import dataclasses
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..base import Frame

if TYPE_CHECKING:
    from ..keys import Roster, SigningKey

#: the largest `HttpConfig.send_window` (each message in a window holds a connection)
MAX_SEND_WINDOW = 256


@dataclasses.dataclass
class HttpConfig:
    """Configuration of one party's HTTP transport.

    Attributes:
      name: this party's name (sent as ``X-Tandem-Sender``).
      host, port: where to serve; port 0 picks a free port (see `HttpTransport.url`).
      peers: peer name -> base URL (``http://host:port`` or ``https://...``); more via add_peer.
      secret: shared HMAC secret; None disables HMAC (then only peer names are checked — use
        mutual TLS for authentication in that case). Requests are signed for one receiver (its
        name and process incarnation), so a captured request is refused by every other one.
      key_id: the id sent with every signature (default: derived from ``secret``).
      previous_secret / previous_key_id: a second key accepted (never used to sign), for
        rotation without downtime (docs/security.md: add the new key here everywhere, then
        swap it with ``secret`` everywhere, then remove it).
      signing_key / roster: per-party keys instead of a shared ``secret``
        (`tandem.transports.keys`): this party signs with its own Ed25519 ``signing_key``, and
        accepts a request only when it is signed with a key ``roster`` lists under the
        request's sender, so a roster member can sign as itself only (another member's
        claim is refused with 403). Both or neither; not with ``secret``. Frame streams need
        a shared secret for their record tags: with per-party keys every frame is a signed
        request (POST or bulk).
      metrics_token: a bearer token (``Authorization: Bearer ...``) that may read
        ``GET /metrics``. Without it, ``/metrics`` answers only a caller proving a peer's
        identity (signature or certificate, as ``/healthz`` names the incarnation); anyone
        else gets 401 with an empty body.
      metrics_listen: ``host:port`` (or ``port``: loopback) of a separate listener serving
        ``GET /metrics`` to whoever reaches it; the main listener then answers 404 there.
      max_clock_skew: seconds a signed request's timestamp may be ahead of the receiver's clock
        (``auth_window`` bounds how far behind it may be).
      peer_identities: peer name -> the certificate identities (subject CN, or DNS/URI/IP
        subjectAltName) that may speak for it. A request whose TLS client certificate names
        none of the claimed sender's identities is refused (403). Peers not listed must present
        a certificate naming them (CN or SAN equal to the peer name).
      ssl_server / ssl_client: `ssl.SSLContext` for serving HTTPS / verifying peers (mTLS when
        the server context has ``verify_mode = CERT_REQUIRED`` and the client context a cert).
      capacity: frames buffered per inbound (peer, channel) before senders are pushed back.
      inbound_budget: bytes of inbound messages held at once, across every stream: partial
        messages (their whole declared size, from their first chunk) and delivered frames not
        yet taken by `recv`. A new message that does not fit waits ``backpressure_wait``, then
        gets 503 (the sender retries). None: ``max(max_frame_bytes, 1 GiB)``. Must be at
        least ``max_frame_bytes``.
      partial_timeout: seconds a partially received message may sit with no request reading
        into it before it is dropped (its bytes leave the budget; the sender restarts it).
      header_timeout: seconds a connection may take to send a complete request head (from its
        accept, or from its first byte after an idle keep-alive period); also bounds the TLS
        handshake.
      body_idle_timeout: seconds a request body may stall (no byte arriving) before its
        connection is closed; the partial message stays resumable.
      keepalive_timeout: seconds an idle keep-alive connection stays open.
      max_connections / max_connections_per_address: inbound connections held at once; when
        full, a new connection replaces the oldest one that is idle or still sending its head,
        or is closed. Lowered at start so that at least `connections.FD_RESERVE` file
        descriptors of ``RLIMIT_NOFILE`` stay free for the party's own files.
      read_timeout: seconds one send attempt may go without progress (a body piece written,
        or the answer read) before it is abandoned and retried (a frozen peer: stopped
        process, network split without a reset).
      max_frame_bytes: larger frames are refused with 413.
      reject_nonfinite: refuse float/complex tensors containing NaN or Inf with 422.
      chunk_bytes: messages larger than this travel as several requests (such a message is
        sent alone: it waits for the messages before it and holds back the ones after it).
      send_window: messages of one (peer, channel) in flight at once (1..256): concurrent
        `send` calls on a channel each post their message without waiting for the previous
        one's answer, so a link with a long round trip carries several at a time. As a
        receiver: how many messages of one stream it holds ahead of the next one in order
        (each in an inbox slot, delivered strictly in id order); further ones are refused
        (503 ``ahead``) and their senders wait.
      spec_hash: when non-empty, stamped on outgoing frames; inbound frames must match (409).
      validator: called with each decoded inbound frame; raise `FrameError` to refuse it (422).
      retry_timeout: seconds a send keeps retrying an unreachable peer before
        `PeerUnavailableError`.
      peer_timeout: seconds a peer we have received from may stay unreachable while a `recv`
        from it waits; past that (or as soon as its ``/healthz`` shows a new incarnation: it
        restarted) it is treated as having said goodbye: its inboxes close and the waiting
        `recv` raises `TransportClosedError`, as after a clean close. A waiting `recv` probes
        the peer's ``/healthz`` every ``min(1, peer_timeout / 3)`` s. A peer never heard from
        is not probed (it may not have started yet). None: wait forever.
      backoff_base / backoff_max: exponential backoff between retries (with jitter).
      backpressure_wait: seconds a request waits for an inbox slot before 503.
      auth_window: accepted clock skew (s) for signed requests; max_nonces: replay memory.
      seed: seeds the retry jitter.
      write_piece_bytes: size of individual socket writes (bounds sender-side buffering).
      bulk_min_bytes: requests carrying at least this many body bytes take the bulk path: the
        request is an HTTP/1.1 Upgrade without a body, admitted (authentication, sizes,
        de-duplication, inbox slot) like any request; once accepted (101) the body travels raw
        on that connection and is received straight into the frame buffer, outside aiohttp's
        parser (two user-space copies fewer per byte), and the outcome comes back as one JSON
        line. Smaller requests (per-message latency matters more there) keep the plain POST.
        None: always plain POST.
      frame_streams: send single-chunk frames below ``bulk_min_bytes`` (and below 1 MiB) on a
        persistent frame stream per peer (``tandem-stream/1``: one signed handshake, then
        records and compact acks, tagged when both parties hold a ``secret``; no HTTP
        request per frame), and offer such streams to senders. A peer that does not offer
        them gets POSTs, as does every frame while the link is shaped (and a peer whose
        secret setting differs). False: POST only.
      clock: wall clock for signing/verifying (injectable in tests).
      advertise_url: the base URL peers should use to reach this party (sent, signed, as
        ``X-Tandem-Reply-To``); defaults to `HttpTransport.url` (set it when serving on 0.0.0.0
        or behind NAT).
      admit_unknown: accept a frame from a sender not in ``peers`` when its request is signed
        with the shared ``secret`` and names its URL; the sender then becomes a peer (at most
        ``max_peers``). For roles that anyone holding the secret may join (elastic workers).
        Requires ``secret``.
      admit_names: with ``admit_unknown``, only senders of these names are admitted (a roster,
        e.g. a federated server's clients); any other name is refused with 401. None: any name.
      shape_bandwidth / shape_latency: emulate a slower link on loopback (benchmarks, tests):
        request bodies to each peer are paced to ``shape_bandwidth`` bytes/s, shared by all
        channels to that peer (one wire per direction, as `MemoryNetwork.shape`), and each
        request waits ``shape_latency`` s before its first byte. None / 0 disable shaping; the
        receiving direction is shaped by the peer's own setting.
    """

    name: str
    host: str = "127.0.0.1"
    port: int = 0
    peers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    secret: bytes | None = None
    key_id: str | None = None
    previous_secret: bytes | None = None
    previous_key_id: str | None = None
    signing_key: SigningKey | None = None
    roster: Roster | None = None
    metrics_token: bytes | None = None
    metrics_listen: str | None = None
    max_clock_skew: float = 5.0
    peer_identities: Mapping[str, Sequence[str]] | None = None
    ssl_server: ssl.SSLContext | None = None
    ssl_client: ssl.SSLContext | None = None
    capacity: int = 64
    inbound_budget: int | None = None
    partial_timeout: float = 30.0
    header_timeout: float = 10.0
    body_idle_timeout: float = 30.0
    keepalive_timeout: float = 30.0
    max_connections: int = 256
    max_connections_per_address: int = 64
    read_timeout: float = 30.0
    max_frame_bytes: int = 1 << 31
    reject_nonfinite: bool = True
    chunk_bytes: int = 64 << 20
    send_window: int = 8
    spec_hash: str = ""
    validator: Callable[[Frame], None] | None = None
    retry_timeout: float = 30.0
    peer_timeout: float | None = 30.0
    backoff_base: float = 0.01
    backoff_max: float = 1.0
    backpressure_wait: float = 1.0
    auth_window: float = 60.0
    max_nonces: int = 65536
    seed: int = 0
    write_piece_bytes: int = 1 << 20
    read_bufsize: int = 1 << 22
    bulk_min_bytes: int | None = 1 << 20
    frame_streams: bool = True
    clock: Callable[[], float] = time.time
    advertise_url: str | None = None
    admit_unknown: bool = False
    admit_names: frozenset[str] | None = None
    max_peers: int = 4096
    shape_bandwidth: float | None = None
    shape_latency: float = 0.0

    def __post_init__(self) -> None:
        problems = [*self._size_problems(), *self._credential_problems()]
        problems += self._timing_problems()
        if problems:
            raise ValueError("invalid HttpConfig: " + "; ".join(problems))

    def _size_problems(self) -> list[str]:
        """What is wrong with the name, the counts and the byte limits."""
        problems = []
        if not isinstance(self.name, str) or not self.name or "\n" in self.name:
            problems.append(f"name must be a non-empty single-line string, got {self.name!r}")
        if self.capacity < 1:
            problems.append(f"capacity must be >= 1 frame, got {self.capacity}")
        if self.chunk_bytes < 1:
            problems.append(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if not (isinstance(self.send_window, int) and 1 <= self.send_window <= MAX_SEND_WINDOW):
            problems.append(
                f"send_window must be an int in 1..{MAX_SEND_WINDOW} messages, "
                f"got {self.send_window!r}"
            )
        if self.bulk_min_bytes is not None and not (
            isinstance(self.bulk_min_bytes, int) and self.bulk_min_bytes >= 1
        ):
            problems.append(
                f"bulk_min_bytes must be an int >= 1 or None, got {self.bulk_min_bytes!r}"
            )
        if self.max_frame_bytes < 1:
            problems.append(f"max_frame_bytes must be >= 1, got {self.max_frame_bytes}")
        if self.inbound_budget is not None and self.inbound_budget < self.max_frame_bytes:
            problems.append(
                f"inbound_budget ({self.inbound_budget} bytes) must hold at least one frame of "
                f"max_frame_bytes={self.max_frame_bytes}; raise it or lower max_frame_bytes"
            )
        for f in ("max_connections", "max_connections_per_address"):
            if getattr(self, f) < 1:
                problems.append(f"{f} must be >= 1, got {getattr(self, f)}")
        return problems

    def _credential_problems(self) -> list[str]:
        """What is wrong with the secrets, keys, identities and who may read metrics."""
        problems = []
        if self.secret is not None and (not isinstance(self.secret, bytes) or not self.secret):
            problems.append("secret must be non-empty bytes or None")
        if self.previous_secret is not None and (
            not isinstance(self.previous_secret, bytes) or not self.previous_secret
        ):
            problems.append("previous_secret must be non-empty bytes or None")
        if self.previous_secret is not None and not self.secret:
            problems.append("previous_secret needs a current secret (set secret)")
        for f in ("key_id", "previous_key_id"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not v or "\n" in v):
                problems.append(f"{f} must be a non-empty single-line string or None, got {v!r}")
        if self.secret and self.previous_secret and len(self.keys()) < 2:
            problems.append("previous_key_id equals the current key id; give each key its own id")
        if self.peer_identities is not None:
            for peer, ids in self.peer_identities.items():
                if isinstance(ids, str) or not all(isinstance(i, str) and i for i in ids):
                    problems.append(
                        f"peer_identities[{peer!r}] must be a list of identity strings, got {ids!r}"
                    )
        if (self.signing_key is None) != (self.roster is None):
            problems.append(
                "signing_key and roster go together: a party signing with its own key "
                "verifies its peers against the roster of their public keys"
            )
        if self.signing_key is not None and self.secret:
            problems.append(
                "give either a shared secret or per-party keys (signing_key, roster), not both"
            )
        if self.metrics_token is not None and (
            not isinstance(self.metrics_token, bytes) or not self.metrics_token
        ):
            problems.append("metrics_token must be non-empty bytes or None")
        if self.metrics_listen is not None:
            try:
                self.metrics_address()
            except ValueError as exc:
                problems.append(str(exc))
        if self.admit_unknown and not self.signs:
            problems.append(
                "admit_unknown needs a secret or per-party keys: only senders proving who "
                "they are may join; set secret (or signing_key and roster) or list every "
                "peer in peers"
            )
        return problems

    def _timing_problems(self) -> list[str]:
        """What is wrong with the addresses, the link shaping and the timeouts."""
        problems = []
        if self.advertise_url is not None and not str(self.advertise_url).startswith(
            ("http://", "https://")
        ):
            problems.append(
                f"advertise_url must start with http:// or https://, got {self.advertise_url!r}"
            )
        if self.max_peers < 1:
            problems.append(f"max_peers must be >= 1, got {self.max_peers}")
        if self.shape_bandwidth is not None and not self.shape_bandwidth > 0:
            problems.append(
                f"shape_bandwidth must be > 0 bytes/s or None, got {self.shape_bandwidth!r}"
            )
        if not self.shape_latency >= 0:
            problems.append(f"shape_latency must be >= 0 s, got {self.shape_latency!r}")
        for f in (
            "retry_timeout",
            "backoff_base",
            "backoff_max",
            "backpressure_wait",
            "auth_window",
            "partial_timeout",
            "header_timeout",
            "body_idle_timeout",
            "keepalive_timeout",
            "read_timeout",
        ):
            if not getattr(self, f) > 0:
                problems.append(f"{f} must be > 0 s, got {getattr(self, f)!r}")
        if not self.max_clock_skew >= 0:
            problems.append(f"max_clock_skew must be >= 0 s, got {self.max_clock_skew!r}")
        if self.peer_timeout is not None and not self.peer_timeout > 0:
            problems.append(f"peer_timeout must be > 0 s or None, got {self.peer_timeout!r}")
        return problems

    def budget_bytes(self) -> int:
        """The inbound byte budget in effect (``inbound_budget`` or its default)."""
        if self.inbound_budget is not None:
            return self.inbound_budget
        return max(self.max_frame_bytes, 1 << 30)

    @property
    def signs(self) -> bool:
        """Whether requests are signed and verified (a shared secret, or per-party keys)."""
        return bool(self.secret) or self.signing_key is not None

    @property
    def signer(self) -> bytes | SigningKey:
        """What signs this party's requests: its own key, else the shared secret."""
        if self.signing_key is not None:
            return self.signing_key
        assert self.secret is not None, "signer needs a secret or a signing_key"
        return self.secret

    @property
    def offers_streams(self) -> bool:
        """Frame streams in use: ``frame_streams``, and not per-party keys (their records
        are tagged with a key derived from the shared secret)."""
        return self.frame_streams and self.signing_key is None

    def metrics_address(self) -> tuple[str, int]:
        """``metrics_listen`` as ``(host, port)`` (host 127.0.0.1 when only a port is given);
        ValueError naming the problem."""
        text = str(self.metrics_listen)
        host, _, port = text.rpartition(":")
        try:
            number = int(port)
        except ValueError:
            number = -1
        if not 0 <= number <= 65535:
            raise ValueError(
                f"metrics_listen must be 'host:port' or 'port' (0..65535), got {text!r}"
            )
        return (host.strip("[]") or "127.0.0.1"), number

    def keys(self) -> dict[str, bytes]:
        """``{key_id: secret}``: the current key first, then the previous one (if any)."""
        from .. import auth

        out: dict[str, bytes] = {}
        if self.secret:
            out[self.key_id or auth.key_id_of(self.secret)] = self.secret
        if self.previous_secret:
            pid = self.previous_key_id or auth.key_id_of(self.previous_secret)
            out.setdefault(pid, self.previous_secret)
        return out


def check_peer(own_name: str, name: str, url: str) -> str:
    """``url`` normalised (no trailing slash) for a peer ``name``; ValueError naming the
    problem when the name or the URL cannot be a peer's."""
    if not isinstance(name, str) or not name or "\n" in name or name == own_name:
        raise ValueError(f"peer name must be a non-empty string other than our own, got {name!r}")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"peer {name!r}: url must start with http:// or https://, got {url!r}")
    return url.rstrip("/")
