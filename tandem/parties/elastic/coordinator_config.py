"""The coordinator's settings (`CoordinatorConfig`) and the progress it reports (`Progress`)."""

from __future__ import annotations

import dataclasses

from .errors import ConfigError

#: What a membership change does: roll back to the last checkpoint, or checkpoint and go on.
ON_CHANGE = ("rollback", "keep")


@dataclasses.dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """``interval``: detection period T (s). ``timeout``: heartbeat silence that removes a
    worker (default 1.5 T). ``drain``: longest pause waiting for in-flight batches (default
    T / 2). ``call_timeout``: longest wait for a data server's reply (after which it counts
    as down); the first ``hello`` waits at least 60 s for data servers still starting.
    ``on_change``: what a membership change does, ``"rollback"`` or ``"keep"`` (module
    docstring). ``recover_timeout``: longest wait for data servers to come back after one went
    down. ``journal``: local path of the write-ahead journal (None: progress lives in memory
    only and a restarted coordinator starts afresh). ``false_reports``: done-reports without
    gradients after which a worker is removed for good (`tandem.parties.elastic.audit`)."""

    data_servers: tuple[str, ...]
    data_server_urls: tuple[tuple[str, str], ...] = ()
    interval: float = 1.0
    timeout: float | None = None
    drain: float | None = None
    epochs: int = 1
    min_workers: int = 1
    call_timeout: float = 60.0
    on_change: str = "rollback"
    recover_timeout: float = 120.0
    journal: str | None = None
    false_reports: int = 3

    def __post_init__(self) -> None:
        if not self.data_servers:
            raise ConfigError("the coordinator needs at least one data server name")
        if len(set(self.data_servers)) != len(self.data_servers):
            raise ConfigError(f"data server names repeat: {list(self.data_servers)}")
        if not self.interval > 0:
            raise ConfigError(f"detection interval must be > 0 s, got {self.interval!r}")
        if self.epochs < 1 or self.min_workers < 0:
            raise ConfigError("epochs must be >= 1 and min_workers >= 0")
        if self.on_change not in ON_CHANGE:
            raise ConfigError(
                f"on_change is {self.on_change!r}; choose one of {', '.join(ON_CHANGE)} "
                "(docs/elastic.md says when each is right)"
            )
        if not (self.call_timeout > 0 and self.recover_timeout > 0):
            raise ConfigError("call_timeout and recover_timeout must be > 0 s")
        if self.false_reports < 1:
            raise ConfigError(f"false_reports must be >= 1, got {self.false_reports!r}")

    @property
    def heartbeat_timeout(self) -> float:
        return self.timeout if self.timeout is not None else 1.5 * self.interval

    @property
    def drain_time(self) -> float:
        return self.drain if self.drain is not None else 0.5 * self.interval


@dataclasses.dataclass
class Progress:
    epoch: int = 0
    committed: int = 0
    total: int = 0
    live: int = 0
    generation: int = 0
    checkpoints: int = 0
    rollbacks: int = 0
    recoveries: int = 0
    loss: float | None = None
