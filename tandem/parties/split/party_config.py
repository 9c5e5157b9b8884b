"""The TOML configuration of one standalone split-learning party (`tandem party --config`).

`load_party_config(path) -> PartyConfig` reads and checks the file; every error names the key
(``section.key``), what was wrong and how to fix it. Relative paths are resolved against the
config file's folder. Keys (docs/parties.md#configuration has the full table)::

    role = "leader"                  # "leader" (owns the loss stage) or "follower"
    name = "leader"                  # this party's name in the topology
    export_dir = "out/leader"        # optional: save this party's stages here at the end
    progress = true                  # optional: live progress display
    wait = 120.0                     # optional: seconds to wait for the peers to negotiate
    grace = 10.0                     # optional: seconds SIGINT/SIGTERM lets a batch finish

    [listen]      host = "127.0.0.1", port = 8711
    [peers]       follower = "http://127.0.0.1:8712"       # name = base URL, every other party
    [link]        bandwidth (bytes/s), latency (s): emulate a slower link on loopback
    [security]    secret | secret_env | secret_file (at most one; none = unsigned), key_id,
                  previous_secret | previous_secret_env | previous_secret_file and
                  previous_key_id (a key still accepted during a rotation), max_clock_skew,
                  tls_cert, tls_key, tls_ca (optional), max_frame_bytes, reject_nonfinite,
                  retry_timeout, peer_timeout
    [identities]  peer = "name" or ["name", ...]: the TLS client certificate names (CN or
                  subjectAltName) that may speak for that peer (default: the peer's name)
    [http]        inbound_budget, partial_timeout, header_timeout, body_idle_timeout,
                  keepalive_timeout, max_connections, max_connections_per_address,
                  read_timeout, backpressure_wait, max_nonces (docs/security.md lists their
                  defaults)
    [data]        source = "breast_cancer" | "x.npz" | "x.csv"; part ("leader"/"follower",
                  breast_cancer only), seed (breast_cancer split), label_column (csv),
                  test (csv of test rows), aligned (the `tandem align --out` CSV)
    [model]       topology (a built-in name or a .json file of Topology.to_dict),
                  topology_args (list of party names for the built-in), cut, hidden, out
    [schema]      leader only: feature columns of each other feature-holding party
    [train]       leader only: SplitConfig fields + eval_batch_size
    [checkpoint]  dir, every (batches), keep

This module is the stable entry point other commands build on (e.g. ``tandem predict``): keep
`load_party_config`, `PartyConfig`, `PartyData` and the helper methods importable.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import tomllib
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from tandem.engine.kernels import StageModel, mlp_stage
from tandem.engine.topology import BUILTIN, FEATURES, Topology
from tandem.errors import ConfigError


class PartyConfigError(ConfigError):
    """The party's TOML configuration is wrong; the message names the key and the fix."""


