"""The sections several Tandem TOML files share, each declared once.

``[listen]``, ``[peers]``, ``[security]``, ``[identities]``, ``[http]``, ``[data]``,
``[model]``, ``[log]``: a file kind (`tandem.parties.split.process.config`, ...) names these
types as its fields, so a key means the same in every file and its JSON Schema says so. Values are
plain data: nothing here opens a socket, builds a TLS context, reads a table or builds a model
(`tandem.parties.http_security` and each system's builders do).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tandem.errors import ConfigError

from .base import Ints, Invalid, Names, Section, base_dir, resolve_file

Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


def _port(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 65535:
        raise Invalid("", f"must be in [0, 65535] (0: any free port), got {value}")
    return value


#: A TCP port to listen on (0: any free port).
Port = Annotated[int, BeforeValidator(_port)]


def _url(value: Any) -> Any:
    from tandem.transports.factory import is_transport_url, url_hint

    if isinstance(value, str) and not is_transport_url(value):
        raise Invalid("", f"must be {url_hint('http://127.0.0.1:8780')}, got {value!r}")
    return value.rstrip("/") if isinstance(value, str) else value


#: The base URL of a peer (or of this party as its peers reach it), trailing slash dropped.
Url = Annotated[str, BeforeValidator(_url)]


class Listen(Section):
    """``[listen]``: where this party serves its peers."""

    host: str = Field(default="127.0.0.1", description="address to bind (0.0.0.0: every interface)")
    port: int = Field(default=0, ge=0, le=65535, description="TCP port (0: any free port)")


def _peers(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value
    from tandem.transports.factory import common_scheme, is_transport_url, url_hint

    out = {}
    for peer, url in value.items():
        if not is_transport_url(url):
            raise Invalid(peer, f"must be {url_hint()}, got {url!r}")
        out[peer] = url.rstrip("/")
    try:
        common_scheme(out.values())
    except ConfigError as exc:
        raise Invalid("", str(exc)) from None
    return out


#: ``[peers]``: the base URL of every other party, by name (trailing slashes dropped).
Peers = Annotated[dict[str, str], BeforeValidator(_peers)]


def _identities(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value
    out = {}
    for peer, names in value.items():
        names = [names] if isinstance(names, str) else names
        if (
            not isinstance(names, list)
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise Invalid(peer, f"must be a certificate name or a list of them, got {names!r}")
        out[peer] = tuple(names)
    return out


#: ``[identities]``: peer -> the TLS client certificate names (CN or subjectAltName) that may
#: speak for it (default: the peer's own name).
Identities = Annotated[dict[str, Names], BeforeValidator(_identities)]


class Security(Section):
    """``[security]`` (FL: ``[http]``): how a party authenticates and protects its transport.

    File names are resolved against the TOML file's folder and must exist. The shared secret
    (``secret``, ``secret_env`` or ``secret_file``: at most one) is read when the file is
    checked; `secret_bytes` and `previous_secret_bytes` hold it.

    Invariant: ``tls_cert`` and ``tls_key`` are both set or both None; a ``previous_*`` key
    is set only beside a current one.
    """

    secret: str | None = Field(default=None, description="the shared HMAC secret, inline")
    secret_env: str | None = Field(
        default=None, description="... read from this environment variable"
    )
    secret_file: str | None = Field(default=None, description="... read from this file (stripped)")
    key_id: str | None = Field(default=None, description="the id the current secret signs under")
    previous_secret: str | None = Field(default=None, description="a retiring key, still accepted")
    previous_secret_env: str | None = None
    previous_secret_file: str | None = None
    previous_key_id: str | None = None
    private_key: str | None = Field(
        default=None, description="this party's own Ed25519 key file (`tandem keys generate`)"
    )
    private_key_env: str | None = Field(
        default=None, description="... or the key's PEM text in this environment variable"
    )
    public_keys: dict[str, str | list[str]] | None = Field(
        default=None, description="roster: party name -> its .pub file(s) (several: rotation)"
    )
    max_clock_skew: float = Field(default=5.0, ge=0, description="seconds a request may be early")
    tls_cert: str | None = Field(
        default=None, description="serve HTTPS with this certificate chain"
    )
    tls_key: str | None = Field(default=None, description="... and this key (both or neither)")
    tls_ca: str | None = Field(
        default=None, description="verify peers against this CA (mutual TLS)"
    )
    max_frame_bytes: int = Field(default=1 << 31, gt=0, description="largest frame accepted")
    reject_nonfinite: bool = Field(default=True, description="refuse tensors holding NaN or Inf")
    retry_timeout: Positive = Field(default=30.0, description="seconds a send retries a lost peer")
    peer_timeout: Positive = Field(default=30.0, description="seconds a silent peer may be away")
    insecure: bool = Field(
        default=False,
        description="serve on a non-loopback address without authentication (no secret, no "
        "mutual TLS): anyone who reaches the port can speak for any party",
    )

    _secret: bytes | None = PrivateAttr(None)
    _previous: bytes | None = PrivateAttr(None)
    _private_pem: bytes | None = PrivateAttr(None)

    @field_validator(
        "tls_cert", "tls_key", "tls_ca", "secret_file", "previous_secret_file", "private_key"
    )
    @classmethod
    def _exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_file(info, value, str(info.field_name))

    @field_validator("public_keys")
    @classmethod
    def _roster(
        cls, value: dict[str, str | list[str]] | None, info: ValidationInfo
    ) -> dict[str, str | list[str]] | None:
        if value is None:
            return None
        out: dict[str, str | list[str]] = {}
        for name, files in value.items():
            listed = [files] if isinstance(files, str) else files
            if not listed:
                raise Invalid(name, "must name at least one .pub file")
            out[name] = [resolve_file(info, f, f"public_keys.{name}") for f in listed]
        return out

    @model_validator(mode="after")
    def _check(self) -> Security:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise Invalid(
                "", "{section}.tls_cert and {section}.tls_key go together; set both or neither"
            )
        self._secret = self._read("")
        self._previous = self._read("previous_")
        if self._previous is not None and self._secret is None:
            raise Invalid(
                "previous_secret",
                "is the key being retired; set the new one as {section}.secret too",
            )
        self._private_pem = self._read_private_key()
        return self

    def _read_private_key(self) -> bytes | None:
        if self.private_key is not None and self.private_key_env is not None:
            raise Invalid("", "set only one of {section}.private_key, {section}.private_key_env")
        pem: bytes | None = None
        if self.private_key is not None:
            with open(self.private_key, "rb") as f:
                pem = f.read()
        elif self.private_key_env is not None:
            text = os.environ.get(self.private_key_env)
            if not text:
                raise Invalid(
                    "private_key_env",
                    f"names ${self.private_key_env}, which is not set; export it (the PEM "
                    "text of NAME.key) or use {section}.private_key",
                )
            pem = text.encode()
        if (pem is None) != (self.public_keys is None):
            raise Invalid(
                "public_keys" if pem is not None else "private_key",
                "and {section}.private_key go together: a party signs with its own key and "
                "checks its peers' signatures against their public keys",
            )
        if pem is not None and self._secret is not None:
            raise Invalid(
                "secret",
                "is the shared-secret mode; with per-party keys ({section}.private_key) drop "
                "it: keys and a shared secret do not mix",
            )
        return pem

    def _read(self, prefix: str) -> bytes | None:
        plain, env, file = f"{prefix}secret", f"{prefix}secret_env", f"{prefix}secret_file"
        given = [k for k in (plain, env, file) if getattr(self, k) is not None]
        if len(given) > 1:
            raise Invalid("", "set only one of " + str([f"{{section}}.{k}" for k in given]))
        if not given:
            return None
        if given[0] == plain:
            value = getattr(self, plain)
        elif given[0] == env:
            value = os.environ.get(getattr(self, env))
            if value is None:
                raise Invalid(
                    env, f"names ${getattr(self, env)}, which is not set; export it or use {file}"
                )
        else:
            with open(getattr(self, file), "rb") as f:
                value = f.read().strip().decode()
        if not value:
            raise Invalid("", f"the shared secret ({{section}}.{given[0]}) is empty")
        return str(value).encode()

    @property
    def secret_bytes(self) -> bytes | None:
        """The current shared secret's bytes, or None (unsigned)."""
        return self._secret

    @property
    def previous_secret_bytes(self) -> bytes | None:
        """The retiring secret's bytes, or None."""
        return self._previous

    @property
    def private_key_pem(self) -> bytes | None:
        """This party's private key (PEM), or None (no per-party keys)."""
        return self._private_pem

    @property
    def auth(self) -> str:
        """``"keys"``, ``"hmac"``, ``"mtls"`` or ``"none"``: how peers prove who they are."""
        if self._private_pem:
            return "keys"
        if self._secret:
            return "hmac"
        return "mtls" if self.tls_ca and self.tls_cert else "none"


