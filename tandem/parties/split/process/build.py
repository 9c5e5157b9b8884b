"""Building what a split party's configuration describes: topology, TLS, transport, models.

`load_party_config(path) -> PartySetup` reads the file once (`tandem.parties.split.process.config`,
plain frozen data), runs the checks that need the topology or a model, and returns the
`PartySetup` the party's code works from: it reads like its configuration (``setup.name``,
``setup.peers``, ``setup.checkpoint``, ...) and builds, each once, what the configuration
describes: `topology`, `ssl_contexts`, `transport`, `stage_model`, `stage_widths`,
`split_config`, `report_config`, the spec's `hyper`, and `load_data`
(`tandem.parties.split.process.build_data`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.engine.kernels import StageModel, check_inputs, mlp_stage
from tandem.engine.topology import FEATURES, Stage, Topology
from tandem.errors import ConfigError
from tandem.parties.config import Data
from tandem.parties.http_security import security_of

from ..hyper import HYPER_KEYS, SPLIT_FIELDS
from ..spec import cut_of
from .build_data import PartyData, load_data
from .config import PartyConfig, PartyConfigError, load_party_file
from .topology_ref import TopologyRef, talks_to, topology_of, topology_ref


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``table`` is the checked `tandem.parties.data.DataConfig` of a table source; the other
    fields describe a pre-split source (``table`` None)."""

    source: str
    part: str | None = None
    seed: int = 0
    label_column: str | None = None
    test: str | None = None
    aligned: str | None = None
    table: Any = None


@dataclasses.dataclass(init=False, eq=False)
class PartySetup:
    """One party's checked configuration (``config``) and what it builds, each built once.

    Reading an attribute the setup does not define reads the configuration's
    (`tandem.parties.split.process.config.PartyConfig`): ``name``, ``path``, ``role``, ``peers``,
    ``checkpoint``, ``model``, ``log``, ``wait``, ... ``train`` is the ``[train]`` keys the file
    states (a dict); ``data`` the `DataConfig` of its source. ``PartySetup(config, **changes)``
    (and so ``dataclasses.replace(setup, wait=1.0)``) replaces top-level configuration values.
    """

    config: PartyConfig

    def __init__(self, config: PartyConfig, **changes: Any) -> None:
        self.config = config = config.model_copy(update=changes) if changes else config
        self.train: dict[str, Any] = config.train.given()
        d = config.data
        if isinstance(d, Data):
            self.data = DataConfig(source=d.source, table=d.table(config.path))
        else:
            self.data = DataConfig(
                source=d.source,
                part=d.part,
                seed=d.seed,
                label_column=d.label_column,
                test=d.test,
                aligned=d.aligned,
            )
        self.topology_ref = topology_ref(config)
        self._topology: Topology | None = None
        self._models: dict[Any, StageModel] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "config":
            raise AttributeError(name)
        return getattr(self.config, name)

    def topology(self) -> Topology:
        """The configured topology (built-in by name, or read from a JSON file; read once,
        then cached, so later calls do no file I/O)."""
        if self._topology is None:
            self._topology = topology_of(self.topology_ref, self.path)
        return self._topology

    def security(self) -> dict[str, Any]:
        """The security settings recorded in the task spec."""
        sec = self.config.security
        return {
            "auth": sec.auth,
            "tls": bool(sec.tls_cert),
            "max_frame_bytes": sec.max_frame_bytes,
            "reject_nonfinite": sec.reject_nonfinite,
        }

    def ssl_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        """(server, client) contexts: TLS when ``tls_cert`` is set; mutual when ``tls_ca`` is."""
        return security_of(self.config.security).ssl_contexts()

    def transport(self):
        """An (unstarted) transport for this party, built by `tandem.transports.make_transport`
        for the scheme of its peers' URLs (``http``/``https``: `HttpTransport`)."""
        from tandem.transports.factory import common_scheme, make_transport

        c = self.config
        http = {
            k: float(v) if k.endswith(("timeout", "wait")) else v
            for k, v in c.http.fields().items()
        }
        return make_transport(
            common_scheme(c.peers.values()),
            name=c.name,
            **security_of(c.security).transport_settings(
                host=c.listen.host,
                port=c.listen.port,
                peers=dict(c.peers),
                peer_identities={k: list(v) for k, v in c.identities.items()} or None,
                shape_bandwidth=c.link.bandwidth,
                shape_latency=float(c.link.latency),
                **http,
            ),
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
        from ..reporting import report_config

        default = next(
            (os.path.join(d, "history.jsonl") for d in (self.checkpoint.dir, self.export_dir) if d),
            None,
        )
        log = self.config.log.model_dump(exclude_none=True)
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
        out.update(self.config.privacy.spec_fields())  # nothing with defenses off and seed 0
        given = self.config.train.eval_batch_size
        out["eval_batch_size"] = int(given if given is not None else max(sc.batch_size, 256))
        out["checkpoint_every"] = self.checkpoint.every
        return out

    def load_data(self) -> PartyData:
        """Read this party's data (labels too when it owns the loss stage), aligned if
        ``data.aligned`` is set. Raises `PartyConfigError` naming the file and the fix."""
        return load_data(self)

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
            read = self.read_dims(s, in_dims)
            if own:
                model = self.stage_model(s.name, read, vocab)
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
                "sizes": [sum(read), *m.hidden, width] if mlp_sized else None,
                **cut,
            }
        return {s.name: out[s.name] for s in topo.stages}

    def read_dims(self, stage: Stage, in_dims: Sequence[int]) -> list[int]:
        """The input widths ``stage``'s model reads: ``in_dims``, or one of them when
        ``[model] aggregate`` sums the loss stage's cuts (`tandem.parties.privacy.securesum`)."""
        summed = stage.loss and self.model.aggregate != "concat"
        return list(in_dims[:1]) if summed else list(in_dims)

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
        cache = self._models
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
            out[s.name] = self.stage_model(s.name, self.read_dims(s, dims), vocab)
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


