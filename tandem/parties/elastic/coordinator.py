"""The coordinator (static): survival detection, the live-worker list, the batch ledger, and
training requests to the data servers.

Loop (every ``interval`` T seconds):

1. **Train** for up to T: give every idle live worker the next pending batch by sending its
   data server a ``train`` request with the worker's name and address.
2. **Pause**: stop issuing; wait until in-flight batches are reported (at most ``drain``
   seconds, less if a busy worker stopped beating).
3. **Detect** (`Membership.detect`). Unchanged: fence every data server at generation g+1,
   merge the replicas (mean of parameters and float optimizer state), checkpoint, and commit in
   the ledger exactly the batches the parameter servers hold. Changed, with ``on_change =
   "rollback"``: roll every parameter server back to the last checkpoint at generation g+1;
   every uncommitted batch is issued again. Changed, with ``on_change = "keep"``: checkpoint as
   if unchanged (fencing already refuses the late results of a removed worker). Results
   stamped g are refused from then on.
4. When every batch of the epoch is committed, each data server closes the epoch, checking that
   its parameters reflect each of its batches exactly once.

**Durability** (with a `Journal`): every checkpoint has a sequence number ``seq``. The data
servers first write checkpoint ``seq`` durably (two-phase: prepared), then the coordinator
appends the commit (``seq``, generation, epoch, the batch ids) to its journal and only then
commits it in the ledger. A coordinator restarted after ``kill -9`` replays its journal and
restores every data server to the journal's ``seq``, so a checkpoint written but not yet
journaled is discarded and its batches issued again: each batch stays committed exactly once.
Rollbacks and recoveries are journaled as well, and every record carries the run's tally
(re-issued batches, refused reports, false-report strikes and bans), so a restarted
coordinator's counters, its bans and so its summary cover the whole run (`journal`).

**Data server failures.** A data server that does not answer (killed, restarted, unreachable
for ``call_timeout``) stops the round: the coordinator waits up to ``recover_timeout`` for every
data server to answer, restores them all to the last committed checkpoint at a new generation
(a restarted one reads it from its store), and issues every uncommitted batch again.

The pieces: requests to the data servers in `calls.DataServerCalls`; the workers' side
(heartbeats, welcomes, assignment, done-reports and the fencing of workers whose reports come
without gradients) in `workforce.Workforce`; the merge of replicas in `replicas`; settings and
progress in `coordinator_config`.

``events`` records (time, kind, detail) for observers (tests, the benchmark); ``on_phase`` is
called on every phase change with the phase name.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tandem.errors import TransportError
from tandem.transports.base import Frame, Transport

from . import protocol as P
from .calls import DataServerCalls
from .coordinator_config import ON_CHANGE, CoordinatorConfig, Progress
from .errors import ConfigError, DataServerDownError, ElasticError, JournalError
from .journal import Journal, JournalState
from .ledger import Ledger
from .membership import Detection, Membership
from .replicas import merge_replicas
from .workforce import Workforce

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self,
        transport: Transport,
        config: CoordinatorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_phase: Callable[[str], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.t = transport
        self.cfg = config
        self.clock = clock
        self.on_phase = on_phase or (lambda phase: None)
        self.on_progress = on_progress or (lambda p: None)
        self.membership = Membership(config.heartbeat_timeout)
        self.ledger: Ledger | None = None
        self.phase = "init"
        self.progress = Progress()
        self.events: collections.deque[tuple[float, str, Any]] = collections.deque(maxlen=100_000)
        self.history: list[dict[str, Any]] = []  # per epoch: committed ids, losses
        self._wake = asyncio.Event()
        self.calls = DataServerCalls(
            transport,
            config.data_servers,
            call_timeout=config.call_timeout,
            pause=config.interval / 4,
        )
        servers = dict(config.data_server_urls)
        self.workers = Workforce(
            transport,
            self.membership,
            data_servers={ds: servers.get(ds, "") for ds in config.data_servers},
            ledger=lambda: self.ledger,
            event=self._event,
            clock=clock,
            wake=self._wake,
            poll=config.interval / 4,
            false_reports=config.false_reports,
        )
        self._n_batches: dict[str, int] = {}
        self._ckpt_digest: dict[str, str] = {}
        self._stop_requested = False
        self.initial_loss: float | None = None
        self.journal = Journal(config.journal) if config.journal else None
        self.resumed: dict[str, Any] | None = None  # what a restart found in the journal
        self.restarts = 0  # restarts of the coordinator during the run (from the journal)
        self._seq = 0  # the last committed checkpoint every data server holds
        self.training = uuid.uuid4().hex  # the run's id (kept across restarts by the journal)
        self.test: dict[str, dict[str, Any]] = {}
        self.exports: dict[str, str] = {}
        self.workers.admit()

    @property
    def _watched(self) -> set[str]:
        """Every peer ever watched as a possible worker."""
        return self.workers.watched

    @property
    def _down(self) -> set[str]:
        return self.calls.down

    @property
    def _ready_ledger(self) -> Ledger:
        """The ledger `_hello` builds; every step that reads it runs after `_hello`."""
        if self.ledger is None:
            raise ElasticError("the coordinator has no batch ledger before its hello phase")
        return self.ledger

    # -- plumbing --------------------------------------------------------------------------
    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.on_phase(phase)

    def _event(self, kind: str, detail: Any = None) -> None:
        self.events.append((self.clock(), kind, detail))

    async def _call_all(
        self, op: str, per_ds: Callable[[str], dict] | None = None, arrays=(), **meta
    ) -> dict[str, Frame]:
        """`DataServerCalls.call_all`."""
        return await self.calls.call_all(op, per_ds, arrays, **meta)

    async def _wait(self, seconds: float) -> None:
        self._wake.clear()
        if seconds > 0:
            try:
                async with asyncio.timeout(seconds):
                    await self._wake.wait()
            except TimeoutError:
                pass

    # -- the protocol ----------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Train ``epochs`` epochs; returns a summary. Leaves no task running."""
        async with asyncio.TaskGroup() as tg:
            helpers = [tg.create_task(self.calls.replies_from(ds)) for ds in self.cfg.data_servers]
            helpers.append(tg.create_task(self.workers.discover(tg)))  # welcome workers at once
            try:
                await self._hello()
                await self._train()
                await self._finish()
                await self._stop()
            finally:
                for task in helpers:
                    task.cancel()
                for task in self.workers.listeners:
                    task.cancel()
        return self.summary()

    async def _hello(self) -> None:
        self._set_phase("hello")
        for ds, url in self.cfg.data_server_urls:
            P.learn_peer(self.t, ds, url)
        reps = await self._call_all(
            "hello", per_ds=lambda ds: {"index": self.cfg.data_servers.index(ds)}
        )
        specs = {ds: rep.meta["spec"] for ds, rep in reps.items()}
        if len(set(specs.values())) != 1:
            raise ConfigError(
                f"data servers loaded different model descriptions {specs}; "
                "point every data server at the same model URL"
            )
        self._n_batches = {ds: int(rep.meta["n_batches"]) for ds, rep in reps.items()}
        spec = next(iter(specs.values()))
        state = await asyncio.to_thread(self.journal.open) if self.journal else None
        if state is not None:
            gen = max([state.generation, *(int(r.meta["generation"]) for r in reps.values())])
            await self._resume(state, spec, gen)
            return
        self.ledger = ledger = Ledger(self._batches())
        self.progress.total = ledger.total
        self._remember(await self._call_all("checkpoint", seq=0))
        losses = await self._call_all("eval")
        self.initial_loss = float(np.mean([rep.meta["loss"] for rep in losses.values()]))
        await self._journal(
            {
                "kind": "start",
                "data_servers": list(self.cfg.data_servers),
                "n_batches": self._n_batches,
                "spec": spec,
                "seq": 0,
                "digests": self._ckpt_digest,
                "initial_loss": self.initial_loss,
                "training": self.training,
            }
        )

    async def _journal(self, record: dict[str, Any]) -> None:
        if self.journal is not None:
            await asyncio.to_thread(self.journal.append, record)

    async def _resume(self, state: JournalState, spec: str, generation: int) -> None:
        """Continue the run the journal records: the ledger as committed, every data server
        restored to the journal's checkpoint."""
        start = state.start
        if (
            start.get("data_servers") != list(self.cfg.data_servers)
            or start.get("spec") != spec
            or start.get("n_batches") != self._n_batches
        ):
            raise JournalError(
                f"journal {self.cfg.journal!r} records another run (data servers "
                f"{start.get('data_servers')}, model {start.get('spec')}, batches "
                f"{start.get('n_batches')}; now {list(self.cfg.data_servers)}, {spec}, "
                f"{self._n_batches}); move it away to start afresh, or restore that run's setup"
            )
        self.ledger = ledger = Ledger(self._batches(), generation=generation, epoch=state.epoch)
        ledger.restore(state.committed)
        self.progress.total = ledger.total
        self.history = list(state.history)
        self.initial_loss = float(start["initial_loss"])
        self.training = str(start.get("training", self.training))
        self._seq = state.seq
        self._ckpt_digest = dict(state.digests)
        p, counts = self.progress, state.counts
        p.checkpoints, p.rollbacks = counts["checkpoints"], counts["rollbacks"]
        p.recoveries, self.restarts = counts["recoveries"], counts["restarts"]
        self.workers.restore(state.tally)
        ledger.reissued = counts["reissued"]  # the tally's, or the older journals' deltas
        p.loss = self.history[-1]["loss"] if self.history else self.initial_loss
        self.resumed = {
            "epoch": state.epoch,
            "committed": len(state.committed),
            "seq": state.seq,
            "epochs_done": len(state.history),
        }
        self._event("resumed", dict(self.resumed))
        log.info("resuming from journal %s: %s", self.cfg.journal, self.resumed)
        self.restarts += 1
        await self._recover("the coordinator restarted", restart=True)

    def _batches(self) -> dict[str, list[int]]:
        return {
            ds: [i * P.STRIDE + b for b in range(self._n_batches[ds])]
            for i, ds in enumerate(self.cfg.data_servers)
        }

    async def _train(self) -> None:
        cfg, ledger = self.cfg, self._ready_ledger
        if len(self.history) >= cfg.epochs:  # resumed after the last epoch closed
            return
        since = said = self.clock()
        while len(self.membership.live) < max(cfg.min_workers, 1) or not self.membership.live:
            self._set_phase("waiting")
            await self._wait(cfg.interval)
            self.membership.detect(self.clock())
            if self.clock() - said > max(10.0, 10 * cfg.interval):  # name what it waits for
                said = self.clock()
                log.warning(
                    "waiting %.0f s for %d live worker(s) (min_workers); live: %s, watched: %s",
                    said - since, max(cfg.min_workers, 1), sorted(self.membership.live),
                    sorted(self._watched),
                )  # fmt: skip
                self._report()
        self._event("live", sorted(self.membership.live))
        while True:
            self._set_phase("train")
            end = self.clock() + cfg.interval
            while self.clock() < end and not ledger.drained:
                for ds, meta in self.workers.assign():
                    await self.calls.request_training(ds, meta)
                await self._wait(end - self.clock())
            self._set_phase("pause")
            end = self.clock() + cfg.drain_time
            while ledger.in_flight and self.clock() < end:
                busy = set(ledger.in_flight.values())
                quiet = self.membership.silent(self.clock(), cfg.heartbeat_timeout / 2)
                if busy & quiet:  # a holder went quiet: its batch will be fenced anyway
                    break
                await self._wait(min(end - self.clock(), cfg.interval / 10))
            det = self.membership.detect(self.clock())
            try:
                if self._down:
                    raise DataServerDownError(f"data server(s) {sorted(self._down)} failed")
                if det.changed and cfg.on_change == "rollback":
                    await self._rollback(det)
                else:
                    await self._checkpoint(det)
            except DataServerDownError as exc:
                await self._recover(str(exc))
            self._report()
            if self._stop_requested:
                return
            if ledger.done:
                try:
                    more = await self._close_epoch()
                except DataServerDownError as exc:
                    await self._recover(str(exc))
                    continue
                if not more:
                    return

    def request_stop(self) -> None:
        """Finish after the next detection (checkpoint or rollback), even mid-epoch."""
        self._stop_requested = True
        self._wake.set()

    async def _checkpoint(self, det: Detection | None = None) -> None:
        """Fence, merge and checkpoint; journal the commit, then commit it in the ledger.
        With a membership change (``on_change = "keep"``) the removed workers are forgotten
        first; their late results are refused by the fence."""
        self._set_phase("checkpoint")
        ledger = self._ready_ledger
        fence: dict[str, Any] = {}
        if det is not None and det.changed:
            self._membership_changed(det)
            fence["live"] = sorted(det.live)
        gen = ledger.generation + 1
        seq = self._seq + 1
        merge = len(self.cfg.data_servers) > 1
        fenced = await self._call_all("fence", gen=gen, export=merge, **fence)
        applied = [b for rep in fenced.values() for b in rep.meta["applied"]]
        merged: Sequence[np.ndarray] = ()
        if merge:
            merged = await asyncio.to_thread(merge_replicas, [r.arrays for r in fenced.values()])
        reps = await self._call_all("checkpoint", arrays=merged, seq=seq)
        self._check_replicas(reps)
        digests = {ds: rep.meta["digest"] for ds, rep in reps.items()}
        self.workers.settle(applied)  # before the record, so its tally holds the strikes
        await self._journal(
            {
                "kind": "commit",
                "seq": seq,
                "generation": gen,
                "epoch": ledger.epoch,
                "batches": applied,
                "digests": digests,
                "tally": self.workers.tally(requeued=ledger.unapplied(applied)),
            }
        )
        self._seq = seq
        self._remember(reps)
        committed = ledger.checkpoint(applied)
        # reports the ledger took while the record was written (still this generation) are
        # judged by this checkpoint too: left recorded, the next one would strike them
        self.workers.settle(applied)
        self.progress.checkpoints += 1
        self._event("commit", len(committed))
        if det is not None and det.changed:
            self._event("kept", len(committed))

    def _membership_changed(self, det: Detection) -> None:
        self._event("removed", sorted(det.left))
        self._event("joined", sorted(det.joined))
        self.workers.forget(det.left)

    async def _recover(self, reason: str, restart: bool = False) -> None:
        """Wait for every data server, restore them all to the last committed checkpoint at a
        new generation, and issue every uncommitted batch again (module docstring); journaled
        (``restart``: because the coordinator restarted) so the counts survive a restart."""
        self._set_phase("recover")
        ledger = self._ready_ledger
        log.warning("recovering the data servers (%s)", reason)
        self._event("recover_start", reason)
        gen = ledger.generation + 1
        deadline = self.clock() + self.cfg.recover_timeout
        while True:
            try:
                reps = await self._call_all(
                    "restore",
                    per_ds=lambda ds: {"index": self.cfg.data_servers.index(ds)},
                    seq=self._seq,
                    gen=gen,
                    live=sorted(self.membership.live),
                )
                break
            except DataServerDownError as exc:
                if self.clock() > deadline:
                    raise ElasticError(
                        f"data servers did not all come back within {self.cfg.recover_timeout:g}"
                        f" s ({exc}); restart them with the same checkpoints URL, or raise "
                        "recover_timeout"
                    ) from None
                await asyncio.sleep(self.cfg.interval)
        self._check_replicas(reps)
        for ds, rep in reps.items():
            if int(rep.meta["n_batches"]) != self._n_batches.get(ds):
                raise ElasticError(
                    f"data server {ds!r} came back with {rep.meta['n_batches']} batches, not "
                    f"{self._n_batches.get(ds)}: it was restarted with other data"
                )
        back = {ds: rep.meta["digest"] for ds, rep in reps.items()}
        self._event("rollback_digests", back)
        wrong = [ds for ds, d in back.items() if d != self._ckpt_digest.get(ds)]
        if wrong:
            raise ElasticError(
                f"data server(s) {wrong} did not restore checkpoint {self._seq} bit for bit"
            )
        self.workers.busy.clear()
        self.workers.audit.forget()
        self._down.clear()
        # the rollback digests are counted as rollbacks by observers: keep the counts in step
        n = ledger.rollback()
        if ledger.generation != gen:
            raise ElasticError(f"ledger generation {ledger.generation} != restore's {gen}")
        await self._journal_counted("recover", gen, n, restart=restart)
        self.progress.rollbacks += 1
        self.progress.recoveries += 1
        self._event("recover", n)

    async def _rollback(self, det: Detection) -> None:
        self._set_phase("rollback")
        ledger = self._ready_ledger
        self._membership_changed(det)
        gen = ledger.generation + 1
        reps = await self._call_all("rollback", gen=gen, live=sorted(det.live))
        self._check_replicas(reps)
        back = {ds: rep.meta["digest"] for ds, rep in reps.items()}
        self._event("rollback_digests", back)
        wrong = [ds for ds, d in back.items() if d != self._ckpt_digest.get(ds)]
        if wrong:
            raise ElasticError(
                f"parameter server(s) {wrong} did not return bit-identical to "
                "their last checkpoint after rollback"
            )
        self.workers.audit.forget()
        n = ledger.rollback()
        await self._journal_counted("rollback", gen, n)
        self.progress.rollbacks += 1
        self._event("rollback", n)
        log.info(
            "membership changed (+%s -%s): rolled back, %d batches re-issued",
            sorted(det.joined),
            sorted(det.left),
            n,
        )

    async def _journal_counted(self, kind: str, gen: int, reissued: int, **extra: Any) -> None:
        """Journal a ``rollback`` or ``recover`` (`journal` module: kept for the counts)."""
        await self._journal(
            {
                "kind": kind,
                "seq": self._seq,
                "generation": gen,
                "digests": dict(self._ckpt_digest),
                "reissued": reissued,
                "tally": self.workers.tally(),
                **extra,
            }
        )

    def _remember(self, reps: dict[str, Frame]) -> None:
        self._ckpt_digest = {ds: rep.meta["digest"] for ds, rep in reps.items()}
        self._event("checkpoint_digests", dict(self._ckpt_digest))

    def _check_replicas(self, reps: dict[str, Frame]) -> None:
        models = {rep.meta["model"] for rep in reps.values()}
        if len(models) != 1:
            raise ElasticError(
                f"replicas diverged after {self.phase}: "
                f"{ {ds: r.meta['model'][:12] for ds, r in reps.items()} }"
            )

    async def _close_epoch(self) -> bool:
        self._set_phase("epoch")
        ledger = self._ready_ledger
        seq = self._seq + 1
        reps = await self._call_all("epoch", seq=seq)
        losses = await self._call_all("eval")
        loss = float(np.mean([rep.meta["loss"] for rep in losses.values()]))
        await self._journal(
            {
                "kind": "epoch",
                "seq": seq,
                "epoch": ledger.epoch,
                "loss": loss,
                "generation": ledger.generation,
                "digests": {ds: rep.meta["digest"] for ds, rep in reps.items()},
                "tally": self.workers.tally(),
            }
        )
        self._seq = seq
        self._remember(reps)
        self.history.append(
            {
                "epoch": ledger.epoch,
                "committed": list(ledger.committed),
                "loss": loss,
                "generation": ledger.generation,
            }
        )
        self.progress.loss = loss
        self._event("epoch", loss)
        if ledger.epoch + 1 >= self.cfg.epochs:
            self._report()
            return False
        ledger.new_epoch(self._batches())
        self._report()
        return True

    def _report(self) -> None:
        p, ledger = self.progress, self._ready_ledger
        p.epoch, p.committed = ledger.epoch, len(ledger.committed)
        p.live, p.generation = len(self.membership.live), ledger.generation
        self.on_progress(p)

    async def _finish(self) -> None:
        """Evaluate the trained model on every data server's test rows and have each data
        server that is configured to export it write the export."""
        self._set_phase("finish")
        try:
            tests = await self._call_all("test")
            exports = await self._call_all("export", training=self.training)
        except DataServerDownError as exc:
            await self._recover(str(exc))
            tests = await self._call_all("test")
            exports = await self._call_all("export", training=self.training)
        self.test = {
            ds: {k: rep.meta.get(k) for k in ("rows", "loss", "accuracy", "objective")}
            for ds, rep in tests.items()
        }
        self.exports = {ds: rep.meta["path"] for ds, rep in exports.items() if rep.meta["path"]}

    async def _stop(self) -> None:
        """Tell the data servers, then every worker ever heard from, to stop. Workers the
        membership holds dead are told too: one that was only slow (its heartbeats late on a
        loaded machine) would otherwise wait out its transport's ``peer_timeout``. The sends
        run at once and each is bounded, so a worker that is truly gone delays the end by at
        most ``max(2 s, 2 T)``."""
        self._set_phase("stop")
        await self._call_all("stop")

        async def stop(worker: str) -> None:
            try:
                async with asyncio.timeout(max(2.0, 2 * self.cfg.interval)):
                    await self.t.send(worker, P.CTL, Frame(meta={"op": "stop"}))
            except (TransportError, TimeoutError):
                pass

        async with asyncio.TaskGroup() as tg:
            for worker in sorted(self._watched):
                tg.create_task(stop(worker))

    def summary(self) -> dict[str, Any]:
        return {
            "epochs": len(self.history),
            "history": self.history,
            "initial_loss": self.initial_loss,
            "checkpoints": self.progress.checkpoints,
            "rollbacks": self.progress.rollbacks,
            "recoveries": self.progress.recoveries,
            "restarts": self.restarts,
            "on_change": self.cfg.on_change,
            "resumed": self.resumed,
            "training": self.training,
            "test": self.test,
            "exports": self.exports,
            "reissued": self.ledger.reissued if self.ledger else 0,
            "refused_reports": self.ledger.refused if self.ledger else 0,
            "false_reports": dict(self.workers.audit.strikes),
            "fenced": sorted(self.workers.audit.banned),
            "fenced_reports": self.workers.audit.refused,
            "generation": self.ledger.generation if self.ledger else 0,
        }


__all__ = ["ON_CHANGE", "Coordinator", "CoordinatorConfig", "Progress"]
