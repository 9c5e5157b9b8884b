"""`tandem party --config F.toml`: one split-learning party as its own OS process.

`run_party(cfg, stop=event)` = `tandem.parties.split.process.session.connect` (transport,
peers, task spec, checkpoint agreement) + train + evaluate + export, and returns the result
as a dict (the CLI prints it as one JSON line). docs/parties.md describes the whole life
cycle; in short:

* **Checkpoints** (``[checkpoint] dir``): after every batch whose step (batches done) is a
  multiple of the spec's ``checkpoint_every``, each party atomically saves its own params,
  optimizer state, step and data cursor (`tandem.parties.split.checkpoint.CheckpointStore`); at
  start-up the parties resume from the newest step they *all* hold for the agreed spec hash,
  and delete their newer ones. A party that saved step k while its peer died before saving k
  thus resumes from the previous common step: no batch is lost or applied twice. ``keep`` is at
  least 2, so that previous step still exists.
* **Finished** (status ``done``): each party saves a *finished* checkpoint at its final step
  (the trajectory, the parameters it exports, the leader's summary). A restart that agrees on
  a step every party finished (`tandem.parties.split.negotiate.Agreement`) trains nothing: it
  loads the exported parameters, evaluates, exports again (``"resumed": "finished"``,
  ``"batches_trained": 0`` in the result).
* **Stop** (``stop`` set, by SIGINT/SIGTERM in the CLI): the leader finishes the current batch
  (within ``grace`` seconds), checkpoints, and sends ``stop`` with the checkpoint step; a
  follower asks the leader to stop (``{"cmd": "leave"}`` on ``ctl``), serves until the
  leader's ``stop`` (within ``grace``) and checkpoints the same step. Past ``grace`` the batch
  is aborted: nothing is saved for it, the transport says goodbye, and the last checkpoint
  remains the resume point. Result ``status``: ``"done"``, ``"stopped"`` or ``"aborted"``.
* **Export** (``export_dir``): ``<export_dir>/<name>.safetensors`` with this party's own stages
  (`tandem.parties.export.save_stages`, with model specs, cut widths, run id and loss).
* **Reports** (the leader): validation after every epoch, early stopping, the JSONL history and
  TensorBoard files (`tandem.parties.split.reporting.Reporter`); with ``trace_dir``, every
  party's Chrome trace and Gantt picture of a few batches
  (`tandem.parties.split.process.party_trace.BatchTrace`).

Contract: runs inside the caller's loop, never blocks it (file I/O and model set-up in
threads), every task inside a TaskGroup; the transport is closed on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from tandem.engine.data import epoch_batches
from tandem.engine.topology import Topology
from tandem.errors import TandemError, TransportClosedError
from tandem.parties.compile_cache import compile_cache_folder
from tandem.parties.memory import peak_rss_bytes
from tandem.transports.base import MetricsTransport

from ...privacy.config import agreed
from ..checkpoint import CheckpointStore
from ..inference import export_party
from ..negotiate import CTL
from ..observe import party_metrics
from ..party import SplitParty
from ..reporting import Reporter, validation_for
from ..spec import TaskSpec
from . import cut_sum, noise_key, tuned
from .build import PartyData, PartySetup, models_from_widths, split_config_from
from .graceful import leaf, until, with_grace
from .party_trace import DEFAULT_BATCHES, BatchTrace
from .resume import RunState, open_store, refuse_other_specs, resume, save, stale_checkpoints
from .session import Session, connect


def make_party(spec: TaskSpec, cfg: PartySetup, data: PartyData, transport) -> SplitParty:
    """The `SplitParty` of ``cfg.name`` for the agreed ``spec``: its own stages built from its
    configuration (`PartySetup.own_models`), the others' as width stand-ins from the spec's
    stage widths, hyper-parameters from its ``hyper``, its privacy noise keyed by the key
    beside its checkpoints (`noise_key`); blocking (JAX initialisation, file I/O)."""
    topo = Topology.from_dict(spec.topology)
    features = {p: int(d["features"]) for p, d in spec.datasets.items()}
    models = models_from_widths(topo, spec.stages)
    models.update(cfg.own_models(features, spec.stages, data.vocab))
    return SplitParty(
        cfg.name,
        topo,
        models,
        transport,
        datasets=data.datasets(),
        labels=data.labels(),
        config=split_config_from(spec.hyper),
        privacy=noise_key.party_privacy(
            agreed(spec.hyper.get("privacy"), cfg.config.privacy),
            cfg.checkpoint.dir,
            cfg.name,
            spec.spec_hash(),
        ),
        cut_sum=cut_sum.party_cut_sum(cfg, spec.hyper, topo),
    )


async def run_party(
    cfg: PartySetup,
    *,
    stop: asyncio.Event | None = None,
    trace_dir: str | None = None,
    trace_batches: int = DEFAULT_BATCHES,
    fresh: bool = False,
) -> dict[str, Any]:
    """Run one standalone party to the end (see the module docstring); returns its result.
    With ``trace_dir``, the party traces ``trace_batches`` training batches into that folder.

    ``fresh``: delete this party's checkpoints first and start over. Without it, checkpoints
    saved on other data (another fingerprint) refuse the start, naming ``--fresh``.

    Raises `tandem.errors.TandemError` subclasses with readable messages (refused spec,
    wrong secret, unreachable peer, bad checkpoint, changed data, peer left mid-batch).
    """
    stop = stop or asyncio.Event()
    st = RunState()
    data, load_seconds, refusals, held, finished = await open_store(cfg, st, fresh)

    async def prepare(session: Session) -> None:
        await _prepare(cfg, st, session)

    session = await until(
        stop,
        connect(
            cfg,
            data=data,
            checkpoints=held,
            finished=finished,
            prepare=prepare,
            refusals=refusals,
        ),
    )
    if session is None:
        return {
            "party": cfg.name,
            "role": cfg.role,
            "status": "stopped",
            "step": 0,
            "checkpoint": None,
            "detail": "stopped before training started",
        }
    try:
        party = st.ready_party()
        if trace_dir:
            st.trace = BatchTrace(trace_dir, party, batches=trace_batches)
        if cfg.is_leader:
            result = await _lead(session, st, party, stop)
        else:
            result = await _follow(session, st, party, stop)
        _describe_run(result, session, st, party, load_seconds)
        if st.trace is not None:
            result.update(await st.trace.write())
        return result
    finally:
        await session.transport.aclose()


async def _prepare(cfg: PartySetup, st: RunState, session: Session) -> None:
    """`connect`'s prepare step: stop if the party holds checkpoints of other settings
    (`refuse_other_specs`), build the party for the agreed spec, drop checkpoints newer than
    the agreed step, resume from that step, serve the party's metrics, and compile the kernels
    the job's shapes fix (`SplitParty.compile_ahead`)."""
    if st.store is not None:  # checkpoints of other settings: stop rather than delete them
        await asyncio.to_thread(refuse_other_specs, cfg, st.store, session.spec)
    st.party = party = await asyncio.to_thread(
        make_party, session.spec, cfg, session.data, session.transport
    )
    if st.store is not None:
        st.discarded = await asyncio.to_thread(st.store.discard_after, session.step)
    if session.step:
        await resume(cfg, st, party, session)
    if isinstance(session.transport, MetricsTransport):
        session.transport.add_metrics_source(party_metrics(party, lambda: st.saved))
    # before this party says it is ready: a follower compiles while the leader still prepares
    started = time.perf_counter()
    await asyncio.to_thread(party.compile_ahead)
    st.compile_seconds = time.perf_counter() - started


