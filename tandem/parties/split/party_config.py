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
                  defaults), send_window (messages of a channel in flight, docs/transports.md)
    [data]        the party's table (`tandem.parties.data.parse_data_config`: source,
                  id_column, label_column, features, categorical, missing, scale, aligned,
                  [data.split] test/validation/seed; docs/data.md), or a pre-split source:
                  source = "breast_cancer" (with part, seed) | an .npz of x_train/y_train/
                  x_test/y_test | a numeric .csv with test (label_column, aligned)
    [topology]    kind (a built-in) and its arguments, typed: star takes followers (a list
                  of names, or a count) and leader; or file = "topology.json"
    [model]       topology, topology_args (the older spelling of [topology]), cut, hidden,
                  out: the MLP of every stage without its own table;
                  [model.<stage>] per stage (`tandem.parties.models.model_from_toml`)
    [schema]      leader only, optional: feature columns each other party must hold
    [train]       leader only: SplitConfig fields + eval_batch_size, and the reporting
                  keys monitor, patience, min_delta, restore_best
    [checkpoint]  dir, every (batches), keep
    [log]         leader only: history (JSONL, one line per epoch), tensorboard (a folder)

This module is the stable entry point other commands build on (e.g. ``tandem predict``): keep
`load_party_config`, `PartyConfig`, `PartyData` and the helper methods importable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import ssl
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tandem.engine.data import RowSource
from tandem.engine.kernels import StageModel, check_inputs, mlp_stage
from tandem.engine.topology import BUILTIN, FEATURES, Stage, Topology
from tandem.errors import ConfigError
from tandem.parties import data as tabular
from tandem.parties.http_security import (
    SECURITY_KEYS,
    HttpSecurity,
    existing_file,
    read_secret,
)
from tandem.transports.factory import common_scheme, is_transport_url, url_hint

