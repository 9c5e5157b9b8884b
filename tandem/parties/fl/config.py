"""The TOML configuration of a federated server and of a federated client.

`load_server_config(path)` and `load_client_config(path)` read a file (a path or an fsspec
URL) and check every key through the typed sections below (`ServerFile`, `ClientFile`:
`tandem.parties.config`, which also gives `tandem config schema fl-server|fl-client`); an
error is an `FLConfigError` naming the file, the key and the fix.
docs/federated.md#running-a-federation has the full tables. In short::

    # server.toml
    [server]         # name, host, port, clients (the roster: no one else may join), rounds,
                     # fraction, min_clients, round_timeout, wait, seed, loss, eval_every,
                     # evaluate ("server" | "clients": federated evaluation),
                     # checkpoint (path or fsspec URL), export (path), compile_cache
    [optimizer]      # any optax optimizer: name + its keyword arguments
                     # FedAvg: name = "sgd", learning_rate = 1.0; FedAdam: "adam"; FedYogi: "yogi"
    [compression]    # preset = "dense" | "compressed", and the preset's knobs
    [model]          # a model spec (shared ModelSpec): kind = "mlp", hidden = [64], out_dim
    [data]           # the held-out evaluation set (shared [data], docs/data.md); with
                     # evaluate = "clients", label_column may be left out
    [http]           # the shared [security] section: secret_env / secret_file, TLS, insecure
    [secagg]         # secure aggregation (optional): max_dropout, neighbours, corrupt_share,
                     # scale, clip, stage_timeout, noise_std, public_keys (the clients'
                     # Ed25519 identity keys)
    [dp]             # differential privacy (optional; fl/private_config.py)
    [aggregation]    # rule = "mean" | "median" | "trimmed_mean" | "krum" | ...

    # client.toml
    [client]         # name, server (URL), server_name, host, port, reconnect_timeout,
                     # max_refusals, final_model (a .safetensors path for the final model)
    [train]          # epochs, batch_size
    [optimizer]      # the local optimizer (default: sgd, learning_rate 0.05)
    [data]           # this client's rows (it trains on the split's training part and
                     # evaluates, when asked, on its validation part)
    [http]           # as the server's
    [secagg]         # private_key (this client's Ed25519 key), public_keys (the roster)

The clients take the model, the loss and the initial parameters from the server (its
``welcome``), so only the server has ``[model]`` and ``loss``. The loaders return a flat,
frozen view (`ServerConfig`, `ClientConfig`) with the data table and the security settings
built (`DataConfig`, `HttpSecurity`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tandem.engine.kernels import LOSSES
from tandem.errors import ConfigError
from tandem.parties.config import Data, Section, Security, validate
from tandem.parties.config.base import Invalid, Names
from tandem.parties.config.sections import ModelSpec, Port, Positive, Url, exposure
from tandem.parties.data import DataConfig
from tandem.parties.http_security import HttpSecurity, security_of

from .preprocessing import PreprocessingTable
from .private_config import AggregationTable, DPTable
from .tables import CompressionConfig, OptimizerConfig


class FLConfigError(ConfigError):
    """A federated party's TOML configuration is wrong; the message names the key and the fix."""


def _location(value: str | None, info: ValidationInfo) -> str | None:
    """A path relative to the config file's folder (a URL, or a file read by URL, as is)."""
    path = str((info.context or {}).get("path", ""))
    if value is None or "://" in value or "://" in path or os.path.isabs(value):
        return value
    return os.path.join(os.path.dirname(os.path.abspath(path)), value)


