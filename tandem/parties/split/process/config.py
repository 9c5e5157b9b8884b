"""The TOML file of one standalone split-learning party (`tandem party --config`), as data.

`load_party_file(path) -> PartyConfig` reads and checks the file (`tandem.parties.config`: every
error names ``section.key``, what was wrong and the fix; relative paths start at the file's
folder). The sections (docs/parties.md#configuration has the full table)::

    role = "leader" | "follower"; name; export_dir; progress; wait; grace
    [listen] [peers] [security] [identities] [http] [log]   shared (tandem.parties.config)
    [link]        bandwidth (bytes/s), latency (s): emulate a slower link on loopback
    [data]        a table (shared [data], docs/data.md), or a pre-split source: "breast_cancer"
                  (part, seed) | an .npz of x_train/y_train/x_test/y_test | a numeric .csv
    [topology]    kind (a built-in) and its typed arguments, or file = "topology.json"
    [model]       shared [model]: the uniform MLP and [model.<stage>] tables
    [schema]      leader only: feature columns each other party holds
    [train]       leader only (a follower may state compress, compress_topk): `Train`
    [checkpoint]  dir, every (batches), keep, compile_cache
    [privacy]     the defenses and the audit (`tandem.parties.privacy.config.Privacy`); the
                  leader's defenses bind (task spec), a follower may state them to check

Checks that need the topology or a model built (a stage table naming no stage, the peers the
topology needs) are the builder's (`tandem.parties.split.process.build`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_validator

from tandem.errors import ConfigError
from tandem.parties.config import Data, Http, Listen, Log, Model, Section, Security, load_toml
from tandem.parties.config.base import Invalid, base_dir, resolve_file
from tandem.parties.config.sections import Identities, Peers, Positive, exposure

from ...privacy.config import Privacy
from ..hyper import FOLLOWER_TRAIN_KEYS, Train


class PartyConfigError(ConfigError):
    """The party's TOML configuration is wrong; the message names the key and the fix."""


class Link(Section):
    """``[link]``: emulate a slower link on loopback (each direction of every peer)."""

    bandwidth: Positive | None = Field(default=None, description="bytes per second")
    latency: float = Field(default=0.0, ge=0, description="seconds added to each message")


class Checkpoint(Section):
    """``[checkpoint]``: where and how often the party saves its state."""

    dir: str | None = Field(default=None, description="folder (relative to this file)")
    every: int = Field(default=10, ge=1, description="batches between checkpoints")
    keep: int = Field(default=3, ge=1, description="checkpoints kept")
    compile_cache: bool | str = Field(
        default=True,
        description="compiled-kernel cache: true (a folder beside the checkpoints), a folder, "
        "or false (off)",
    )

    @field_validator("dir")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else os.path.join(base_dir(info), value)

    @field_validator("compile_cache")
    @classmethod
    def _cache(cls, value: bool | str, info: ValidationInfo) -> bool | str:
        if isinstance(value, str):
            if not value:
                raise Invalid("", "is empty; give a folder, true (the default folder) or false")
            return os.path.join(base_dir(info), value)
        return value


class Presplit(Section):
    """``[data]`` of a pre-split source: the built-in breast-cancer data (``part``, ``seed``),
    an .npz of x_train/y_train/x_test/y_test, or a numeric .csv with a .csv of test rows."""

    source: str
    part: Literal["leader", "follower"] | None = None
    seed: int = 0
    label_column: str | None = None
    test: str | None = None
    aligned: str | None = None
    table: None = None  # read like the shared [data]: no checked table

    @field_validator("source", "test", "aligned")
    @classmethod
    def _exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or value == "breast_cancer":
            return value
        return resolve_file(info, value, "")

    @model_validator(mode="after")
    def _part(self) -> Presplit:
        if self.source == "breast_cancer" and self.part is None:
            raise Invalid(
                "part", "must be 'leader' or 'follower' with the built-in breast_cancer source"
            )
        return self


def is_presplit(d: Mapping[str, Any], base: str) -> bool:
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


#: Arguments of each built-in topology in [topology], with their TOML types.
TOPOLOGY_ARGS: dict[str, dict[str, tuple[type, ...]]] = {
    "two_party": {"a": (str,), "b": (str,)},
    "leader_follower": {"leader": (str,), "follower": (str,)},
    "u_shape": {"a": (str,), "b": (str,)},
    "star": {"followers": (list, int), "leader": (str,), "leader_bottom": (bool,)},
}


