"""What a split-learning training run reports: validation after every epoch, early stopping,
a JSONL history and TensorBoard event files (docs/parties.md, "What a run reports").

The leader builds one `Reporter` for its `SplitParty` and hands ``reporter.after_epoch`` to
`SplitParty.fit`. After each complete epoch it

1. evaluates the model on the validation rows (`Validation`: a dataset every party holds, and
   optionally which of its rows) with `SplitParty.evaluate`;
2. appends one JSON line to the history file: ``epoch`` (from 0), ``train_loss``, every
   validation metric as ``val_<name>`` (`tandem.parties.split.metrics`; null where undefined),
   ``seconds`` (training), ``val_seconds``, ``n_groups``, ``batches``, ``improved``, and with
   the leakage audit on the leader's ``audit_*`` keys (`tandem.parties.privacy.audit`);
3. writes the same numbers as TensorBoard scalars (``train/loss``, ``val/<name>``,
   ``n_groups``, ``audit/<name>``; step = epoch) when ``[log] tensorboard`` names a folder;
4. updates `EarlyStopping` with the monitored value and asks `fit` to stop once ``patience``
   epochs in a row brought no improvement.

Parameters: with ``patience`` set and ``restore_best`` (the default), every party keeps a copy
of its parameters at each new best epoch (`SplitParty.keep_params`) and `Reporter.finish` puts
them back (`SplitParty.restore_kept`) before the final evaluation and the export, so the export
holds the best epoch's model. Without ``patience`` (or with ``restore_best = false``) the
parameters of the last epoch stay. Checkpoints hold the training trajectory (the last
batch's parameters); only the finished checkpoint of a completed job holds the restored ones
beside it (`tandem.parties.split.checkpoint`).

Resuming: `Reporter.start` keeps the history lines of the epochs before the resume point (and
drops later ones, which the resumed run replays) and rebuilds the early-stopping state from
them; TensorBoard is told to discard events from the resume epoch on (``purge_step``). Kept
parameters live in memory only: when the best epoch precedes the resume point, the run ends
with the last epoch's parameters and says so (``"parameters": "last"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import numpy as np

from tandem._extras import needs
from tandem.errors import ConfigError

from .metrics import LOWER_IS_BETTER, Metric, metric_names
from .party import EpochResult, SplitParty

#: Monitored values that are not validation metrics.
TRAIN_MONITORS = ("train_loss",)


def monitor_names(loss: str) -> tuple[str, ...]:
    """The values `ReportConfig.monitor` may name for ``loss``: ``train_loss`` and
    ``val_<metric>`` for every validation metric."""
    return (*TRAIN_MONITORS, *(f"val_{m}" for m in metric_names(loss)))


def monitor_key(name: str, loss: str) -> str:
    """The history key of monitor ``name`` (``"auc"`` and ``"val_auc"`` both mean
    ``"val_auc"``); `ConfigError` listing the accepted names if ``loss`` has no such value."""
    accepted = monitor_names(loss)
    key = name if name in TRAIN_MONITORS or name.startswith("val_") else f"val_{name}"
    if key not in accepted:
        bare = [a.removeprefix("val_") for a in accepted if a.startswith("val_")]
        raise ConfigError(
            f"monitor {name!r} is not a value of a {loss!r} run; accepted: "
            f"{', '.join(accepted)} (the val_ prefix may be left out: {', '.join(bare)})"
        )
    return key


def lower_is_better(key: str) -> bool:
    """Whether the monitored history value ``key`` improves by going down (losses, errors)."""
    return key == "train_loss" or key.removeprefix("val_") in LOWER_IS_BETTER


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """The leader's reporting settings (``[train] monitor, patience, min_delta,
    restore_best``; ``[log] history, tensorboard``).

    ``monitor`` is a history key (`monitor_key`); ``patience`` None means no early stopping;
    an improvement must beat the best value by more than ``min_delta``. ``history`` and
    ``tensorboard`` are paths, or None for no file.
    """

    monitor: str = "val_loss"
    patience: int | None = None
    min_delta: float = 0.0
    restore_best: bool = True
    history: str | None = None
    tensorboard: str | None = None

    def __post_init__(self) -> None:
        if self.patience is not None and self.patience < 1:
            raise ConfigError(f"patience must be >= 1 epoch, got {self.patience}")
        if not (self.min_delta >= 0 and math.isfinite(self.min_delta)):
            raise ConfigError(f"min_delta must be a finite number >= 0, got {self.min_delta}")

    @property
    def mode(self) -> str:
        """``"min"`` or ``"max"``: the direction in which ``monitor`` improves."""
        return "min" if lower_is_better(self.monitor) else "max"

    @property
    def keeps_best(self) -> bool:
        """Whether the run ends with the best epoch's parameters (see the module docstring)."""
        return self.patience is not None and self.restore_best


