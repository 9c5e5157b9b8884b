"""Batch bookkeeping for one epoch, fenced by generation: a pure state machine.

Every batch id of the epoch belongs to one data server (its shard). A batch moves through::

    pending --assign--> in_flight --report--> completed --checkpoint--> committed
        ^                   |                     |
        +---- rollback / fence (not applied) -----+

* `assign` hands the next pending batch (in epoch order, data servers interleaved) to a worker.
* `report` accepts a worker's "done" only for the current generation (fencing).
* `checkpoint(applied)` bumps the generation and commits exactly the batches the data servers
  say their parameters hold (their word is the truth: a worker may have pushed and died before
  reporting); everything else goes back to pending.
* `rollback()` bumps the generation and puts every uncommitted batch back to pending.
* `release(batch, worker)` puts one in-flight batch back to pending at once (its worker's
  report was refused: `tandem.parties.elastic.audit`). The worker may have pushed it all the
  same: a released batch the parameter servers list as applied at the checkpoint is taken out
  of pending and committed (once).

Invariants (checked by `check`): the four sets partition the epoch's batch ids; no batch is
ever committed twice in an epoch (`LedgerError` otherwise); the generation never decreases.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .errors import LedgerError


class Ledger:
    """Batches of one epoch. ``batches`` maps data server -> its batch ids in issue order."""

    def __init__(
        self, batches: Mapping[str, Sequence[int]], *, generation: int = 0, epoch: int = 0
    ) -> None:
        self.generation = generation
        self.epoch = epoch
        self.reissued = 0  # batches put back to pending after being assigned
        self.refused = 0  # reports refused (older generation or unknown batch)
        self._reset(batches)

    def _reset(self, batches: Mapping[str, Sequence[int]]) -> None:
        self.owner: dict[int, str] = {}
        self._order: dict[int, int] = {}
        for ds, ids in batches.items():
            for b in ids:
                if b in self.owner:
                    raise LedgerError(
                        f"batch id {b} is listed by both {self.owner[b]!r} and "
                        f"{ds!r}; batch ids must be unique across data servers"
                    )
                self.owner[b] = ds
        # interleave data servers so every replica keeps making progress
        ordered: list[int] = []
        queues = [list(ids) for ids in batches.values()]
        while any(queues):
            for q in queues:
                if q:
                    ordered.append(q.pop(0))
        self._order = {b: i for i, b in enumerate(ordered)}
        self.pending: list[int] = ordered
        self.in_flight: dict[int, str] = {}  # batch -> worker
        self.completed: set[int] = set()
        self.released: set[int] = set()  # released since the last checkpoint or rollback
        self.committed: list[int] = []
        self._committed_set: set[int] = set()

    # -- queries ---------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self.owner)

    @property
    def done(self) -> bool:
        """Every batch of the epoch is committed."""
        return len(self._committed_set) == self.total

    @property
    def drained(self) -> bool:
        """Nothing pending nor in flight (the epoch may still need a checkpoint)."""
        return not self.pending and not self.in_flight

    def check(self) -> None:
        """Raise `LedgerError` if the invariants do not hold."""
        sets = [set(self.pending), set(self.in_flight), self.completed, self._committed_set]
        union = set().union(*sets)
        if (
            sum(map(len, sets)) != len(union)
            or union != set(self.owner)
            or len(self.committed) != len(self._committed_set)
        ):
            raise LedgerError(
                "ledger invariant broken: pending/in_flight/completed/committed "
                "must partition the epoch's batch ids"
            )

    # -- transitions -----------------------------------------------------------------------
    def assign(self, worker: str) -> tuple[str, int] | None:
        """Give ``worker`` the next pending batch; returns ``(data_server, batch)`` or None."""
        if not self.pending:
            return None
        b = self.pending.pop(0)
        self.in_flight[b] = worker
        return self.owner[b], b

    def report(self, batch: int, generation: int, worker: str) -> bool:
        """A worker says it finished ``batch`` in ``generation``; True if accepted."""
        if generation != self.generation or self.in_flight.get(batch) != worker:
            self.refused += 1
            return False
        del self.in_flight[batch]
        self.completed.add(batch)
        return True

    def release(self, batch: int, worker: str) -> bool:
        """Put ``batch``, in flight with ``worker``, back to pending (in epoch order); False
        when it is not in flight with that worker."""
        if self.in_flight.get(batch) != worker:
            return False
        del self.in_flight[batch]
        self.pending = sorted([*self.pending, batch], key=self._order.__getitem__)
        self.released.add(batch)
        self.reissued += 1
        return True

    def checkpoint(self, applied: Iterable[int]) -> list[int]:
        """Commit the batches the parameter servers hold (``applied``), fence the rest.

        Returns the newly committed ids. Raises `LedgerError` on a double commit or an id
        that is not part of this epoch (which would mean a parameter server applied a batch
        twice or from another epoch).
        """
        applied = list(applied)
        for b in applied:
            if b not in self.owner:
                raise LedgerError(
                    f"parameter servers report batch {b}, which is not in epoch {self.epoch}"
                )
            if b in self._committed_set:
                raise LedgerError(f"batch {b} would be committed twice in epoch {self.epoch}")
        if len(set(applied)) != len(applied):
            raise LedgerError(f"parameter servers report a batch twice: {sorted(applied)}")
        for b in applied:
            self.in_flight.pop(b, None)
            self.completed.discard(b)
            if b in self.pending:
                if b not in self.released:
                    raise LedgerError(f"batch {b} is applied but was never assigned")
                self.pending.remove(b)  # released, yet its worker did push it
            self.committed.append(b)
            self._committed_set.add(b)
        self.released.clear()  # a checkpoint starts a generation: older pushes are refused
        self._requeue()
        return applied

    def unapplied(self, applied: Iterable[int]) -> int:
        """How many batches `checkpoint(applied)` would put back to pending (and count in
        ``reissued``): those in flight or completed but not in ``applied``."""
        return len((set(self.in_flight) | self.completed) - set(applied))

    def restore(self, committed: Iterable[int]) -> None:
        """Mark ``committed`` (read back from the coordinator's journal) as committed before
        anything is assigned; `LedgerError` for an id not in the epoch or listed twice."""
        ids = list(committed)
        if self.in_flight or self.completed or self.committed:
            raise LedgerError("restore a ledger only before anything is assigned or committed")
        unknown = [b for b in ids if b not in self.owner]
        if unknown or len(set(ids)) != len(ids):
            raise LedgerError(
                f"the journal's committed ids of epoch {self.epoch} do not fit this epoch's "
                f"batches (unknown {unknown[:5]}, {len(ids) - len(set(ids))} repeated)"
            )
        self.committed = ids
        self._committed_set = set(ids)
        self.pending = [b for b in self.pending if b not in self._committed_set]

    def rollback(self) -> int:
        """Put every uncommitted batch back to pending; returns how many were re-issued."""
        return self._requeue()

    def new_epoch(self, batches: Mapping[str, Sequence[int]]) -> None:
        """Start the next epoch (only once this one is `done`)."""
        if not self.done:
            raise LedgerError(
                f"epoch {self.epoch} is not fully committed "
                f"({len(self._committed_set)}/{self.total} batches)"
            )
        self.epoch += 1
        self._reset(batches)

    def _requeue(self) -> int:
        back = list(self.in_flight) + sorted(self.completed)
        self.reissued += len(back)
        self.in_flight.clear()
        self.completed.clear()
        self.released.clear()
        self.pending = sorted(self.pending + back, key=self._order.__getitem__)
        self.generation += 1
        return len(back)