class TopologyTable(Section):
    """``[topology]``: ``kind`` (a built-in) with its typed arguments, or ``file``."""

    model_config = {**Section.model_config, "extra": "allow"}

    kind: Literal["two_party", "leader_follower", "u_shape", "star"] | None = None
    file: str | None = Field(default=None, description="a topology JSON file")
    followers: list[str] | int | None = Field(default=None, description="star: names or count")
    leader: str | None = None
    leader_bottom: bool | None = None

    @field_validator("file")
    @classmethod
    def _exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_file(info, value, "")

    @model_validator(mode="after")
    def _arguments(self) -> TopologyTable:
        given = {k: v for k, v in self.model_dump(exclude_none=True).items()}
        if self.file is not None:
            if set(given) != {"file"}:
                raise Invalid(
                    "", f'[topology] file = "topology.json" takes no other key, got {sorted(given)}'
                )
            return self
        if self.kind is None:
            raise Invalid(
                "kind",
                f'is None; choose one of {sorted(TOPOLOGY_ARGS)}, or give file = "topology.json"',
            )
        accepted = TOPOLOGY_ARGS[self.kind]
        for key, value in given.items():
            if key == "kind":
                continue
            if key not in accepted:
                raise Invalid(
                    key, f"is not an argument of {self.kind!r}; it takes {sorted(accepted)}"
                )
            if isinstance(value, bool) != (bool in accepted[key]) or not isinstance(
                value, accepted[key]
            ):
                kinds = " or ".join(k.__name__ for k in accepted[key])
                raise Invalid(key, f"must be {kinds}, got {value!r}")
        if self.kind == "star":
            if self.followers is None:
                raise Invalid(
                    "followers",
                    'is missing: a star needs topology.followers = ["bank", "shop"] (or a count)',
                )
            if isinstance(self.followers, list) and not all(self.followers):
                raise Invalid("followers", f"must list party names, got {self.followers!r}")
        return self

    def arguments(self) -> dict[str, Any]:
        """The built-in's keyword arguments."""
        return self.model_dump(exclude_none=True, exclude={"kind", "file"})


class PartyConfig(Section):
    """A checked party configuration: plain, frozen data (see the module docstring)."""

    path: str = Field(default="", description="the TOML file (set by the loader)")
    role: Literal["leader", "follower"] = Field(description="the leader owns the loss stage")
    name: str = Field(description="this party's name in the topology")
    export_dir: str | None = Field(default=None, description="save this party's stages here")
    progress: bool = Field(default=True, description="live progress display on stderr")
    wait: Positive = Field(default=120.0, description="seconds to wait for the peers")
    grace: float = Field(default=10.0, ge=0, description="seconds SIGINT lets a batch finish")
    listen: Listen = Listen()
    peers: Peers = Field(default_factory=dict, description="name = base URL, every other party")
    link: Link = Link()
    security: Security = Field(default_factory=Security)
    identities: Identities = Field(default_factory=dict)
    http: Http = Http()
    data: Data | Presplit
    topology: TopologyTable | None = None
    model: Model = Field(default_factory=Model)
    schema_: dict[str, int] = Field(default_factory=dict, alias="schema")
    train: Train = Train()
    checkpoint: Checkpoint = Checkpoint()
    log: Log = Log()
    privacy: Privacy = Privacy()

    @field_validator("data", mode="before")
    @classmethod
    def _data(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, Mapping) and is_presplit(value, base_dir(info)):
            return Presplit.model_validate(dict(value), context=info.context)
        if isinstance(value, Mapping):
            return Data.model_validate(dict(value), context=info.context)
        return value

    @field_validator("export_dir")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else os.path.join(base_dir(info), value)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: dict[str, int]) -> dict[str, int]:
        for k, v in value.items():
            if v < 1:
                raise Invalid(k, f"must be a positive feature count, got {v!r}")
        return value

    @model_validator(mode="after")
    def _roles(self) -> PartyConfig:
        if not self.peers:
            raise Invalid(
                "", '[peers] is empty; add `name = "http://host:port"` for every other party'
            )
        train = self.train.given()
        if self.role == "follower" and (set(train) - set(FOLLOWER_TRAIN_KEYS) or self.schema_):
            raise Invalid(
                "",
                "[train] and [schema] are the leader's (it proposes them in the task spec); "
                "remove them from the follower's config (a follower's [train] may hold only "
                f"{list(FOLLOWER_TRAIN_KEYS)})",
            )
        if self.role == "follower" and self.log.model_fields_set:
            raise Invalid(
                "",
                "[log] is the leader's (it holds the labels, so the metrics); remove it from "
                "the follower's config (`tandem party --trace DIR` traces any party)",
            )
        exposed = exposure(
            self.listen.host, self.security, listen="listen.host", section="security"
        )
        if exposed:
            raise Invalid("", exposed)
        budget, frame = self.http.inbound_budget, self.security.max_frame_bytes
        if budget is not None and budget < frame:
            raise Invalid(
                "",
                f"http.inbound_budget ({budget} bytes) must hold one frame of "
                f"security.max_frame_bytes ({frame}); lower max_frame_bytes or raise the budget",
            )
        if self.topology is not None and (
            self.model.topology is not None or self.model.topology_args is not None
        ):
            raise Invalid(
                "",
                "the topology is given twice, by [topology] and by model.topology/topology_args; "
                "keep [topology]",
            )
        return self

    @property
    def is_leader(self) -> bool:
        return self.role == "leader"

    @property
    def schema(self) -> dict[str, int]:  # type: ignore[override]
        """``[schema]``: feature columns each other party holds (leader only)."""
        return self.schema_


def load_party_file(path: str | os.PathLike[str]) -> PartyConfig:
    """Read and check the TOML file at ``path``; `PartyConfigError` names any bad key."""
    cfg = load_toml(
        PartyConfig,
        path,
        error=PartyConfigError,
        example="party TOML (see examples/split/leader.toml)",
    )
    return cfg.model_copy(update={"path": os.fspath(path)})


__all__ = [
    "Checkpoint",
    "Link",
    "PartyConfig",
    "PartyConfigError",
    "Presplit",
    "TOPOLOGY_ARGS",
    "TopologyTable",
    "is_presplit",
    "load_party_file",
]