@dataclasses.dataclass(frozen=True)
class EarlyStopping:
    """Early-stopping state: the best monitored value so far, its epoch, and the epochs since.

    Pure: `observe` returns a new state. A value that is None or not finite never improves.
    Invariant: ``best is None`` iff ``best_epoch is None``; ``wait`` counts the epochs observed
    since ``best_epoch`` (all of them while there is none).
    """

    mode: str
    min_delta: float = 0.0
    best: float | None = None
    best_epoch: int | None = None
    wait: int = 0

    def improves(self, value: Metric) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def observe(self, epoch: int, value: Metric) -> EarlyStopping:
        if self.improves(value):
            return dataclasses.replace(self, best=value, best_epoch=epoch, wait=0)
        return dataclasses.replace(self, wait=self.wait + 1)

    def exhausted(self, patience: int | None) -> bool:
        """True once ``patience`` epochs in a row brought no improvement."""
        return patience is not None and self.wait >= patience


@dataclasses.dataclass(frozen=True)
class Validation:
    """The rows validated after every epoch: ``rows`` of ``dataset`` (all rows when None), a
    dataset every party holds; ``batch_size`` rows per evaluation batch."""

    dataset: str
    rows: np.ndarray | None = None
    batch_size: int | None = None

    def size(self, party: SplitParty) -> int:
        return len(party.labels[self.dataset]) if self.rows is None else len(self.rows)


