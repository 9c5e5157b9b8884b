"""Fencing of workers whose reports cannot be true: a pure state machine (no asyncio).

A worker reports a batch done (``DONE ok``) only after its data server acknowledged the
gradients it pushed, so at the next checkpoint the data servers' ``applied`` list holds every
batch whose report the ledger accepted. A batch reported done but not applied is a *false
report*: the worker said done without sending gradients (or sent them to nobody). Left alone,
such a worker takes batches and sends them back to pending at every checkpoint, and a fast one
keeps the coordinator turning generations without progress.

Contract:

* `record(batch, worker)` notes each report the ledger accepted; `settle(applied)` at each
  checkpoint counts one strike per recorded batch missing from ``applied`` and forgets the
  records. `forget()` drops the records without judging them (a rollback or a recovery: the
  data servers went back to a checkpoint, so ``applied`` says nothing about them).
* A worker with a strike is *fenced*: each further report of it is refused (`refuse`), its
  batch goes back to pending at once, and the refusal is one more strike.
* A worker with ``limit`` strikes or more is `banned`: the coordinator removes it from the
  membership for good.

* `tally()` and `restore(tally)` carry the strikes, the bans and the refusal count across a
  restart of the coordinator (the coordinator journals the tally with each record).

Invariant: ``strikes[w] >= 1`` for every fenced ``w``; ``banned`` holds exactly the workers
with ``strikes >= limit``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class ReportAudit:
    """False-report strikes per worker (module docstring). ``limit`` >= 1."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the false-report limit must be >= 1, got {limit!r}")
        self.limit = limit
        self.strikes: dict[str, int] = {}
        self.banned: set[str] = set()
        self.refused = 0  # reports refused from fenced workers
        self._reported: dict[int, str] = {}  # batch -> worker whose report was accepted

    def fenced(self, worker: str) -> bool:
        return self.strikes.get(worker, 0) > 0

    def record(self, batch: int, worker: str) -> None:
        self._reported[batch] = worker

    def refuse(self, worker: str) -> bool:
        """Count a refused report of fenced ``worker``; True when this bans it."""
        self.refused += 1
        return self._strike(worker)

    def settle(self, applied: Iterable[int]) -> list[str]:
        """Judge the recorded reports against the batches the data servers hold; returns the
        workers this checkpoint banned."""
        held = set(applied)
        newly: list[str] = []
        for batch, worker in self._reported.items():
            if batch not in held and self._strike(worker):
                newly.append(worker)
        self._reported.clear()
        return newly

    def forget(self) -> None:
        self._reported.clear()

    def tally(self) -> dict[str, Any]:
        """The counts to keep across a restart: ``strikes`` (worker -> count), ``banned``
        (sorted) and ``fenced_reports`` (reports refused from fenced workers)."""
        return {
            "strikes": dict(sorted(self.strikes.items())),
            "banned": sorted(self.banned),
            "fenced_reports": self.refused,
        }

    def restore(self, tally: Mapping[str, Any]) -> None:
        """Take back what `tally` returned (before any report is recorded). The bans are
        recomputed from the strikes and this audit's ``limit``, so the invariant holds even
        when the restarted coordinator runs with another limit; a worker banned before keeps
        its ban."""
        self.strikes = {str(w): int(n) for w, n in tally.get("strikes", {}).items() if int(n) > 0}
        self.banned = {w for w, n in self.strikes.items() if n >= self.limit}
        for w in tally.get("banned", ()):  # banned under a lower limit: still banned
            self.banned.add(str(w))
            self.strikes[str(w)] = max(self.strikes.get(str(w), 0), self.limit)
        self.refused = int(tally.get("fenced_reports", 0))

    def _strike(self, worker: str) -> bool:
        self.strikes[worker] = self.strikes.get(worker, 0) + 1
        if worker not in self.banned and self.strikes[worker] >= self.limit:
            self.banned.add(worker)
            return True
        return False


__all__ = ["ReportAudit"]