def is_loopback(host: str) -> bool:
    """True when ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure(host: str, security: Security, *, listen: str, section: str) -> str | None:
    """Why serving on ``host`` (the key ``listen``) with ``security`` (the ``[section]``
    table) is refused, or None: a non-loopback address needs authentication (a secret, or
    mutual TLS), unless ``section.insecure = true`` says the operator means it."""
    if is_loopback(host) or security.auth != "none" or security.insecure:
        return None
    return (
        f"{listen} = {host!r} is reachable from other machines, and [{section}] sets no "
        f"authentication: set {section}.secret_env or {section}.secret_file (a shared secret), "
        f"{section}.private_key and [{section}.public_keys] (per-party keys), "
        f"or {section}.tls_cert, tls_key and tls_ca (mutual TLS); or listen on 127.0.0.1; or "
        f"set {section}.insecure = true to serve unauthenticated on purpose"
    )


class Http(Section):
    """``[http]``: limits and timeouts of the HTTP transport (docs/security.md lists the
    defaults; `tandem.transports.http.HttpConfig` has the same fields). Unset keys keep the
    transport's defaults."""

    inbound_budget: PositiveInt | None = Field(default=None, description="bytes buffered inbound")
    partial_timeout: Positive | None = None
    header_timeout: Positive | None = None
    body_idle_timeout: Positive | None = None
    keepalive_timeout: Positive | None = None
    max_connections: PositiveInt | None = None
    max_connections_per_address: PositiveInt | None = None
    read_timeout: Positive | None = None
    backpressure_wait: Positive | None = None
    max_nonces: PositiveInt | None = None
    send_window: PositiveInt | None = Field(
        default=None, description="messages of a channel in flight"
    )
    metrics_token_env: str | None = Field(
        default=None, description="env variable holding a bearer token that may read /metrics"
    )
    metrics_listen: str | None = Field(
        default=None, description="serve /metrics on this 'host:port' (or 'port': loopback) only"
    )

    _metrics_token: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _token(self) -> Http:
        if self.metrics_token_env is not None:
            token = os.environ.get(self.metrics_token_env, "")
            if not token:
                raise Invalid(
                    "metrics_token_env",
                    f"names ${self.metrics_token_env}, which is not set or empty; export it",
                )
            self._metrics_token = token.encode()
        if self.metrics_listen is not None:
            from tandem.transports.http.config import HttpConfig

            try:
                HttpConfig(name="x", metrics_listen=self.metrics_listen)
            except ValueError as exc:
                raise Invalid("metrics_listen", str(exc).split(": ", 1)[-1]) from None
        return self

    @field_validator("send_window")
    @classmethod
    def _window(cls, value: int | None) -> int | None:
        from tandem.transports.http.config import MAX_SEND_WINDOW

        if value is not None and value > MAX_SEND_WINDOW:
            raise Invalid(
                "",
                f"must be at most {MAX_SEND_WINDOW} messages (each holds a connection while "
                f"in flight), got {value}",
            )
        return value

    def fields(self) -> dict[str, Any]:
        """The keys given, as `HttpConfig` keyword arguments (timeouts as floats; the
        token's variable as the token itself, ``metrics_token``)."""
        out = self.model_dump(exclude_none=True)
        if out.pop("metrics_token_env", None) is not None:
            out["metrics_token"] = self._metrics_token
        return out