class Reporter:
    """Validation, early stopping, history and TensorBoard of one leader's run (see the module
    docstring). Use::

        async with reporter.opened(first_epoch):
            await party.fit(..., start_epoch=first_epoch, after_epoch=reporter.after_epoch)
            summary = await reporter.finish()
    """

    def __init__(
        self, party: SplitParty, config: ReportConfig, validation: Validation | None
    ) -> None:
        if validation is not None and validation.dataset not in party.labels:
            raise ConfigError(
                f"{party.name!r} has no labels for the validation dataset {validation.dataset!r}"
            )
        if config.monitor != "train_loss" and validation is None and config.patience:
            raise ConfigError(
                f"early stopping monitors {config.monitor!r}, but this run has no validation "
                "rows; give the parties validation (or test) data, or set "
                '[train] monitor = "train_loss"'
            )
        self.party, self.config, self.validation = party, config, validation
        self.state = EarlyStopping(config.mode, config.min_delta)
        self.last: dict[str, Any] | None = None  # the newest history record
        self.best: dict[str, Any] | None = None  # the record of state.best_epoch
        self.kept_epoch: int | None = None  # epoch of the parameters kept this process
        self.stopped_early = False
        self._tb: Any = None

    # -- life cycle --------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def opened(self, start_epoch: int) -> AsyncIterator[Reporter]:
        """`start` on entry, `aclose` on every exit."""
        await self.start(start_epoch)
        try:
            yield self
        finally:
            await self.aclose()

    async def start(self, start_epoch: int) -> None:
        """Prepare the files for a run whose first epoch is ``start_epoch`` (0: a fresh run,
        which truncates the history); rebuild the early-stopping state from the history of
        the epochs before it."""
        if self.config.history:
            kept = await asyncio.to_thread(_trim_history, self.config.history, start_epoch)
            for record in kept:
                self._observe(record)
        if self.config.tensorboard:
            self._tb = await asyncio.to_thread(
                _summary_writer, self.config.tensorboard, start_epoch
            )

    def recorded(self, epoch: int) -> bool:
        """Whether the history file holds a record of ``epoch`` (its `after_epoch` ran before
        the run was interrupted); False without a history file. Blocking file I/O."""
        path = self.config.history
        if not path or not os.path.exists(path):
            return False
        return any(record.get("epoch") == epoch for record in _records(path))

    async def after_epoch(self, result: EpochResult) -> bool:
        """`SplitParty.fit`'s ``after_epoch`` hook: validate, record, decide; True = stop."""
        val_seconds = 0.0
        if self.validation is not None:
            t0 = time.perf_counter()
            result.validation = await self.party.evaluate(
                self.validation.dataset,
                rows=self.validation.rows,
                batch_size=self.validation.batch_size,
            )
            val_seconds = time.perf_counter() - t0
        record: dict[str, Any] = {
            "epoch": result.epoch,
            "train_loss": result.loss,
            **{f"val_{k}": v for k, v in result.validation.items()},
            "seconds": result.seconds,
            "val_seconds": val_seconds,
            "n_groups": result.n_groups,
            "batches": result.batches,
            **result.privacy,
            **_audit_of(self.party, result.epoch),
        }
        improved = self._observe(record)
        if improved and self.config.keeps_best:
            await self.party.keep_params()
            self.kept_epoch = result.epoch
        if self.config.history:
            await asyncio.to_thread(_append_line, self.config.history, _json_line(record))
        if self._tb is not None:
            await asyncio.to_thread(_write_scalars, self._tb, record)
        self.stopped_early = self.state.exhausted(self.config.patience)
        return self.stopped_early

    async def finish(self, *, restore: bool = True) -> dict[str, Any]:
        """End of training (before the final evaluation and the export): put the best epoch's
        parameters back if configured and ``restore``, close the TensorBoard writer, and
        return the summary for the leader's JSON line (``validation``: the last epoch's
        metrics; ``best``: the monitored value's best epoch and its metrics;
        ``early_stopping``; ``epochs_done``; ``history``; ``tensorboard``; JSON values,
        undefined metrics null)."""
        parameters = "last"
        if restore and self.config.keeps_best and self.state.best_epoch is not None:
            last_epoch = None if self.last is None else self.last["epoch"]
            if self.state.best_epoch == last_epoch:
                parameters = "best"  # the last epoch is the best: nothing to put back
            elif self.kept_epoch == self.state.best_epoch:
                await self.party.restore_kept()
                parameters = "best"
        await self.aclose()
        out: dict[str, Any] = {}
        if self.validation is not None and self.last is not None:
            out["validation"] = {
                "dataset": self.validation.dataset,
                "rows": self.validation.size(self.party),
                **_validation_of(self.last),
            }
        out["best"] = {
            "monitor": self.config.monitor,
            "mode": self.config.mode,
            "epoch": self.state.best_epoch,
            "value": self.state.best,
            **({} if self.best is None else {"validation": _validation_of(self.best)}),
        }
        if self.config.patience is not None:
            out["early_stopping"] = {
                "patience": self.config.patience,
                "stopped": self.stopped_early,
                "parameters": parameters,
            }
        out.update({k: v for k, v in (self.last or {}).items() if k.startswith("privacy_")})
        if self.party.audit is not None:
            out.update(self.party.audit.summary())
        out["epochs_done"] = None if self.last is None else int(self.last["epoch"]) + 1
        out["history"] = self.config.history
        out["tensorboard"] = self.config.tensorboard
        return _jsonable(out)

    async def aclose(self) -> None:
        """Close the TensorBoard writer (idempotent)."""
        tb, self._tb = self._tb, None
        if tb is not None:
            await asyncio.to_thread(tb.close)

    def _observe(self, record: dict[str, Any]) -> bool:
        """Advance the early-stopping state with one history record, and mark in it
        (``improved``) whether it improved on the best so far; returns that."""
        value = record.get(self.config.monitor)
        improved = record["improved"] = self.state.improves(value)
        self.state = self.state.observe(int(record["epoch"]), value)
        self.last = record
        if improved:
            self.best = record
        return improved


def validation_for(party: SplitParty, *, batch_size: int | None = None) -> Validation | None:
    """The validation rows of a standalone run: the ``validation`` dataset when the parties
    hold one (the ``[data.split]`` validation ids), else the ``test`` dataset, else None."""
    for name in ("validation", "test"):
        if name in party.labels and len(party.labels[name]):
            return Validation(name, batch_size=batch_size)
    return None


