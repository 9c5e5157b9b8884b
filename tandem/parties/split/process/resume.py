"""A standalone party's checkpoints across runs: what `run_party`'s steps share (`RunState`),
opening the store before connecting (and refusing checkpoints of another spec version or other
data, `stale_checkpoints`), resuming from the step every party agreed (`resume`), and saving a
step so a cancellation never leaves a half-written newest file (`save`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from tandem.errors import TandemError
from tandem.parties.memory import release_free_memory

from ..checkpoint import CheckpointError, CheckpointStore
from ..party import SplitParty
from ..spec import SPEC_VERSION, TaskSpec
from . import noise_key, notice, tuned
from .build import PartyData, PartySetup
from .party_trace import BatchTrace
from .session import Session


@dataclasses.dataclass
class RunState:
    """What `run_party`'s steps share: the party, its checkpoints and the resume point."""

    party: SplitParty | None = None  # built by `connect`'s prepare step, before it returns
    store: CheckpointStore | None = None
    saved: int = -1  # step of the last checkpoint saved or loaded
    cursor: tuple[int, int] = (0, 0)  # (epoch, batches done in it) at the resume point
    discarded: list[int] = dataclasses.field(default_factory=list)
    trace: BatchTrace | None = None  # `run_party(trace_dir=...)`
    #: a finished checkpoint's leader summary (`_lead`'s report), replayed by a restart
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: seconds the prepare step spent compiling ahead (`SplitParty.compile_ahead`)
    compile_seconds: float = 0.0

    def ready_party(self) -> SplitParty:
        """The party, once the session has prepared it (every step after `connect`)."""
        if self.party is None:
            raise TandemError("the party is used before the session prepared it")
        return self.party


def stale_checkpoints(store: CheckpointStore, data: PartyData) -> list[str]:
    """Why this party must not resume from ``store``: its checkpoints were saved under another
    task-spec version, or recorded a data fingerprint other than ``data``'s (the training rows
    or preprocessing changed)."""
    older = {s: v for s, v in store.spec_versions().items() if v != SPEC_VERSION}
    if older:
        step = max(older)
        return [
            f"{store.party!r}: checkpoint {step} in {store.directory!r} was saved for a version "
            f"{older[step]} task spec (this Tandem negotiates version {SPEC_VERSION}), so it "
            "cannot be resumed. Start over with `tandem party --config <file> --fresh` on every "
            "party (it deletes these checkpoints)"
        ]
    if data.fingerprint is None:
        return []
    other = {s: f for s, f in store.fingerprints().items() if f and f != data.fingerprint}
    if not other:
        return []
    step = max(other)
    return [
        f"{store.party!r}: the training data or its preprocessing changed since checkpoint "
        f"{step} in {store.directory!r} was saved (data fingerprint {other[step][:12]}.. "
        f"then, {data.fingerprint[:12]}.. now); resuming would train that model on other rows. "
        "Start over with `tandem party --config <file> --fresh` on every party (it deletes "
        "these checkpoints), or restore the data"
    ]


async def open_store(
    cfg: PartySetup, st: RunState, fresh: bool
) -> tuple[PartyData, float, list[str], dict, set]:
    """Before connecting: load the data and open the checkpoint store (``fresh``: emptied);
    returns (data, load seconds, reasons to refuse resuming, checkpoints held, finished
    ones). A failure here is told to the peers (`notice.telling`, docs/parties.md)."""
    async with notice.telling(cfg):
        loading = time.perf_counter()
        data = await asyncio.to_thread(cfg.load_data)
        await asyncio.to_thread(release_free_memory)  # the loader's temporaries
        load_seconds = time.perf_counter() - loading
        if cfg.checkpoint.dir:
            st.store = CheckpointStore(
                cfg.checkpoint.dir, party=cfg.name, keep=max(2, cfg.checkpoint.keep)
            )
        refusals: list[str] = []
        if st.store is not None and fresh:
            await asyncio.to_thread(st.store.discard_after, -1)
            await asyncio.to_thread(noise_key.discard, st.store.directory, cfg.name)
        elif st.store is not None:
            refusals = await asyncio.to_thread(stale_checkpoints, st.store, data)
        held = await asyncio.to_thread(st.store.index) if st.store else {}
        finished = await asyncio.to_thread(st.store.finished) if st.store else set()
    return data, load_seconds, refusals, held, finished


def own_models(party: SplitParty) -> dict[str, Any]:
    """``{stage: model spec}`` of the party's own stages, as JSON data (None for a model
    without a spec): what a checkpoint records so that it is never loaded into another model
    whose parameters happen to have the same shapes (another activation, factory or kwargs)."""
    return json.loads(json.dumps({s: m.spec for s, m in party.handler.models.items()}))


def refuse_other_specs(cfg: PartySetup, store: CheckpointStore, spec: TaskSpec) -> None:
    """`CheckpointError` when ``store`` holds checkpoints of this party saved under another
    task spec than the agreed ``spec`` (a setting the spec records changed: a ``[train]`` key,
    ``[checkpoint] every``, a model, the data's size or columns). They cannot be resumed under
    these settings, and the agreement would otherwise delete them (no common step: a fresh
    start): the party stops instead, naming what changed where the newest of them recorded
    its spec, and how to go on. ``--fresh`` deletes them first. Blocking file I/O."""
    now = spec.spec_hash()
    other = {step: h for step, h in store.index().items() if h != now}
    if not other:
        return
    newest = max(other)
    then = store.read_meta(newest).get("extra", {}).get("spec")
    changes = _spec_changes(then, spec.to_dict()) if isinstance(then, dict) else []
    what = (
        f": {'; '.join(changes)}"
        if changes
        else f" (spec hash {other[newest][:12]}.. then, {now[:12]}.. now)"
    )
    raise CheckpointError(
        f"{cfg.name!r}: {len(other)} checkpoint(s) in {store.directory!r} (newest: step "
        f"{newest}) were saved under other task settings{what}. They cannot be resumed under "
        "these settings, and starting over would delete them: restore the settings to resume, "
        "or start over with `tandem party --config <file> --fresh` on every party (it deletes "
        "them)"
    )