def _describe_run(
    result: dict[str, Any], session: Session, st: RunState, party: SplitParty, load_seconds: float
) -> None:
    """Add to ``result`` how the run started, what it trained and sent, and what it cost."""
    result["resumed"] = (
        "finished" if session.finished else "checkpoint" if session.step else "fresh"
    )
    result["batches_trained"] = party.step - session.step
    result.update(_traffic(session))
    result["cut_bytes_sent"] = dict(party.cut_bytes)
    result["compress"] = party.config.compress
    if party.audit is not None:  # a follower's own feature audit reaches no one else
        result.update(party.audit.summary())
    result["load_seconds"] = round(load_seconds, 3)
    result["compile_ahead_seconds"] = round(st.compile_seconds, 3)
    result["peak_rss_mb"] = round(peak_rss_bytes() / 2**20, 1)
    if st.discarded:  # newer than the agreed step: replaced by the replayed batches
        result["discarded_checkpoints"] = st.discarded


# -- leader --------------------------------------------------------------------------------------
async def _lead(
    session: Session, st: RunState, party: SplitParty, stop: asyncio.Event
) -> dict[str, Any]:
    if session.finished:
        return await _lead_finished(session, st, party)
    cfg, spec = session.config, session.spec
    hyper = spec.hyper
    epochs, every = int(hyper["epochs"]), int(hyper["checkpoint_every"])
    per_epoch = len(epoch_batches(spec.samples, int(hyper["batch_size"]), 0, int(hyper["seed"])))
    reporter = Reporter(
        party, cfg.report_config(), validation_for(party, batch_size=int(hyper["eval_batch_size"]))
    )
    epoch0, batch0 = st.cursor
    # a checkpoint at an epoch's last batch precedes that epoch's validation (a stop or a crash
    # may come between): resume after the epoch only where the history recorded it, else fit
    # runs none of its batches and validates it
    if batch0 >= per_epoch and await asyncio.to_thread(reporter.recorded, epoch0):
        epoch0, batch0 = epoch0 + 1, 0
    cursor = (epoch0, batch0)
    left: list[str] = []
    tuned_at = await _tuned_start(session, party)
    with _progress(cfg, epochs * per_epoch, party.step, f"{cfg.name} (leader)") as advance:

        async def after_batch(epoch: int, done: int) -> bool:
            nonlocal cursor
            cursor = (epoch, done)
            advance(party.handler.loss_sum)
            if st.trace is not None:
                st.trace.after_batch()
            if st.store is not None and party.step % every == 0:
                await _save_leader(st, st.store, party, session, cursor)
            return stop.is_set()

        async def listen(peer: str) -> None:  # a follower asks to stop ("leave")
            while True:
                meta = (await session.transport.recv(peer, CTL)).meta
                if meta.get("cmd") == "leave":
                    left.append(peer)
                    stop.set()

        fit = party.fit(
            max(0, epochs - epoch0),
            start_epoch=epoch0,
            start_batch=batch0,
            after_batch=after_batch,
            after_epoch=reporter.after_epoch,
            # a stop (signal, a follower leaving) lands one batch later, and the hook's
            # checkpoint still sees batch b's state (`tandem.parties.split.training`)
            announce_ahead=True,
        )
        async with reporter.opened(epoch0):
            with _peer_left(cfg.name, party, st):
                finished = await with_grace(
                    stop, cfg.grace, fit, [listen(p) for p in party.followers]
                )
            # the best epoch's parameters go back only at a normal end: a stopped run's
            # checkpoint must hold its trajectory, and an aborted run's peers are gone
            report = await reporter.finish(restore=finished and not stop.is_set())
    if trained := [h for h in party.history if h.batches]:
        report["train_loss"] = trained[-1].loss
    if tuned_at is not None and (settled := _settled(party)) is not None:
        folder, key = tuned_at
        await asyncio.to_thread(tuned.remember, folder, key, settled)
    base = {**_leader_base(session, party), **report}
    if not finished:  # aborted mid-batch: the peers see our goodbye
        return {
            **base,
            "status": "aborted",
            "step": party.step,
            "checkpoint": st.saved if st.saved >= 0 else None,
        }
    if stop.is_set():
        return await _lead_stopped(session, st, party, base, cursor, left)
    if st.store is not None:  # what a restart evaluates and exports again
        await _save_leader(st, st.store, party, session, cursor, report=report, finished=True)
    return await _lead_done(session, st, party, base)


