"""The coordinator's write-ahead journal: append-only JSON lines on a local file, each line
flushed and ``fsync``-ed before the commit it records takes effect.

Records (one JSON object per line)::

    {"kind": "start", "data_servers": [...], "spec": "<digest>", "seq": 0,
     "digests": {ds: sha256}, "initial_loss": 1.38}
    {"kind": "commit", "seq": 4, "generation": 9, "epoch": 0, "batches": [3, 1048579],
     "digests": {...}, "tally": {"reissued": 2, "refused_reports": 1, "fenced_reports": 0,
     "strikes": {}, "banned": []}}
    {"kind": "epoch", "seq": 5, "epoch": 0, "loss": 0.41, "generation": 10, "digests": {...}}
    {"kind": "rollback", "seq": 5, "generation": 11, "digests": {...}, "reissued": 3}
    {"kind": "recover", "seq": 5, "generation": 12, "digests": {...}, "reissued": 0,
     "restart": true}

``commit`` adds ``batches`` to the committed ids of ``epoch``; ``epoch`` closes that epoch (its
committed ids and loss join the history) and starts the next with nothing committed. ``seq`` is
the parameter-server checkpoint every data server holds for that state (`store.CheckpointStore`),
``digests`` their SHA-256 digests, so a restarted coordinator can restore every data server to it
and check the restore bit for bit. ``rollback`` and ``recover`` change no state but the
generation; they are journaled so that the run's counters (`JournalState.counts`:
``checkpoints``, ``rollbacks``, ``recoveries``, ``restarts``, ``reissued``) survive a restart of
the coordinator, whose summary then covers the whole run. A ``recover`` counts as a rollback
too (it rolls every data server back), as the coordinator counts it.

Every record after ``start`` also carries ``tally``: the run's cumulative counts *as they stand
once the record takes effect* (`TALLY`: ``reissued``, ``refused_reports``, ``fenced_reports``,
``strikes`` per worker, ``banned`` workers). Counts that move between records (a report
refused, a worker fenced) are thus kept as of the last record; `JournalState.tally` is the last
one, and when present its ``reissued`` is ``counts["reissued"]`` (it also holds the batches a
checkpoint or a refused report put back, which the ``reissued`` of a ``rollback`` or
``recover`` record does not). A journal written without tallies replays with zero tallies.

Crash safety: a record counts once its line and newline are on disk. `Journal.open` drops a torn
last line (``kill -9`` in the middle of a write) and truncates the file to its last complete
line, so later appends stay well formed; any other unreadable line is refused
(`JournalError`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from .errors import JournalError

#: The run's counters a journal keeps (`JournalState.counts`).
COUNTS = ("checkpoints", "rollbacks", "recoveries", "restarts", "reissued")

#: The cumulative counts each record's ``tally`` holds, with their value before any record.
TALLY: dict[str, Any] = {
    "reissued": 0,
    "refused_reports": 0,
    "fenced_reports": 0,
    "strikes": {},
    "banned": [],
}


@dataclasses.dataclass
class JournalState:
    """What the journal's records add up to (see the module docstring)."""

    start: dict[str, Any]
    seq: int
    generation: int
    epoch: int
    committed: list[int]
    history: list[dict[str, Any]]
    digests: dict[str, str]
    records: int
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    tally: dict[str, Any] = dataclasses.field(default_factory=lambda: _tally(TALLY))


class Journal:
    """An append-only journal at ``path`` (a local file; created with its folder if absent)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        if "://" in path and not path.startswith("file://"):
            raise JournalError(
                f"journal {path!r}: the coordinator's journal is appended and fsync-ed in place, "
                "so it must be a local file (a path or file://...); keep it on a disk that "
                "survives the coordinator's machine, e.g. a mounted volume"
            )
        self.path = path.removeprefix("file://")
        self._lines: list[dict[str, Any]] = []

    def open(self) -> JournalState | None:
        """Read the journal (repairing a torn tail); the state it records, or None if empty."""
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raw = b""
        end = raw.rfind(b"\n") + 1
        if end != len(raw):  # a torn last line: it was never committed
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        self._lines = []
        for number, line in enumerate(raw[:end].splitlines(), 1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "kind" not in record:
                    raise ValueError("not a record object")
            except ValueError as exc:
                raise JournalError(
                    f"journal {self.path!r}, line {number}, is damaged ({exc}); it is not a "
                    "torn last line, so the file was edited or corrupted: restore it from a "
                    "backup, or move it away to start training afresh"
                ) from None
            self._lines.append(record)
        return replay(self._lines, self.path)

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record durably (returns after ``fsync``)."""
        line = json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        with open(self.path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._lines.append(dict(record))


def replay(records: list[dict[str, Any]], where: str = "journal") -> JournalState | None:
    """Fold ``records`` into a `JournalState` (None when there is no ``start``)."""
    if not records:
        return None
    if records[0].get("kind") != "start":
        raise JournalError(f"{where!r} does not begin with a start record; it is not a journal")
    start = records[0]
    state = JournalState(
        start=start,
        seq=int(start["seq"]),
        generation=0,
        epoch=0,
        committed=[],
        history=[],
        digests=dict(start["digests"]),
        records=len(records),
    )
    counts = state.counts
    for key in COUNTS:
        counts[key] = 0
    for record in records[1:]:
        kind = record.get("kind")
        if kind in ("rollback", "recover"):
            counts["rollbacks"] += 1
            counts["reissued"] += int(record.get("reissued", 0))
            if kind == "recover":
                counts["recoveries"] += 1
                counts["restarts"] += bool(record.get("restart"))
        elif kind == "commit":
            counts["checkpoints"] += 1
            if int(record["epoch"]) != state.epoch:
                raise JournalError(
                    f"{where!r}: a commit of epoch {record['epoch']} follows epoch {state.epoch}; "
                    "the journal is inconsistent"
                )
            state.committed += [int(b) for b in record["batches"]]
        elif kind == "epoch":
            state.history.append(
                {
                    "epoch": state.epoch,
                    "committed": list(state.committed),
                    "loss": float(record["loss"]),
                    "generation": int(record["generation"]),
                }
            )
            state.epoch += 1
            state.committed = []
        else:
            raise JournalError(f"{where!r}: unknown record kind {kind!r}")
        state.seq = int(record["seq"])
        state.generation = int(record["generation"])
        state.digests = dict(record["digests"])
        if "tally" in record:
            state.tally = _tally(record["tally"], where)
            counts["reissued"] = state.tally["reissued"]
    return state


def _tally(raw: Any, where: str = "journal") -> dict[str, Any]:
    """A record's ``tally``, checked and copied (`JournalError` when malformed)."""
    try:
        return {
            "reissued": int(raw["reissued"]),
            "refused_reports": int(raw["refused_reports"]),
            "fenced_reports": int(raw["fenced_reports"]),
            "strikes": {str(w): int(n) for w, n in dict(raw["strikes"]).items()},
            "banned": sorted(str(w) for w in raw["banned"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalError(
            f"{where!r}: a record's tally {raw!r} is malformed ({exc!r}); it needs the keys "
            f"{sorted(TALLY)}: restore the journal from a backup, or move it away to start afresh"
        ) from None