def report_config(
    train: Mapping[str, Any],
    log: Mapping[str, Any],
    *,
    loss: str,
    default_history: str | None,
) -> ReportConfig:
    """A `ReportConfig` from the ``[train]`` table (``monitor``, ``patience``, ``min_delta``,
    ``restore_best``; other keys ignored) and the ``[log]`` table (``history``,
    ``tensorboard``: resolved paths), for a run of ``loss``; ``default_history`` when
    ``[log]`` names no history file. Checks that the TensorBoard extra is installed."""
    if log.get("tensorboard"):
        with needs("tensorboard", "[log] tensorboard (TensorBoard event files)"):
            import tensorboardX  # noqa: F401
    return ReportConfig(
        monitor=monitor_key(str(train.get("monitor", "val_loss")), loss),
        patience=train.get("patience"),
        min_delta=float(train.get("min_delta", 0.0)),
        restore_best=bool(train.get("restore_best", True)),
        history=log.get("history", default_history),
        tensorboard=log.get("tensorboard"),
    )


def _audit_of(party: SplitParty, epoch: int) -> dict[str, Any]:
    """The audit keys the leader measured in ``epoch`` (`tandem.parties.privacy.audit`), or
    ``{}`` when the audit is off or recorded nothing then."""
    if party.audit is None:
        return {}
    for record in reversed(party.audit.history):
        if record["epoch"] == epoch:
            return {k: v for k, v in record.items() if k.startswith("audit_")}
    return {}


# -- files ---------------------------------------------------------------------------------------
def _validation_of(record: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "epoch": record["epoch"],
        **{k[4:]: v for k, v in record.items() if k.startswith("val_") and k != "val_seconds"},
    }


def _jsonable(value: Any) -> Any:
    """``value`` with every non-finite float as None (strict JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    return value


def _json_line(record: Mapping[str, Any]) -> str:
    return json.dumps(_jsonable(dict(record)), allow_nan=False) + "\n"


def _append_line(path: str, line: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _records(path: str) -> Iterator[dict[str, Any]]:
    """The records (JSON objects) of the history file at ``path``, in file order; a line that
    does not parse (a write cut short by a crash, bytes that are not UTF-8) is skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def _trim_history(path: str, start_epoch: int) -> list[dict[str, Any]]:
    """Keep the records of epochs before ``start_epoch`` (in file order) and rewrite the file
    with only those, atomically; lines that do not parse (a write cut short by a crash) are
    dropped. Returns the kept records."""
    kept: list[dict[str, Any]] = []
    if start_epoch > 0 and os.path.exists(path):
        kept = [r for r in _records(path) if int(r.get("epoch", -1)) in range(start_epoch)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(_json_line(r) for r in kept)
    os.replace(tmp, path)
    return kept


def _summary_writer(directory: str, start_epoch: int) -> Any:
    with needs("tensorboard", "[log] tensorboard (TensorBoard event files)"):
        from tensorboardX import SummaryWriter

    # purge_step: TensorBoard drops this folder's older events from that epoch on (a resume)
    return SummaryWriter(directory, purge_step=start_epoch or None)


def _write_scalars(writer: Any, record: Mapping[str, Any]) -> None:
    step = int(record["epoch"])
    if math.isfinite(record["train_loss"]):  # (not known for an epoch resumed at its end)
        writer.add_scalar("train/loss", record["train_loss"], step)
    for key, value in record.items():
        if key.startswith("val_") and key != "val_seconds" and value is not None:
            writer.add_scalar(f"val/{key[4:]}", value, step)
    writer.add_scalar("n_groups", record["n_groups"], step)
    writer.add_scalar("seconds/train", record["seconds"], step)
    writer.add_scalar("seconds/val", record["val_seconds"], step)
    for key, value in record.items():
        if key.startswith("audit_") and isinstance(value, (int, float)):
            writer.add_scalar(f"audit/{key[6:]}", value, step)
    writer.flush()


__all__ = [
    "EarlyStopping",
    "ReportConfig",
    "Reporter",
    "Validation",
    "lower_is_better",
    "monitor_key",
    "monitor_names",
    "report_config",
    "validation_for",
]