async def _tuned_start(session: Session, party: SplitParty) -> tuple[str, str] | None:
    """With ``groups = "auto"`` and a compile cache: where the job's count is remembered
    (folder, `tuned.job_key`); a fresh run starts settled at the count remembered there
    (`tandem.parties.split.process.tuned`; a resumed one started at its checkpoint's, in
    `resume`). None with a fixed count or no cache."""
    cfg = session.config
    folder = compile_cache_folder(cfg.checkpoint.compile_cache, cfg.checkpoint.dir, cfg.export_dir)
    if party.config.groups != "auto" or folder is None:
        return None
    key = tuned.job_key(session.spec, cfg.peers)
    if party.groups_from == "search":
        got = await asyncio.to_thread(tuned.recall, folder, key, party.config.batch_size)
        if got is not None:
            party.resume_groups(got.n, "remembered", interval=got.interval, wall=got.wall)
    return folder, key


def _settled(party: SplitParty) -> tuned.Settled | None:
    """Where the leader's tuner last settled (`TunerState.settled_n`; a run may end in the
    middle of a re-check), or None before its first settle (or with a fixed count)."""
    state = party.tuner_state
    n = state.settled_n if party.config.groups == "auto" else None
    return None if n is None else tuned.Settled(n, state.interval, party.tuner.mean(state, n))


