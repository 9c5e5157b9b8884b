"""Checks a split-learning party applies to every inbound frame *before* its transport accepts
it, so that a frame which cannot be right is refused to its sender (HTTP 403/422 naming the
field) instead of killing the job later (a `ShapeError` in the runtime).

Three layers, each installed where its knowledge lives; the transport only calls them
(`tandem.transports.http.HttpTransport.admit_stream` / ``admit_frame``):

* `negotiation_streams` (`session.connect`, before negotiation): only the ``ctl`` channel,
  only from the parties the negotiation talks to (the leader's followers; a follower's leader),
  and the ``notice`` channel from any peer (`tandem.parties.split.process.notice`: why a peer
  stops);
* `spec_streams` (`negotiate.install`, once a spec is agreed): ``ctl`` as above, plus each
  ``act``/``grad`` channel of the spec from the party that sends on it to the party that
  receives it; any other (sender, channel) is refused at the request head, before its body is
  read or any memory is reserved;
* `NegotiationAdmission` (`session.connect`, until the party exists): ``ctl`` commands of the
  negotiation protocol only, in their order (a follower takes ``propose``, then ``start`` or
  ``abort``, then the first ``batch`` at the agreed step), never a tensor but the first
  batch's rows; on the spec's channels only a first message (micro-batch 0 of the
  first batch);
* `PlanAdmission` (`SplitParty`): each frame against the batches the party runs. A follower's
  batch command must carry the next batch id, a group count, chunks, mode, dataset and rows its
  plan can run (`tandem.parties.split.command_rows`: a list, a range, or a draw of the seeded
  shuffle that the follower repeats and checks against the leader's digest); an activation or
  gradient must carry a batch id the party is running or about to run (one that uses the
  channel), the next micro-batch index of that channel in that batch, and one
  ``float32[rows, width]`` tensor with exactly the rows of its group (part) and the width of
  its source stage (with cut compression, the arrays of the negotiated compressor's layout of
  that tensor, `tandem.parties.split.compress`).

Invariant (`PlanAdmission`): for every announced batch ``b`` and inbound channel ``ch``,
``admitted[(ch, b)]`` frames were accepted, with micro-batch indices ``0 .. admitted - 1`` in
order, each with the rows of its message; so the runtime's receivers (which expect exactly
that sequence) never see a frame they must refuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from tandem.engine.microbatch import chunk_bounds, fit_chunks, group_bounds
from tandem.engine.plan import Plan, make_plans
from tandem.engine.topology import FEATURES, Topology
from tandem.errors import AdmissionError
from tandem.transports.base import Frame

from .command_rows import RowsDecoder, row_count

if TYPE_CHECKING:
    from .spec import TaskSpec


class AdmittingParty(Protocol):
    """What the plan check reads of its `tandem.parties.split.party.SplitParty`."""

    @property
    def name(self) -> str: ...
    @property
    def topology(self) -> Topology: ...
    @property
    def config(self) -> Any: ...
    @property
    def datasets(self) -> Mapping[str, Any]: ...
    @property
    def handler(self) -> Any: ...
    @property
    def command_rows(self) -> RowsDecoder: ...

    @property
    def is_leader(self) -> bool: ...
    @property
    def batches_done(self) -> int: ...
    def plan(self, n: int, mode: str, chunks: int = 1) -> Plan: ...


CTL = "ctl"
NOTICE = "notice"  # `tandem.parties.split.process.notice`: taken until a spec is agreed
#: commands a follower takes from its leader once its party runs (`SplitParty.serve`)
#: what a running follower takes from its leader (`SplitParty.serve`): batches, the end, and
#: keeping and restoring the best parameters (early stopping, `reporting`)
LEADER_COMMANDS = frozenset({"batch", "stop", "keep", "restore_kept"})


def negotiation_streams(me: str, leader: str, peers: Iterable[str]) -> Callable[[str, str], None]:
    """`admit_stream` before negotiation: ``ctl`` from the leader (on a follower) or from the
    other parties (on the leader); ``notice`` from any peer the transport authenticated."""
    allowed = {leader} if me != leader else set(peers) - {me}

    def admit(sender: str, channel: str) -> None:
        if channel == NOTICE:
            return
        if channel != CTL:
            raise AdmissionError(
                f"channel {channel!r} is not part of the negotiated task: before the task is "
                f"negotiated {me!r} takes only {CTL!r} and {NOTICE!r}",
                field="channel",
            )
        if sender not in allowed:
            raise AdmissionError(
                f"{sender!r} may not send on {CTL!r} to {me!r} (only {sorted(allowed)})",
                field="sender",
            )

    return admit


def spec_streams(spec: TaskSpec, me: str, leader: str) -> Callable[[str, str], None]:
    """`admit_stream` once ``spec`` is agreed: ``ctl`` as in `negotiation_streams`, and each of
    the spec's ``act``/``grad`` channels from its sending party to its receiving party."""
    parties = {p for e in spec.edges for p in (e["src_party"], e["dst_party"])} | {leader}
    ctl_from = {leader} if me != leader else parties - {me}
    inbound: dict[str, str] = {}  # channel -> the party that sends it to me
    for e in spec.edges:
        if e["dst_party"] == me and e["src_party"] != me:
            inbound[f"act/{e['src']}->{e['dst']}"] = e["src_party"]
        if e["src_party"] == me and e["dst_party"] != me:
            inbound[f"grad/{e['src']}->{e['dst']}"] = e["dst_party"]
    names = sorted(set(inbound) | {CTL})

    def admit(sender: str, channel: str) -> None:
        if channel == CTL:
            if sender not in ctl_from:
                raise AdmissionError(
                    f"{sender!r} may not send on {CTL!r} to {me!r} (only {sorted(ctl_from)})",
                    field="sender",
                )
            return
        expected = inbound.get(channel)
        if expected is None:
            raise AdmissionError(
                f"channel {channel!r} is not part of the negotiated task (channels: {names})",
                field="channel",
            )
        if sender != expected:
            raise AdmissionError(
                f"{sender!r} may not send on {channel!r} (only {expected!r})", field="sender"
            )

    return admit


