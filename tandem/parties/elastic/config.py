"""The TOML files of the elastic roles (`tandem elastic coordinator|data-server|worker`).

Each file is flat: the role's own keys at the top level, plus the shared ``[security]``
section (`tandem.parties.config.Security`: ``secret_env`` / ``secret_file``, TLS files,
``insecure``). `load_role(model, url)` reads a file (a path or any fsspec URL) and checks it
as `CoordinatorFile`, `DataServerFile` or `WorkerFile`; every error names the file, the key
and the fix. docs/elastic.md#configuration lists every key::

    name, host, port, advertise_url       every role: who it is, where it listens
    secret                                 the shared secret inline (or [security], not both)
    [security]                             the shared section (secret_env, secret_file, TLS)

    coordinator: [data_servers] (name = URL), interval, timeout, drain, epochs, min_workers,
                 [workers] / roster, admit_workers, on_change, call_timeout,
                 recover_timeout, journal
    data server: coordinator (URL), coordinator_name, checkpoints, coordinator_wait, export,
                 compile_cache,
                 and its shard: model = "<description URL>" + shard = "<.npz URL>", or the
                 [data] + [model] (+ [train]) tables of the shared contract
    worker:      coordinator (URL), coordinator_name, heartbeat, join_timeout, compile_cache

Every relative path in a file starts at that file's folder, as ``[data] source`` does
(docs/data.md): ``journal`` and ``roster`` of the coordinator, ``checkpoints``, ``export``,
``model`` and ``shard`` of a data server (`PATH_KEYS`); for a file read from an fsspec URL
they start at the URL's folder. URLs (``scheme://...``) and absolute paths are kept.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import Any, Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from tandem.parties.compile_cache import DESCRIPTION as CACHE_DESCRIPTION
from tandem.parties.compile_cache import check_setting
from tandem.parties.config import Data, Section, Security, validate
from tandem.parties.config.base import Invalid
from tandem.parties.config.sections import Peers, Port, Positive, Url, exposure
from tandem.parties.http_security import HttpSecurity, security_of

from .errors import ConfigError

R = TypeVar("R", bound="RoleFile")


class RoleFile(Section):
    """The keys every elastic role has: its name, address and authentication."""

    name: str = Field(description="this role's name (data servers and workers: unique)")
    host: str = Field(default="127.0.0.1", description="address to bind")
    port: Port = Field(default=0, description="TCP port (0: any free port)")
    advertise_url: Url | None = Field(default=None, description="the URL peers reach it at")
    secret: str | None = Field(default=None, description="the shared secret inline")
    security: Security = Field(default_factory=Security)

    @model_validator(mode="after")
    def _auth(self) -> RoleFile:
        if self.secret is not None and self.security.secret_bytes is not None:
            raise Invalid(
                "",
                "the shared secret is given twice, by secret and in [security]; keep one "
                "(security.secret_env or security.secret_file keeps it out of the file)",
            )
        if not self.secret:
            exposed = exposure(self.host, self.security, listen="host", section="security")
            if exposed:
                raise Invalid("", exposed)
        return self

    @property
    def signed(self) -> bool:
        """True when the role signs its requests: with a shared secret, or its own key."""
        return (
            bool(self.secret)
            or self.security.secret_bytes is not None
            or self.security.auth == "keys"
        )

    def http_security(self) -> HttpSecurity:
        """The role's security settings (``secret`` standing for ``security.secret``)."""
        sec = security_of(self.security)
        return dataclasses.replace(sec, secret=self.secret.encode()) if self.secret else sec

    def transport_settings(self) -> dict[str, Any]:
        """`make_transport` keywords for the security given: the secret and TLS contexts, and
        only the limits the file sets (the others keep the transport's defaults)."""
        settings = self.http_security().transport_settings()
        keep = {"secret", "ssl_server", "ssl_client", "key_id", "previous_secret"}
        keep |= {"previous_key_id"} | set(self.security.model_fields_set)
        return {k: v for k, v in settings.items() if k in keep}


class CoordinatorFile(RoleFile):
    """``tandem elastic coordinator``: survival detection and the batch ledger."""

    data_servers: Peers = Field(description="name = URL of every data server")
    interval: Positive = Field(default=1.0, description="survival detection every T seconds")
    timeout: float | None = Field(default=None, description="heartbeat silence (default 1.5 T)")
    drain: float | None = None
    epochs: int = Field(default=1, ge=1)
    min_workers: int = Field(default=1, ge=0)
    workers: Peers = Field(default_factory=dict, description="name = URL of workers allowed")
    roster: str | None = Field(default=None, description="a TOML of workers, re-read every T")
    admit_workers: bool | None = Field(
        default=None,
        description="admit unknown signed workers (default: with a secret and no workers "
        "table or roster)",
    )
    on_change: Literal["rollback", "keep"] = "rollback"
    call_timeout: Positive = 60.0
    recover_timeout: Positive = 120.0
    journal: str | None = Field(default=None, description="write-ahead journal (restart)")

    @model_validator(mode="after")
    def _admission(self) -> CoordinatorFile:
        if self.admit and not self.signed:
            raise Invalid(
                "",
                "admit_workers = true needs a secret (workers prove they may join by signing "
                "with it); set secret (or security.secret_env / secret_file) or list the "
                "workers in [workers] / roster",
            )
        return self

    @property
    def admit(self) -> bool:
        """Whether unknown workers that sign with the secret may join: as asked, else only
        with a secret and no list of workers (with a roster, strangers stay out)."""
        if self.admit_workers is not None:
            return self.admit_workers
        return self.signed and not self.workers and self.roster is None