async def _save_leader(
    st: RunState,
    store: CheckpointStore,
    party: SplitParty,
    session: Session,
    cursor: tuple[int, int],
    *,
    report: dict[str, Any] | None = None,
    finished: bool = False,
) -> None:
    """The leader's checkpoint at data ``cursor`` (epoch, batches done in it), with what a
    restart needs beyond the parameters (run id, ``n``, and a finished job's ``report``)."""
    extra: dict[str, Any] = {"run_id": party.run_id, "n_groups": party.n_groups}
    if (settled := _settled(party)) is not None:
        extra["tuned_groups"] = settled.n
        extra["tuned_interval"], extra["tuned_wall"] = settled.interval, settled.wall
    if report is not None:
        extra["report"] = report
    at = {"epoch": cursor[0], "batch": cursor[1]}
    await save(st, store, party, session, at, extra, finished=finished)


async def _lead_stopped(
    session: Session,
    st: RunState,
    party: SplitParty,
    base: dict[str, Any],
    cursor: tuple[int, int],
    left: list[str],
) -> dict[str, Any]:
    """A stop between batches (signal, or a follower in ``left`` asked): checkpoint the step
    reached, then tell the followers why."""
    if st.store is not None and st.saved != party.step:
        await _save_leader(st, st.store, party, session, cursor)
    reason = f"{left[0]} asked to stop" if left else "signal"
    await party.stop(reason=reason, checkpoint=st.saved if st.store else None)
    return {
        **base,
        "status": "stopped",
        "step": party.step,
        "detail": reason,
        "checkpoint": st.saved if st.store else None,
    }


def _leader_base(session: Session, party: SplitParty) -> dict[str, Any]:
    return {
        "party": session.config.name,
        "role": "leader",
        "spec_hash": session.spec_hash,
        "alignment": _plain(session.spec.alignment),
        "resumed_from": session.step,
        "n_groups": party.n_groups,
        "groups_from": party.groups_from,
        "groups_tried": groups_tried(party.tuner_path),
        "groups_path": groups_path(party.tuner_path),
    }


def groups_tried(path: list[tuple[int, float]]) -> dict[str, dict[str, float]]:
    """The tuner's batches by count, in the order the counts first ran: ``{n: {"batches",
    "mean_s"}}`` (the mean wall seconds of that count's batches, the first after each change
    and the compiles included); empty with a fixed count."""
    out: dict[str, dict[str, float]] = {}
    for n, wall in path:
        entry = out.setdefault(str(n), {"batches": 0, "mean_s": 0.0})
        entry["batches"] += 1
        entry["mean_s"] += (wall - entry["mean_s"]) / entry["batches"]
    return {n: {"batches": e["batches"], "mean_s": round(e["mean_s"], 5)} for n, e in out.items()}


def groups_path(path: list[tuple[int, float]]) -> list[list[float]]:
    """The tuner's counts in the order the batches ran them, each run of one count as
    ``[n, batches, mean_s]`` (their mean wall seconds per batch): where the search went, how
    long it stayed and what it measured there (empty with a fixed count)."""
    runs: list[list[float]] = []
    for n, wall in path:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
            runs[-1][2] += wall
        else:
            runs.append([n, 1, wall])
    return [[n, k, round(total / k, 5)] for n, k, total in runs]


async def _lead_finished(session: Session, st: RunState, party: SplitParty) -> dict[str, Any]:
    """Leader of a job that had completed (`Session.finished`): no training; the finished
    checkpoint's parameters are evaluated and exported again, its summary reported again."""
    return await _lead_done(session, st, party, {**_leader_base(session, party), **st.report})


async def _lead_done(
    session: Session, st: RunState, party: SplitParty, base: dict[str, Any]
) -> dict[str, Any]:
    """The end of a completed job: test evaluation, ``stop`` (reason ``done``), export."""
    hyper = session.spec.hyper
    if int(hyper.get("test_samples", 0)) and "test" in party.labels:
        metrics = await party.evaluate("test", batch_size=int(hyper["eval_batch_size"]))
        base.update({f"test_{k}": v for k, v in metrics.items()})
    await party.stop(reason="done")
    return {
        **base,
        "status": "done",
        "step": party.step,
        "epochs": int(hyper["epochs"]),
        "checkpoint": st.saved if st.saved >= 0 else None,
        "export": await _export(session, party),
    }


