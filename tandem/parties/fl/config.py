"""The TOML configuration of a federated server and of a federated client.

`load_server_config(path)` and `load_client_config(path)` read a file (a path or an fsspec
URL) and check every key; an error is an `FLConfigError` naming the file, the key and the fix.
docs/federated.md#running-a-federation has the full tables. In short::

    # server.toml
    [server]         # name, host, port, clients (the roster: no one else may join), rounds,
                     # fraction, min_clients, round_timeout, wait, seed, loss, eval_every,
                     # checkpoint (path or fsspec URL), export (path)
    [optimizer]      # any optax optimizer: name + its keyword arguments
                     # FedAvg: name = "sgd", learning_rate = 1.0; FedAdam: "adam"; FedYogi: "yogi"
    [compression]    # preset = "dense" | "compressed", and the preset's knobs
    [model]          # a model spec for model_from_spec: kind = "mlp", hidden = [64], out_dim
    [data]           # the held-out evaluation set (docs/data.md)
    [http]           # secret / secret_env / secret_file, TLS files, limits (as split learning)

    # client.toml
    [client]         # name, server (URL), server_name, host, port, reconnect_timeout
    [train]          # epochs, batch_size
    [optimizer]      # the local optimizer (default: sgd, learning_rate 0.05)
    [data]           # this client's rows (it trains on the split's training part)
    [http]           # as the server's

The clients take the model, the loss and the initial parameters from the server (its
``welcome``), so only the server has ``[model]`` and ``loss``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from typing import Any

import optax

from tandem.engine.kernels import LOSSES
from tandem.errors import ConfigError
from tandem.parties.data import DataConfig, parse_data_config
from tandem.parties.http_security import HttpSecurity, parse_security
from tandem.transports.factory import is_transport_url, url_hint

from .downlink import MODES


class FLConfigError(ConfigError):
    """A federated party's TOML configuration is wrong; the message names the key and the fix."""


PRESETS = ("dense", "compressed")

