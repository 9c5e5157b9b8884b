"""The leader's training loop (`SplitParty.fit`): epochs of seeded batches, the hooks between
them, the micro-batch tuner's observations, and announcing the next batch ahead.

`Fit` holds one call's state: each epoch's batch order (one epoch's at a time), the data cursor
to resume from, and the command announced ahead (`Announce`). The batches of an epoch depend
only on the seed and the epoch (`tandem.engine.data.epoch_batches`), so a resumed call skips
exactly the batches already trained. Every party runs every batch the leader commands, once,
in order, whether or not it was announced ahead: exactness does not depend on it.

Announcing ahead: the command of the next batch is sent while the current one runs,
so a follower finds it waiting when its update is done: one round trip per batch
fewer on a long link. It leaves once the leader's last op whose result is sent has
run (`PartyRuntime.run`'s ``produced``: its own backward and updates may still be
running), with a fixed ``groups`` and with ``"auto"`` alike, at the count current
then: the tuner observes a batch once all its compute has run (``computed``), so
its choice applies to the batch after the one already announced.
``announce_ahead``: None (the default) announces ahead only without ``after_batch``,
where each command otherwise waits for the hook (which may stop training, and a
command sent cannot be taken back); True announces ahead with the hook too, and a
true answer from it then stops training after the batch already announced, for which
the hook is awaited as well (its answer no longer matters): every party still runs
every batch commanded, once, in order; False never announces ahead. The hook always
runs between two batches of the leader: batch ``b``'s update is done and ``b + 1``'s
compute has not begun, so its parameters, optimizer state, ``step`` and ``loss_sum``
are batch ``b``'s (a follower may meanwhile run ``b + 1``'s forward, which changes
none of them). With ``after_epoch``, an epoch's first command waits for it. The
tuner's wall of a batch is the time from the end of the previous batch's compute to the end
of its own (from its command, when that was not announced ahead; to the batch's end, when the
next is not announced ahead). The tuner learns only from a batch that ran at the
count it asked for (`retune`): one that ran at another (announced before the tuner's last
choice, or a count restored from a checkpoint) is no sample.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from tandem.engine.data import epoch_batches
from tandem.engine.lanes import ThreadLane
from tandem.engine.microbatch import GroupTuner, TunerState
from tandem.engine.runtime import BatchStats, PartyRuntime
from tandem.parties.privacy.audit import PartyAudit
from tandem.transports.base import Transport

from ..privacy.accounting import epoch_report
from ..privacy.config import Privacy
from .admission import PlanAdmission
from .command_rows import Draw
from .settings import EpochResult, SplitConfig
from .stages import StageHandler

#: ``after_batch(epoch, batches_done_in_epoch)``: true stops training (`SplitParty.fit`).
AfterBatch = Callable[[int, int], Awaitable[bool | None]]
#: ``after_epoch(result)``: true stops training after that epoch.
AfterEpoch = Callable[[EpochResult], Awaitable[bool | None]]


class SplitParty(Protocol):
    """What the training loop uses of a leader `tandem.parties.split.party.SplitParty` (named
    here, not imported, so the party can import this module)."""

    name: str
    config: SplitConfig
    transport: Transport
    handler: StageHandler
    admission: PlanAdmission
    labels: dict[str, np.ndarray]
    privacy: Privacy
    history: list[EpochResult]
    audit: PartyAudit | None
    followers: tuple[str, ...]
    n_groups: int
    interrupted: str | None
    tuner: GroupTuner
    tuner_state: TunerState
    tuner_path: list[tuple[int, float]]
    _tune_mark: tuple[float, dict[tuple[str, str], tuple[int, float]]]

    @property
    def batches_done(self) -> int: ...

    @property
    def step(self) -> int: ...

    def _runtime(self, lane: Any) -> PartyRuntime: ...

    async def _start_batch(
        self,
        idx: np.ndarray,
        n: int,
        mode: str,
        dataset: str,
        draw: Draw | None = None,
        **meta: Any,
    ) -> tuple[int, int]: ...

    async def _run_batch(
        self,
        runtime: PartyRuntime,
        idx: np.ndarray,
        n: int,
        mode: str,
        dataset: str,
        chunks: int = 1,
        computed: Callable[[BatchStats], Awaitable[None]] | None = None,
        produced: Callable[[BatchStats], Awaitable[None]] | None = None,
    ) -> BatchStats: ...

    def _batch_command(
        self, b: int, rows: int, n: int, mode: str, dataset: str, **meta: Any
    ) -> tuple[int, int, dict[str, Any]]: ...

    async def _command(
        self, meta: dict, idx: np.ndarray | None = None, draw: Draw | None = None
    ) -> None: ...


class Fit:
    """One call of `SplitParty.fit` on the leader ``party`` (its arguments as there).

    Invariant: ``ahead`` is None or holds the command of the batch after the one that last
    ran (n, chunks, the task sending it); ``stopping`` is set once ``after_batch`` asked to
    stop while a command was already announced, so that batch runs and training then stops.
    """

    def __init__(
        self,
        party: SplitParty,
        epochs: int,
        *,
        dataset: str,
        on_batch: Callable[[int, int, float], None] | None,
        start_epoch: int | None,
        start_batch: int,
        after_batch: AfterBatch | None,
        after_epoch: AfterEpoch | None,
        announce_ahead: bool | None,
    ) -> None:
        self.party, self.dataset = party, dataset
        self.on_batch, self.after_batch, self.after_epoch = on_batch, after_batch, after_epoch
        self.n_rows = len(party.labels[dataset])
        self.first = len(party.history) if start_epoch is None else start_epoch
        self.last = self.first + epochs
        self.start_batch = start_batch
        self.ahead_ok = after_batch is None if announce_ahead is None else announce_ahead
        self.ahead: tuple[int, int, asyncio.Task] | None = None
        self.stopping = False
        self._order: dict[int, list[np.ndarray]] = {}

    def batches_of(self, epoch: int) -> list[np.ndarray]:
        """The row indices of each batch of ``epoch`` (one epoch's order kept at a time)."""
        if epoch not in self._order:
            self._order.clear()
            cfg = self.party.config
            self._order[epoch] = epoch_batches(self.n_rows, cfg.batch_size, epoch, cfg.seed)
        return self._order[epoch]

    def following(self, epoch: int, i: int) -> tuple[int, int, np.ndarray] | None:
        """The batch after batch ``i`` of ``epoch`` in this call (None: it is the last, or
        the epoch's last and an ``after_epoch`` hook, which may run batches or stop
        training, comes between)."""
        if i + 1 < len(self.batches_of(epoch)):
            return epoch, i + 1, self.batches_of(epoch)[i + 1]
        if self.after_epoch is None and epoch + 1 < self.last and self.batches_of(epoch + 1):
            return epoch + 1, 0, self.batches_of(epoch + 1)[0]
        return None

    async def run(self) -> None:
        """Train the epochs, appending each one's `EpochResult` to the party's ``history``."""
        party = self.party
        try:
            async with ThreadLane(f"tandem-{party.name}") as lane, asyncio.TaskGroup() as tg:
                runtime = party._runtime(lane)
                for epoch in range(self.first, self.last):
                    result, stop = await self._epoch(runtime, tg, epoch)
                    party.history.append(result)
                    if stop or (self.after_epoch is not None and await self.after_epoch(result)):
                        break
        except BaseException:
            if self.ahead is not None and party.interrupted is None:  # sent, never run
                party.interrupted = f"batch {party.batches_done} (train) was announced but not run"
            raise

    async def _epoch(
        self, runtime: PartyRuntime, tg: asyncio.TaskGroup, epoch: int
    ) -> tuple[EpochResult, bool]:
        """Run ``epoch``'s batches from the cursor; (its result, whether training stops)."""
        party = self.party
        t0 = time.perf_counter()
        batches = self.batches_of(epoch)
        skip = self.start_batch if epoch == self.first else 0
        total, rows, stop = 0.0, 0, False
        for i, idx in enumerate(batches):
            if i < skip:
                continue
            await self._batch(runtime, tg, epoch, i, idx)
            total += party.handler.loss_sum * len(idx)
            rows += len(idx)
            if self.on_batch is not None:
                self.on_batch(epoch, i + 1, party.handler.loss_sum)
            if self.after_batch is not None:
                asked = bool(await self.after_batch(epoch, i + 1))
                if self.stopping or (asked and self.ahead is None):
                    stop = True
                    break
                self.stopping = asked
        seconds = time.perf_counter() - t0
        if party.audit is not None:
            party.audit.end_epoch(epoch)
        # (no batch ran: a resume at the epoch's end, for its after_epoch hook; loss unknown)
        result = EpochResult(
            epoch, total / rows if rows else math.nan, seconds, party.n_groups, len(batches) - skip
        )
        result.privacy = epoch_report(
            party.privacy,
            batch_size=party.config.batch_size,
            samples=len(party.labels.get("train", ())),
            steps=party.step,
        )
        return result, stop

    async def _batch(
        self, runtime: PartyRuntime, tg: asyncio.TaskGroup, epoch: int, i: int, idx: np.ndarray
    ) -> None:
        """Command batch ``i`` of ``epoch`` (unless it was announced ahead) and run it,
        announcing the next one while it drains when allowed."""
        party = self.party
        if self.ahead is None:
            party._tune_mark = (time.perf_counter(), link_counters(party))
            n, c = await party._start_batch(
                idx,
                party.n_groups,
                "train",
                self.dataset,
                draw(party, self.n_rows, epoch, i),
                epoch=epoch,
                i=i,
            )
        else:
            (n, c, sent), self.ahead = self.ahead, None
            await sent
        nxt = self.following(epoch, i) if self.ahead_ok and not self.stopping else None
        announce = None if nxt is None else Announce(party, tg, nxt, self.dataset, self.n_rows)

        async def computed(stats: BatchStats) -> None:
            retune(party, stats.compute, len(idx), n)

        stats = await party._run_batch(
            runtime,
            idx,
            n,
            "train",
            self.dataset,
            c,
            computed=None if announce is None else computed,
            produced=announce,
        )
        if announce is None:
            retune(party, stats.compute, len(idx), n)
        else:
            self.ahead = announce.ahead


def draw(party: SplitParty, n_rows: int, epoch: int, i: int) -> Draw:
    """Where batch ``i`` of ``epoch`` of `SplitParty.fit` over ``n_rows`` rows comes from."""
    return Draw(n_rows, party.config.batch_size, party.config.seed, epoch, i)


def link_counters(party: SplitParty) -> dict[tuple[str, str], tuple[int, float]]:
    """(bytes, busy seconds) each way of every link of the leader ``party``, now."""
    out = {}
    for p in party.followers:
        s, r = party.transport.sent_stats(p), party.transport.received_stats(p)
        out[(p, "out")] = (s.bytes, s.busy_seconds)
        out[(p, "in")] = (r.bytes, r.busy_seconds)
    return out


def retune(party: SplitParty, compute: float, rows: int, ran_at: int) -> None:
    """Feed the tuner the batch of ``rows`` rows that ran at ``ran_at`` groups and has run all
    its compute (``compute`` seconds): its wall is the period since the previous mark (the end
    of the previous batch's compute, or this batch's command when not announced ahead), and
    the link counters' change over it. The tuner's count becomes ``n_groups``, which the next
    command not yet sent uses.

    Only a full batch that ran at the count the tuner asked for (``tuner_state.n``) is a sample:
    one announced before the tuner's last choice, or run at a count restored from a checkpoint,
    is not, and the tuner's count is asked for again."""
    now, after = time.perf_counter(), link_counters(party)
    (start, before), party._tune_mark = party._tune_mark, (now, after)
    if party.config.groups != "auto" or rows < party.config.batch_size:
        return
    if party.tuner_state.started and ran_at != party.tuner_state.n:
        party.n_groups = party.tuner_state.n
        return
    links = []
    for k, (b1, t1) in after.items():
        b0, t0 = before.get(k, (0, 0.0))
        if b1 > b0 and t1 > t0:
            links.append((b1 - b0, (b1 - b0) / (t1 - t0)))
    wall = now - start
    party.tuner_path.append((party.tuner_state.n, wall))
    party.n_groups, party.tuner_state = party.tuner.observe(
        party.tuner_state, wall, compute=compute, links=links
    )


class Announce:
    """The hook (`PartyRuntime.run`'s ``produced``) by which a leader's `SplitParty.fit`,
    once a training batch ran its last op whose result is sent, sends the command of the next
    training batch ``nxt = (epoch, i, row indices)`` at the party's current ``n_groups`` as a
    task of ``tg``; ``ahead`` then holds (n, chunks, that task).

    The command then reaches the followers beside the batch's last gradients, so a follower
    starts the next batch as soon as its update is done instead of a round trip later.
    Followers run commands in order, one batch at a time, so announcing one batch ahead
    changes nothing they compute: one update per batch, in order (exactness holds)."""

    def __init__(
        self,
        party: SplitParty,
        tg: asyncio.TaskGroup,
        nxt: tuple[int, int, np.ndarray],
        dataset: str,
        n_rows: int,
    ) -> None:
        self.party, self.tg, self.nxt, self.dataset, self.n_rows = party, tg, nxt, dataset, n_rows
        self.ahead: tuple[int, int, asyncio.Task] | None = None

    async def __call__(self, stats: BatchStats) -> None:
        party = self.party
        epoch, i, idx = self.nxt
        # the batch after the running one, which `_run_batch` has not counted yet
        n, c, cmd = party._batch_command(
            party.batches_done + 1,
            len(idx),
            party.n_groups,
            "train",
            self.dataset,
            epoch=epoch,
            i=i,
        )
        party.admission.announce(party.batches_done + 1, len(idx), n, c, "train")
        rows = draw(party, self.n_rows, epoch, i)
        self.ahead = (n, c, self.tg.create_task(party._command(cmd, idx, rows)))


__all__ = ["Announce", "Fit", "draw", "link_counters", "retune"]