class DataSplit(Section):
    """``[data.split]``: ids held out for testing and validation (the same on every party)."""

    test: float = Field(default=0.2, ge=0, lt=1)
    validation: float = Field(default=0.0, ge=0, lt=1)
    seed: int = Field(default=0, ge=0, lt=2**64, description="every party must use the same seed")


class Data(Section):
    """``[data]``: a party's table (docs/data.md), checked by
    `tandem.parties.data.parse_data_config`, whose `DataError` names the key and the fix."""

    model_config = {**Section.model_config, "strict": False}

    source: str = Field(description="fsspec URL or path: .csv, .parquet or .npz")
    id_column: str | None = None
    label_column: str | None = Field(default=None, description="the label party only")
    features: Names | None = Field(
        default=None, description="default: every column but id and label"
    )
    categorical: Names = ()
    vocabularies: str | None = None
    hash_buckets: dict[str, int] = Field(
        default_factory=dict, description="categorical column -> buckets of its seeded hash"
    )
    hash_seed: int = Field(default=0, ge=0, lt=2**64, description="the same on every party")
    missing: Literal["error", "mean", "zero"] = "error"
    scale: Literal["standard", "none"] = "standard"
    aligned: str | None = Field(default=None, description="the `tandem align --out` file")
    split: DataSplit = DataSplit()
    in_memory: bool = False
    spill_dir: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, table: Any, info: ValidationInfo) -> Any:
        from tandem.parties.data import parse_data_config

        path = (info.context or {}).get("path")
        parse_data_config(table, path=path)  # raises its own DataError, located
        return table

    def table(self, path: str | None) -> Any:
        """The checked `tandem.parties.data.DataConfig` (paths resolved against ``path``)."""
        from tandem.parties.data import parse_data_config

        return parse_data_config(self.model_dump(mode="json", exclude_defaults=True), path=path)


