"""The coordinator's side of its workers: discovery, heartbeats, welcomes, batch assignment,
done-reports and the fencing of workers whose reports cannot be true.

`Workforce.discover` watches every addressable peer that is not a data server (a roster member,
or a stranger the transport admitted: `tandem.transports.http.identity.Gate`) as a possible
worker: one task reads its heartbeats (`Membership.beat`; a new incarnation is welcomed with
the data servers' directory), one its ``DONE`` reports. `assign` hands every idle live worker
the next pending batch of the `Ledger`.

A report is accepted by the ledger only for the current generation and the batch's holder.
Reports are audited (`tandem.parties.elastic.audit.ReportAudit`): a batch reported done that
the data servers did not apply by the next checkpoint is a strike; a struck worker's further
reports are refused and their batches go back to pending at once; at ``limit`` strikes the
worker is banned from the membership (it leaves at the next detection and is never welcomed
again), so such a worker cannot hold the job in place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.errors import TransportError
from tandem.transports.base import Frame, Transport

from . import protocol as P
from .audit import ReportAudit
from .errors import ElasticError
from .ledger import Ledger
from .membership import Membership

log = logging.getLogger(__name__)


class Workforce:
    """The workers of one coordinator. ``ledger()`` returns the current batch ledger (None
    until the coordinator's hello built it: workers are welcomed before, see `discover`);
        ``event(kind, detail)`` records an event; ``wake`` is set whenever something changed."""

    def __init__(
        self,
        transport: Transport,
        membership: Membership,
        *,
        data_servers: Mapping[str, str],
        ledger: Callable[[], Ledger | None],
        event: Callable[[str, Any], None],
        clock: Callable[[], float],
        wake: asyncio.Event,
        poll: float,
        false_reports: int,
    ) -> None:
        self.t = transport
        self.membership = membership
        self.data_servers = dict(data_servers)
        self.ledger = ledger
        self.event = event
        self.clock = clock
        self.wake = wake
        self.poll = poll
        self.audit = ReportAudit(false_reports)
        self.urls: dict[str, str] = {}
        self.busy: dict[str, tuple[int, int]] = {}  # worker -> (batch, generation)
        self.watched: set[str] = set()
        self.listeners: set[asyncio.Task] = set()

    async def discover(self, tg: asyncio.TaskGroup) -> None:
        """Watch every addressable peer that is not a data server (forever: cancel it and
        `listeners`); the watchers run in ``tg``. The coordinator starts it before its hello
        to the data servers (which may wait for them to start and compile), so a worker is
        welcomed within its ``join_timeout`` however long the data servers take."""
        skip = set(self.data_servers) | {self.t.name}
        while True:
            for peer in self.t.peers:
                if peer not in skip and peer not in self.watched:
                    self.watched.add(peer)
                    self.listeners.add(tg.create_task(self._heartbeats(peer)))
                    self.listeners.add(tg.create_task(self._reports(peer)))
            await asyncio.sleep(self.poll)

    async def _heartbeats(self, worker: str) -> None:
        while True:
            try:
                hb = await self.t.recv(worker, P.HB)
            except TransportError:
                return
            url = hb.meta.get("url")
            if url and worker not in self.membership.banned:
                self.urls[worker] = str(url)
            if self.membership.beat(worker, str(hb.meta.get("incarnation", "")), self.clock()):
                self.busy.pop(worker, None)  # a restarted worker lost what it was doing
                self.event("beat_new", worker)
                P.learn_peer(self.t, worker, url)
                try:
                    meta = {"data_servers": self.data_servers}
                    await self.t.send(worker, P.WELCOME, Frame(meta=meta))
                except TransportError as exc:
                    log.info("cannot welcome %s: %s", worker, exc)
                self.wake.set()

    async def _reports(self, worker: str) -> None:
        while True:
            try:
                done = await self.t.recv(worker, P.DONE)
            except TransportError:
                return
            self.report(worker, done.meta)
            self.wake.set()

    def report(self, worker: str, meta: Mapping[str, Any]) -> None:
        """Take ``worker``'s done-report (module docstring)."""
        batch, gen = meta.get("batch"), meta.get("gen")
        if self.busy.get(worker) == (batch, gen):
            del self.busy[worker]
        if not (meta.get("ok") and isinstance(batch, int) and isinstance(gen, int)):
            return
        ledger = self.ledger()
        if ledger is None:  # before the hello: a report of an earlier coordinator's batch
            log.info("%s: report of batch %d from %r before the ledger: ignored", self.t.name,
                     batch, worker)  # fmt: skip
            return
        if self.audit.fenced(worker) and gen == ledger.generation:
            ledger.release(batch, worker)
            self.event("report_refused", (worker, batch))
            log.warning(
                "%s: report of batch %d from fenced worker %r refused", self.t.name, batch, worker
            )
            if self.audit.refuse(worker):
                self.ban(worker)
        elif ledger.report(batch, gen, worker):
            self.audit.record(batch, worker)
            self.event("done", (worker, batch))

    def settle(self, applied: Iterable[int]) -> None:
        """At a checkpoint: strike every accepted report the data servers did not apply."""
        for worker in self.audit.settle(applied):
            self.ban(worker)

    def ban(self, worker: str) -> None:
        log.warning(
            "%s: worker %r removed: %d done-reports without gradients (the data servers did "
            "not apply those batches)",
            self.t.name,
            worker,
            self.audit.strikes.get(worker, 0),
        )
        self.membership.ban(worker)
        self.busy.pop(worker, None)
        self.event("fenced", worker)

    def tally(self, requeued: int = 0) -> dict[str, Any]:
        """The run's cumulative counts for the journal (`journal.TALLY`), with ``requeued``
        more batches re-issued (those the checkpoint being journaled is about to put back)."""
        ledger = self._ledger()
        return {
            "reissued": ledger.reissued + requeued,
            "refused_reports": ledger.refused,
            **self.audit.tally(),
        }

    def restore(self, tally: Mapping[str, Any]) -> None:
        """Take back a journaled `tally` after a restart: the ledger's counts, the audit's
        strikes and refusals, and the bans (a banned worker stays out of the membership)."""
        ledger = self._ledger()
        ledger.reissued = int(tally["reissued"])
        ledger.refused = int(tally["refused_reports"])
        self.audit.restore(tally)
        for worker in sorted(self.audit.banned):
            self.membership.ban(worker)

    def _ledger(self) -> Ledger:
        ledger = self.ledger()
        if ledger is None:
            raise ElasticError("the coordinator has no batch ledger before its hello phase")
        return ledger

    def forget(self, workers: Iterable[str]) -> None:
        for worker in workers:
            self.busy.pop(worker, None)

    def admit(self) -> None:
        """Take ``REPLY`` only from data servers, ``HB`` and ``DONE`` only from others."""
        servers = set(self.data_servers)
        P.admit_channels(
            self.t,
            {
                P.REPLY: servers.__contains__,
                P.HB: lambda s: s not in servers,
                P.DONE: lambda s: s not in servers,
            },
        )

    def assign(self) -> list[tuple[str, dict]]:
        """Give every idle live worker the next pending batch: ``(data server, train
        request)`` pairs."""
        ledger = self._ledger()
        out = []
        idle = self.membership.live - set(self.busy) - self.membership.banned
        for worker in sorted(idle):
            got = ledger.assign(worker)
            if got is None:
                break
            ds, batch = got
            self.busy[worker] = (batch, ledger.generation)
            meta = {
                "op": "train",
                "req": -1,
                "batch": batch,
                "worker": worker,
                "gen": ledger.generation,
                "url": self.urls.get(worker, ""),
            }
            out.append((ds, meta))
        return out