class SecAggTable(Section):
    """``[secagg]`` of a server: secure aggregation of every round (its presence turns it on;
    see `tandem.parties.fl.secagg.SecAggConfig` for each key). ``public_keys`` (client name
    -> its ``.pub`` file, `tandem keys generate`) makes the server and the clients check that
    each client's round keys are signed by that client; without it a server that lies could
    substitute keys, so the guarantee holds against an honest-but-curious server only."""

    max_dropout: float = Field(default=0.3, ge=0, lt=0.5)
    scale: Positive = float(2**20)
    clip: Positive = 1.0
    stage_timeout: Positive = 30.0
    noise_std: float = Field(default=0.0, ge=0)
    neighbours: int | Literal["auto", "all"] = "auto"
    corrupt_share: float = Field(default=0.1, ge=0, lt=0.5)
    public_keys: dict[str, str] | None = None

    @field_validator("public_keys")
    @classmethod
    def _keys(cls, value: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        if value is None:
            return None
        return {k: str(_location(v, info)) for k, v in value.items()}

    def build(self) -> Any:
        from .secagg import SecAggConfig

        return SecAggConfig(
            max_dropout=self.max_dropout,
            scale=self.scale,
            clip=self.clip,
            stage_timeout=self.stage_timeout,
            noise_std=self.noise_std,
            neighbours=self.neighbours,
            corrupt_share=self.corrupt_share,
        )

    def roster(self) -> Any:
        """The clients' identity keys (`tandem.transports.keys.Roster`), or None."""
        return _roster(self.public_keys)


class ClientSecAgg(Section):
    """``[secagg]`` of a client: its identity key (``private_key``, a PKCS#8 PEM file) that
    signs its round keys, and ``public_keys``, the other clients' (see `SecAggTable`)."""

    private_key: str | None = None
    public_keys: dict[str, str] | None = None

    @field_validator("private_key")
    @classmethod
    def _key(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _location(value, info)

    @field_validator("public_keys")
    @classmethod
    def _keys(cls, value: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        return SecAggTable._keys(value, info)

    @model_validator(mode="after")
    def _both(self) -> ClientSecAgg:
        if (self.private_key is None) != (self.public_keys is None):
            raise Invalid(
                "",
                "secagg.private_key and secagg.public_keys go together: a client signs its "
                "round keys with its own key and checks the others' against the roster",
            )
        return self

    def signer(self) -> Any:
        if self.private_key is None:
            return None
        from tandem.transports.keys import SigningKey

        return SigningKey.from_file(self.private_key)

    def roster(self) -> Any:
        return _roster(self.public_keys)


def _roster(files: Mapping[str, str] | None) -> Any:
    if files is None:
        return None
    from tandem._extras import needs

    with needs("keys", "signed secure-aggregation keys ([secagg] public_keys)"):
        from tandem.transports.keys import Roster
    return Roster.from_files({k: [v] for k, v in files.items()})


class ServerTable(Section):
    """``[server]``: who the server is, who may join and how the rounds go."""

    # required (the checks below word their absence); the JSON Schema says so for editors
    model_config = {
        **Section.model_config,
        "json_schema_extra": {"required": ["clients", "rounds"]},
    }

    name: str = "server"
    host: str = "127.0.0.1"
    port: Port = 0
    advertise_url: Url | None = Field(default=None, description="the URL clients reach it at")
    clients: Names | None = Field(default=None, description="the roster: only these may join")
    rounds: int | None = Field(default=None, ge=1)
    fraction: float = Field(default=1.0, description="share of the clients asked each round")
    min_clients: int | None = Field(default=None, ge=1, description="default: every client")
    round_timeout: Positive = 60.0
    wait: Positive = Field(default=300.0, description="seconds to wait for the clients")
    seed: int = Field(default=0, ge=0)
    loss: str = "softmax"
    eval_every: int = Field(default=1, ge=0)
    evaluate: Literal["server", "clients"] = Field(
        default="server",
        description='where the global model is evaluated: "server" (its labelled [data]) or '
        '"clients" (their validation rows, data.split.validation)',
    )
    checkpoint: str | None = Field(default=None, description="path or fsspec URL")
    export: str | None = None
    compile_cache: str = Field(
        default="auto", description='JAX compilation cache folder, "auto" or "off"'
    )

    @field_validator("checkpoint", "export")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _location(value, info)

    @field_validator("fraction")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise Invalid("", f"must be in (0, 1], got {value}")
        return float(value)

    @field_validator("loss")
    @classmethod
    def _loss(cls, value: str) -> str:
        if value not in LOSSES:
            raise Invalid("", f"must be one of {sorted(LOSSES)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _roster(self) -> ServerTable:
        clients = self.clients
        if not clients or not all(clients):
            raise Invalid(
                "clients",
                'must list the client names, e.g. clients = ["bank_a", "bank_b"]; only these '
                f"may join, got {list(clients) if clients is not None else None!r}",
            )
        if len(set(clients)) != len(clients):
            raise Invalid("", f"server.clients names a client twice: {list(clients)}")
        if self.name in clients:
            raise Invalid("", f"server.name {self.name!r} is also a client's name; rename one")
        if self.rounds is None:
            raise Invalid("", "[server] needs `rounds` (an integer >= 1)")
        if self.min_clients is not None and self.min_clients > len(clients):
            raise Invalid(
                "",
                f"server.min_clients = {self.min_clients} but server.clients has only "
                f"{len(clients)} names; lower min_clients or add clients",
            )
        return self


def _labelled(data: Data) -> None:
    if data.label_column is None:
        raise Invalid(
            "",
            "data.label_column is required: a federated client trains on labelled rows",
        )


class ServerFile(Section):
    """A federated server's TOML file (`tandem fl server --config`)."""

    server: ServerTable
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig.model_validate(
            {"name": "sgd", "learning_rate": 1.0}
        )
    )
    compression: CompressionConfig = CompressionConfig()
    model: ModelSpec
    data: Data
    http: Security = Field(default_factory=Security)
    secagg: SecAggTable | None = None
    preprocessing: PreprocessingTable = Field(default_factory=PreprocessingTable)
    dp: DPTable | None = None
    aggregation: AggregationTable = AggregationTable()

    @model_validator(mode="after")
    def _checks(self) -> ServerFile:
        if self.server.evaluate == "server" and self.data.label_column is None:
            raise Invalid(
                "",
                'data.label_column is required with server.evaluate = "server" (the default: '
                "the server evaluates on its labelled [data]); set it, or let the clients "
                'evaluate on their validation rows with server.evaluate = "clients" (each '
                "client's data.split.validation)",
            )
        if self.http.secret_bytes is None:
            raise Invalid(
                "",
                "[http] needs a shared secret (secret_env, secret_file or secret): the server "
                "admits the clients of server.clients by their signed requests",
            )
        exposed = exposure(self.server.host, self.http, listen="server.host", section="http")
        if exposed:
            raise Invalid("", exposed)
        return self


class ClientTable(Section):
    """``[client]``: who the client is and where its server is."""

    model_config = {**Section.model_config, "json_schema_extra": {"required": ["name", "server"]}}

    name: str | None = None
    server: Url | None = Field(default=None, description="the server's URL")
    server_name: str = "server"
    host: str = "127.0.0.1"
    port: Port = 0
    advertise_url: Url | None = None
    reconnect_timeout: Positive = 300.0
    compile_cache: str = Field(
        default="auto", description='JAX compilation cache folder, "auto" or "off"'
    )
    max_refusals: int = Field(default=3, ge=1, description="stop after this many refusals")
    final_model: str | None = Field(default=None, description="write the final model here")

    @field_validator("final_model")
    @classmethod
    def _final(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _location(value, info)

    @model_validator(mode="after")
    def _needed(self) -> ClientTable:
        for key, example in (("name", '"bank_a"'), ("server", '"http://127.0.0.1:8780"')):
            if getattr(self, key) is None:
                raise Invalid("", f"[client] needs `{key}` (e.g. {key} = {example})")
        return self


class TrainTable(Section):
    """``[train]``: the client's local training each round."""

    epochs: int = Field(default=1, ge=1)
    batch_size: int = Field(default=16, ge=1)


class ClientFile(Section):
    """A federated client's TOML file (`tandem fl client --config`)."""

    client: ClientTable
    train: TrainTable = TrainTable()
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig.model_validate(
            {"name": "sgd", "learning_rate": 0.05}
        )
    )
    data: Data
    http: Security = Field(default_factory=Security)
    secagg: ClientSecAgg = ClientSecAgg()

    @model_validator(mode="after")
    def _checks(self) -> ClientFile:
        _labelled(self.data)
        exposed = exposure(self.client.host, self.http, listen="client.host", section="http")
        if exposed:
            raise Invalid("", exposed)
        return self


# -- the checked views ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """A checked server configuration: ``[server]``'s keys flat, the other sections as
    checked, the data table and the security settings built."""

    path: str
    name: str
    host: str
    port: int
    advertise_url: str | None
    clients: tuple[str, ...]
    rounds: int
    fraction: float
    min_clients: int
    round_timeout: float
    wait: float
    seed: int
    loss: str
    eval_every: int
    checkpoint: str | None
    export: str | None
    optimizer: OptimizerConfig
    compression: CompressionConfig
    model: Mapping[str, Any]
    data: DataConfig
    security: HttpSecurity
    secagg: SecAggTable | None = None
    preprocessing: PreprocessingTable = PreprocessingTable()
    compile_cache: str = "auto"
    dp: DPTable | None = None
    aggregation: AggregationTable = AggregationTable()
    evaluate: str = "server"  # or "clients" (`tandem.parties.fl.evaluation`)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must have been written with to be resumed: everything that shapes
        the trained model (not ``rounds``, timeouts, addresses or the evaluation data)."""
        return (
            {
                "name": self.name,
                "clients": list(self.clients),
                "fraction": self.fraction,
                "seed": self.seed,
                "loss": self.loss,
                "model": _plain(self.model),
                "optimizer": _plain(self.optimizer.describe()),
                "compression": self.compression.model_dump(),
            }
            | ({} if self.secagg is None else {"secagg": self.secagg.model_dump()})
            | (
                {}
                if self.preprocessing == PreprocessingTable()
                else {"preprocessing": self.preprocessing.model_dump()}
            )
            | ({} if self.dp is None else {"dp": self.dp.model_dump()})
            | (
                {"aggregation": self.aggregation.model_dump()}
                if self.aggregation.model_fields_set
                else {}
            )
        )

    def identity_hash(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """A checked client configuration: ``[client]`` and ``[train]`` flat (see `ServerConfig`)."""

    path: str
    name: str
    server: str
    server_name: str
    host: str
    port: int
    advertise_url: str | None
    reconnect_timeout: float
    max_refusals: int
    final_model: str | None
    epochs: int
    batch_size: int
    optimizer: OptimizerConfig
    data: DataConfig
    security: HttpSecurity
    secagg: ClientSecAgg = ClientSecAgg()
    compile_cache: str = "auto"


# -- loading ---------------------------------------------------------------------------------
def check_server_file(path: str | os.PathLike[str]) -> ServerFile:
    """The server TOML at ``path`` (a path or an fsspec URL), checked as `ServerFile`."""
    path, raw = _read(path)
    return validate(ServerFile, _tables(ServerFile, raw, path), path=path, error=FLConfigError)


def check_client_file(path: str | os.PathLike[str]) -> ClientFile:
    """The client TOML at ``path`` (a path or an fsspec URL), checked as `ClientFile`."""
    path, raw = _read(path)
    return validate(ClientFile, _tables(ClientFile, raw, path), path=path, error=FLConfigError)


def load_server_config(path: str | os.PathLike[str]) -> ServerConfig:
    """Read and check a server TOML (see the module docstring)."""
    f = check_server_file(path)
    s = f.server
    assert s.clients is not None and s.rounds is not None  # Invariant: checked by ServerTable
    model = f.model.spec()
    if model["kind"] == "mlp":
        model.setdefault("activate_last", False)  # the output layer gives logits
    return ServerConfig(
        path=os.fspath(path),
        **s.model_dump(exclude={"clients", "rounds", "min_clients"}),
        clients=tuple(s.clients),
        rounds=s.rounds,
        min_clients=s.min_clients if s.min_clients is not None else len(s.clients),
        optimizer=f.optimizer,
        compression=f.compression,
        model=model,
        data=f.data.table(os.fspath(path)),
        security=security_of(f.http),
        secagg=f.secagg,
        preprocessing=f.preprocessing,
        dp=f.dp,
        aggregation=f.aggregation,
    )


def load_client_config(path: str | os.PathLike[str]) -> ClientConfig:
    """Read and check a client TOML (see the module docstring)."""
    f = check_client_file(path)
    return ClientConfig(
        path=os.fspath(path),
        **f.client.model_dump(),
        **f.train.model_dump(),
        optimizer=f.optimizer,
        data=f.data.table(os.fspath(path)),
        security=security_of(f.http),
        secagg=f.secagg,
    )


def _read(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    import fsspec

    path = os.fspath(path)
    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FLConfigError(
            f"config file {path!r} not found; pass --config with the path of a TOML file "
            "(see examples/fl/)"
        ) from None
    try:
        return path, tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FLConfigError(f"{path}: not valid TOML: {exc}") from None


def _tables(model: type[Section], raw: dict[str, Any], path: str) -> dict[str, Any]:
    """``raw`` when it holds the tables of ``model`` (each a table, the required ones there)."""
    fields = model.model_fields
    for key, value in raw.items():
        if key not in fields:
            raise FLConfigError(
                f"{path}: unknown table or key {key!r}; a file of this kind holds the tables "
                f"{[f'[{t}]' for t in fields]}"
            )
        if not isinstance(value, dict):
            raise FLConfigError(f"{path}: {key} must be a table ([{key}])")
    for key, field in fields.items():
        if field.is_required() and key not in raw:
            raise FLConfigError(f"{path}: the table [{key}] is missing")
    return raw


def _plain(value: Any) -> Any:
    """TOML data as plain JSON data (tables to dicts, arrays to lists)."""
    return json.loads(json.dumps(value))


__all__ = [
    "ClientConfig",
    "ClientFile",
    "CompressionConfig",
    "FLConfigError",
    "OptimizerConfig",
    "ServerConfig",
    "ServerFile",
    "check_client_file",
    "check_server_file",
    "load_client_config",
    "load_server_config",
]