#: what a leader takes from its followers while negotiating (``data``: a follower's data
#: description, `negotiate.gather`; inference, the model description; standalone, a request
#: to stop)
FOLLOWER_NEGOTIATION = frozenset({"accept", "refuse", "ready", "error", "model", "leave", "data"})


class NegotiationAdmission:
    """`admit_frame` of a party from its start until its `SplitParty` exists: the
    negotiation's commands (`tandem.parties.split.negotiate`), in order; AdmissionError naming
    the field otherwise. Called on the event loop."""

    def __init__(self, me: str, leader: str) -> None:
        self.me, self.leader = me, leader
        self.phase = "propose"  # follower: what the leader may send next
        # the agreed checkpoint step: the follower's from ``start``; the leader's set by
        # `session.connect` once its proposal went through
        self.step: int | None = None

    def __call__(self, frame: Frame) -> None:
        if frame.channel == NOTICE:
            if frame.arrays or not all(isinstance(v, str) for v in frame.meta.values()):
                raise AdmissionError("a notice carries only text, no arrays", field="arrays")
            return
        if frame.channel != CTL:
            # before the party exists only the first message of its first batch can come
            # (the leader commands no batch before every follower is ready); its dtype and
            # width were checked by the spec's validator
            b, m = frame.meta.get("b"), frame.meta.get("m")
            if not _is_int(b) or b != self.step:
                raise AdmissionError(
                    f"batch id {b!r} on {frame.channel!r} before {self.me!r} runs any batch",
                    field="b",
                )
            if m != 0 or not _is_int(m):
                raise AdmissionError(
                    f"micro-batch index {m!r} on {frame.channel!r} before {self.me!r} runs "
                    "any batch; the first is 0",
                    field="m",
                )
            return
        cmd = frame.meta.get("cmd")
        if self.me == self.leader:
            if cmd not in FOLLOWER_NEGOTIATION or frame.arrays:
                raise AdmissionError(
                    f"{cmd!r} is not a follower's command while {self.me!r} negotiates "
                    f"(only {sorted(FOLLOWER_NEGOTIATION)}, without arrays)",
                    field="cmd",
                )
            return
        allowed = {
            "propose": {"describe", "propose", "abort"},
            "start": {"start", "abort"},
            "batch": {"batch", "stop"},
        }[self.phase]
        if cmd not in allowed:
            raise AdmissionError(
                f"{cmd!r} from the leader while {self.me!r} expects {sorted(allowed)}",
                field="cmd",
            )
        if cmd == "batch":
            b = frame.meta.get("b")
            if b != self.step:
                raise AdmissionError(
                    f"batch command for batch {b!r}; the agreed start is batch {self.step}",
                    field="b",
                )
            return
        if frame.arrays:
            raise AdmissionError(f"{cmd!r} carries no arrays", field="arrays")
        if cmd == "propose":
            self.phase = "start"
        elif cmd == "start":
            step = frame.meta.get("step", 0)
            if not _is_int(step) or step < 0:
                raise AdmissionError(f"start at step {step!r}", field="step")
            if not isinstance(frame.meta.get("finished", False), bool):
                raise AdmissionError("start's `finished` is not a boolean", field="finished")
            self.phase, self.step = "batch", step


