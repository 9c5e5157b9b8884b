"""From a party TOML to a negotiated link: the start-up every standalone command shares.

`connect(cfg)` does, in order (docs/parties.md#negotiation):

1. load this party's data (`PartySetup.load_data`, in a thread) unless given;
2. start its transport (`PartySetup.transport`, built by `tandem.transports.make_transport`
   from the peers' URL scheme) on ``[listen]``;
3. wait until the transport reaches every peer (`PeerWaitingTransport`; over HTTP, each
   answers ``GET /healthz``), bounded by the config's ``wait``;
4. negotiate the `tandem.parties.split.spec.TaskSpec`: the leader builds it (`leader_spec`) and
   proposes it, a follower checks it against its own data and model (`follower_check`) and
   accepts or refuses with readable reasons; the parties also agree on the newest checkpoint
   they all hold for that spec (``checkpoints``);
5. call ``prepare(session)`` (build the model on ``session.transport``, load checkpoint
   ``session.step``; a follower reports a failure there to the leader), after which both
   transports stamp every frame with the spec hash and refuse frames of another hash (409)
   or tensors of another dtype/shape (422).

Example (a ``tandem predict`` could start the same way with its own ``spec``/``check``)::

    async with connected(cfg) as session:        # closes the transport on exit
        session.spec, session.transport, session.step

From the transport's start to the end of step 5 a `tandem.parties.split.process.notice.PeerWatch`
watches the peers; a failure of this party before or during these steps (except the
negotiation's own refusals and aborts, which its protocol carries) is told to every peer by an
abort notice before the exception propagates (`notice`, at most about 2 s).

Contract: never blocks the loop (file I/O in threads), creates no event loop, leaves nothing
running on failure (the transport is closed before the exception propagates). Errors:
`PartyStartError` (peer unreachable, nothing from the leader in time),
`tandem.parties.split.negotiate.NegotiationError` (spec refused; ``reasons`` per party),
`tandem.errors.AuthenticationError` (the peer answered 401, or refuses our signature as we
refuse its: wrong secret), `tandem.parties.split.process.notice.PeerAbortedError` (a peer
stopped and said why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from tandem.engine.topology import CUT_DTYPES
from tandem.errors import ConfigError, PeersUnreachableError, TandemError
from tandem.transports.base import (
    AdmittingTransport,
    AuthWatchingTransport,
    PeerWaitingTransport,
    Transport,
)

from .. import negotiate
from ..admission import NegotiationAdmission, negotiation_streams
from ..compress import mismatch_reasons
from ..spec import TaskSpec, build_spec, cut_of
from . import cut_sum, notice
from .build import PartyData, PartySetup
from .config import PartyConfigError


class PartyStartError(TandemError):
    """A standalone party could not start: a peer is unreachable or silent."""


@dataclasses.dataclass
class Session:
    """A started, negotiated party link.

    Attributes:
      config: the party's configuration.
      transport: the started HTTP transport (spec hash and validator installed); the caller
        owns it (`connected` closes it).
      data: this party's (aligned) data.
      spec: the agreed task spec; ``spec_hash`` its hash, stamped on every frame.
      step: the agreed checkpoint step to resume from (0 = fresh start).
      finished: the checkpoint at ``step`` ends a completed job on every party: evaluate and
        export it, train nothing (`tandem.parties.split.negotiate.Agreement`).
    """

    config: PartySetup
    transport: Any
    data: PartyData
    spec: TaskSpec
    spec_hash: str
    step: int
    finished: bool = False


def leader_spec(
    cfg: PartySetup, data: PartyData, described: Mapping[str, Mapping[str, Any]] | None = None
) -> TaskSpec:
    """The training task spec the leader proposes: every feature party's column count
    (``[schema]``, else what it ``described``), the stage widths (`PartySetup.stage_widths`,
    with the shape and dtype of each follower stage's output as its owner ``described`` it),
    ``[train]`` hyper-parameters (+ ``checkpoint.every``), the security settings, the
    alignment, the sizes of the test and validation splits, the ``[data.split]`` and every
    party's data fingerprint.

    Raises `PartyConfigError` when a feature count is unknown, a follower described a cut
    that is malformed or of a stage it does not own, or one of this party's stages cannot
    read a cut it is given (`PartySetup.check_cut_inputs`)."""
    if data.samples is None:
        raise PartyConfigError(f"{cfg.path}: the leader holds no training rows")
    described = described or {}
    features = {
        p: int(d["features"]) for p, d in described.items() if d.get("features") is not None
    }
    features.update(cfg.schema)
    if data.features is not None:
        features[cfg.name] = data.features
    absent = [p for p in cfg.topology().feature_parties() if p not in features]
    if absent:
        raise PartyConfigError(
            f"{cfg.path}: the feature count of {absent} is unknown (they described no data); "
            f"add `{absent[0]} = <columns>` under [schema]"
        )
    fingerprints = {p: str(d["fingerprint"]) for p, d in described.items() if d.get("fingerprint")}
    if data.fingerprint:
        fingerprints[cfg.name] = data.fingerprint
    return build_spec(
        cfg.topology(),
        features=features,
        samples=data.samples,
        stage_widths=cfg.stage_widths(features, data.vocab, described_cuts(cfg, described)),
        hyper={**cfg.hyper(), **cut_sum.spec_hyper(cfg, described)},
        security=cfg.security(),
        alignment=data.alignment,
        test_samples=0 if data.y_test is None else len(data.y_test),
        validation_samples=0 if data.y_validation is None else len(data.y_validation),
        split=data.split,
        fingerprints=fingerprints,
    )


def describe_data(data: PartyData, cfg: PartySetup | None = None) -> dict[str, Any]:
    """What a follower tells the leader before the proposal (JSON): its feature count, data
    fingerprint and, given its ``cfg``, ``cuts``: the shape after the rows and the dtype of
    each of its stages' outputs (`PartySetup.own_cuts`), so the leader's spec carries a cut
    its own configuration cannot describe (e.g. a factory model's bfloat16 [rows, 4, 8])."""
    out: dict[str, Any] = {"features": data.features, "fingerprint": data.fingerprint}
    if cfg is not None:
        out["cuts"] = cfg.own_cuts(data.features, data.vocab)
        if cut_sum.secure(cfg):
            out["sum_offer"] = cut_sum.offer(cfg)
    return out


def described_cuts(
    cfg: PartySetup, described: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``{stage: {"shape", "dtype"}}`` from every follower's description (`describe_data`),
    checked: each stage is the describing party's own, its shape positive sizes, its dtype a
    cut dtype; `PartyConfigError` naming the party and the value otherwise."""
    topo = cfg.topology()
    out: dict[str, dict[str, Any]] = {}
    for party, desc in described.items():
        cuts = desc.get("cuts") or {}
        if not isinstance(cuts, Mapping):
            raise PartyConfigError(
                f"{party!r} described its cuts as {cuts!r:.80}; expected a table of stage -> "
                "{shape, dtype}: are both parties running the same Tandem version?"
            )
        for stage, cut in cuts.items():
            owner = topo.by_name[stage].owner if stage in topo.by_name else None
            if owner != party:
                raise PartyConfigError(
                    f"{party!r} described the cut of stage {stage!r}, which "
                    + ("is not in the topology" if owner is None else f"belongs to {owner!r}")
                    + f"; a party describes its own stages only ({cfg.path}'s topology: "
                    f"{[s.name for s in topo.stages_of(party)]} are {party!r}'s)"
                )
            shape = _sizes(cut.get("shape")) if isinstance(cut, Mapping) else None
            dtype = cut.get("dtype") if isinstance(cut, Mapping) else None
            if shape is None or dtype not in CUT_DTYPES:
                raise PartyConfigError(
                    f"{party!r} described the cut of stage {stage!r} as {cut!r:.120}; a cut "
                    f"is {{shape: [positive sizes after the rows], dtype: one of "
                    f"{list(CUT_DTYPES)}}}"
                )
            out[stage] = {"shape": shape, "dtype": str(dtype)}
    return out


def _sizes(value: Any) -> list[int] | None:
    """``value`` if it is a non-empty JSON list of positive ints, else None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(type(d) is int and d > 0 for d in value):
        return None
    return list(value)


def follower_check(
    cfg: PartySetup, data: PartyData, refusals: Sequence[str] = ()
) -> Callable[[TaskSpec], list[str]]:
    """``check(spec) -> reasons`` of a follower: ``refusals`` (its own reasons not to start),
    then `TaskSpec.check_local` against its data, its own stages' widths and cuts (each
    able to read the cuts the spec gives the stages it reads), topology, security and
    alignment, plus the test and validation splits' sizes, the ``[data.split]`` and its
    data fingerprint."""

    def check(spec: TaskSpec) -> list[str]:
        features = {p: int(d["features"]) for p, d in spec.datasets.items()}
        if data.features is not None:
            features[cfg.name] = data.features
        theirs = {
            name: dict(zip(("shape", "dtype"), cut_of(st), strict=True))
            for name, st in spec.stages.items()
            if st.get("owner") != cfg.name
        }
        try:
            widths = cfg.stage_widths(features, data.vocab, theirs)
        except PartyConfigError as exc:
            return [*refusals, str(exc)]
        own: dict[str, dict[str, Any]] = {}
        for s in cfg.topology().stages_of(cfg.name):
            mine = dict(widths[s.name])
            # the cut tensor of an own stage is compared even when it is the default
            mine.setdefault("out_shape", [mine["out_dim"]])
            mine.setdefault("out_dtype", "float32")
            if mine.get("sizes") is None or spec.stages.get(s.name, {}).get("sizes") is None:
                mine.pop("sizes", None)  # the owner's model is compared by widths only
            own[s.name] = mine
        reasons = list(refusals)
        reasons += spec.check_local(
            cfg.name,
            features=data.features,
            samples=data.samples,
            stages=own,
            alignment=data.alignment,
            security=cfg.security(),
            topology=cfg.topology().to_dict(),
            privacy=cfg.config.privacy.stated(),
        )
        hyper = spec.hyper
        reasons += mismatch_reasons(cfg.name, hyper, cfg.train)
        reasons += cut_sum.follower_reasons(cfg, hyper, cfg.topology())
        for part, rows in (("test", data.test), ("validation", data.validation)):
            want = int(hyper.get(f"{part}_samples", 0))
            have = 0 if rows is None else len(rows)
            if want and data.features is not None and have != want:
                reasons.append(
                    f"the leader evaluates on {want} {part} rows but {cfg.name!r} holds "
                    f"{have}; give data.test (or x_test) with the same rows"
                    if part == "test" and data.split is None
                    else f"the leader holds {want} {part} rows but {cfg.name!r} holds {have}; "
                    "use the same [data.split] and aligned ids on every party"
                )
        split = hyper.get("split")
        if data.split is not None and split != data.split:
            reasons.append(
                f"[data.split] differs: the leader's is {split}, {cfg.name!r}'s is "
                f"{data.split}; every party must use the same test, validation and seed"
            )
        theirs = hyper.get("fingerprints", {}).get(cfg.name)
        if data.fingerprint is not None and theirs is not None and theirs != data.fingerprint:
            reasons.append(
                f"the spec records data fingerprint {theirs[:12]}.. for {cfg.name!r}, but its "
                f"data has {data.fingerprint[:12]}..; restart every party"
            )
        return reasons

    return check


async def wait_for_peers(cfg: PartySetup, transport: Transport) -> None:
    """Wait (up to ``cfg.wait`` s) until the started ``transport`` reaches every peer, where
    it can tell (`PeerWaitingTransport`; otherwise the negotiation's own bound applies);
    `PartyStartError` naming the silent ones."""
    if not isinstance(transport, PeerWaitingTransport):
        return
    try:
        await transport.wait_for_peers(cfg.wait)
    except PeersUnreachableError as exc:
        raise PartyStartError(f"{exc}. Start them, or fix [peers] / raise `wait`.") from None


async def connect(
    cfg: PartySetup,
    *,
    data: PartyData | None = None,
    spec: TaskSpec | Callable[[dict[str, dict[str, Any]]], TaskSpec] | None = None,
    check: Callable[[TaskSpec], list[str]] | None = None,
    checkpoints: Mapping[int, str] | None = None,
    finished: Collection[int] = (),
    prepare: Callable[[Session], Awaitable[None]] | None = None,
    refusals: Sequence[str] = (),
    describe: Callable[[], dict[str, Any]] | None = None,
) -> Session:
    """Start ``cfg``'s transport, reach the peers, negotiate; see the module docstring.

    Args:
      data: this party's data (default: `PartySetup.load_data`, in a thread).
      spec: leader only, the spec to propose (default `leader_spec`), or a function of the
        followers' descriptions (`negotiate.gather`) that builds it.
      check: follower only, the acceptance check (default `follower_check`).
      checkpoints: ``{step: spec_hash}`` of the checkpoints this party holds
        (`tandem.parties.split.checkpoint.CheckpointStore.index`); only those of the agreed
        hash count.
      finished: the steps among ``checkpoints`` that are finished
        (`tandem.parties.split.checkpoint.CheckpointStore.finished`).
      prepare: awaited with the `Session` once the step is agreed, before training can
        start (a follower's failure here is sent to the leader as the reason).
      refusals: this party's own reasons not to start (e.g. its data changed since its
        checkpoints): a leader aborts with them, a follower refuses the proposal with them.
      describe: follower only, with ``check``: what it tells a leader that asks (its
        key offer of a secure sum, `tandem.parties.split.process.cut_sum`; ``{}`` when None).
    Without ``spec`` (leader) or ``check`` (follower) this is a training start: the leader
    first gathers each follower's data description (`negotiate.gather`: feature count,
    fingerprint) for the spec. Reaching the peers, then agreeing, are each bounded by
    ``cfg.wait`` seconds.
    """
    async with notice.telling(cfg):
        if data is None:
            data = await asyncio.to_thread(cfg.load_data)
        topology = await asyncio.to_thread(cfg.topology)  # may read a JSON file; cached after
        transport = cfg.transport()
    held = dict(checkpoints or {})
    leader = topology.label_owner
    # until a spec is agreed, only the negotiation's own messages are admitted (its commands in
    # order, until the party's model exists: `SplitParty` installs its plan's checks then)
    negotiating = NegotiationAdmission(cfg.name, leader)
    if isinstance(transport, AdmittingTransport):
        transport.admit_stream = negotiation_streams(cfg.name, leader, topology.parties)
        transport.admit_frame = negotiating
    watch = notice.PeerWatch(transport, cfg.peers)
    if isinstance(transport, AuthWatchingTransport):
        transport.on_auth_refused = watch.auth_refused
    told: set[str] = set()  # peers the negotiation itself told why this party stops
    await transport.start()
    try:
        return await watch.guard(
            _agree(
                cfg,
                transport,
                data,
                held,
                finished,
                negotiating,
                told,
                spec,
                check,
                prepare,
                refusals,
                describe,
            )
        )
    except Exception as exc:
        if not isinstance(exc, negotiate.NegotiationError):  # (its protocol told them)
            await notice.tell_the_others(watch, told, exc)
        await transport.aclose()
        raise
    except BaseException:
        await transport.aclose()
        raise


async def _agree(
    cfg: PartySetup,
    transport: Any,
    data: PartyData,
    held: dict[int, str],
    finished: Collection[int],
    negotiating: NegotiationAdmission,
    told: set[str],
    spec: TaskSpec | Callable[[dict[str, dict[str, Any]]], TaskSpec] | None,
    check: Callable[[TaskSpec], list[str]] | None,
    prepare: Callable[[Session], Awaitable[None]] | None,
    refusals: Sequence[str],
    describe: Callable[[], dict[str, Any]] | None = None,
) -> Session:
    """`connect`'s steps 3 to 5 on the started ``transport``."""
    topology = cfg.topology()
    leader = topology.label_owner
    await wait_for_peers(cfg, transport)
    try:
        async with asyncio.timeout(cfg.wait):
            agreed: TaskSpec
            if cfg.is_leader:
                followers = [p for p in topology.parties if p != cfg.name]
                if spec is None:
                    spec = await _training_spec(cfg, data, transport, followers, refusals, told)
                elif not isinstance(spec, TaskSpec):  # built from what the followers describe
                    spec = spec(await negotiate.gather(transport, followers))
                agreed = spec
                digest = agreed.spec_hash()
                agreement = await negotiate.propose_agreement(
                    transport,
                    followers,
                    agreed,
                    checkpoints=[s for s, h in held.items() if h == digest],
                    finished=finished,
                )
                negotiating.step = agreement.step  # (a follower learns it from `start`)
            else:
                # (built in a thread: describing the cuts builds this party's models)
                told_data = (
                    None if check is not None else await asyncio.to_thread(describe_data, data, cfg)
                )
                agreed, agreement = await negotiate.answer_agreement(
                    transport,
                    leader,
                    check=check or follower_check(cfg, data, refusals),
                    checkpoints=lambda h: [s for s, d in held.items() if d == h],
                    finished=lambda h: finished,
                    describe=describe if told_data is None else lambda: told_data,
                )
    except TimeoutError:
        raise PartyStartError(
            f"{cfg.name!r}: no agreement with {sorted(cfg.peers)} within wait={cfg.wait:g} s;"
            " is every party started with a matching config (same secret, ports)?"
        ) from None
    session = Session(
        cfg, transport, data, agreed, agreed.spec_hash(), agreement.step, agreement.finished
    )
    if prepare is not None:
        try:
            await prepare(session)
        except Exception as exc:
            if not cfg.is_leader:
                await negotiate.ready(transport, leader, error=f"{type(exc).__name__}: {exc}")
                told.add(leader)
            raise
    if not cfg.is_leader:
        await negotiate.ready(transport, leader)
    return session


async def _training_spec(
    cfg: PartySetup,
    data: PartyData,
    transport: Any,
    followers: list[str],
    refusals: Sequence[str],
    told: set[str],
) -> TaskSpec:
    """Leader: gather the followers' data descriptions and build the training spec; when this
    party cannot start (``refusals``, or a configuration error) the followers are told why
    (and added to ``told``)."""
    reasons = list(refusals)
    described: dict[str, dict[str, Any]] = {}
    if not reasons:
        described = await negotiate.gather(transport, followers)
        try:
            return await asyncio.to_thread(leader_spec, cfg, data, described)
        except ConfigError as exc:
            reasons = [str(exc)]
            await negotiate.abort(transport, followers, reasons)
            told.update(followers)
            raise
    await negotiate.abort(transport, followers, reasons)
    raise negotiate.NegotiationError(
        f"{cfg.name!r} cannot start the training:\n  " + "\n  ".join(reasons),
        {cfg.name: reasons},
    )


@contextlib.asynccontextmanager
async def connected(cfg: PartySetup, **kwargs: Any) -> AsyncIterator[Session]:
    """`connect`, closing the transport (goodbye to the peers) when the block exits."""
    session = await connect(cfg, **kwargs)
    try:
        yield session
    finally:
        await session.transport.aclose()


__all__ = [
    "Session",
    "PartyStartError",
    "connect",
    "connected",
    "leader_spec",
    "follower_check",
    "describe_data",
    "described_cuts",
    "wait_for_peers",
]
