"""The job file of ``tandem elastic launch``: every role of one elastic run, plus ``[ray]``.

One TOML describes the whole run; `launch` turns it into the flat role tables that
``tandem elastic coordinator|data-server|worker`` read (`..config`), filling in what only the
placement knows (names, hosts, ports, the coordinator's URL, the journal and checkpoint
locations). Pure: it imports neither Ray nor asyncio::

    [ray]                       placement and scaling (`RaySection`)
    [security]                  shared by every role (a shared secret: secret_env / secret_file)
    [coordinator]               CoordinatorFile's keys, less name/host/port/data_servers/journal
    [data_servers.NAME]         DataServerFile's keys, less name/host/port/coordinator/checkpoints
    [worker]                    WorkerFile's keys, less name/host/port/coordinator

Relative paths in ``[data]`` start at the job file's folder (as in a role's own file).
"""

from __future__ import annotations

import os
import tomllib
from typing import Any, Literal

from pydantic import Field, model_validator

from tandem.parties.config import Section, Security, validate
from tandem.parties.config.base import Invalid
from tandem.parties.config.sections import Positive

from ..config import CoordinatorFile, DataServerFile, WorkerFile
from ..errors import ConfigError

#: keys `launch` sets in each role's table; a job file that sets them is refused.
PLACED: dict[str, tuple[str, ...]] = {
    "coordinator": ("name", "host", "port", "advertise_url", "data_servers", "journal"),
    "data_servers": ("name", "host", "port", "advertise_url", "coordinator", "checkpoints"),
    "worker": ("name", "host", "port", "advertise_url", "coordinator"),
}