SERVER_KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "host": (str,),
    "port": (int,),
    "advertise_url": (str,),
    "clients": (list,),
    "rounds": (int,),
    "fraction": (float, int),
    "min_clients": (int,),
    "round_timeout": (float, int),
    "wait": (float, int),
    "seed": (int,),
    "loss": (str,),
    "eval_every": (int,),
    "checkpoint": (str,),
    "export": (str,),
}
CLIENT_KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "server": (str,),
    "server_name": (str,),
    "host": (str,),
    "port": (int,),
    "advertise_url": (str,),
    "reconnect_timeout": (float, int),
}
TRAIN_KEYS: dict[str, tuple[type, ...]] = {"epochs": (int,), "batch_size": (int,)}
COMPRESSION_KEYS: dict[str, tuple[type, ...]] = {
    "preset": (str,),
    "uplink_ratio": (int,),
    "topk_ratio": (int,),
    "sketch": (bool,),
    "downlink": (str,),
    "anchor_every": (int,),
    "log_size": (int,),
    "lossless": (bool,),
}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """``optax.<name>(**kwargs)``: the server's (or a client's local) optimizer."""

    name: str
    kwargs: Mapping[str, Any]

    def build(self) -> optax.GradientTransformation:
        return _optax(self.name, dict(self.kwargs), "[optimizer]")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.kwargs)}


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """``preset`` "dense" (dense uplink, full downlink) or "compressed" (rand-k uplink keeping
    1/``uplink_ratio`` of the coordinates, or a count sketch of that size with ``sketch``;
    error feedback applying the top 1/``topk_ratio``; ``downlink`` deltas)."""

    preset: str = "dense"
    uplink_ratio: int = 60
    topk_ratio: int = 50
    sketch: bool = False
    downlink: str = "full"
    anchor_every: int = 10
    log_size: int = 16
    lossless: bool = False


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """A checked server configuration (see the module docstring)."""

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

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must have been written with to be resumed: everything that shapes
        the trained model (not ``rounds``, timeouts, addresses or the evaluation data)."""
        return {
            "name": self.name,
            "clients": list(self.clients),
            "fraction": self.fraction,
            "seed": self.seed,
            "loss": self.loss,
            "model": _plain(self.model),
            "optimizer": _plain(self.optimizer.describe()),
            "compression": dataclasses.asdict(self.compression),
        }

    def identity_hash(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """A checked client configuration (see the module docstring)."""

    path: str
    name: str
    server: str
    server_name: str
    host: str
    port: int
    advertise_url: str | None
    reconnect_timeout: float
    epochs: int
    batch_size: int
    optimizer: OptimizerConfig
    data: DataConfig
    security: HttpSecurity


# -- loading ---------------------------------------------------------------------------------
def load_server_config(path: str | os.PathLike[str]) -> ServerConfig:
    """Read and check a server TOML (see the module docstring)."""
    path, raw = _read(path)
    _tables(
        raw,
        path,
        required=("server", "model", "data"),
        optional=("optimizer", "compression", "http"),
    )
    top = _checked(raw["server"], SERVER_KEYS, "server", path)
    clients = top.get("clients")
    if not clients or not all(isinstance(c, str) and c for c in clients):
        raise FLConfigError(
            f'{path}: server.clients must list the client names, e.g. clients = ["bank_a", '
            f'"bank_b"]; only these may join, got {clients!r}'
        )
    if len(set(clients)) != len(clients):
        raise FLConfigError(f"{path}: server.clients names a client twice: {clients}")
    name = top.get("name", "server")
    if name in clients:
        raise FLConfigError(f"{path}: server.name {name!r} is also a client's name; rename one")
    rounds = _at_least(top, "rounds", 1, path, default=None)
    fraction = float(top.get("fraction", 1.0))
    if not 0 < fraction <= 1:
        raise FLConfigError(f"{path}: server.fraction must be in (0, 1], got {fraction}")
    min_clients = _at_least(top, "min_clients", 1, path, default=len(clients))
    if min_clients > len(clients):
        raise FLConfigError(
            f"{path}: server.min_clients = {min_clients} but server.clients has only "
            f"{len(clients)} names; lower min_clients or add clients"
        )
    loss = top.get("loss", "softmax")
    if loss not in LOSSES:
        raise FLConfigError(f"{path}: server.loss must be one of {sorted(LOSSES)}, got {loss!r}")
    base = _base(path)
    security = parse_security(raw.get("http", {}), path=path, section="http", error=FLConfigError)
    if security.secret is None:
        raise FLConfigError(
            f"{path}: [http] needs a shared secret (secret_env, secret_file or secret): the "
            "server admits the clients of server.clients by their signed requests"
        )
    return ServerConfig(
        path=path,
        name=name,
        host=top.get("host", "127.0.0.1"),
        port=_port(top, path, "server"),
        advertise_url=_url(top, "advertise_url", path, "server"),
        clients=tuple(clients),
        rounds=rounds,
        fraction=fraction,
        min_clients=min_clients,
        round_timeout=_positive(top, "round_timeout", 60.0, path, "server"),
        wait=_positive(top, "wait", 300.0, path, "server"),
        seed=_at_least(top, "seed", 0, path, default=0),
        loss=loss,
        eval_every=_at_least(top, "eval_every", 0, path, default=1),
        checkpoint=_location(top.get("checkpoint"), base),
        export=_location(top.get("export"), base),
        optimizer=_optimizer(raw.get("optimizer", {"name": "sgd", "learning_rate": 1.0}), path),
        compression=_compression(raw.get("compression", {}), path),
        model=_model(raw["model"], path),
        data=_data(raw["data"], path),
        security=security,
    )


def load_client_config(path: str | os.PathLike[str]) -> ClientConfig:
    """Read and check a client TOML (see the module docstring)."""
    path, raw = _read(path)
    _tables(raw, path, required=("client", "data"), optional=("train", "optimizer", "http"))
    top = _checked(raw["client"], CLIENT_KEYS, "client", path)
    for key in ("name", "server"):
        if key not in top:
            example = '"bank_a"' if key == "name" else '"http://127.0.0.1:8780"'
            raise FLConfigError(f"{path}: [client] needs `{key}` (e.g. {key} = {example})")
    server = str(_url(top, "server", path, "client"))
    train = _checked(raw.get("train", {}), TRAIN_KEYS, "train", path)
    return ClientConfig(
        path=path,
        name=top["name"],
        server=server,
        server_name=top.get("server_name", "server"),
        host=top.get("host", "127.0.0.1"),
        port=_port(top, path, "client"),
        advertise_url=_url(top, "advertise_url", path, "client"),
        reconnect_timeout=_positive(top, "reconnect_timeout", 300.0, path, "client"),
        epochs=_at_least(train, "epochs", 1, path, default=1, section="train"),
        batch_size=_at_least(train, "batch_size", 1, path, default=16, section="train"),
        optimizer=_optimizer(raw.get("optimizer", {"name": "sgd", "learning_rate": 0.05}), path),
        data=_data(raw["data"], path),
        security=parse_security(
            raw.get("http", {}), path=path, section="http", error=FLConfigError
        ),
    )


# -- helpers ---------------------------------------------------------------------------------
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


def _tables(
    raw: Mapping[str, Any], path: str, *, required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    accepted = (*required, *optional)
    for key, value in raw.items():
        if key not in accepted:
            raise FLConfigError(
                f"{path}: unknown table or key {key!r}; a file of this kind holds the tables "
                f"{[f'[{t}]' for t in accepted]}"
            )
        if not isinstance(value, dict):
            raise FLConfigError(f"{path}: {key} must be a table ([{key}])")
    for key in required:
        if key not in raw:
            raise FLConfigError(f"{path}: the table [{key}] is missing")


def _checked(
    table: Mapping[str, Any], keys: Mapping[str, tuple[type, ...]], section: str, path: str
) -> dict[str, Any]:
    for key, value in table.items():
        if key not in keys:
            raise FLConfigError(
                f"{path}: unknown key {section}.{key}; accepted keys in [{section}]: {sorted(keys)}"
            )
        kinds = keys[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise FLConfigError(
                f"{path}: {section}.{key} must be {' or '.join(k.__name__ for k in kinds)}, "
                f"got {value!r}"
            )
    return dict(table)


def _at_least(
    table: Mapping[str, Any],
    key: str,
    low: int,
    path: str,
    *,
    default: int | None,
    section: str = "server",
) -> int:
    if key not in table:
        if default is None:
            raise FLConfigError(f"{path}: [{section}] needs `{key}` (an integer >= {low})")
        return default
    value = table[key]
    if value < low:
        raise FLConfigError(f"{path}: {section}.{key} must be >= {low}, got {value}")
    return int(value)


def _positive(table: Mapping[str, Any], key: str, default: float, path: str, section: str) -> float:
    value = float(table.get(key, default))
    if not value > 0:
        raise FLConfigError(f"{path}: {section}.{key} must be > 0 seconds, got {value}")
    return value


def _port(table: Mapping[str, Any], path: str, section: str) -> int:
    port = table.get("port", 0)
    if not 0 <= port <= 65535:
        raise FLConfigError(
            f"{path}: {section}.port must be in [0, 65535] (0: any free port), got {port}"
        )
    return int(port)


def _url(table: Mapping[str, Any], key: str, path: str, section: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not is_transport_url(value):
        raise FLConfigError(
            f"{path}: {section}.{key} must be {url_hint('http://127.0.0.1:8780')}, got {value!r}"
        )
    return str(value).rstrip("/")


def _base(path: str) -> str | None:
    """The folder relative locations start at: the config file's, when it is a local file."""
    return None if "://" in path else os.path.dirname(os.path.abspath(path))