TRAIN_KEYS: dict[str, tuple[type, ...]] = {
    "batch_size": (int,),
    "eval_batch_size": (int,),
    "epochs": (int,),
    "groups": (int, str),
    "learning_rate": (float, int),
    "optimizer": (str,),
    "loss": (str,),
    "seed": (int,),
    "threshold": (int,),
    "capacity": (int,),
    "policy": (str,),
    "chunks": (int,),
}
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "": {
        "role": (str,),
        "name": (str,),
        "export_dir": (str,),
        "progress": (bool,),
        "wait": (float, int),
        "grace": (float, int),
    },
    "link": {"bandwidth": (float, int), "latency": (float, int)},
    "listen": {"host": (str,), "port": (int,)},
    "peers": {},  # free-form: name -> URL
    "security": {
        "secret": (str,),
        "secret_env": (str,),
        "secret_file": (str,),
        "tls_cert": (str,),
        "tls_key": (str,),
        "tls_ca": (str,),
        "max_frame_bytes": (int,),
        "reject_nonfinite": (bool,),
        "retry_timeout": (float, int),
        "peer_timeout": (float, int),
        "key_id": (str,),
        "previous_secret": (str,),
        "previous_secret_env": (str,),
        "previous_secret_file": (str,),
        "previous_key_id": (str,),
        "max_clock_skew": (float, int),
    },
    "identities": {},  # free-form: peer -> certificate name(s)
    "http": {
        "inbound_budget": (int,),
        "partial_timeout": (float, int),
        "header_timeout": (float, int),
        "body_idle_timeout": (float, int),
        "keepalive_timeout": (float, int),
        "max_connections": (int,),
        "max_connections_per_address": (int,),
        "read_timeout": (float, int),
        "backpressure_wait": (float, int),
        "max_nonces": (int,),
    },
    "data": {
        "source": (str,),
        "part": (str,),
        "seed": (int,),
        "label_column": (str,),
        "test": (str,),
        "aligned": (str,),
    },
    "model": {
        "topology": (str,),
        "topology_args": (list,),
        "cut": (int,),
        "hidden": (list,),
        "out": (int,),
    },
    "schema": {},  # free-form: party -> feature count
    "train": TRAIN_KEYS,
    "checkpoint": {"dir": (str,), "every": (int,), "keep": (int,)},
}
REQUIRED = {"": ("role", "name"), "data": ("source",)}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str  # "breast_cancer" or an absolute .npz/.csv path
    part: str | None = None
    seed: int = 0
    label_column: str | None = None
    test: str | None = None
    aligned: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    topology: str = "leader_follower"
    topology_args: tuple[str, ...] = ()
    cut: int = 16
    hidden: tuple[int, ...] = (32,)
    out: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 10
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class PartyData:
    """One party's (aligned) data. ``alignment`` is ``{"size", "commitment"}`` or None."""

    train: np.ndarray | None
    test: np.ndarray | None = None
    y_train: np.ndarray | None = None
    y_test: np.ndarray | None = None
    alignment: dict[str, Any] | None = None

    @property
    def features(self) -> int | None:
        return None if self.train is None else int(self.train.shape[1])

    @property
    def samples(self) -> int | None:
        if self.train is not None:
            return int(self.train.shape[0])
        return None if self.y_train is None else int(self.y_train.shape[0])

    def datasets(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in (("train", self.train), ("test", self.test)) if v is not None}

    def labels(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in (("train", self.y_train), ("test", self.y_test)) if v is not None}