def _check_stage_tables(cfg: PartySetup, topo: Topology) -> None:
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


def _check_privacy(cfg: PartySetup) -> None:
    from ...privacy.config import checked

    try:
        checked(cfg.config.privacy, loss=cfg.split_config().loss)
    except ConfigError as exc:
        raise PartyConfigError(f"{cfg.path}: {exc}") from None


def _check_compress(train: Mapping[str, Any], path: str) -> None:
    from ..compress import from_hyper

    try:
        from_hyper(train)
    except ConfigError as exc:
        raise PartyConfigError(f"{path}: [train] {exc}") from None


def split_config_from(hyper: Mapping[str, Any]):
    """A `SplitConfig` from the ``train`` table or a spec's ``hyper`` (extra keys ignored)."""
    from ..party import SplitConfig

    return SplitConfig(**{k: v for k, v in hyper.items() if k in SPLIT_FIELDS})


def load_party_config(path: str | os.PathLike) -> PartySetup:
    """Read and check the TOML file at ``path``: its keys (`load_party_file`), then what only
    the topology and the models can tell. `PartyConfigError` names any bad key."""
    cfg = PartySetup(load_party_file(path))
    path = str(cfg.path)
    topo = cfg.topology()
    if cfg.name not in topo.parties:
        raise PartyConfigError(
            f"{path}: name {cfg.name!r} owns no stage of topology "
            f"{cfg.topology_ref.topology!r} (parties: {list(topo.parties)}); fix `name` "
            "or model.topology_args"
        )
    is_owner = topo.label_owner == cfg.name
    if is_owner != cfg.is_leader:
        raise PartyConfigError(
            f"{path}: role is {cfg.role!r} but {cfg.name!r} "
            f"{'owns' if is_owner else 'does not own'} the loss stage; the leader is "
            f"{topo.label_owner!r}"
        )
    missing = [p for p in talks_to(topo, cfg.name) if p not in cfg.peers]
    if missing:
        raise PartyConfigError(f'{path}: [peers] lacks {missing}; add `name = "http://host:port"`')
    others = [p for p in topo.parties if p != cfg.name]
    unknown = [p for p in cfg.schema if p not in others]
    if unknown:
        raise PartyConfigError(
            f"{path}: [schema] names {unknown}, which own no other stage of the topology; the "
            f"accepted names are {others}"
        )
    _check_stage_tables(cfg, topo)
    if cfg.is_leader:
        _check_privacy(cfg)  # and [privacy] against the loss
        cfg.split_config()  # checks the [train] values now
        cfg.report_config()  # and the reporting keys (monitor names, the TensorBoard extra)
    elif cfg.train:
        _check_compress(cfg.train, path)
    return cfg


__all__ = [
    "DataConfig",
    "HYPER_KEYS",
    "PartyData",
    "PartySetup",
    "TopologyRef",
    "load_party_config",
    "models_from_widths",
    "split_config_from",
]