from .spec import cut_of


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
    # cut-layer compression (`tandem.parties.split.compress`): the leader's, in the task spec
    "compress": (str,),
    "compress_topk": (float, int),
    # reporting (`tandem.parties.split.reporting`): the leader's alone, not in the task spec
    "monitor": (str,),
    "patience": (int,),
    "min_delta": (float, int),
    "restore_best": (bool,),
}
#: the [train] keys a follower may state: it checks them against the leader's spec
FOLLOWER_TRAIN_KEYS = ("compress", "compress_topk")
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
    "security": SECURITY_KEYS,
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
        "send_window": (int,),
    },
    "data": {},  # checked by `_data_config` (a table, or a pre-split source)
    "topology": {},  # checked by `_topology_table`
    "model": {},  # checked by `_model_config` (keys, and one table per stage)
    "schema": {},  # free-form: party -> feature count
    "train": TRAIN_KEYS,
    "checkpoint": {"dir": (str,), "every": (int,), "keep": (int,)},
    "log": {"history": (str,), "tensorboard": (str,)},
}
REQUIRED = {"": ("role", "name"), "data": ("source",)}
#: [data] keys of a pre-split source (the built-in breast-cancer data, an .npz of
#: x_train/y_train/x_test/y_test, a numeric .csv with a .csv of test rows).
PRESPLIT_KEYS: dict[str, tuple[type, ...]] = {
    "source": (str,),
    "part": (str,),
    "seed": (int,),
    "label_column": (str,),
    "test": (str,),
    "aligned": (str,),
}
MODEL_KEYS: dict[str, tuple[type, ...]] = {
    "topology": (str,),
    "topology_args": (list,),
    "cut": (int,),
    "hidden": (list,),
    "out": (int,),
}
#: Arguments of each built-in topology in [topology], with their types.
TOPOLOGY_ARGS: dict[str, dict[str, tuple[type, ...]]] = {
    "two_party": {"a": (str,), "b": (str,)},
    "leader_follower": {"leader": (str,), "follower": (str,)},
    "u_shape": {"a": (str,), "b": (str,)},
    "star": {"followers": (list, int), "leader": (str,), "leader_bottom": (bool,)},
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``table`` is the checked `tandem.parties.data.DataConfig` of a table source; the other
    fields describe a pre-split source (``table`` None)."""

    source: str  # "breast_cancer", an absolute .npz/.csv path, or the table's source
    part: str | None = None
    seed: int = 0
    label_column: str | None = None
    test: str | None = None
    aligned: str | None = None
    table: tabular.DataConfig | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``topology`` is a built-in name or a JSON file; ``topology_args`` positional and
    ``topology_kwargs`` keyword arguments of the built-in. ``stages`` holds the
    ``[model.<stage>]`` tables; a stage without one is the MLP ``hidden`` -> ``cut`` (the
    loss stage: -> ``out``)."""

    topology: str = "leader_follower"
    topology_args: tuple[str | int, ...] = ()
    cut: int = 16
    hidden: tuple[int, ...] = (32,)
    out: int = 1
    topology_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stages: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 10
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """``[log]``: where the leader writes its per-epoch history (JSONL) and TensorBoard event
    files (absolute paths; None: the default history, no TensorBoard)."""

    history: str | None = None
    tensorboard: str | None = None


@dataclasses.dataclass(frozen=True)
class PartyData:
    """One party's (aligned) data. ``alignment`` is ``{"size", "commitment"}`` or None.

    From a table source (`tandem.parties.split.party_data`) also: ``validation`` rows,
    ``fingerprint`` (training rows and preprocessing; a pre-split source's arrays are hashed
    instead), ``preprocessing`` (the JSON state the export keeps), ``vocab`` (code counts of
    the categorical columns, the last columns of the features) and ``split`` (its
    ``{"test", "validation", "seed"}``). Its feature matrices are arrays, or with
    ``[data] in_memory = false`` `tandem.parties.data.mapped.MappedRows` of a file.
    """

    train: np.ndarray | RowSource | None
    test: np.ndarray | RowSource | None = None
    y_train: np.ndarray | None = None
    y_test: np.ndarray | None = None
    alignment: dict[str, Any] | None = None
    validation: np.ndarray | RowSource | None = None
    y_validation: np.ndarray | None = None
    fingerprint: str | None = None
    preprocessing: dict[str, Any] | None = None
    vocab: tuple[int, ...] = ()
    split: dict[str, Any] | None = None

    @property
    def features(self) -> int | None:
        return None if self.train is None else int(self.train.shape[1])

    @property
    def samples(self) -> int | None:
        if self.train is not None:
            return int(self.train.shape[0])
        return None if self.y_train is None else int(self.y_train.shape[0])

    def datasets(self) -> dict[str, np.ndarray | RowSource]:
        parts = (("train", self.train), ("test", self.test), ("validation", self.validation))
        return {k: v for k, v in parts if v is not None}

    def labels(self) -> dict[str, np.ndarray]:
        parts = (("train", self.y_train), ("test", self.y_test), ("validation", self.y_validation))
        return {k: v for k, v in parts if v is not None}


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
    log: LogConfig = LogConfig()
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
        return HttpSecurity(
            tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca
        ).ssl_contexts()

    def transport(self):
        """An (unstarted) transport for this party, built by `tandem.transports.make_transport`
        for the scheme of its peers' URLs (``http``/``https``: `HttpTransport`)."""
        from tandem.transports.factory import make_transport

        server, client = self.ssl_contexts()
        return make_transport(
            common_scheme(self.peers.values()),
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

    def split_config(self):
        """The leader's `SplitConfig` from [train] (defaults for keys not given)."""
        train = dict(self.train)
        train.pop("eval_batch_size", None)
        for key in ("learning_rate", "compress_topk"):
            if key in train:
                train[key] = float(train[key])
        try:
            return split_config_from(train)
        except ConfigError as exc:
            raise PartyConfigError(f"{self.path}: [train] {exc}") from None

    def report_config(self):
        """The leader's `tandem.parties.split.reporting.ReportConfig` from ``[train]`` and
        ``[log]``. The history goes to ``[log] history``, by default ``history.jsonl`` in the
        checkpoint folder, else in the export folder, else nowhere."""
        from .reporting import report_config

        default = next(
            (os.path.join(d, "history.jsonl") for d in (self.checkpoint.dir, self.export_dir) if d),
            None,
        )
        log = {k: v for k, v in dataclasses.asdict(self.log).items() if v is not None}
        try:
            return report_config(
                self.train, log, loss=self.split_config().loss, default_history=default
            )
        except ConfigError as exc:
            if isinstance(exc, PartyConfigError) or type(exc) is not ConfigError:
                raise
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
        out.update(sc.compressor.spec_fields())  # nothing for "none"
        out["eval_batch_size"] = int(self.train.get("eval_batch_size", max(sc.batch_size, 256)))
        out["checkpoint_every"] = self.checkpoint.every
        return out

    def load_data(self) -> PartyData:
        """Read this party's data (labels too when it owns the loss stage), aligned if
        ``data.aligned`` is set. Raises `PartyConfigError` naming the file and the fix."""
        return _load_data(self)

    def stage_widths(
        self,
        features: Mapping[str, int],
        vocab: Sequence[int] = (),
        cuts: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """``{stage: {"in_dims", "out_dim", "sizes"}}`` of every stage, given the feature count
        of every feature-holding party (``vocab``: this party's categorical code counts); a
        stage whose output is not a float32 matrix adds its ``out_shape`` and ``out_dtype``.

        This party's own stages are built (`stage_model`); another party's stage is known by
        its output width: ``[model.<stage>] out``, else ``cut`` (``out`` for the loss stage),
        and by the shape and dtype its owner describes in ``cuts`` (``{stage: {"shape",
        "dtype"}}``, see `own_cuts`), recorded when their product is that width (else the
        owner refuses the width in negotiation). ``sizes`` (MLP layer sizes) is given for a
        stage using the uniform MLP (``hidden``): one of this party's without a table, or any
        stage when this config has no per-stage table at all; else None (the owner's model is
        its own business).

        Raises `PartyConfigError` when a feature count is unknown, a model cannot be built, or
        an own stage cannot read the cut of a stage it reads (`check_cut_inputs`)."""
        topo, m = self.topology(), self.model
        uniform = not m.stages
        cuts = cuts or {}
        out: dict[str, dict[str, Any]] = {}
        for s in topo.topological_order():
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
                    in_dims.append(int(out[i]["out_dim"]))
            own = s.owner == self.name
            cut: dict[str, Any] = {}
            if own:
                model = self.stage_model(s.name, in_dims, vocab)
                width = model.out_dim
                shape, dtype = list(model.out_shape or ()), model.out_dtype
                self.check_cut_inputs(s, model, out)
            else:
                width = self.declared_width(s)
                described = cuts.get(s.name, {})
                shape = [int(d) for d in described.get("shape", [width])]
                dtype = str(described.get("dtype", "float32"))
                if math.prod(shape) != width:
                    shape, dtype = [width], "float32"
            if len(shape) > 1 or dtype != "float32":
                cut = {"out_shape": shape, "out_dtype": dtype}
            mlp_sized = s.name not in m.stages if own else uniform
            out[s.name] = {
                "in_dims": in_dims,
                "out_dim": width,
                "sizes": [sum(in_dims), *m.hidden, width] if mlp_sized else None,
                **cut,
            }
        return {s.name: out[s.name] for s in topo.stages}

    def declared_width(self, stage: Stage) -> int:
        """The output width this config gives another party's ``stage``: ``[model.<stage>]
        out``, else ``cut`` (``out`` for the loss stage)."""
        m = self.model
        table = m.stages.get(stage.name, {})
        return int(table.get("out", m.out if stage.loss else m.cut))

    def check_cut_inputs(
        self, stage: Stage, model: StageModel, widths: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """`PartyConfigError` unless this party's ``stage`` (its ``model``) reads the outputs
        ``widths`` records for the stages it takes (a stage's ``out_shape``/``out_dtype``,
        float32 matrices when absent), checked abstractly when one is not a float32 matrix;
        the message names the stage, its owner, the cut's shape and dtype, and the fix."""
        inputs: list[Any] = []
        odd = []
        for i, name in enumerate(stage.inputs):
            if name == FEATURES:
                inputs.append(int(model.in_dims[i]))
                continue
            shape, dtype = cut_of(widths[name])
            inputs.append((shape, dtype))
            if len(shape) > 1 or dtype != "float32":
                odd.append(name)
        if not odd:
            return
        try:
            check_inputs(model, inputs)
        except ConfigError as exc:
            topo = self.topology()
            read = ", ".join(
                f"the cut of stage {n!r} of {topo.by_name[n].owner!r}, "
                f"{cut_of(widths[n])[1]}[rows, {', '.join(map(str, cut_of(widths[n])[0]))}]"
                for n in odd
            )
            raise PartyConfigError(
                f"{self.path}: stage {stage.name!r} of {self.name!r} cannot read {read}: "
                f"its model's {str(exc).rstrip('.')}. Give {stage.name!r} a model that takes "
                f"that shape and dtype ([model.{stage.name}]: a factory can flatten and cast "
                "it, see docs/models.md#cut-tensors), or make that stage output a float32 "
                "[rows, width] matrix"
            ) from None

    def own_cuts(self, features: int | None, vocab: Sequence[int] = ()) -> dict[str, Any]:
        """``{stage: {"shape", "dtype"}}``: the output per row of each of this party's stages,
        as its model gives it, for the stages whose inputs' widths this party knows (its own
        features; the widths its config gives other parties' stages, `declared_width`). What
        a follower describes to the leader before the proposal (`stage_widths`' ``cuts``). A
        stage whose model cannot be built is left out: the proposal's check says why."""
        widths: dict[str, int | None] = {}
        out: dict[str, Any] = {}
        for s in self.topology().topological_order():
            if s.owner != self.name:
                widths[s.name] = self.declared_width(s)
                continue
            dims = [features if i == FEATURES else widths[i] for i in s.inputs]
            widths[s.name] = None
            if any(d is None for d in dims):
                continue
            try:
                model = self.stage_model(s.name, [int(d) for d in dims if d is not None], vocab)
            except ConfigError:
                continue
            widths[s.name] = model.out_dim
            out[s.name] = model.cut
        return out

    def stage_model(self, stage: str, in_dims: Sequence[int], vocab: Sequence[int] = ()):
        """The `StageModel` of this party's ``stage`` over inputs of widths ``in_dims``: its
        ``[model.<stage>]`` table (`tandem.parties.models.model_from_toml`; ``vocab`` is the
        default of an embedding model's), else the uniform MLP. Built once per arguments."""
        from tandem.parties.models import mlp, model_from_toml

        key = (stage, tuple(int(d) for d in in_dims), tuple(vocab))
        cache = self.__dict__.setdefault("_models", {})
        if key in cache:
            return cache[key]
        st = self.topology().by_name[stage]
        m = self.model
        table = m.stages.get(stage)
        try:
            if table is None:
                width = m.out if st.loss else m.cut
                model = mlp(key[1], m.hidden, width, activate_last=not st.loss)
            else:
                model = model_from_toml(
                    table,
                    in_dims=key[1],
                    out_dim=m.out if st.loss else None,
                    loss=st.loss,
                    vocab=list(vocab) if vocab and FEATURES in st.inputs else None,
                    where=f"model.{stage}",
                )
        except ConfigError as exc:
            raise PartyConfigError(f"{self.path}: {exc}") from None
        cache[key] = model
        return model

    def own_models(
        self, features: Mapping[str, int], widths: Mapping[str, Mapping[str, Any]], vocab=()
    ) -> dict[str, StageModel]:
        """`stage_model` of each stage this party owns, its inputs' widths taken from
        ``widths`` (an agreed spec's ``stages``) and ``features``."""
        out = {}
        for s in self.topology().stages_of(self.name):
            dims = [
                int(features[s.owner]) if i == FEATURES else int(widths[i]["out_dim"])
                for i in s.inputs
            ]
            out[s.name] = self.stage_model(s.name, dims, vocab)
        return out


def models_from_widths(
    topology: Topology, widths: Mapping[str, Mapping[str, Any]]
) -> dict[str, StageModel]:
    """MLP `StageModel`s for every stage from ``{"in_dims", "out_dim", "sizes"}`` (a spec's
    ``stages`` or `PartyConfig.stage_widths`); the loss stage's last layer is linear.

    A stage whose output is recorded as other than a float32 matrix (``out_shape``,
    ``out_dtype``) gets a stand-in that knows only that output (to check what its owner
    sends): no MLP makes it, so its owner must build that stage's model."""
    models = {}
    for s in topology.stages:
        w = widths[s.name]
        if "out_shape" in w or "out_dtype" in w:
            models[s.name] = _output_only(s.name, w)
            continue
        sizes = w.get("sizes") or [sum(w["in_dims"]), w["out_dim"]]
        models[s.name] = mlp_stage(
            w["in_dims"], list(sizes[1:-1]), w["out_dim"], activate_last=not s.loss
        )
    return models


def _output_only(stage: str, widths: Mapping[str, Any]) -> StageModel:
    def unbuilt(*_: Any) -> Any:
        raise PartyConfigError(
            f"stage {stage!r} is known here by its output only ({widths.get('out_dtype')} "
            f"{widths.get('out_shape')}); its owner builds its model"
        )

    shape, dtype = cut_of(widths)
    return StageModel(
        unbuilt,
        unbuilt,
        tuple(int(d) for d in widths["in_dims"]),
        int(widths["out_dim"]),
        out_shape=tuple(shape),
        out_dtype=dtype,
    )


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
        if not is_transport_url(url):
            raise PartyConfigError(f"{path}: peers.{peer} must be {url_hint()}, got {url!r}")
        peers[peer] = url.rstrip("/")
    try:
        common_scheme(peers.values())
    except ConfigError as exc:
        raise PartyConfigError(f"{path}: [peers]: {exc}") from None
    if not peers:
        raise PartyConfigError(
            f'{path}: [peers] is empty; add `name = "http://host:port"` for every other party'
        )
    data = _data_config(raw["data"], base, path)
    model = _model_config(raw.get("model", {}), raw.get("topology"), base, path)
    schema = raw.get("schema", {})
    for k, v in schema.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PartyConfigError(
                f"{path}: schema.{k} must be a positive feature count, got {v!r}"
            )
    train = dict(raw.get("train", {}))
    # a follower may state the cut compression it trains with: it then refuses a spec that
    # says otherwise (`compress.mismatch_reasons`); the rest of [train] is the leader's
    if role == "follower" and (set(train) - set(FOLLOWER_TRAIN_KEYS) or schema):
        raise PartyConfigError(
            f"{path}: [train] and [schema] are the leader's (it proposes them in the task "
            f"spec); remove them from the follower's config (a follower's [train] may hold "
            f"only {list(FOLLOWER_TRAIN_KEYS)})"
        )
    if role == "follower" and train:
        _check_compress(train, path)
    log_table = raw.get("log", {})
    if role == "follower" and log_table:
        raise PartyConfigError(
            f"{path}: [log] is the leader's (it holds the labels, so the metrics); remove it "
            "from the follower's config (`tandem party --trace DIR` traces any party)"
        )
    log = LogConfig(**{k: os.path.join(base, os.path.expanduser(v)) for k, v in log_table.items()})
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
    from tandem.transports.http.config import MAX_SEND_WINDOW

    if http.get("send_window", 1) > MAX_SEND_WINDOW:
        raise PartyConfigError(
            f"{path}: http.send_window must be at most {MAX_SEND_WINDOW} messages (each holds a "
            f"connection while in flight), got {http['send_window']}"
        )
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
        log=log,
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
    missing = [p for p in _talks_to(topo, cfg.name) if p not in peers]
    if missing:
        raise PartyConfigError(f'{path}: [peers] lacks {missing}; add `name = "http://host:port"`')
    others = [p for p in topo.parties if p != cfg.name]
    unknown = [p for p in schema if p not in others]
    if unknown:
        raise PartyConfigError(
            f"{path}: [schema] names {unknown}, which own no other stage of the topology; the "
            f"accepted names are {others}"
        )
    _check_stage_tables(cfg, topo)
    if cfg.is_leader:
        cfg.split_config()  # checks the [train] values now
        cfg.report_config()  # and the reporting keys (monitor names, the TensorBoard extra)
    return cfg


def _data_config(d: Mapping[str, Any], base: str, path: str) -> DataConfig:
    """The [data] table: a pre-split source (`PRESPLIT_KEYS`) or a table for
    `tandem.parties.data.parse_data_config`."""
    if not isinstance(d, Mapping):
        raise PartyConfigError(f"{path}: data must be a table ([data])")
    if not _presplit(d, base):
        return DataConfig(source=str(d["source"]), table=tabular.parse_data_config(d, path=path))
    for sub, v in d.items():
        if sub not in PRESPLIT_KEYS:
            raise PartyConfigError(
                f"{path}: data.{sub} is not used with the pre-split source {d['source']!r} "
                f"(keys: {sorted(PRESPLIT_KEYS)}); a table source (.csv, .parquet, .npz of "
                "columns) takes the keys of docs/data.md"
            )
        _check_type(f"data.{sub}", v, PRESPLIT_KEYS[sub], path)
    source = d["source"]
    if source != "breast_cancer":
        source = _file(base, source, "data.source", path)
    if source == "breast_cancer" and d.get("part") not in ("leader", "follower"):
        raise PartyConfigError(
            f"{path}: data.part must be 'leader' or 'follower' with the "
            f"built-in breast_cancer source, got {d.get('part')!r}"
        )
    return DataConfig(
        source=source,
        part=d.get("part"),
        seed=d.get("seed", 0),
        label_column=d.get("label_column"),
        test=_file(base, d["test"], "data.test", path) if "test" in d else None,
        aligned=_file(base, d["aligned"], "data.aligned", path) if "aligned" in d else None,
    )


def _presplit(d: Mapping[str, Any], base: str) -> bool:
    """True for a pre-split source: the built-in breast-cancer data, keys only such a source
    takes (``part``, ``seed``, ``test``), or an .npz holding an ``x_train`` matrix."""
    source = d.get("source")
    if source == "breast_cancer" or any(k in d for k in ("part", "seed", "test")):
        return True
    if not isinstance(source, str) or "://" in source or not source.endswith(".npz"):
        return False
    full = source if os.path.isabs(source) else os.path.join(base, source)
    if not os.path.isfile(full):
        return False
    with np.load(full, allow_pickle=False) as z:
        return "x_train" in z.files


def _model_config(m: Mapping[str, Any], topology: Any, base: str, path: str) -> ModelConfig:
    """[model]: the uniform MLP, the topology's older spelling, one table per stage."""
    if not isinstance(m, Mapping):
        raise PartyConfigError(f"{path}: model must be a table ([model])")
    stages = {k: dict(v) for k, v in m.items() if isinstance(v, Mapping)}
    for key, value in m.items():
        if key in stages:
            continue
        if key not in MODEL_KEYS:
            raise PartyConfigError(
                f"{path}: unknown key model.{key}; accepted keys in [model]: "
                f"{sorted(MODEL_KEYS)}, and one table [model.<stage>] per stage"
            )
        _check_type(f"model.{key}", value, MODEL_KEYS[key], path)
    hidden = m.get("hidden", [32])
    if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
        raise PartyConfigError(
            f"{path}: model.hidden must be a list of positive ints, got {hidden!r}"
        )
    for key in ("cut", "out"):
        if key in m and m[key] < 1:
            raise PartyConfigError(f"{path}: model.{key} must be >= 1, got {m[key]}")
    if topology is not None and ("topology" in m or "topology_args" in m):
        raise PartyConfigError(
            f"{path}: the topology is given twice, by [topology] and by model.topology"
            "/topology_args; keep [topology]"
        )
    if topology is not None:
        name, args, kwargs = _topology_table(topology, base, path)
    else:
        args = tuple(m.get("topology_args", []))
        if not all(
            (isinstance(a, str) and a) or (isinstance(a, int) and not isinstance(a, bool))
            for a in args
        ):
            raise PartyConfigError(
                f"{path}: model.topology_args must be a list of party names (or, for star, "
                f"the follower count first), got {list(args)!r}"
            )
        name, kwargs = m.get("topology", "leader_follower"), {}
        if name not in BUILTIN:
            name = _file(base, name, "model.topology", path)
    return ModelConfig(
        topology=name,
        topology_args=args,
        cut=m.get("cut", 16),
        hidden=tuple(hidden),
        out=m.get("out", 1),
        topology_kwargs=kwargs,
        stages=stages,
    )


def _topology_table(
    t: Any, base: str, path: str
) -> tuple[str, tuple[str | int, ...], dict[str, Any]]:
    """[topology]: ``kind`` (a built-in) with its typed arguments, or ``file``."""
    if not isinstance(t, Mapping):
        raise PartyConfigError(f"{path}: topology must be a table ([topology] kind = ...)")
    if "file" in t:
        if set(t) != {"file"} or not isinstance(t["file"], str):
            raise PartyConfigError(
                f'{path}: [topology] file = "topology.json" takes no other key, got {sorted(t)}'
            )
        return _file(base, t["file"], "topology.file", path), (), {}
    kind = t.get("kind")
    if kind not in TOPOLOGY_ARGS:
        raise PartyConfigError(
            f"{path}: topology.kind is {kind!r}; choose one of {sorted(TOPOLOGY_ARGS)}, or "
            'give file = "topology.json"'
        )
    accepted = TOPOLOGY_ARGS[kind]
    kwargs = {}
    for key, value in t.items():
        if key == "kind":
            continue
        if key not in accepted:
            raise PartyConfigError(
                f"{path}: topology.{key} is not an argument of {kind!r}; it takes "
                f"{sorted(accepted)}"
            )
        _check_type(f"topology.{key}", value, accepted[key], path)
        kwargs[key] = value
    if kind == "star":
        followers = kwargs.get("followers")
        if followers is None:
            raise PartyConfigError(
                f'{path}: a star needs topology.followers = ["bank", "shop", ...] (or a count)'
            )
        if isinstance(followers, list) and not all(isinstance(f, str) and f for f in followers):
            raise PartyConfigError(
                f"{path}: topology.followers must list party names (strings), got {followers!r}"
            )
    return kind, (), kwargs


def _check_stage_tables(cfg: PartyConfig, topo: Topology) -> None:
    names = [s.name for s in topo.stages]
    for stage, table in cfg.model.stages.items():
        if stage not in names:
            raise PartyConfigError(
                f"{cfg.path}: [model.{stage}] names no stage of the topology; the stages are "
                f"{names}"
            )
        owner = topo.by_name[stage].owner
        if owner != cfg.name and set(table) - {"out"}:
            raise PartyConfigError(
                f"{cfg.path}: stage {stage!r} belongs to {owner!r}, which configures its model; "
                f"here [model.{stage}] may only give its output width (out = <cut width>), got "
                f"{sorted(table)}"
            )
        if owner != cfg.name and "out" in table:
            out = table["out"]
            if isinstance(out, bool) or not isinstance(out, int) or out < 1:
                raise PartyConfigError(
                    f"{cfg.path}: model.{stage}.out must be a positive int, got {out!r}"
                )


def _check_compress(train: Mapping[str, Any], path: str) -> None:
    from .compress import from_hyper

    try:
        from_hyper(train)
    except ConfigError as exc:
        raise PartyConfigError(f"{path}: [train] {exc}") from None


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
    return existing_file(base, value, key, path, error=PartyConfigError)


def _secret(sec: Mapping[str, Any], path: str, base: str, prefix: str = "") -> bytes | None:
    """The key of ``security.{prefix}secret`` (or ``_env`` / ``_file``); None when unset."""
    return read_secret(sec, path, base, prefix=prefix, error=PartyConfigError)


def _topology(model: ModelConfig, path: str) -> Topology:
    from tandem.errors import TopologyError

    if model.topology in BUILTIN:
        kwargs = dict(model.topology_kwargs)
        try:
            if model.topology == "star":
                return _star(list(model.topology_args), kwargs)
            return BUILTIN[model.topology](*model.topology_args, **kwargs)
        except (TypeError, TopologyError) as exc:
            given = list(model.topology_args) or kwargs
            raise PartyConfigError(
                f"{path}: the arguments {given} do not fit the built-in topology "
                f"{model.topology!r}: {exc}"
            ) from None
    import json

    try:
        with open(model.topology, encoding="utf-8") as f:
            return Topology.from_dict(json.load(f))
    except (ValueError, TopologyError) as exc:
        raise PartyConfigError(f"{path}: model.topology file {model.topology!r}: {exc}") from None


def _star(args: list[Any], kwargs: dict[str, Any]) -> Topology:
    """A star: ``followers`` a count (parties ``follower0``... as `tandem.engine.topology.star`)
    or a list of names (stages ``bottom_<name>``), one leader with the top (and, with
    ``leader_bottom``, ``bottom_<leader>``)."""
    from tandem.engine.topology import star
    from tandem.errors import TopologyError

    followers = kwargs.pop("followers", args.pop(0) if args else None)
    leader = kwargs.pop("leader", args.pop(0) if args else "leader")
    if args or set(kwargs) - {"leader_bottom"}:
        raise TypeError(f"star takes followers, leader, leader_bottom; got extra {args or kwargs}")
    if isinstance(followers, int) and not isinstance(followers, bool):
        return star(followers, leader, **kwargs)
    if not isinstance(followers, list) or not followers:
        raise TopologyError(f"followers must be a count or a list of names, got {followers!r}")
    names = [str(f) for f in followers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice or leader in names:
        raise TopologyError(
            f"party names must differ: {twice or [leader]} given twice (the leader is {leader!r})"
        )
    stages = [Stage(f"bottom_{n}", n, (FEATURES,)) for n in names]
    if kwargs.get("leader_bottom"):
        stages.append(Stage(f"bottom_{leader}", leader, (FEATURES,)))
    stages.append(Stage("top", leader, tuple(s.name for s in stages), loss=True))
    return Topology(tuple(stages))


def _talks_to(topo: Topology, name: str) -> list[str]:
    """The parties ``name`` exchanges frames with: every other party for the leader (it
    drives them all); a follower: the leader and the parties across its cut edges."""
    if topo.label_owner == name:
        return [p for p in topo.parties if p != name]
    peers = {topo.label_owner}
    for e in topo.edges():
        if name in (e.src_party, e.dst_party):
            peers.update((e.src_party, e.dst_party))
    peers.discard(name)
    return sorted(peers)


def _load_data(cfg: PartyConfig) -> PartyData:
    d = cfg.data
    topo = cfg.topology()
    owner = topo.label_owner == cfg.name
    if d.table is not None:
        from .party_data import load_table_data

        loss = str(cfg.train.get("loss", "binary")) if owner else None
        return PartyData(**load_table_data(d.table, labels=owner, loss=loss, out=cfg.model.out))
    if d.source == "breast_cancer":
        from .demo import load_breast_cancer_split

        if d.part not in ("leader", "follower"):
            raise PartyConfigError(
                f"{cfg.path}: data.part must be 'leader' or 'follower' with the built-in "
                f"breast_cancer source, got {d.part!r}"
            )
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
    from .party_data import arrays_fingerprint

    x = None if data.train is None else np.asarray(data.train)  # a pre-split source: arrays
    digest = arrays_fingerprint({"x": x, "y": data.y_train})
    return dataclasses.replace(data, fingerprint=digest)


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
    from tandem.parties.data.aligned_file import read_aligned
    from tandem.parties.data.errors import AlignedFileError as AlignmentError

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
    "LogConfig",
    "ModelConfig",
    "CheckpointConfig",
    "load_party_config",
    "models_from_widths",
    "split_config_from",
]