@dataclasses.dataclass(frozen=True)
class PartyConfig:
    """A checked party configuration (see the module docstring for the keys)."""

    path: str
    role: str
    name: str
    host: str
    port: int
    peers: dict[str, str]
    secret: bytes | None
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None
    max_frame_bytes: int
    reject_nonfinite: bool
    retry_timeout: float
    peer_timeout: float
    data: DataConfig
    model: ModelConfig
    schema: dict[str, int]
    train: dict[str, Any]
    checkpoint: CheckpointConfig
    export_dir: str | None
    progress: bool
    wait: float = 120.0
    grace: float = 10.0
    link_bandwidth: float | None = None
    link_latency: float = 0.0
    key_id: str | None = None
    previous_secret: bytes | None = None
    previous_key_id: str | None = None
    max_clock_skew: float = 5.0
    identities: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    http: dict[str, Any] = dataclasses.field(default_factory=dict)  # [http] HttpConfig fields

    # -- derived objects -----------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.role == "leader"

    def topology(self) -> Topology:
        """The configured topology (built-in by name, or read from a JSON file; read once,
        then cached, so later calls do no file I/O)."""
        cached = self.__dict__.get("_topology")
        if cached is None:
            cached = self.__dict__["_topology"] = _topology(self.model, self.path)
        return cached

    def security(self) -> dict[str, Any]:
        """The security settings recorded in the task spec."""
        auth = "hmac" if self.secret else ("mtls" if self.tls_ca and self.tls_cert else "none")
        return {
            "auth": auth,
            "tls": bool(self.tls_cert),
            "max_frame_bytes": self.max_frame_bytes,
            "reject_nonfinite": self.reject_nonfinite,
        }

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

    def transport(self):
        """An (unstarted) `tandem.transports.http.HttpTransport` for this party."""
        from tandem.transports.http import HttpConfig, HttpTransport

        server, client = self.ssl_contexts()
        return HttpTransport(
            HttpConfig(
                name=self.name,
                host=self.host,
                port=self.port,
                peers=dict(self.peers),
                secret=self.secret,
                key_id=self.key_id,
                previous_secret=self.previous_secret,
                previous_key_id=self.previous_key_id,
                max_clock_skew=self.max_clock_skew,
                peer_identities=self.identities or None,
                ssl_server=server,
                ssl_client=client,
                max_frame_bytes=self.max_frame_bytes,
                reject_nonfinite=self.reject_nonfinite,
                retry_timeout=self.retry_timeout,
                peer_timeout=self.peer_timeout,
                shape_bandwidth=self.link_bandwidth,
                shape_latency=self.link_latency,
                **self.http,
            )
        )

    def split_config(self):
        """The leader's `SplitConfig` from [train] (defaults for keys not given)."""
        train = dict(self.train)
        train.pop("eval_batch_size", None)
        if "learning_rate" in train:
            train["learning_rate"] = float(train["learning_rate"])
        try:
            return split_config_from(train)
        except ConfigError as exc:
            raise PartyConfigError(f"{self.path}: [train] {exc}") from None

    def hyper(self) -> dict[str, Any]:
        """The task spec's ``hyper`` table: [train] with defaults, plus checkpoint.every."""
        sc = self.split_config()
        out = {
            k: getattr(sc, k)
            for k in (
                "batch_size",
                "groups",
                "learning_rate",
                "optimizer",
                "loss",
                "epochs",
                "seed",
                "threshold",
                "capacity",
                "policy",
                "chunks",
            )
        }
        out["eval_batch_size"] = int(self.train.get("eval_batch_size", max(sc.batch_size, 256)))
        out["checkpoint_every"] = self.checkpoint.every
        return out

    def load_data(self) -> PartyData:
        """Read this party's data (labels too when it owns the loss stage), aligned if
        ``data.aligned`` is set. Raises `PartyConfigError` naming the file and the fix."""
        return _load_data(self)

    def stage_widths(self, features: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """``{stage: {"in_dims", "out_dim", "sizes"}}`` of the configured MLP stages, given the
        feature count of every feature-holding party."""
        topo, m = self.topology(), self.model
        out = {}
        for s in topo.stages:
            in_dims = []
            for i in s.inputs:
                if i == FEATURES:
                    if s.owner not in features:
                        raise PartyConfigError(
                            f"{self.path}: the feature count of {s.owner!r} is unknown; add "
                            f"`{s.owner} = <columns>` under [schema]"
                        )
                    in_dims.append(int(features[s.owner]))
                else:
                    in_dims.append(m.cut)
            width = m.out if s.loss else m.cut
            out[s.name] = {
                "in_dims": in_dims,
                "out_dim": width,
                "sizes": [sum(in_dims), *m.hidden, width],
            }
        return out


def models_from_widths(
    topology: Topology, widths: Mapping[str, Mapping[str, Any]]
) -> dict[str, StageModel]:
    """MLP `StageModel`s for every stage from ``{"in_dims", "out_dim", "sizes"}`` (a spec's
    ``stages`` or `PartyConfig.stage_widths`); the loss stage's last layer is linear."""
    models = {}
    for s in topology.stages:
        w = widths[s.name]
        sizes = w.get("sizes") or [sum(w["in_dims"]), w["out_dim"]]
        models[s.name] = mlp_stage(
            w["in_dims"], list(sizes[1:-1]), w["out_dim"], activate_last=not s.loss
        )
    return models


# -- loading ---------------------------------------------------------------------------------
def load_party_config(path: str | os.PathLike) -> PartyConfig:
    """Read and check the TOML file at ``path``; `PartyConfigError` names any bad key."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise PartyConfigError(
            f"config file {path!r} not found; pass --config with the path "
            "of a party TOML (see examples/split/leader.toml)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise PartyConfigError(f"{path}: not valid TOML: {exc}") from None
    base = os.path.dirname(os.path.abspath(path))
    _check_keys(raw, path)
    top = raw
    role = top["role"]
    if role not in ("leader", "follower"):
        raise PartyConfigError(f"{path}: role must be 'leader' or 'follower', got {role!r}")
    listen, sec = raw.get("listen", {}), raw.get("security", {})
    peers = {}
    for peer, url in raw.get("peers", {}).items():
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise PartyConfigError(
                f"{path}: peers.{peer} must be a URL like 'http://127.0.0.1:8712', got {url!r}"
            )
        peers[peer] = url.rstrip("/")
    if not peers:
        raise PartyConfigError(
            f'{path}: [peers] is empty; add `name = "http://host:port"` for every other party'
        )
    d = raw["data"]
    source = d["source"]
    if source != "breast_cancer":
        source = _file(base, source, "data.source", path)
    if source == "breast_cancer" and d.get("part") not in ("leader", "follower"):
        raise PartyConfigError(
            f"{path}: data.part must be 'leader' or 'follower' with the "
            f"built-in breast_cancer source, got {d.get('part')!r}"
        )
    data = DataConfig(
        source=source,
        part=d.get("part"),
        seed=d.get("seed", 0),
        label_column=d.get("label_column"),
        test=_file(base, d["test"], "data.test", path) if "test" in d else None,
        aligned=_file(base, d["aligned"], "data.aligned", path) if "aligned" in d else None,
    )
    m = raw.get("model", {})
    hidden = m.get("hidden", [32])
    if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
        raise PartyConfigError(
            f"{path}: model.hidden must be a list of positive ints, got {hidden!r}"
        )
    args = m.get("topology_args", [])
    if not all(isinstance(a, str) and a for a in args):
        raise PartyConfigError(f"{path}: model.topology_args must be a list of party names")
    topo_name = m.get("topology", "leader_follower")
    if topo_name not in BUILTIN:
        topo_name = _file(base, topo_name, "model.topology", path)
    for key in ("cut", "out"):
        if key in m and m[key] < 1:
            raise PartyConfigError(f"{path}: model.{key} must be >= 1, got {m[key]}")
    model = ModelConfig(
        topology=topo_name,
        topology_args=tuple(args),
        cut=m.get("cut", 16),
        hidden=tuple(hidden),
        out=m.get("out", 1),
    )
    schema = raw.get("schema", {})
    for k, v in schema.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PartyConfigError(
                f"{path}: schema.{k} must be a positive feature count, got {v!r}"
            )
    train = dict(raw.get("train", {}))
    if role == "follower" and (train or schema):
        raise PartyConfigError(
            f"{path}: [train] and [schema] are the leader's (it proposes them in the task "
            "spec); remove them from the follower's config"
        )
    ck = raw.get("checkpoint", {})
    for key in ("every", "keep"):
        if key in ck and ck[key] < 1:
            raise PartyConfigError(f"{path}: checkpoint.{key} must be >= 1, got {ck[key]}")
    checkpoint = CheckpointConfig(
        dir=os.path.join(base, ck["dir"]) if "dir" in ck else None,
        every=ck.get("every", 10),
        keep=ck.get("keep", 3),
    )
    secret = _secret(sec, path, base)
    previous = _secret(sec, path, base, "previous_")
    if previous is not None and secret is None:
        raise PartyConfigError(
            f"{path}: security.previous_secret is the key being retired; set the new one as "
            "security.secret too"
        )
    identities = {}
    for peer, names in raw.get("identities", {}).items():
        names = [names] if isinstance(names, str) else names
        if (
            not isinstance(names, list)
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise PartyConfigError(
                f"{path}: identities.{peer} must be a certificate name or a list of them, "
                f"got {names!r}"
            )
        identities[peer] = list(names)
    http = dict(raw.get("http", {}))
    for key, value in http.items():
        if value <= 0:
            raise PartyConfigError(f"{path}: http.{key} must be > 0, got {value}")
    if http.get("inbound_budget", 1 << 62) < sec.get("max_frame_bytes", 1 << 31):
        raise PartyConfigError(
            f"{path}: http.inbound_budget ({http['inbound_budget']} bytes) must hold one frame "
            f"of security.max_frame_bytes ({sec.get('max_frame_bytes', 1 << 31)}); lower "
            "max_frame_bytes or raise the budget"
        )
    if "max_clock_skew" in sec and sec["max_clock_skew"] < 0:
        raise PartyConfigError(
            f"{path}: security.max_clock_skew must be >= 0 s, got {sec['max_clock_skew']}"
        )
    link = raw.get("link", {})
    for key, value in [*link.items(), ("wait", top.get("wait", 1)), ("grace", top.get("grace", 1))]:
        if value < 0 or (key in ("bandwidth", "wait") and value == 0):
            raise PartyConfigError(f"{path}: {key} must be > 0, got {value}")
    tls = {
        k: _file(base, sec[k], f"security.{k}", path) if k in sec else None
        for k in ("tls_cert", "tls_key", "tls_ca")
    }
    if bool(tls["tls_cert"]) != bool(tls["tls_key"]):
        raise PartyConfigError(
            f"{path}: security.tls_cert and security.tls_key go together; set both or neither"
        )
    cfg = PartyConfig(
        path=path,
        role=role,
        name=top["name"],
        host=listen.get("host", "127.0.0.1"),
        port=listen.get("port", 0),
        peers=peers,
        secret=secret,
        **tls,
        max_frame_bytes=sec.get("max_frame_bytes", 1 << 31),
        reject_nonfinite=sec.get("reject_nonfinite", True),
        retry_timeout=float(sec.get("retry_timeout", 30.0)),
        peer_timeout=float(sec.get("peer_timeout", 30.0)),
        data=data,
        model=model,
        schema=dict(schema),
        train=train,
        checkpoint=checkpoint,
        export_dir=os.path.join(base, top["export_dir"]) if "export_dir" in top else None,
        progress=top.get("progress", True),
        wait=float(top.get("wait", 120.0)),
        grace=float(top.get("grace", 10.0)),
        link_bandwidth=float(link["bandwidth"]) if "bandwidth" in link else None,
        link_latency=float(link.get("latency", 0.0)),
        key_id=sec.get("key_id"),
        previous_secret=previous,
        previous_key_id=sec.get("previous_key_id"),
        max_clock_skew=float(sec.get("max_clock_skew", 5.0)),
        identities=identities,
        http={k: float(v) if k.endswith(("timeout", "wait")) else v for k, v in http.items()},
    )
    topo = cfg.topology()
    if cfg.name not in topo.parties:
        raise PartyConfigError(
            f"{path}: name {cfg.name!r} owns no stage of topology "
            f"{model.topology!r} (parties: {list(topo.parties)}); fix `name` "
            "or model.topology_args"
        )
    is_owner = topo.label_owner == cfg.name
    if is_owner != cfg.is_leader:
        raise PartyConfigError(
            f"{path}: role is {role!r} but {cfg.name!r} "
            f"{'owns' if is_owner else 'does not own'} the loss stage; the leader is "
            f"{topo.label_owner!r}"
        )
    missing = [p for p in topo.parties if p != cfg.name and p not in peers]
    if missing:
        raise PartyConfigError(f'{path}: [peers] lacks {missing}; add `name = "http://host:port"`')
    if cfg.is_leader:
        cfg.split_config()  # checks the [train] values now
        absent = [p for p in topo.feature_parties() if p != cfg.name and p not in schema]
        if absent:
            raise PartyConfigError(
                f"{path}: [schema] lacks the feature count of {absent}; add "
                f"`{absent[0]} = <columns>`"
            )
    return cfg


def split_config_from(hyper: Mapping[str, Any]):
    """A `SplitConfig` from the ``train`` table or a spec's ``hyper`` (extra keys ignored)."""
    from .party import SplitConfig

    fields = {f.name for f in dataclasses.fields(SplitConfig)}
    return SplitConfig(**{k: v for k, v in hyper.items() if k in fields})


def _check_keys(raw: Mapping[str, Any], path: str) -> None:
    for key, value in raw.items():
        if key in SCHEMA and key != "" and isinstance(value, dict):
            allowed = SCHEMA[key]
            if not allowed:  # free-form tables
                continue
            for sub, v in value.items():
                if sub not in allowed:
                    raise PartyConfigError(
                        f"{path}: unknown key {key}.{sub}; accepted keys in "
                        f"[{key}]: {sorted(allowed)}"
                    )
                _check_type(f"{key}.{sub}", v, allowed[sub], path)
        elif key in SCHEMA[""]:
            _check_type(key, value, SCHEMA[""][key], path)
        elif key in SCHEMA:
            raise PartyConfigError(f"{path}: {key} must be a table ([{key}])")
        else:
            raise PartyConfigError(
                f"{path}: unknown key {key!r}; accepted top-level keys: {sorted(SCHEMA[''])}, "
                f"tables: {sorted(k for k in SCHEMA if k)}"
            )
    for section, keys in REQUIRED.items():
        table = raw if section == "" else raw.get(section, {})
        for k in keys:
            if k not in table:
                name = k if section == "" else f"{section}.{k}"
                raise PartyConfigError(f"{path}: required key {name!r} is missing")


def _check_type(name: str, value: Any, kinds: tuple[type, ...], path: str) -> None:
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        raise PartyConfigError(
            f"{path}: {name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}"
        )


def _file(base: str, value: str, key: str, path: str) -> str:
    full = value if os.path.isabs(value) else os.path.join(base, value)
    if not os.path.exists(full):
        raise PartyConfigError(
            f"{path}: {key} = {value!r}: no such file ({full}); fix the path "
            "(relative paths start at the config file's folder)"
        )
    return full


def _secret(sec: Mapping[str, Any], path: str, base: str, prefix: str = "") -> bytes | None:
    """The key of ``security.{prefix}secret`` (or ``_env`` / ``_file``); None when unset."""
    plain, env, file = f"{prefix}secret", f"{prefix}secret_env", f"{prefix}secret_file"
    given = [k for k in (plain, env, file) if k in sec]
    if len(given) > 1:
        raise PartyConfigError(f"{path}: set only one of security.{given}")
    if not given:
        return None
    if plain in sec:
        value = sec[plain]
    elif env in sec:
        value = os.environ.get(sec[env])
        if value is None:
            raise PartyConfigError(
                f"{path}: security.{env} names ${sec[env]}, "
                f"which is not set; export it or use {file}"
            )
    else:
        with open(_file(base, sec[file], f"security.{file}", path), "rb") as f:
            value = f.read().strip().decode()
    if not value:
        raise PartyConfigError(f"{path}: the shared secret ({given[0]}) is empty")
    return value.encode()


def _topology(model: ModelConfig, path: str) -> Topology:
    from tandem.errors import TopologyError

    if model.topology in BUILTIN:
        try:
            factory = cast(Callable[..., Topology], BUILTIN[model.topology])
            return factory(*model.topology_args)
        except TypeError as exc:
            raise PartyConfigError(
                f"{path}: model.topology_args {list(model.topology_args)} do "
                f"not fit the built-in {model.topology!r}: {exc}"
            ) from None
    import json

    try:
        with open(model.topology, encoding="utf-8") as f:
            return Topology.from_dict(json.load(f))
    except (ValueError, TopologyError) as exc:
        raise PartyConfigError(f"{path}: model.topology file {model.topology!r}: {exc}") from None


def _load_data(cfg: PartyConfig) -> PartyData:
    d = cfg.data
    topo = cfg.topology()
    owner = topo.label_owner == cfg.name
    if d.source == "breast_cancer":
        from .demo import load_breast_cancer_split

        split = load_breast_cancer_split(d.seed)
        part = getattr(split, str(d.part))  # "leader" or "follower": checked at load
        data = PartyData(
            part["train"],
            part["test"],
            split.labels["train"] if owner else None,
            split.labels["test"] if owner else None,
        )
    elif d.source.endswith(".npz"):
        with np.load(d.source, allow_pickle=False) as z:
            if "x_train" not in z:
                raise PartyConfigError(
                    f"{cfg.path}: data.source {d.source!r} has no array "
                    f"'x_train' (it holds {sorted(z.files)})"
                )
            if owner and "y_train" not in z:
                raise PartyConfigError(
                    f"{cfg.path}: {cfg.name!r} owns the loss stage but "
                    f"{d.source!r} has no 'y_train' labels"
                )
            get = lambda k: np.asarray(z[k]) if k in z else None  # noqa: E731
            data = PartyData(
                get("x_train"),
                get("x_test"),
                get("y_train") if owner else None,
                get("y_test") if owner else None,
            )
    elif d.source.endswith(".csv"):
        x, y = _read_csv(d.source, d.label_column if owner else None, cfg.path)
        xt = yt = None
        if d.test:
            xt, yt = _read_csv(d.test, d.label_column if owner else None, cfg.path)
        data = PartyData(x, xt, y, yt)
    else:
        raise PartyConfigError(
            f"{cfg.path}: data.source {d.source!r} must be 'breast_cancer', a .npz or a .csv file"
        )
    data = dataclasses.replace(
        data,
        train=None if data.train is None else np.asarray(data.train, np.float32),
        test=None if data.test is None else np.asarray(data.test, np.float32),
        y_train=None if data.y_train is None else np.asarray(data.y_train, np.float32),
        y_test=None if data.y_test is None else np.asarray(data.y_test, np.float32),
    )
    if d.aligned:
        data = _align(data, d.aligned, cfg.path)
    return data


def _read_csv(path: str, label: str | None, cfg_path: str):
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise PartyConfigError(f"{cfg_path}: {path!r} is empty; expected a header row")
        rows = list(reader)
    if label is not None and label not in header:
        raise PartyConfigError(
            f"{cfg_path}: data.label_column {label!r} is not a column of "
            f"{path!r} (columns: {header})"
        )
    li = header.index(label) if label is not None else None
    try:
        table = np.asarray(rows, dtype=np.float64)
    except ValueError as exc:
        raise PartyConfigError(
            f"{cfg_path}: {path!r} has a non-numeric value ({exc}); feature CSVs hold numbers only"
        ) from None
    if table.ndim != 2 or table.shape[1] != len(header):
        raise PartyConfigError(f"{cfg_path}: {path!r} rows do not all have {len(header)} columns")
    if li is None:
        return table, None
    return np.delete(table, li, axis=1), table[:, li]


def _align(data: PartyData, aligned: str, cfg_path: str) -> PartyData:
    from tandem.parties.alignment.aligned_file import read_aligned
    from tandem.parties.alignment.errors import AlignmentError

    try:
        file = read_aligned(aligned)
    except AlignmentError as exc:
        raise PartyConfigError(f"{cfg_path}: data.aligned: {exc}") from None
    rows = file.rows
    n = data.samples or 0
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        raise PartyConfigError(
            f"{cfg_path}: data.aligned {aligned!r} refers to row "
            f"{int(rows.max())} but the training data has {n} rows"
        )
    take = lambda a: None if a is None else a[rows]  # noqa: E731
    return dataclasses.replace(
        data, train=take(data.train), y_train=take(data.y_train), alignment=file.spec_fields()
    )


__all__ = [
    "PartyConfig",
    "PartyConfigError",
    "PartyData",
    "DataConfig",
    "ModelConfig",
    "CheckpointConfig",
    "load_party_config",
    "models_from_widths",
    "split_config_from",
]