class RaySection(Section):
    """``[ray]``: where the roles run and how many workers there are.

    Scaling rule (`supervisor.decide`): with ``a`` of a resource available beyond what the
    job's pending actors claim, a worker is added while the live workers are fewer than
    ``max_workers`` and ``a >= worker_<resource> + reserve_<resource>`` for CPU, GPU and
    memory; one is removed while they are more than ``min_workers`` and available CPU is below
    ``reserve_cpus`` (someone else's work needs the room back). A worker whose actor died (its
    node went away) is replaced when the rule allows."""

    address: str | None = Field(default=None, description="the Ray cluster ('auto', ray://...)")
    min_workers: int = Field(default=1, ge=1, description="workers kept even without room")
    max_workers: int = Field(default=4, ge=1, description="workers at most")
    worker_cpus: float = Field(default=1.0, ge=0, description="CPUs each worker claims")
    worker_gpus: float = Field(default=0.0, ge=0, description="GPUs each worker claims")
    worker_memory: int | None = Field(default=None, ge=1, description="bytes each worker claims")
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each worker claims"
    )
    data_server_cpus: float = Field(default=1.0, ge=0, description="CPUs each data server claims")
    data_server_memory: int | None = Field(default=None, ge=1)
    data_server_resources: dict[str, float] = Field(default_factory=dict)
    coordinator_cpus: float = Field(default=0.5, ge=0, description="CPUs the coordinator claims")
    spread: Literal["spread", "strict_spread"] = Field(
        default="spread",
        description="data servers over nodes: one per node (strict_spread) or as far as can be",
    )
    reserve_cpus: float = Field(default=0.0, ge=0, description="CPUs left free for others")
    reserve_gpus: float = Field(default=0.0, ge=0)
    poll: Positive = Field(default=1.0, description="seconds between scaling decisions")
    restarts: int = Field(default=-1, ge=-1, description="restarts of a static role (-1: any)")
    storage: str = Field(description="fsspec URL every node reaches: journal and checkpoints")
    compile_cache: bool | str = Field(
        default=True,
        description="JAX's compilation cache of the workers: true: storage/compile-cache "
        "(JAX_COMPILATION_CACHE_DIR wins), a folder every node reaches, or false",
    )
    worker_env: dict[str, str] = Field(
        default_factory=dict,
        description="environment of the role processes (never secrets: Ray stores it)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> RaySection:
        if self.min_workers > self.max_workers:
            raise Invalid(
                "min_workers",
                f"is {self.min_workers}, above max_workers = {self.max_workers}; lower it",
            )
        if self.compile_cache == "":
            raise Invalid("compile_cache", "is empty; give a folder, true or false")
        if not self.storage.startswith(("file://", "/")):
            raise Invalid(
                "storage",
                f"is {self.storage!r}; the coordinator's journal is a file it fsyncs, so give "
                "a file:// URL (or absolute path) of a folder every node mounts (NFS, a "
                "Kubernetes ReadWriteMany volume)",
            )
        return self

    @property
    def storage_path(self) -> str:
        """``storage`` as a local path (it is a shared mount on every node)."""
        return self.storage.removeprefix("file://")

    @property
    def compile_cache_folder(self) -> str | None:
        """Where workers keep their compiled kernels (None: no cache), so a worker started on a
        new node loads them instead of compiling (`tandem.parties.compile_cache`)."""
        from tandem.parties.compile_cache import compile_cache_folder

        return compile_cache_folder(self.compile_cache, self.storage_path, None)

    def worker_claim(self) -> dict[str, float]:
        """What one worker claims, in `ray.available_resources` keys."""
        claim = {"CPU": self.worker_cpus, "GPU": self.worker_gpus, **self.worker_resources}
        if self.worker_memory is not None:
            claim["memory"] = float(self.worker_memory)
        return {k: v for k, v in claim.items() if v}


class JobFile(Section):
    """The whole job file (module docstring)."""

    ray: RaySection
    security: Security = Field(default_factory=Security)
    coordinator: dict[str, Any] = Field(default_factory=dict)
    data_servers: dict[str, dict[str, Any]] = Field(description="NAME = the data server's keys")
    worker: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _placed(self) -> JobFile:
        if not self.data_servers:
            raise Invalid("data_servers", "is empty; add a [data_servers.ds0] table")
        tables = [("coordinator", self.coordinator), ("worker", self.worker)]
        tables += [(f"data_servers.{n}", t) for n, t in self.data_servers.items()]
        for where, table in tables:
            role = where.split(".")[0]
            for key in PLACED[role]:
                if key in table:
                    raise Invalid(
                        f"{where}.{key}" if role != "data_servers" else where,
                        f"sets {key!r}, which launch places itself; remove it",
                    )
            if "secret" in table or "security" in table:
                raise Invalid(where, "carries a secret; put it once in [security]")
        return self


class Job:
    """A checked job file and the role tables it makes.

    ``text``: the TOML; ``path``: where it was read (relative ``[data]`` paths start at its
    folder). Invariant: every table `coordinator_table`, `data_server_table` and
    `worker_table` return checks as its role's file (`validate` raised otherwise)."""

    def __init__(self, text: str, path: str) -> None:
        self.text = text
        self.path = os.path.abspath(path)
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path!r} is not valid TOML: {exc}") from None
        self.file = validate(JobFile, raw, path=self.path)
        self.ray = self.file.ray
        # check every role now, with placeholders for what launch fills in later
        coord = self.coordinator_table(
            {n: "http://127.0.0.1:1" for n in self.file.data_servers}, "h", 0
        )
        if not validate(CoordinatorFile, coord, path=self.path).admit:
            raise ConfigError(
                f"config {path!r}: launched workers join with the shared secret; set "
                "security.secret_env or security.secret_file (the variable or file must exist "
                "on every node) and leave coordinator.admit_workers unset"
            )
        for name in self.file.data_servers:
            self.data_server_table(name, "http://127.0.0.1:1", "h", 0)
        self.worker_table("w0", "http://127.0.0.1:1", "h")

    @property
    def data_server_names(self) -> list[str]:
        return sorted(self.file.data_servers)

    def _security(self) -> dict[str, Any]:
        return self.file.security.model_dump(mode="json", exclude_unset=True)

    def _check(self, model: type[Section], table: dict[str, Any], where: str) -> dict[str, Any]:
        validate(model, table, path=self.path, where=(where,))
        return table

    def coordinator_table(self, ds_urls: dict[str, str], host: str, port: int) -> dict[str, Any]:
        table = {
            **self.file.coordinator,
            "name": "coordinator",
            "host": host,
            "port": port,
            "data_servers": dict(ds_urls),
            "journal": f"{self.ray.storage_path}/journal.jsonl",
            "security": self._security(),
        }
        table.setdefault("min_workers", self.ray.min_workers)
        return self._check(CoordinatorFile, table, "coordinator")

    def data_server_table(self, name: str, coord_url: str, host: str, port: int) -> dict[str, Any]:
        table = {
            **self.file.data_servers[name],
            "name": name,
            "host": host,
            "port": port,
            "coordinator": coord_url,
            "checkpoints": f"{self.ray.storage}/checkpoints/{name}",
            "security": self._security(),
        }
        return self._check(DataServerFile, table, f"data_servers.{name}")

    def worker_table(self, name: str, coord_url: str, host: str) -> dict[str, Any]:
        table = {
            **self.file.worker,
            "name": name,
            "host": host,
            "port": 0,
            "coordinator": coord_url,
            "security": self._security(),
        }
        return self._check(WorkerFile, table, "worker")


def read_job(url: str) -> Job:
    """The job file at ``url`` (a path or fsspec URL), checked; `ConfigError` names the key."""
    from ..spec import _read

    try:
        text = _read(url).decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {url!r} is not UTF-8 text: {exc}") from None
    return Job(text, url)
