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

    _secret: bytes | None = PrivateAttr(None)
    _previous: bytes | None = PrivateAttr(None)

    @field_validator("tls_cert", "tls_key", "tls_ca", "secret_file", "previous_secret_file")
    @classmethod
    def _exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_file(info, value, str(info.field_name))

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
        return self

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
    def auth(self) -> str:
        """``"hmac"``, ``"mtls"`` or ``"none"``: how peers prove who they are."""
        if self._secret:
            return "hmac"
        return "mtls" if self.tls_ca and self.tls_cert else "none"


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
        """The keys given, as `HttpConfig` keyword arguments (timeouts as floats)."""
        return self.model_dump(exclude_none=True)


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
    "Peers",
    "Positive",
    "PositiveInt",
    "Security",
]