def _files(info: ValidationInfo, value: str | None) -> str | None:
    if value is None:
        return None
    return os.path.join(base_dir(info), os.path.expanduser(value))


class ModelSpec(Section):
    """``[model]`` of a federated server or an elastic data server: one whole model as a spec
    for `tandem.parties.models.model_from_spec` (``kind`` and its arguments, docs/models.md),
    unlike split learning's `Model`, which describes a stage per party."""

    model_config = {**Section.model_config, "extra": "allow"}

    kind: str | None = Field(default=None, description='"mlp", "embedding_mlp", a factory path')

    @model_validator(mode="after")
    def _kind(self) -> ModelSpec:
        if not self.kind:
            raise Invalid(
                "", '[model] needs `kind` (e.g. kind = "mlp", hidden = [64], out_dim = 10)'
            )
        return self

    def spec(self) -> dict[str, Any]:
        """The spec as plain JSON data (tables to dicts, arrays to lists)."""
        import json

        return dict(json.loads(json.dumps(self.model_dump())))


class Log(Section):
    """``[log]``: where the metrics go (paths relative to the TOML file's folder)."""

    history: str | None = Field(default=None, description="JSONL file, one line per epoch")
    tensorboard: str | None = Field(default=None, description="a folder of TensorBoard event files")

    @field_validator("history", "tensorboard")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _files(info, value)


class Model(Section):
    """``[model]``: the uniform MLP of every stage without its own table (``hidden`` ->
    ``cut``; the loss stage -> ``out``), and one ``[model.<stage>]`` table per stage
    (`tandem.parties.models.model_from_toml` checks it when the stage is built).
    ``topology`` and ``topology_args`` are the older spelling of ``[topology]``."""

    model_config = {**Section.model_config, "extra": "allow"}

    topology: str | None = Field(default=None, description="a built-in topology or a JSON file")
    topology_args: list[str | int] | None = None
    cut: int = Field(default=16, ge=1, description="output width of a stage without its own table")
    hidden: Ints = Field(default=(32,), description="hidden layer sizes of the uniform MLP")
    out: int = Field(default=1, ge=1, description="output width of the loss stage")
    aggregate: Literal["concat", "sum", "secure_sum"] = Field(
        default="concat",
        description="how the star top reads its followers' cuts: their concatenation, their "
        "sum, or their secure sum (the leader learns only the sum)",
    )
    sum_bound: float = Field(
        default=64.0, gt=0, description="secure_sum: largest |activation| a follower may send"
    )
    sum_frac_bits: int = Field(
        default=16, ge=0, description="secure_sum: fixed-point scale 2^-sum_frac_bits"
    )
    sum_ring_bits: Literal[32, 64] = Field(
        default=32, description="secure_sum: the ring Z_2^sum_ring_bits"
    )

    @field_validator("hidden")
    @classmethod
    def _hidden(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not all(h > 0 for h in value):
            raise Invalid("", f"must be a list of positive ints, got {list(value)!r}")
        return value

    @model_validator(mode="after")
    def _stages(self) -> Model:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, Mapping):
                raise Invalid(
                    "",
                    f"unknown key {{section}}.{key}; accepted keys in [model]: "
                    f"{sorted(Model.model_fields)}, and one table [model.<stage>] per stage",
                )
        return self

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        """The ``[model.<stage>]`` tables, by stage name."""
        return {k: dict(v) for k, v in (self.model_extra or {}).items()}


__all__ = [
    "Data",
    "DataSplit",
    "Http",
    "Identities",
    "Listen",
    "Log",
    "Model",
    "ModelSpec",
    "Peers",
    "Port",
    "Positive",
    "PositiveInt",
    "Security",
    "Url",
    "exposure",
    "is_loopback",
]