@dataclasses.dataclass(frozen=True)
class Batch:
    """What a party knows of one batch before running it: ``rows`` in ``n`` groups of ``c``
    messages each, ``mode`` (``train``/``eval``), and per inbound channel its message count."""

    b: int
    rows: int
    n: int
    c: int
    mode: str
    messages: Mapping[str, int]  # inbound channel -> messages per batch
    bounds: tuple[tuple[int, int], ...]  # row range of each message


class PlanAdmission:
    """`admit_frame` of one `SplitParty` (see the module docstring). Called on the event loop;
    raises `AdmissionError` naming the field."""

    def __init__(self, party: AdmittingParty) -> None:
        self.party = party
        self.batches: dict[int, Batch] = {}
        self.admitted: dict[tuple[str, int], int] = {}
        self.reads_features = any(
            FEATURES in s.inputs for s in party.topology.stages_of(party.name)
        )
        #: the pipeline's channels (every party's activations and gradients): the ones this
        #: check polices; others (e.g. an application's own channel on a shared transport) are
        #: the transport's stream policy's to admit or refuse
        self.channels = frozenset(
            channel
            for mode in ("train", "eval")
            for plan in make_plans(party.topology, 1, mode=mode).values()
            for _, channel, _m in plan.recv_op
        )

    # -- what the party is about to run ------------------------------------------------------
    def announce(self, b: int, rows: int, n: int, c: int, mode: str) -> Batch:
        """Batch ``b`` will run (leader: before its command goes out; follower: once its
        command is admitted)."""
        plan = self.party.plan(n, mode, c)
        messages: dict[str, int] = {}
        for _, channel, _m in plan.recv_op:
            messages[channel] = messages.get(channel, 0) + 1
        batch = Batch(b, rows, n, c, mode, messages, tuple(chunk_bounds(group_bounds(rows, n), c)))
        self.batches[b] = batch
        return batch

    def _prune(self) -> None:
        done = self.party.batches_done
        for b in [b for b in self.batches if b < done]:
            del self.batches[b]
        for key in [k for k in self.admitted if k[1] < done]:
            del self.admitted[key]

    # -- the check ---------------------------------------------------------------------------
    def __call__(self, frame: Frame) -> None:
        self._prune()
        if frame.channel == CTL:
            if frame.sender == self.party.topology.label_owner and not self.party.is_leader:
                self._command(frame)
            return
        if frame.channel in self.channels:
            self._message(frame)

    def _command(self, frame: Frame) -> None:
        """A command of the leader to this follower (`SplitParty.serve` runs it)."""
        meta = frame.meta
        cmd = meta.get("cmd")
        if cmd not in LEADER_COMMANDS:
            raise AdmissionError(
                f"command {cmd!r} is not one a running party takes "
                f"(only {sorted(LEADER_COMMANDS)})",
                field="cmd",
            )
        if cmd != "batch":
            return
        party = self.party
        expect = max(self.batches) + 1 if self.batches else party.batches_done
        b = meta.get("b")
        if not _is_int(b) or b != expect:
            raise AdmissionError(
                f"batch command for batch {b!r}; {party.name!r} expects batch {expect} next",
                field="b",
            )
        n, c, mode, data = meta.get("n"), meta.get("c", 1), meta.get("mode"), meta.get("data")
        if not isinstance(data, str):
            raise AdmissionError(f"dataset {data!r} is not a name", field="data")
        rows = row_count(meta, frame.arrays)  # the form checked; nothing drawn yet
        if not _is_int(n) or not 1 <= n <= rows:
            raise AdmissionError(f"n={n!r} groups for {rows} rows; expected 1..{rows}", field="n")
        want_c = fit_chunks(rows, n, party.config.chunks)
        if not _is_int(c) or c != want_c:
            raise AdmissionError(
                f"c={c!r} messages per group; the agreed chunks={party.config.chunks} give "
                f"{want_c} for {rows} rows in {n} groups",
                field="c",
            )
        if mode not in ("train", "eval"):
            raise AdmissionError(f"mode {mode!r}; expected 'train' or 'eval'", field="mode")
        table = party.datasets.get(data)
        if table is None and (party.datasets or self.reads_features):
            raise AdmissionError(
                f"{party.name!r} holds no dataset {data!r} (it holds {sorted(party.datasets)})",
                field="data",
            )
        idx = party.command_rows.decode(meta, frame.arrays, None if table is None else len(table))
        if table is not None:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= len(table):
                raise AdmissionError(
                    f"row {lo if lo < 0 else hi} of dataset {data!r}, which has {len(table)} rows",
                    field="idx",
                )
        self.announce(b, rows, n, c, mode)

    def _message(self, frame: Frame) -> None:
        """An activation or gradient for one of this party's receive ops."""
        ch, meta = frame.channel, frame.meta
        b, m = meta.get("b"), meta.get("m")
        batch = self.batches.get(b) if _is_int(b) else None
        if batch is None or not _is_int(b):
            raise AdmissionError(
                f"batch id {b!r} on {ch!r}: {self.party.name!r} runs or awaits batches "
                f"{sorted(self.batches) or 'none'}",
                field="b",
            )
        count = batch.messages.get(ch, 0)
        if not count:
            raise AdmissionError(f"batch {b} ({batch.mode}) receives nothing on {ch!r}", field="b")
        expect = self.admitted.get((ch, b), 0)
        if not _is_int(m) or m != expect or m >= count:
            raise AdmissionError(
                f"micro-batch index {m!r} on {ch!r} in batch {b}; expected {expect}"
                + (f" (of 0..{count - 1})" if expect < count else f": all {count} arrived"),
                field="m",
            )
        handler = self.party.handler
        compressor = handler.compressor
        want = len(compressor.layout(1, (1,), "float32"))
        if len(frame.arrays) != want:
            raise AdmissionError(
                f"{ch!r} messages carry {want} array{'s' if want > 1 else ''} with "
                f"compress={compressor.kind!r}, got {len(frame.arrays)}",
                field="arrays",
            )
        a = frame.arrays[0]
        lo, hi = batch.bounds[m]
        if a.ndim < 1 or a.shape[0] != hi - lo:
            raise AdmissionError(
                f"{list(a.shape)} on {ch!r}, micro-batch {m} of batch {b}: its group has "
                f"{hi - lo} rows",
                field="rows",
            )
        src = ch.partition("/")[2].partition("->")[0]
        if src in handler.out_dims:  # the stage's cut: its dtype and shape after the rows
            dtype, shape = handler.channel_cut(ch)
            if compressor.check(frame.arrays, shape, dtype):
                got = " + ".join(f"{x.dtype.name}{list(x.shape)}" for x in frame.arrays)
                raise AdmissionError(
                    f"{got} on {ch!r}; expected {compressor.describe(hi - lo, shape, dtype)}",
                    field="shape",
                )
        self.admitted[(ch, b)] = expect + 1


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)