def _spec_changes(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The fields of two task specs (`TaskSpec.to_dict`) that differ, ``hyper`` key by key
    with both values (each cut to 60 characters)."""

    def short(value: Any) -> str:
        text = json.dumps(value, sort_keys=True)
        return text if len(text) <= 60 else text[:57] + "..."

    out = []
    for field in sorted(set(then) | set(now)):
        a, b = then.get(field), now.get(field)
        if field == "hyper" and isinstance(a, dict) and isinstance(b, dict):
            out += [
                f"[{k}] {short(a.get(k))} then, {short(b.get(k))} now"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            out.append(f"the spec's {field!r}")
    return out


def _model_changes(
    cfg: PartySetup, store: CheckpointStore, step: int, saved: Any, now: dict[str, Any]
) -> None:
    """`CheckpointError` naming each own stage whose model differs from the one checkpoint
    ``step`` was trained with (``saved``; a checkpoint that recorded none is not checked)."""
    if not isinstance(saved, dict):
        return
    differ = sorted(s for s in set(saved) | set(now) if saved.get(s) != now.get(s))
    if differ:
        what = "; ".join(f"{s!r}: saved {saved.get(s)}, now {now.get(s)}" for s in differ)
        raise CheckpointError(
            f"{cfg.name!r}: checkpoint {step} in {store.directory!r} was trained for another "
            f"model of stage(s) {differ} ({what}); resuming would load those parameters into "
            "a model they were not trained for. Restore the [model] tables it was trained "
            "with, or start over with `tandem party --config <file> --fresh` on every party"
        )


async def resume(cfg: PartySetup, st: RunState, party: SplitParty, session: Session) -> None:
    """Restore the agreed checkpoint ``session.step`` (a finished job's: its exported
    parameters, the best epoch's where it restored them); `CheckpointError` when it was
    trained for another model of one of this party's stages (`own_models`)."""
    # the agreed step is one every party holds: a party without a store gets 0
    if st.store is None:
        raise TandemError(
            f"{cfg.name!r} was asked to resume from checkpoint {session.step} but has "
            "no [checkpoint] dir; set it, or start every party afresh"
        )
    r = await asyncio.to_thread(
        st.store.load,
        session.step,
        params_like=party.handler.params,
        opt_state_like=party.handler.opt_state,
        spec_hash=session.spec_hash,
    )
    _model_changes(cfg, st.store, r.step, r.extra.get("models"), own_models(party))
    if session.finished and not r.finished:
        raise CheckpointError(
            f"{cfg.name!r}: checkpoint {r.step} was agreed as finished but is not; "
            "restart every party"
        )
    best = r.best if session.finished else None
    party.restore(r.params if best is None else best, r.opt_state, r.step)
    st.saved = r.step
    st.report = dict(r.extra.get("report") or {}) if session.finished else {}
    st.cursor = (int(r.cursor.get("epoch", 0)), int(r.cursor.get("batch", 0)))
    if party.is_leader:
        party.run_id = str(r.extra.get("run_id", party.run_id))
        party.n_groups = int(r.extra.get("n_groups", party.n_groups))
        fields = {k: r.extra.get(f"tuned_{k}") for k in ("interval", "wall")}
        settled = tuned.parse({"n": r.extra.get("tuned_groups"), **fields}, party.config.batch_size)
        if party.config.groups == "auto" and settled is not None:
            party.resume_groups(
                settled.n, "checkpoint", interval=settled.interval, wall=settled.wall
            )


async def save(
    st: RunState,
    store: CheckpointStore,
    party: SplitParty,
    session: Session,
    cursor: dict,
    extra: dict,
    *,
    finished: bool = False,
) -> None:
    """Checkpoint the party's current step into ``store`` (``st.store``); a cancellation (grace
    ran out) waits for the write to finish first, so ``st.saved`` always names the newest file
    on disk. ``finished``: the final checkpoint of a completed job; where `Reporter.finish`
    put the best epoch's parameters back, it holds those beside the trajectory's last. The
    party's own model specs (`own_models`) are recorded in ``extra["models"]``, the agreed
    task spec in ``extra["spec"]`` (`refuse_other_specs` names what changed from it)."""
    step = party.step
    extra = {**extra, "models": own_models(party), "spec": session.spec.to_dict()}
    params, best = dict(party.handler.params), None
    if finished and party.replaced_params is not None:
        params, best = dict(party.replaced_params), params
    # the party's own arrays, not copies: its next batch (whose update donates them) waits for
    # this write, since the save is awaited from the batch hook
    write = asyncio.ensure_future(
        asyncio.to_thread(
            store.save,
            step,
            params=params,
            opt_state=dict(party.handler.opt_state),
            spec_hash=session.spec_hash,
            cursor=cursor,
            extra=extra,
            fingerprint=session.data.fingerprint,
            finished=finished,
            best=best,
        )
    )
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        await write
        st.saved = step
        raise
    st.saved = step


__all__ = [
    "RunState",
    "open_store",
    "own_models",
    "refuse_other_specs",
    "resume",
    "save",
    "stale_checkpoints",
]