def _location(value: str | None, base: str | None) -> str | None:
    if value is None or base is None or "://" in value or os.path.isabs(value):
        return value
    return os.path.join(base, value)


def _optimizer(table: Mapping[str, Any], path: str) -> OptimizerConfig:
    kwargs = dict(table)
    name = kwargs.pop("name", None)
    if not isinstance(name, str) or not name:
        raise FLConfigError(
            f'{path}: [optimizer] needs `name`, an optax optimizer such as "sgd", "adam" or '
            f'"yogi", got {name!r}'
        )
    cfg = OptimizerConfig(name, kwargs)
    try:
        _optax(name, kwargs, f"{path}: [optimizer]")
    except ConfigError as exc:
        raise FLConfigError(str(exc)) from None
    return cfg


def _optax(name: str, kwargs: dict[str, Any], where: str) -> optax.GradientTransformation:
    fn = getattr(optax, name, None) if not name.startswith("_") else None
    if fn is None or not callable(fn) or isinstance(fn, type):
        raise ConfigError(
            f"{where}: name = {name!r} is not an optax optimizer; use one of optax's, e.g. "
            '"sgd" (FedAvg with learning_rate = 1), "adam" (FedAdam), "yogi" (FedYogi), '
            '"adagrad", "rmsprop", "lamb"'
        )
    try:
        opt = fn(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"{where}: optax.{name} does not take these arguments {sorted(kwargs)}: {exc}; "
            "the table's other keys are optax.{name}'s keyword arguments"
        ) from None
    if not isinstance(opt, optax.GradientTransformation):
        raise ConfigError(
            f"{where}: optax.{name}(...) returned {type(opt).__name__}, not an optimizer"
        )
    return opt


