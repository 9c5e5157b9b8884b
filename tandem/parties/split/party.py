"""`SplitParty`: one party of a split-learning (vertical FL) job.

Every party holds feature datasets by name (rows aligned across parties: row ``i`` of every
party is the same sample) and its own stages. The party owning the loss stage is the *leader*:
it samples batches (seeded), chooses the number of micro-batches, and drives everyone through a
``ctl`` channel; the others *follow*: `serve` answers the leader's commands until it says stop.

Leader::

    history = await leader.fit(epochs=10)
    metrics = await leader.evaluate("test")
    await leader.stop()

Follower::

    await follower.serve()

Counters: ``batches_done`` counts every batch (train and eval: the counter ``b`` every command
carries and every party keeps in step); ``step`` counts training batches only (what checkpoints
record), so evaluating between epochs does not move the checkpoint schedule.

Each batch runs `tandem.engine.runtime.PartyRuntime` over the party's plan; the leader re-tunes
``n`` between batches (`tandem.engine.microbatch.GroupTuner`) unless ``groups`` is fixed.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import optax

from tandem.engine.data import BatchRows, RowSource
from tandem.engine.kernels import StageModel, get_loss
from tandem.engine.lanes import ThreadLane
from tandem.engine.microbatch import GroupTuner, fit_chunks, group_bounds, shared_shape_counts
from tandem.engine.plan import Plan, make_plan
from tandem.engine.policy import as_policy
from tandem.engine.runtime import BatchStats, PartyRuntime
from tandem.engine.topology import Topology
from tandem.engine.trace import Trace
from tandem.errors import ConfigError, EngineError
from tandem.transports.base import AdmittingTransport, Frame, Transport

from ..privacy.securesum import CutSum
from ..privacy.setup import AuditSettings, Privacy
from ..privacy.setup import setup as privacy_setup
from .admission import PlanAdmission
from .command_rows import Draw, RowsDecoder, encode_rows
from .metrics import Metric, metric_names, task_metrics
from .settings import OPTIMIZERS, EpochResult, SplitConfig, check_param_dtypes
from .stages import StageHandler
from .training import AfterBatch, AfterEpoch, Fit

CTL = "ctl"


class SplitParty:
    """One party of a split-learning job (see the module docstring).

    Args:
      name: this party's name (must own at least one stage of ``topology``).
      topology: the agreed topology.
      models: a `StageModel` for each stage this party owns (others' entries are used only for
        widths, to check received tensors).
      transport: the party's transport.
      datasets: ``{"train": X, "test": X_test, ...}`` feature matrices (float32, rows aligned
        across parties), arrays or `tandem.engine.data.RowSource` (rows in a file, gathered
        per micro-batch). A party whose stages take no raw features may pass none.
      labels: ``{"train": y, ...}``, the leader only.
      config: the shared `SplitConfig`.
      trace: record ops and transfers here.
      optimizer: overrides ``config.optimizer`` with any optax transformation.
      privacy, audit: ``[privacy]`` (`Privacy` or its table; None: off; every party passes
        the leader's) and the audit's settings (None: as ``privacy`` says), made into labels and
        an audit by `tandem.parties.privacy.setup`; the audit's records: ``audit.history``.
      cut_sum: the summing stage reads its cuts' sum (`tandem.parties.privacy.securesum`).
    """

    def __init__(
        self,
        name: str,
        topology: Topology,
        models: Mapping[str, StageModel],
        transport: Transport,
        *,
        datasets: Mapping[str, np.ndarray | RowSource] | None = None,
        labels: Mapping[str, np.ndarray] | None = None,
        config: SplitConfig | None = None,
        trace: Trace | None = None,
        optimizer: optax.GradientTransformation | None = None,
        params: Mapping[str, Any] | None = None,
        progress: bool = False,
        privacy: Privacy | Mapping[str, Any] | None = None,
        audit: AuditSettings | None = None,
        cut_sum: CutSum | None = None,
    ) -> None:
        self.name = name
        self.topology = topology
        self.config = config or SplitConfig()
        #: privacy set-up: ``[privacy]``, the labels trained on (``labels``) and the true ones
        self.private = privacy_setup(privacy, labels, loss=self.config.loss, audit=audit)
        self.privacy, self.labels = self.private.privacy, self.private.labels
        self.transport = transport
        self.trace = trace
        self.progress = progress
        self.is_leader = topology.label_owner == name
        if name not in topology.parties:
            raise ConfigError(f"party {name!r} owns no stage; parties: {list(topology.parties)}")
        self.datasets: dict[str, np.ndarray | RowSource] = {
            k: v if isinstance(v, RowSource) else np.asarray(v, np.float32)
            for k, v in (datasets or {}).items()
        }
        #: Identifies this training run: drawn by the leader, carried by every ctl command,
        #: adopted by a follower from the leader's commands; exports record it so inference can
        #: refuse parts of different runs (`tandem.parties.split.inference`).
        self.run_id: str | None = secrets.token_hex(8) if self.is_leader else None
        import jax

        self.handler = StageHandler(
            topology,
            name,
            models,
            optimizer or self.config.make_optimizer(),
            loss=get_loss(self.config.loss) if self.is_leader else None,
            key=jax.random.PRNGKey(self.config.seed),
            params=params,
            compressor=self.config.compressor,
            privacy=self.privacy,
            cut_sum=cut_sum,
            pad_to=self.config.batch_size,
        )
        if optimizer is None:
            check_param_dtypes(self.config.optimizer, self.handler.params)
        self.audit = self.handler.audit = self.private.audit  # None: off, nothing captured
        self.followers = tuple(p for p in topology.parties if p != name)
        self._init_state()
        #: Checks every inbound frame against the batches this party runs before its transport
        #: accepts it (where the transport takes such a hook, e.g. `HttpTransport`), so a
        #: frame its plan cannot take is refused to its sender instead of failing the batch.
        #: Turns the rows a leader's batch command names back into indices (follower).
        self.command_rows = RowsDecoder()
        self.admission = PlanAdmission(self)
        if isinstance(transport, AdmittingTransport):
            transport.admit_frame = self.admission

    def _init_state(self) -> None:
        """The run's state: plans, batch counters, kept parameters, the leader's tuner, and
        the totals the metrics read."""
        self._plans: dict[tuple[int, str, int], Plan] = {}
        self._batch = 0
        self._trained = 0  # training batches (``step``); ``_batch`` counts eval batches too
        #: Parameters kept by `keep_params` (stage -> pytree, owned copies), or None.
        self.kept_params: dict[str, Any] | None = None
        #: The parameters `restore_kept` replaced (the training trajectory's newest, which a
        #: finished checkpoint keeps beside the restored ones), or None before it ran.
        self.replaced_params: dict[str, Any] | None = None
        #: The leader's micro-batch tuner (settings) and its state; ``tuner_path`` holds the
        #: (n, wall seconds) of every batch the tuner observed.
        self.tuner = GroupTuner(
            self.config.batch_size, max_n=shared_shape_counts(self.config.batch_size)
        )
        self.tuner_state = self.tuner.init(
            self.config.groups if isinstance(self.config.groups, int) else 0
        )
        self.tuner_path: list[tuple[int, float]] = []
        #: where ``n_groups`` came from: "search" (the tuner's own, or a fixed count),
        #: "remembered" or "checkpoint" (`resume_groups`)
        self.groups_from = "search"
        self.history: list[EpochResult] = []
        self.last_stats: BatchStats | None = None
        self.n_groups = self.tuner_state.n
        self.stop_meta: dict[str, Any] = {}
        self.in_batch = False
        #: Why this party is out of step with its peers (a batch, or a command announced
        #: ahead, that was cancelled or failed: its parameters may hold part of that batch's
        #: updates and its peers another part), or None. While set, every call but `stop`
        #: refuses (`_require_in_step`); `restore` clears it.
        self.interrupted: str | None = None
        #: the task running `fit` (its hooks run in it), None when none runs: a second `fit`
        #: refuses, and so do calls from any other task (`_require_leader`)
        self._fit_task: asyncio.Task[Any] | None = None
        #: Op counts and compute seconds by kind, over every batch this party ran (for metrics).
        self.op_counts: collections.Counter[str] = collections.Counter()
        self.op_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        #: Bytes of the activations and gradients this party sent, per peer, over every batch:
        #: the arrays of each message as encoded by the cut compressor, without frame headers
        #: (the transport's ``sent_stats`` counts whole frames, commands included).
        self.cut_bytes: collections.Counter[str] = collections.Counter()
        self._batch_waiters: list[asyncio.Future] = []
        #: when the current training batch's command was issued, and the link counters then
        self._tune_mark: tuple[float, dict[tuple[str, str], tuple[int, float]]] = (0.0, {})

    # -- shared machinery ---------------------------------------------------------------------
    def compile_ahead(self, dataset: str = "train") -> None:
        """Compile the kernels the job's shapes fix before the first batch
        (`StageHandler.compile_ahead`), reading their argument types from row 0 of
        ``dataset`` (its features and, on the leader, its labels). Blocks while XLA compiles:
        call it in a thread (``asyncio.to_thread``) from a coroutine, before the first batch.
        The leader's tuner learns what compiling cost (`GroupTuner.compiled`), which its first
        batch no longer shows."""
        idx = np.arange(1)
        has_rows = dataset in self.datasets and len(self.datasets[dataset]) > 0
        features = self._rows(dataset, idx) if has_rows else None
        labels, _ = (
            self.private.batch(self.name, dataset, idx, True)
            if self.is_leader and self.labels and dataset in self.labels
            else (None, None)
        )
        seconds = self.handler.compile_ahead(features, labels)
        if seconds is not None:
            self.tuner_state = self.tuner.compiled(self.tuner_state, seconds)

    def plan(self, n: int, mode: str, chunks: int = 1) -> Plan:
        key = (n, mode, chunks)
        if key not in self._plans:
            self._plans[key] = make_plan(
                self.topology, self.name, n, mode=mode, seed=self.config.seed, chunks=chunks
            )
        return self._plans[key]

    def chunks_for(self, rows: int, n: int) -> int:
        """The chunks a batch of ``rows`` rows in ``n`` groups uses: ``config.chunks`` lowered
        to its smallest group (the leader decides; the command carries it)."""
        return fit_chunks(rows, max(1, min(n, rows)), self.config.chunks)

    def _rows(self, dataset: str, idx: np.ndarray) -> BatchRows | None:
        if dataset not in self.datasets:
            if any("features" in s.inputs for s in self.topology.stages_of(self.name)):
                raise ConfigError(
                    f"{self.name!r} has no dataset {dataset!r}; pass datasets={{{dataset!r}: X}}"
                )
            return None
        data = self.datasets[dataset]
        lo, hi = (int(idx.min()), int(idx.max())) if len(idx) else (0, -1)
        if lo < 0 or hi >= len(data):
            bad = lo if lo < 0 else hi
            raise ConfigError(
                f"{self.name!r}: row {bad} requested from dataset "
                f"{dataset!r} of {len(data)} rows; the parties' datasets are not aligned"
            )
        return BatchRows(data, idx)  # gathered per group, on the compute lane

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
    ) -> BatchStats:
        n = max(1, min(n, len(idx)))
        train = mode == "train"
        labels, secret = self.private.batch(self.name, dataset, idx, self.is_leader and train)
        self.handler.begin(
            self._rows(dataset, idx),
            labels,
            group_bounds(len(idx), n),
            train=train,
            chunks=chunks,
            row_ids=idx,
            step=self._trained,
            secret=secret,
        )
        runtime.trace, runtime.policy = self.trace, as_policy(self.config.policy)
        runtime.bp = self.config.backpressure.scaled(chunks)
        self.in_batch = True
        try:
            stats = await runtime.run(
                self.plan(n, mode, chunks),
                self.handler,
                self._batch,
                computed=computed,
                produced=produced,
            )
        except BaseException:
            self.interrupted = f"batch {self._batch} ({mode}) did not finish"
            raise
        finally:
            self.in_batch = False
        self._batch += 1
        self._trained += train
        self.last_stats = stats
        self.cut_bytes.update(stats.sent_bytes)
        self._wake_batch_waiters()
        return stats

    @property
    def batches_done(self) -> int:
        """Batches this party finished (its batch counter ``b``; parties keep it in step)."""
        return self._batch

    async def wait_batches(self, count: int) -> None:
        """Return once this party has finished ``count`` batches (``batches_done >= count``).

        For parties in one process, e.g. timing: the leader's `run_batch` returns when *its*
        ops are done, while a follower may still run its last backward and update;
        ``await follower.wait_batches(leader.batches_done)`` waits for those too. Event-driven
        (no polling); cancelling the wait leaves nothing behind.
        """
        while self._batch < count:
            fut = asyncio.get_running_loop().create_future()
            self._batch_waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._batch_waiters:
                    self._batch_waiters.remove(fut)

    def _wake_batch_waiters(self) -> None:
        waiters, self._batch_waiters = self._batch_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _runtime(self, lane) -> PartyRuntime:
        runtime = PartyRuntime(
            self.transport,
            lane,
            backpressure=self.config.backpressure,
            policy=self.config.policy,
            trace=self.trace,
        )
        runtime.counters, runtime.op_seconds = self.op_counts, self.op_seconds  # shared totals
        return runtime

    @property
    def step(self) -> int:
        """Training batches run so far (what checkpoints record); evaluation batches, which
        `batches_done` also counts, leave it alone. Every party keeps it in step, since each
        runs every batch the leader starts."""
        return self._trained

    # -- leader -----------------------------------------------------------------------------
    async def _start_batch(
        self,
        idx: np.ndarray,
        n: int,
        mode: str,
        dataset: str,
        draw: Draw | None = None,
        **meta: Any,
    ) -> tuple[int, int]:
        """Leader: tell every follower to run rows ``idx`` of ``dataset`` (``draw``: where
        they come from, for a batch of the seeded shuffle, `command_rows`); returns the group
        count and chunks the batch uses (``n`` clamped to the rows, `chunks_for`), which the
        command carries, for the leader's own `_run_batch`."""
        n, c, cmd = self._batch_command(self._batch, len(idx), n, mode, dataset, **meta)
        self.admission.announce(self._batch, len(idx), n, c, mode)
        try:
            await self._command(cmd, idx, draw)
        except BaseException:
            self.interrupted = f"batch {self._batch} ({mode}) did not finish"
            raise
        return n, c

    def _batch_command(
        self, b: int, rows: int, n: int, mode: str, dataset: str, **meta: Any
    ) -> tuple[int, int, dict[str, Any]]:
        """(n, chunks, command) of batch ``b`` of ``rows`` rows asked to run at ``n``."""
        n, c = self._batch_shape(rows, n)
        return n, c, {"cmd": "batch", "b": b, "n": n, "c": c, "mode": mode, "data": dataset, **meta}

    def _batch_shape(self, rows: int, n: int) -> tuple[int, int]:
        """The (group count, chunks) a batch of ``rows`` rows asked to run at ``n`` uses."""
        n = max(1, min(n, rows))
        return n, self.chunks_for(rows, n)

    async def _command(
        self, meta: dict, idx: np.ndarray | None = None, draw: Draw | None = None
    ) -> None:
        """Send command ``meta`` to every follower, naming rows ``idx`` when given in their
        smallest form (`command_rows.encode_rows`)."""
        arrays: tuple[np.ndarray, ...] = ()
        if idx is not None:
            rows, arrays = encode_rows(idx, draw)
            meta = {**meta, **rows}
        meta = {**meta, "run": self.run_id}
        for peer in self.followers:
            await self.transport.send(peer, CTL, Frame(meta=meta, arrays=arrays))

    async def run_batch(
        self,
        idx: np.ndarray,
        *,
        mode: str = "train",
        dataset: str = "train",
        n: int | None = None,
        lane=None,
    ) -> BatchStats:
        """Leader: run one batch (rows ``idx`` of ``dataset``) on every party."""
        self._require_leader("run_batch")
        n, c = await self._start_batch(idx, self.n_groups if n is None else n, mode, dataset)
        if lane is None:
            async with ThreadLane(f"tandem-{self.name}") as lane:
                return await self._run_batch(self._runtime(lane), idx, n, mode, dataset, c)
        return await self._run_batch(self._runtime(lane), idx, n, mode, dataset, c)

    async def fit(
        self,
        epochs: int | None = None,
        *,
        dataset: str = "train",
        on_batch: Callable[[int, int, float], None] | None = None,
        start_epoch: int | None = None,
        start_batch: int = 0,
        after_batch: AfterBatch | None = None,
        after_epoch: AfterEpoch | None = None,
        announce_ahead: bool | None = None,
    ) -> list[EpochResult]:
        """Leader: train for ``epochs`` epochs; returns one `EpochResult` per epoch.

        Resume hooks: ``start_epoch`` (default: epochs already in ``history``) and
        ``start_batch`` skip to that data cursor (the batches of an epoch depend only on the
        seed and the epoch, so the skipped batches are exactly those already trained).
        ``after_batch(epoch, batches_done_in_epoch)`` is awaited after every batch (e.g. to
        checkpoint); if it returns true, training stops there (the partial epoch is recorded).
        ``after_epoch(result)`` is awaited after every complete epoch, once its `EpochResult`
        is in ``history`` (e.g. to validate and report); if it returns true, training stops
        after that epoch (early stopping). It may run batches (`evaluate`): the training lane
        is idle meanwhile.

        Announcing ahead (``announce_ahead``: None, the default, only without
        ``after_batch``; True; False): the next batch's command is sent while the current one
        runs; `tandem.parties.split.training` states when, and what the hooks then see.
        """
        self._require_leader("fit")
        if self.fitting:
            raise ConfigError(
                f"fit() on {self.name!r} while its fit() runs; a party trains one fit at a "
                "time: await the first"
            )
        self.private.require(self.name, dataset)
        epochs = self.config.epochs if epochs is None else epochs
        self._fit_task = asyncio.current_task()
        try:
            await Fit(
                self,
                epochs,
                dataset=dataset,
                on_batch=on_batch,
                start_epoch=start_epoch,
                start_batch=start_batch,
                after_batch=after_batch,
                after_epoch=after_epoch,
                announce_ahead=announce_ahead,
            ).run()
        finally:
            self._fit_task = None
        return self.history[-epochs:] if epochs else []

    @property
    def fitting(self) -> bool:
        """True while `fit` runs: a second `fit` at once refuses (their batches would
        interleave); its hooks may still call `evaluate`."""
        return self._fit_task is not None

    async def evaluate(
        self,
        dataset: str = "test",
        *,
        rows: np.ndarray | None = None,
        batch_size: int | None = None,
    ) -> dict[str, Metric]:
        """Leader: forward-only pass over ``dataset`` (its ``rows``, in that order, or all of
        them) on every party; returns `tandem.parties.split.metrics.task_metrics` of the
        loss (``loss`` plus the loss's metrics) and keeps the outputs in ``predictions``.
        Parameters, optimizer state and ``step`` are unchanged."""
        self._require_leader("evaluate")
        if dataset not in self.labels:
            raise ConfigError(f"no labels for dataset {dataset!r}; pass labels={{{dataset!r}: y}}")
        y = self.labels[dataset]
        take = np.arange(len(y)) if rows is None else np.asarray(rows, np.int64).reshape(-1)
        if len(take) and (take.min() < 0 or take.max() >= len(y)):
            raise ConfigError(
                f"{self.name!r}: evaluation rows reach row {int(take.max())} of {dataset!r}, "
                f"which has {len(y)} rows (or are negative)"
            )
        bs = batch_size or max(self.config.batch_size, 256)
        outs = []
        async with ThreadLane(f"tandem-{self.name}") as lane:
            runtime = self._runtime(lane)
            for start in range(0, len(take), bs):
                idx = take[start : start + bs]
                n, c = await self._start_batch(idx, self.n_groups, "eval", dataset)
                await self._run_batch(runtime, idx, n, "eval", dataset, c)
                outs.append(self.handler.predictions())
        if not outs:  # no rows: nothing ran, and no metric is defined
            return {name: None for name in metric_names(self.config.loss)}
        logits = np.concatenate(outs, axis=0)
        self.predictions = logits
        return task_metrics(logits, y[take], self.config.loss)

    async def predict(self, dataset: str, n_rows: int, *, batch_size: int = 256) -> np.ndarray:
        """Leader: forward-only over ``n_rows`` rows of ``dataset`` (no labels needed)."""
        self._require_leader("predict")
        outs = []
        async with ThreadLane(f"tandem-{self.name}") as lane:
            runtime = self._runtime(lane)
            for start in range(0, n_rows, batch_size):
                idx = np.arange(start, min(start + batch_size, n_rows))
                n, c = await self._start_batch(idx, self.n_groups, "eval", dataset)
                await self._run_batch(runtime, idx, n, "eval", dataset, c)
                outs.append(self.handler.predictions())
        return np.concatenate(outs, axis=0)

    async def keep_params(self) -> None:
        """Leader: every party keeps a copy of its current stage parameters (its
        ``kept_params``), e.g. those of the best epoch so far; a later `restore_kept` puts
        them back. The followers copy theirs when the command reaches them, after every batch
        started before it (commands are FIFO), so all parties keep the same step's."""
        self._require_leader("keep_params")
        self.kept_params = self.params
        await self._command({"cmd": "keep"})

    async def restore_kept(self) -> None:
        """Leader: every party puts its ``kept_params`` back into its stages (optimizer state
        and ``step`` unchanged: meant for the end of training, before the final evaluation and
        the export). Raises `ConfigError` if `keep_params` was never called."""
        self._require_leader("restore_kept")
        if self.kept_params is None:
            raise ConfigError(f"{self.name!r}: restore_kept() without keep_params() before")
        await self._command({"cmd": "restore_kept"})
        self._restore_kept()

    def _restore_kept(self) -> None:
        from tandem.engine.kernels import owned_copy

        if self.kept_params is None:
            raise EngineError(
                f"{self.name!r} was asked to restore kept parameters but kept none; "
                "restart both parties"
            )
        # (the engine's own arrays: no longer in the handler, so no update donates them)
        self.replaced_params = {s: self.handler.params[s] for s in self.kept_params}
        # copies: the kept ones stay valid if training went on (an update donates its input)
        self.handler.params.update({s: owned_copy(p) for s, p in self.kept_params.items()})

    async def stop(self, **meta: Any) -> None:
        """Leader: tell every follower to return from `serve`; ``meta`` (JSON values, e.g.
        ``reason``, ``checkpoint``) travels with the command and lands in their `stop_meta`."""
        self._require_leader("stop")
        await self._command({**meta, "cmd": "stop"})

    def _require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise ConfigError(
                f"{what}() is the leader's; {self.name!r} follows "
                f"{self.topology.label_owner!r} and should call serve()"
            )
        if what != "stop":  # a stop still lets the followers return
            self._require_in_step(what)
        if (
            what not in ("fit", "stop")
            and self.fitting
            and asyncio.current_task() is not self._fit_task
        ):
            raise ConfigError(
                f"{what}() on {self.name!r} from another task while its fit() runs: its batches "
                "would interleave with fit's and put the parties out of step; call it from "
                "fit's hooks (after_batch, after_epoch) or once fit() has returned"
            )

    def _require_in_step(self, what: str) -> None:
        """Raise `EngineError` if an earlier batch of this party was cancelled or failed
        (``interrupted``): its parameters and its peers' may hold part of that batch, and
        their batch counters disagree, so nothing may build on them."""
        if self.interrupted is not None:
            raise EngineError(
                f"{what}() on {self.name!r}: {self.interrupted} (cancelled or failed), so "
                "the parties are out of step and their parameters may hold part of it; "
                "restart every party, or restore() the same checkpoint on every party and "
                "serve() again"
            )

    # -- follower -----------------------------------------------------------------------------
    async def serve(
        self, *, on_batch: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None
    ) -> int:
        """Follower: run the leader's batches until it says stop; returns batches run.

        ``on_batch(command)`` is awaited after each batch with the leader's command (``mode``,
        ``b``, and for training ``epoch``/``i``), e.g. to checkpoint. The stop command's fields
        are kept in ``stop_meta``. (On any party, ``in_batch`` is true while a batch runs.)
        """
        if self.is_leader:
            raise ConfigError(
                f"{self.name!r} is the leader; call fit()/evaluate() instead of serve()"
            )
        self._require_in_step("serve")
        leader = self.topology.label_owner
        count = 0
        async with ThreadLane(f"tandem-{self.name}") as lane:
            runtime = self._runtime(lane)
            while True:
                frame = await self.transport.recv(leader, CTL)
                cmd = frame.meta.get("cmd")
                self.run_id = frame.meta.get("run", self.run_id)
                if self.audit is not None:  # a stop ends the audit's epoch, a batch opens one
                    self.audit.command(frame.meta)
                if cmd == "stop":
                    self.stop_meta = dict(frame.meta)
                    return count
                if cmd == "keep":
                    self.kept_params = self.params
                    continue
                if cmd == "restore_kept":
                    self._restore_kept()
                    continue
                if cmd != "batch":
                    raise EngineError(
                        f"{self.name!r} got an unknown command from {leader!r}: {dict(frame.meta)}"
                    )
                if frame.meta.get("b") != self._batch:
                    raise EngineError(
                        f"{self.name!r} is at batch {self._batch} but the leader "
                        f"started batch {frame.meta.get('b')}; restart both parties"
                    )
                self.n_groups = int(frame.meta["n"])
                dataset = str(frame.meta["data"])
                table = self.datasets.get(dataset)
                idx = self.command_rows.decode(
                    frame.meta, frame.arrays, None if table is None else len(table)
                )
                await self._run_batch(
                    runtime,
                    idx,
                    self.n_groups,
                    str(frame.meta["mode"]),
                    dataset,
                    int(frame.meta.get("c", 1)),
                )
                count += 1
                if on_batch is not None:
                    await on_batch(frame.meta)

    @property
    def params(self) -> dict[str, Any]:
        """A copy of this party's stage parameters (stage name -> pytree). A copy, because the
        update kernel takes over the engine's own arrays (`tandem.engine.kernels`, "Donation"): a
        reference kept across a batch would be deleted by the next update."""
        from tandem.engine.kernels import owned_copy

        return {s: owned_copy(p) for s, p in self.handler.params.items()}

    def resume_groups(
        self, n: int, source: str, *, interval: int = 0, wall: float | None = None
    ) -> None:
        """Start the next training batch at ``n`` groups with the tuner settled there
        (`GroupTuner.resume`: no search; its re-checks still probe the neighbours, after
        twice the earlier run's ``interval`` when its ``wall`` at ``n`` is given and this run
        matches it). ``source`` says where ``n`` came from (``groups_from``). Only with
        ``groups = "auto"``."""
        if self.config.groups != "auto":
            raise ConfigError(f"{self.name!r}: groups is fixed at {self.config.groups}")
        self.tuner_state = self.tuner.resume(n, interval=interval, wall=wall)
        self.n_groups, self.groups_from = n, source

    def restore(self, params: Mapping[str, Any], opt_state: Mapping[str, Any], batch: int) -> None:
        """Resume from a checkpoint: this party's stage params and optimizer state, and the
        batch counter ``b`` the leader and followers keep in step (every party must restore
        the same checkpoint step, or the followers refuse the leader's next command). Clears
        ``interrupted``: this is how parties out of step after a cancelled batch resume.

        Leaves are copied to device arrays bit for bit; pytree structure must match this
        party's (`tandem.parties.split.checkpoint.CheckpointStore.load` checks it against
        templates).
        """
        from tandem.engine.kernels import owned_copy

        stages = set(self.handler.stages)
        lacking = sorted((stages - set(params)) | (stages - set(opt_state)))
        if lacking:
            raise ConfigError(
                f"{self.name!r}: the state to restore lacks the params or "
                f"optimizer state of stages {lacking}"
            )
        if int(batch) < 0:
            raise ConfigError(f"{self.name!r}: cannot restore to batch {batch}")
        # copies: the next update donates them, and the caller's must survive
        self.handler.params.update({s: owned_copy(params[s]) for s in stages})
        self.handler.opt_state.update({s: owned_copy(opt_state[s]) for s in stages})
        self._batch = self._trained = int(batch)
        self.interrupted = None  # every party restores the same step: in step again
        self._wake_batch_waiters()


__all__ = ["OPTIMIZERS", "SplitParty", "SplitConfig", "EpochResult"]
