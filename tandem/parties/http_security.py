"""How a party authenticates and protects its HTTP transport: the security keys of its TOML.

Split-learning parties and elastic roles read these keys from their ``[security]`` table and
federated parties from ``[http]``; each is the one `tandem.parties.config.Security` section
(checked with its file; `parse_security` checks a lone table), so a secret, a TLS file or a
limit means the same everywhere::

    private_key = "me.key"    # per-party keys: this party's own Ed25519 key (or private_key_env)
    [security.public_keys]    # ... and the roster: every party's public key(s), by name
    leader = "leader.pub"
    follower = ["follower.pub", "follower-new.pub"]   # two during a rotation

    secret = "..."            # OR the shared HMAC secret, inline (prefer one of the next two):
                              # every party trusts every other (any holder signs as anyone)
    secret_env = "VAR"        # ... read from the environment variable VAR
    secret_file = "secret"    # ... read from a file (relative to the TOML file), stripped
    tls_cert = "me.pem"       # serve HTTPS with this certificate chain ...
    tls_key = "me.key"        # ... and its key (both or neither)
    tls_ca = "ca.pem"         # verify peers against this CA; with tls_cert: mutual TLS
    max_frame_bytes = 2147483648
    reject_nonfinite = true   # refuse tensors holding NaN or Inf (422)
    retry_timeout = 30.0      # seconds a send keeps retrying an unreachable peer
    peer_timeout = 30.0       # seconds a silent peer may be unreachable while we wait on it
    key_id = "2026-11"        # the id the current secret signs under (rotation)
    previous_secret_file = "old"   # a retiring key still accepted (with previous_key_id)
    max_clock_skew = 5.0      # seconds a signed request may be stamped in the future
    insecure = false          # true: serve on a non-loopback address without authentication

`security_of` turns a checked section into an `HttpSecurity`, whose `HttpSecurity.ssl_contexts`
and `HttpSecurity.http_config` build the TLS contexts and a `tandem.transports.http.HttpConfig`.
Every error is a `ConfigError` naming the file, the key
and the fix.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from typing import Any

from tandem.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class HttpSecurity:
    """Checked security settings. File paths are absolute; ``secret`` is the secret's bytes.

    Invariant: ``tls_cert`` and ``tls_key`` are both set or both None.
    """

    secret: bytes | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    max_frame_bytes: int = 1 << 31
    reject_nonfinite: bool = True
    retry_timeout: float = 30.0
    peer_timeout: float = 30.0
    key_id: str | None = None
    previous_secret: bytes | None = None
    previous_key_id: str | None = None
    max_clock_skew: float = 5.0
    private_key: bytes | None = None
    public_keys: Mapping[str, tuple[str, ...]] | None = None

    @property
    def auth(self) -> str:
        """``"keys"``, ``"hmac"``, ``"mtls"`` or ``"none"``: how peers prove who they are."""
        if self.private_key:
            return "keys"
        if self.secret:
            return "hmac"
        return "mtls" if self.tls_ca and self.tls_cert else "none"

    def ssl_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        """(server, client) contexts: TLS when ``tls_cert`` is set; mutual when ``tls_ca`` is."""
        if not self.tls_cert:
            return None, (ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else None)
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.load_cert_chain(self.tls_cert, self.tls_key)
        client = ssl.create_default_context(cafile=self.tls_ca)
        client.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_ca:
            server.load_verify_locations(self.tls_ca)
            server.verify_mode = ssl.CERT_REQUIRED
        return server, client

    def http_config(self, name: str, **fields: Any):
        """A `tandem.transports.http.HttpConfig` for party ``name`` with these settings;
        ``fields`` (host, port, peers, ...) are passed through and may override them."""
        from tandem.transports.http import HttpConfig

        return HttpConfig(name=name, **self.transport_settings(**fields))

    def transport_settings(self, **fields: Any) -> dict[str, Any]:
        """These settings as `tandem.transports.make_transport` keywords (`HttpConfig`'s
        fields); ``fields`` (host, port, ...) are added and may override them."""
        server, client = self.ssl_contexts()
        base: dict[str, Any] = {
            "secret": self.secret,
            "ssl_server": server,
            "ssl_client": client,
            "max_frame_bytes": self.max_frame_bytes,
            "reject_nonfinite": self.reject_nonfinite,
            "retry_timeout": self.retry_timeout,
            "peer_timeout": self.peer_timeout,
            "key_id": self.key_id,
            "previous_secret": self.previous_secret,
            "previous_key_id": self.previous_key_id,
            "max_clock_skew": self.max_clock_skew,
        }
        if self.private_key is not None and self.public_keys is not None:
            from tandem._extras import needs

            with needs("keys", "per-party keys ([security] private_key)"):
                from tandem.transports.keys import Roster, SigningKey

            base["signing_key"] = SigningKey.from_pem(self.private_key)
            base["roster"] = Roster.from_files(self.public_keys)
        return {**base, **fields}


def parse_security(
    table: Mapping[str, Any],
    *,
    path: str,
    section: str = "security",
    error: type[ConfigError] = ConfigError,
) -> HttpSecurity:
    """Check the security keys in ``table`` (the ``[section]`` table of the TOML file ``path``;
    relative file names start at that file's folder) as the shared
    `tandem.parties.config.Security` section. Every error is ``error`` (a `ConfigError`
    subclass: each party kind raises its own) naming ``section.key``."""
    from tandem.parties.config import Security, validate

    return security_of(validate(Security, table, path=path, error=error, where=(section,)))


def security_of(sec: Any) -> HttpSecurity:
    """The `HttpSecurity` of a checked `tandem.parties.config.Security` section."""
    return HttpSecurity(
        secret=sec.secret_bytes,
        key_id=sec.key_id,
        previous_secret=sec.previous_secret_bytes,
        previous_key_id=sec.previous_key_id,
        private_key=sec.private_key_pem,
        public_keys=(
            {n: tuple([f] if isinstance(f, str) else f) for n, f in sec.public_keys.items()}
            if sec.public_keys is not None
            else None
        ),
        max_clock_skew=float(sec.max_clock_skew),
        tls_cert=sec.tls_cert,
        tls_key=sec.tls_key,
        tls_ca=sec.tls_ca,
        max_frame_bytes=sec.max_frame_bytes,
        reject_nonfinite=sec.reject_nonfinite,
        retry_timeout=float(sec.retry_timeout),
        peer_timeout=float(sec.peer_timeout),
    )


__all__ = [
    "HttpSecurity",
    "parse_security",
    "security_of",
]