def _compression(table: Mapping[str, Any], path: str) -> CompressionConfig:
    t = _checked(table, COMPRESSION_KEYS, "compression", path)
    preset = t.get("preset", "dense")
    if preset not in PRESETS:
        raise FLConfigError(
            f"{path}: compression.preset must be one of {list(PRESETS)}, got {preset!r}"
        )
    if preset == "dense":
        knobs = sorted(k for k in ("uplink_ratio", "topk_ratio", "sketch") if k in t)
        if knobs:
            raise FLConfigError(
                f'{path}: compression {knobs} apply to preset = "compressed" only; remove '
                'them or set preset = "compressed"'
            )
    downlink = t.get("downlink", "full" if preset == "dense" else "version")
    if downlink not in MODES:
        raise FLConfigError(
            f"{path}: compression.downlink must be one of {list(MODES)}, got {downlink!r}"
        )
    for key in ("uplink_ratio", "topk_ratio", "anchor_every", "log_size"):
        if key in t and t[key] < 1:
            raise FLConfigError(f"{path}: compression.{key} must be >= 1, got {t[key]}")
    return CompressionConfig(
        preset=preset,
        uplink_ratio=t.get("uplink_ratio", 60),
        topk_ratio=t.get("topk_ratio", 50),
        sketch=t.get("sketch", False),
        downlink=downlink,
        anchor_every=t.get("anchor_every", 10),
        log_size=t.get("log_size", 16),
        lossless=t.get("lossless", False),
    )


def _model(table: Mapping[str, Any], path: str) -> dict[str, Any]:
    if "kind" not in table:
        raise FLConfigError(
            f'{path}: [model] needs `kind` (e.g. kind = "mlp", hidden = [64], out_dim = 10)'
        )
    spec = _plain(table)
    if spec["kind"] == "mlp":
        spec.setdefault("activate_last", False)  # the output layer gives logits
    return spec


def _data(table: Mapping[str, Any], path: str) -> DataConfig:
    cfg = parse_data_config(table, path=path)
    if cfg.label_column is None:
        raise FLConfigError(
            f"{path}: data.label_column is required: federated parties train (clients) and "
            "evaluate (the server) on labelled rows"
        )
    return cfg


def _plain(value: Any) -> Any:
    """TOML data as plain JSON data (tables to dicts, arrays to lists)."""
    return json.loads(json.dumps(value))


__all__ = [
    "ClientConfig",
    "CompressionConfig",
    "FLConfigError",
    "OptimizerConfig",
    "ServerConfig",
    "load_client_config",
    "load_server_config",
]