class DataServerFile(RoleFile):
    """``tandem elastic data-server``: one shard and a parameter server."""

    coordinator: Url = Field(description="the coordinator's URL")
    coordinator_name: str = "coordinator"
    model: str | dict[str, Any] | None = Field(
        default=None, description="a model description URL (with shard), or a [model] table"
    )
    shard: str | None = Field(default=None, description="an .npz URL (with model)")
    data: Data | None = None
    train: dict[str, Any] | None = Field(default=None, description="with [data]: loss, ...")
    export: str | None = Field(default=None, description="write the trained model here")
    checkpoints: str | None = Field(default=None, description="durable checkpoints (fsspec)")
    coordinator_wait: float = 60.0
    compile_cache: bool | str = Field(default=True, description=CACHE_DESCRIPTION)

    @field_validator("compile_cache")
    @classmethod
    def _cache(cls, value: bool | str) -> bool | str:
        return _cache_setting(value)

    @model_validator(mode="after")
    def _shard(self) -> DataServerFile:
        if self.data is not None:
            if self.shard is not None or not isinstance(self.model, dict):
                raise Invalid(
                    "",
                    "with [data], describe the model in a [model] table (docs/models.md) and "
                    "leave out shard",
                )
        elif isinstance(self.model, str) and self.shard is not None:
            if self.train is not None:
                raise Invalid(
                    "",
                    "[train] goes with [data] and [model]; a model description file holds "
                    "its own training settings",
                )
        else:
            raise Invalid(
                "",
                "give the shard as [data] + [model] tables (the shared data and model "
                'contract, docs/data.md and docs/models.md), or as model = "<model '
                'description URL>" + shard = "<.npz URL>"',
            )
        return self

    def contract(self) -> dict[str, Any]:
        """The ``[data]``, ``[model]`` and ``[train]`` tables for `load_party_shard`."""
        assert self.data is not None  # Invariant: called only on the [data] form
        out: dict[str, Any] = {
            "data": self.data.model_dump(mode="json", exclude_defaults=True),
            "model": self.model,
        }
        return out if self.train is None else {**out, "train": self.train}


class WorkerFile(RoleFile):
    """``tandem elastic worker``: a stateless worker."""

    coordinator: Url = Field(description="the coordinator's URL")
    coordinator_name: str = "coordinator"
    heartbeat: float = Field(default=0.3, description="seconds between heartbeats")
    join_timeout: float = Field(default=60.0, description="seconds to wait for a WELCOME")
    compile_cache: bool | str = Field(default=True, description=CACHE_DESCRIPTION)

    @field_validator("compile_cache")
    @classmethod
    def _cache(cls, value: bool | str) -> bool | str:
        return _cache_setting(value)


def _cache_setting(value: bool | str) -> bool | str:
    """``compile_cache`` checked (a folder is used as written, as the other paths here)."""
    try:
        return check_setting(value, "")
    except ValueError as exc:
        raise Invalid("", str(exc)) from None


#: The keys of each role that name a file or folder (resolved against the TOML's folder).
PATH_KEYS: dict[str, tuple[str, ...]] = {
    "CoordinatorFile": ("journal", "roster"),
    "DataServerFile": ("checkpoints", "export", "model", "shard"),
    "WorkerFile": (),
}


def resolve_at(location: str, toml_url: str) -> str:
    """``location`` as the role file at ``toml_url`` means it: a relative path starts at the
    file's folder (a local folder, or the folder of an fsspec URL); URLs and absolute paths
    are kept as written."""
    if "://" in location or os.path.isabs(location):
        return location
    location = os.path.expanduser(location)
    if os.path.isabs(location):
        return location
    if "://" in toml_url and not toml_url.startswith("file://"):
        return f"{toml_url.rsplit('/', 1)[0]}/{location}"
    folder = os.path.dirname(os.path.abspath(toml_url.removeprefix("file://")))
    return os.path.join(folder, location)


def _resolve_paths(cfg: R, url: str) -> R:
    keys = PATH_KEYS.get(type(cfg).__name__, ())
    update = {k: resolve_at(v, url) for k in keys if isinstance(v := getattr(cfg, k, None), str)}
    return cfg.model_copy(update=update) if update else cfg


def load_role(model: type[R], url: str | os.PathLike[str]) -> R:
    """Read the TOML at ``url`` (a path or an fsspec URL) and check it as ``model``; a
    `ConfigError` names the file, the key and the fix."""
    from .spec import _read

    url = os.fspath(url)
    try:
        raw = tomllib.loads(_read(url).decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {url!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - set(model.model_fields))
    if unknown:
        raise ConfigError(
            f"config {url!r}: unknown key(s) {unknown}; accepted: {sorted(model.model_fields)}"
        )
    try:
        return _resolve_paths(validate(model, raw, path=url, error=_Located), url)
    except _Located as exc:
        text = str(exc).removeprefix(f"{url}: ")
        for key in model.model_fields:  # a top-level key is quoted, as the role's own words
            if text.startswith(f"{key} must be"):
                text = f"{key!r}{text[len(key) :]}"
        raise ConfigError(f"config {url!r}: {text}") from None


class _Located(ConfigError):
    """`validate`'s error before `load_role` words it."""


#: ``tandem config`` role -> the model of its files.
ROLE_FILES: dict[str, type[RoleFile]] = {
    "elastic-coordinator": CoordinatorFile,
    "elastic-data-server": DataServerFile,
    "elastic-worker": WorkerFile,
}

__all__ = [
    "PATH_KEYS",
    "ROLE_FILES",
    "CoordinatorFile",
    "DataServerFile",
    "RoleFile",
    "WorkerFile",
    "load_role",
    "resolve_at",
]
