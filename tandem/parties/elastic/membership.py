"""Heartbeat survival detection as a pure state machine (no asyncio, no clock of its own).

Workers call `Membership.beat(worker, incarnation, now)`; the coordinator calls
`Membership.detect(now)` every detection interval ``T``. The caller supplies ``now`` from
whatever clock it likes (the event loop's, or a fake one in tests).

Contract:

* ``live`` is the list of workers used for training; it only changes inside `detect`, so a
  worker that joins is used from the next detection on.
* A live worker whose last beat is older than ``timeout`` at detection time is removed.
* A worker that beat within ``timeout`` and is not live joins at detection time.
* A worker that beats with a new ``incarnation`` (it restarted and lost whatever it was doing)
  counts as a change: the old incarnation leaves and the new one joins.
* A `ban`ned worker (the coordinator fenced it: `tandem.parties.elastic.audit`) leaves at the
  next detection and never joins again under that name; its beats are ignored.

Invariant: ``live`` holds only workers with a recorded beat and no ban; every
``(worker, incarnation)`` in ``live`` is the latest incarnation seen when the detection ran.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Detection:
    """Outcome of one survival detection."""

    live: frozenset[str]
    joined: frozenset[str]
    left: frozenset[str]

    @property
    def changed(self) -> bool:
        return bool(self.joined or self.left)


class Membership:
    """Live workers by heartbeat. ``timeout`` is in the caller's clock units (seconds)."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"heartbeat timeout must be > 0 s, got {timeout!r}")
        self.timeout = float(timeout)
        self._last: dict[str, float] = {}
        self._incarnation: dict[str, str] = {}
        self._live: dict[str, str] = {}  # worker -> incarnation at the last detection
        self.banned: set[str] = set()

    @property
    def live(self) -> frozenset[str]:
        return frozenset(self._live)

    def last_beat(self, worker: str) -> float | None:
        return self._last.get(worker)

    def beat(self, worker: str, incarnation: str, now: float) -> bool:
        """Record a heartbeat; returns True when this is a new incarnation of ``worker``
        (always False for a banned worker: its beats are not recorded)."""
        if worker in self.banned:
            return False
        new = self._incarnation.get(worker) != incarnation
        self._incarnation[worker] = incarnation
        prev = self._last.get(worker)
        self._last[worker] = now if prev is None else max(prev, now)
        return new

    def ban(self, worker: str) -> None:
        """Remove ``worker`` at the next detection, for good (its beats are ignored)."""
        self.banned.add(worker)
        self._last.pop(worker, None)
        self._incarnation.pop(worker, None)

    def alive(self, worker: str, now: float) -> bool:
        """Whether ``worker`` beat within ``timeout`` of ``now`` (regardless of ``live``)."""
        last = self._last.get(worker)
        return last is not None and now - last <= self.timeout

    def suspects(self, now: float) -> frozenset[str]:
        """Live workers that would be removed if a detection ran at ``now``."""
        return frozenset(
            w
            for w, inc in self._live.items()
            if not self.alive(w, now) or self._incarnation.get(w) != inc
        )

    def silent(self, now: float, seconds: float) -> frozenset[str]:
        """Live workers with no beat in the last ``seconds`` (a cheaper, earlier suspicion
        than `suspects`, used only to stop waiting for their in-flight batches)."""
        return frozenset(
            w for w in self._live if w not in self._last or now - self._last[w] > seconds
        )

    def detect(self, now: float) -> Detection:
        """Run one survival detection at time ``now`` and update ``live``."""
        new_live = {w: inc for w, inc in self._incarnation.items() if self.alive(w, now)}
        old = set(self._live.items())
        new = set(new_live.items())
        left = frozenset(w for w, _ in old - new)
        joined = frozenset(w for w, _ in new - old)
        self._live = new_live
        # forget workers that are long gone, so the maps stay bounded under churn
        for w in [w for w, t in self._last.items() if now - t > 10 * self.timeout]:
            del self._last[w], self._incarnation[w]
        return Detection(live=frozenset(new_live), joined=joined, left=left)