# -- follower ------------------------------------------------------------------------------------
async def _follow(
    session: Session, st: RunState, party: SplitParty, stop: asyncio.Event
) -> dict[str, Any]:
    cfg, spec = session.config, session.spec
    hyper = spec.hyper
    every = int(hyper["checkpoint_every"])
    per_epoch = len(epoch_batches(spec.samples, int(hyper["batch_size"]), 0, int(hyper["seed"])))
    leader = party.topology.label_owner
    cursor: dict[str, int] = {}  # of the newest training batch

    with _progress(
        cfg, int(hyper["epochs"]) * per_epoch, party.step, f"{cfg.name} (follower)"
    ) as advance:

        async def on_batch(meta) -> None:
            if meta.get("mode") != "train":
                return
            cursor.update(epoch=int(meta.get("epoch", 0)), batch=int(meta.get("i", 0)) + 1)
            advance(None)
            if st.trace is not None:
                st.trace.after_batch()
            if st.store is not None and party.step % every == 0:
                await save(st, st.store, party, session, dict(cursor), {})

        async def ask_leader_to_stop() -> None:
            await stop.wait()
            with contextlib.suppress(TandemError):
                await session.transport.send(leader, CTL, _leave_frame())
            await asyncio.Event().wait()  # cancelled when serve returns

        with _peer_left(cfg.name, party, st):
            finished = await with_grace(
                stop, cfg.grace, party.serve(on_batch=on_batch), [ask_leader_to_stop()]
            )
    base = {
        "party": cfg.name,
        "role": "follower",
        "spec_hash": session.spec_hash,
        "alignment": _plain(spec.alignment),
        "resumed_from": session.step,
        "step": party.step,
    }
    if not finished:
        return {**base, "status": "aborted", "checkpoint": st.saved if st.saved >= 0 else None}
    meta = party.stop_meta
    if meta.get("reason") != "done":
        step = meta.get("checkpoint")
        if st.store is not None and step is not None and st.saved != int(step):
            if int(step) != party.step:
                raise TandemError(
                    f"{cfg.name!r}: the leader stopped at step {step} but this "
                    f"party is at step {party.step}; restart both parties"
                )
            await save(st, st.store, party, session, {}, {})
        return {
            **base,
            "status": "stopped",
            "detail": str(meta.get("reason")),
            "checkpoint": st.saved if st.store else None,
        }
    if st.store is not None and not session.finished:  # what a restart exports again
        await save(st, st.store, party, session, dict(cursor), {}, finished=True)
    return {
        **base,
        "status": "done",
        "checkpoint": st.saved if st.saved >= 0 else None,
        "export": await _export(session, party),
    }


class PeerLeftError(TandemError):
    """A peer closed its connection in the middle of training (it was stopped or aborted)."""


@contextlib.contextmanager
def _peer_left(name: str, party: SplitParty, st: RunState) -> Iterator[None]:
    """Turn a peer's goodbye during training into a `PeerLeftError` saying how to resume."""
    try:
        yield
    except Exception as err:
        exc = leaf(err, TransportClosedError)
        if exc is None:
            raise
        saved = f"step {st.saved}" if st.saved >= 0 else "none"
        raise PeerLeftError(
            f"{name!r} stopped at step {party.step}: a peer left during training ({exc}). "
            f"Last checkpoint: {saved}; restart every party to resume from the newest common "
            "checkpoint."
        ) from None


def _plain(value: Any) -> Any:
    return None if value is None else dict(value)


def _leave_frame():
    from tandem.transports.base import Frame

    return Frame(meta={"cmd": "leave"})


# -- shared steps --------------------------------------------------------------------------------
async def _export(session: Session, party: SplitParty) -> str | None:
    """Save this party's own stages to ``<export_dir>/<name>.safetensors`` (if configured)."""
    cfg = session.config
    if not cfg.export_dir:
        return None
    path = os.path.join(cfg.export_dir, f"{cfg.name}.safetensors")
    await asyncio.to_thread(os.makedirs, cfg.export_dir, exist_ok=True)
    data = session.data
    await export_party(
        party,
        path,
        data={"preprocessing": data.preprocessing, "fingerprint": data.fingerprint},
    )
    return path


def _traffic(session: Session) -> dict[str, Any]:
    t = session.transport
    return {
        "bytes_sent": {p: t.sent_stats(p).bytes for p in t.peers},
        "bytes_received": {p: t.received_stats(p).bytes for p in t.peers},
    }


@contextlib.contextmanager
def _progress(
    cfg: PartySetup, total: int, done: int, label: str
) -> Iterator[Callable[[float | None], None]]:
    """A rich progress bar on stderr (stdout keeps the JSON line); a no-op when
    ``progress = false``. Yields ``advance(loss)``."""
    if not cfg.progress:
        yield lambda loss: None
        return
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from tandem.parties.progress import progress_bar

    with progress_bar(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} batches  loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    ) as bar:
        task = bar.add_task(label, total=total, completed=done, loss="-")

        def advance(loss: float | None) -> None:
            if loss is None:
                bar.update(task, advance=1)
            else:
                bar.update(task, advance=1, loss=f"{loss:.4f}")

        yield advance


__all__ = ["run_party", "make_party", "stale_checkpoints", "PeerLeftError"]
