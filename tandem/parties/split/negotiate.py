"""Task negotiation and checkpoint agreement over the ``ctl`` channel, before training.

Protocol (every message a `Frame` on channel ``ctl``; the leader's to each follower, the
replies back; docs/parties.md#negotiation)::

    leader -> follower   {"cmd": "describe"}                        # training only (`gather`)
    follower -> leader   {"cmd": "data", "data": {"features", "fingerprint", "cuts"}}
    leader -> follower   {"cmd": "propose", "spec": TaskSpec.to_dict()}
                     or  {"cmd": "abort", "reasons": [...]}   # the leader cannot start
    follower -> leader   {"cmd": "accept", "checkpoints": [steps saved under this spec],
                          "finished": [those of them a completed job saved]}
                     or  {"cmd": "refuse", "reasons": ["follower 'B' has 7 feature columns ..."]}
    -- every follower accepted: both sides set transport.spec_hash and the validator --
    leader -> follower   {"cmd": "start", "step": s,     # s = max common checkpoint, 0 = fresh
                          "finished": f}                # f: s is finished on every party
                     or  {"cmd": "abort", "reasons": [...]}   # another follower refused
    follower -> leader   {"cmd": "ready"}  or  {"cmd": "error", "reason": "..."}

The proposal and the replies travel before the hash is set (spec hash ``""``); from ``start``
on, every frame carries the agreed hash, and the HTTP transport answers 409 to any other hash
and 422 to a tensor the validator (`spec_validator`) refuses.

Agreement rule: each party lists the steps of the checkpoints it holds for this spec hash; the
leader picks the largest step held by every party (0 if none) and everyone loads it. That step
is *finished* only when every party's checkpoint there is a finished one (its job completed):
the parties then evaluate and export it without training. One party's finished checkpoint
with another's periodic one at the same step is an ordinary resume (a finished file holds the
trajectory too, `tandem.parties.split.checkpoint`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tandem.errors import FrameError, TandemError
from tandem.transports.base import AdmittingTransport, Frame, Transport

from .admission import spec_streams
from .command_rows import row_count
from .compress import from_hyper
from .spec import SpecError, TaskSpec

CTL = "ctl"


class NegotiationError(TandemError):
    """The parties could not agree on the task (a follower refused the spec, or a peer broke
    the protocol); ``reasons`` maps each party to its list of reasons."""

    def __init__(self, message: str, reasons: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons or {}


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The checkpoint the parties agreed to start from: ``step`` (0 = fresh start), and
    ``finished``: every party's checkpoint at ``step`` ends a completed job (nothing to
    train; evaluate and export it). Invariant: ``finished`` implies ``step > 0``."""

    step: int = 0
    finished: bool = False


def spec_validator(spec: TaskSpec, *, leader: str) -> Callable[[Frame], None]:
    """A transport validator refusing (with `FrameError`) any tensor the spec does not allow.

    * ``act/src->dst`` and ``grad/src->dst``: exactly one ``dtype[rows, *shape]`` array of the
      edge (`TaskSpec.channel_shapes`), ``1 <= rows <= spec.max_rows``, sent by the edge's
      source (act) or destination (grad) party; the message names the field that differs
      (dtype, shape, rows); with ``reject_nonfinite`` a bfloat16 tensor holding NaN or Inf is
      refused too (numpy float kinds are the transport's own check);
    * ``ctl``: commands of the leader naming at most ``max_rows`` rows (one narrow index array,
      a range or a draw: `tandem.parties.split.command_rows`); replies from followers name no
      rows and carry no arrays;
    * with cut compression in the spec (``hyper["compress"]``), the arrays of the
      compressor's layout of that tensor instead (`tandem.parties.split.compress`);
    * any other channel is refused.
    """
    return _SpecValidator(spec, leader)


class _SpecValidator:
    """`spec_validator`'s check: one frame against the channels, senders, shapes and row
    budget of ``spec`` (`FrameError` naming what differs).

    An `InlineValidator`: it looks at the frame's header and array shapes, and at most scans a
    bfloat16 tensor once for NaN/Inf and a compressed payload's layout, so the transport runs
    it on the loop beside its own checks (no worker thread per cut message)."""

    inline = True

    def __init__(self, spec: TaskSpec, leader: str) -> None:
        self.leader = leader
        self.shapes = spec.channel_shapes()
        self.senders = {}
        for e in spec.edges:
            self.senders[f"act/{e['src']}->{e['dst']}"] = e["src_party"]
            self.senders[f"grad/{e['src']}->{e['dst']}"] = e["dst_party"]
        self.max_rows = spec.max_rows
        self.nonfinite = bool(spec.security.get("reject_nonfinite"))
        self.compressor = from_hyper(spec.hyper)

    def __call__(self, frame: Frame) -> None:
        ch = frame.channel
        if ch == CTL:
            self._ctl(frame)
            return
        if ch not in self.shapes:
            raise FrameError(
                f"channel {ch!r} is not part of the negotiated task (channels: "
                f"{sorted(self.shapes) + [CTL]})"
            )
        dtype, shape = self.shapes[ch]
        sender = self.senders.get(ch)
        if frame.sender and sender and frame.sender != sender:
            raise FrameError(f"{frame.sender!r} may not send on {ch!r} (only {sender!r})")
        if self.compressor.exact:
            self._exact(frame, ch, dtype, shape)
        else:
            self._compressed(frame, ch, dtype, shape)

    def _ctl(self, frame: Frame) -> None:
        """Commands of the leader name at most ``max_rows`` rows; replies name none."""
        if not frame.arrays and frame.meta.get("rows") is None:
            return
        if frame.sender != self.leader or len(frame.arrays) > 1:
            raise FrameError(
                f"ctl frame from {frame.sender!r} carries {len(frame.arrays)} arrays "
                f"{'and rows ' if frame.meta.get('rows') is not None else ''}; only the "
                "leader's commands name rows, with at most one index array"
            )
        rows = row_count(frame.meta, frame.arrays)
        if not 1 <= rows <= self.max_rows:
            raise FrameError(
                f"a command names {rows} rows; the spec allows 1..{self.max_rows} per batch"
            )

    def _exact(self, frame: Frame, ch: str, dtype: str, shape: tuple[int, ...]) -> None:
        """One ``dtype[rows, *shape]`` tensor, finite where the spec asks and numpy cannot."""
        if len(frame.arrays) != 1:
            raise FrameError(f"{ch!r} frames carry exactly one tensor, got {len(frame.arrays)}")
        a = frame.arrays[0]
        wrong = []
        if a.dtype.name != dtype:
            wrong.append("dtype")
        if a.ndim != 1 + len(shape) or tuple(a.shape[1:]) != shape:
            wrong.append("shape")
        elif not 1 <= a.shape[0] <= self.max_rows:
            wrong.append("rows")
        if wrong:
            dims = ", ".join(str(d) for d in shape)
            raise FrameError(
                f"tensor on {ch!r} is {a.dtype.name}{list(a.shape)}; the spec says "
                f"{dtype}[rows, {dims}] with 1 <= rows <= {self.max_rows}: its "
                f"{' and '.join(wrong)} differ{'s' if len(wrong) == 1 else ''}"
            )
        if self.nonfinite and dtype == "bfloat16" and not np.isfinite(a).all():
            # the transports' NaN/Inf check covers numpy's float kinds; bfloat16 is not one
            raise FrameError(
                f"tensor on {ch!r} contains NaN or Inf (reject_nonfinite is set in the spec)"
            )

    def _compressed(self, frame: Frame, ch: str, dtype: str, shape: tuple[int, ...]) -> None:
        """The arrays of the compressor's layout of a ``dtype[rows, *shape]`` tensor."""
        arrays, compressor, max_rows = frame.arrays, self.compressor, self.max_rows
        wrong = compressor.check(arrays, shape, dtype)
        if not wrong and not 1 <= arrays[0].shape[0] <= max_rows:
            wrong = ["rows"]
        if wrong:
            got = " + ".join(f"{a.dtype.name}{list(a.shape)}" for a in arrays)
            raise FrameError(
                f"payload on {ch!r} is {got}; with compress={compressor.kind!r} the spec says "
                f"{compressor.describe('rows', shape, dtype)} with 1 <= rows <= {max_rows}: "
                f"its {' and '.join(wrong)} differ"
            )
        if self.nonfinite and any(a.dtype.name == "bfloat16" for a in arrays):
            if not all(np.isfinite(a).all() for a in arrays if a.dtype.name == "bfloat16"):
                raise FrameError(
                    f"tensor on {ch!r} contains NaN or Inf (reject_nonfinite is set in the spec)"
                )


def install(transport: Transport, spec: TaskSpec, *, leader: str) -> str:
    """Stamp ``transport`` with the spec hash, the validator and the stream admission of the
    spec (`admission.spec_streams`) when it takes admission hooks (`AdmittingTransport`, e.g.
    `tandem.transports.http.HttpTransport`; the memory transport checks none). Returns the
    hash."""
    digest = spec.spec_hash()
    if isinstance(transport, AdmittingTransport):
        transport.spec_hash = digest
        transport.validator = spec_validator(spec, leader=leader)
        transport.admit_stream = spec_streams(spec, transport.name, leader)
    return digest


async def _recv_cmd(transport: Transport, peer: str, expect: Iterable[str]) -> dict[str, Any]:
    frame = await transport.recv(peer, CTL)
    meta = dict(frame.meta)
    if meta.get("cmd") not in set(expect):
        raise NegotiationError(
            f"{peer!r} sent {meta.get('cmd')!r} during negotiation; expected "
            f"one of {sorted(set(expect))}. Are both parties running the same "
            "Tandem version, and was the other one restarted too?"
        )
    return meta


async def gather(transport: Transport, followers: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Leader, before building a training spec: ask every follower to describe its data
    (``{"cmd": "describe"}``); returns ``{follower: {"features", "fingerprint", "cuts"}}`` as
    each answered (`tandem.parties.split.process.session.describe_data`; ``{}`` from a party with
    nothing to describe)."""
    for peer in followers:
        await transport.send(peer, CTL, Frame(meta={"cmd": "describe"}))
    out = {}
    for peer in followers:
        meta = await _recv_cmd(transport, peer, ("data",))
        data = meta.get("data")
        out[peer] = dict(data) if isinstance(data, dict) else {}
    return out


async def abort(transport: Transport, followers: Sequence[str], reasons: Sequence[str]) -> None:
    """Leader: tell every follower waiting for a proposal that training will not start."""
    for peer in followers:
        await transport.send(peer, CTL, Frame(meta={"cmd": "abort", "reasons": list(reasons)}))


async def propose(
    transport: Transport,
    followers: Sequence[str],
    spec: TaskSpec,
    *,
    checkpoints: Iterable[int] = (),
) -> int:
    """Leader: `propose_agreement` without finished checkpoints; returns the agreed step."""
    return (await propose_agreement(transport, followers, spec, checkpoints=checkpoints)).step


async def propose_agreement(
    transport: Transport,
    followers: Sequence[str],
    spec: TaskSpec,
    *,
    checkpoints: Iterable[int] = (),
    finished: Iterable[int] = (),
) -> Agreement:
    """Leader: propose ``spec`` to every follower; returns the agreed checkpoint.
    ``checkpoints``: the steps this party holds for ``spec``; ``finished``: those of them
    that are finished (see the module docstring).

    Raises `NegotiationError` listing every refusing follower's reasons (training must not
    start), or naming a follower that could not load the agreed checkpoint.
    """
    body = spec.to_dict()
    for peer in followers:
        await transport.send(peer, CTL, Frame(meta={"cmd": "propose", "spec": body}))
    refused: dict[str, list[str]] = {}
    steps = set(int(s) for s in checkpoints)
    done = steps & {int(s) for s in finished}
    for peer in followers:
        meta = await _recv_cmd(transport, peer, ("accept", "refuse"))
        if meta["cmd"] == "refuse":
            refused[peer] = [str(r) for r in meta.get("reasons", [])] or ["(no reason given)"]
        else:
            steps &= {int(s) for s in meta.get("checkpoints", [])}
            done &= {int(s) for s in meta.get("finished", [])}
    if refused:
        flat = [f"{p}: {r}" for p, rs in refused.items() for r in rs]
        install(transport, spec, leader=transport.name)  # accepting followers expect the hash
        for peer in followers:
            if peer not in refused:
                await transport.send(peer, CTL, Frame(meta={"cmd": "abort", "reasons": flat}))
        raise NegotiationError(
            "the task spec was refused, training does not start:\n  " + "\n  ".join(flat), refused
        )
    step = max(steps, default=0)
    agreed = Agreement(step, step > 0 and step in done)
    install(transport, spec, leader=transport.name)
    start = {"cmd": "start", "step": step, "finished": agreed.finished}
    for peer in followers:
        await transport.send(peer, CTL, Frame(meta=start))
    errors = {}
    for peer in followers:
        meta = await _recv_cmd(transport, peer, ("ready", "error"))
        if meta["cmd"] == "error":
            errors[peer] = [str(meta.get("reason"))]
    if errors:
        raise NegotiationError(
            "followers could not start: " + "; ".join(f"{p}: {r[0]}" for p, r in errors.items()),
            errors,
        )
    return agreed


async def answer(
    transport: Transport,
    leader: str,
    *,
    check: Callable[[TaskSpec], list[str]],
    checkpoints: Callable[[str], Iterable[int]] = lambda digest: (),
    describe: Callable[[], dict[str, Any]] | None = None,
) -> tuple[TaskSpec, int]:
    """Follower: `answer_agreement` without finished checkpoints; returns ``(spec, step)``."""
    spec, agreed = await answer_agreement(
        transport, leader, check=check, checkpoints=checkpoints, describe=describe
    )
    return spec, agreed.step


async def answer_agreement(
    transport: Transport,
    leader: str,
    *,
    check: Callable[[TaskSpec], list[str]],
    checkpoints: Callable[[str], Iterable[int]] = lambda digest: (),
    finished: Callable[[str], Iterable[int]] = lambda digest: (),
    describe: Callable[[], dict[str, Any]] | None = None,
) -> tuple[TaskSpec, Agreement]:
    """Follower: wait for the leader's proposal, check it, reply; returns ``(spec,
    agreement)``.

    ``check(spec)`` returns the refusal reasons ([] = accept); ``checkpoints(spec_hash)`` the
    steps saved for that spec, ``finished(spec_hash)`` those of them that are finished;
    ``describe()`` what this party tells a leader asking about its
    data first (`gather`; ``{}`` when None). After this returns, load checkpoint ``step`` (0 =
    fresh start) and call `ready`. Raises `NegotiationError` when this party refuses or the
    leader aborts.
    """
    meta = await _recv_cmd(transport, leader, ("describe", "propose", "abort"))
    if meta["cmd"] == "describe":
        data = describe() if describe is not None else {}
        await transport.send(leader, CTL, Frame(meta={"cmd": "data", "data": data}))
        meta = await _recv_cmd(transport, leader, ("propose", "abort"))
    if meta["cmd"] == "abort":
        reasons = [str(r) for r in meta.get("reasons", [])]
        raise NegotiationError(
            "the leader cannot start the training:\n  " + "\n  ".join(reasons),
            {leader: reasons},
        )
    spec: TaskSpec | None
    try:
        spec = TaskSpec.from_dict(meta.get("spec"))  # from_dict checks it
        reasons = list(check(spec))
    except SpecError as exc:
        spec, reasons = None, [f"the proposed spec is malformed: {exc}"]
    if reasons or spec is None:  # no spec comes with a reason
        await transport.send(leader, CTL, Frame(meta={"cmd": "refuse", "reasons": reasons}))
        raise NegotiationError(
            f"{transport.name!r} refused the task spec:\n  " + "\n  ".join(reasons),
            {transport.name: reasons},
        )
    digest = spec.spec_hash()
    saved = sorted(int(s) for s in checkpoints(digest))
    done = sorted(set(saved) & {int(s) for s in finished(digest)})
    accept = {"cmd": "accept", "checkpoints": saved, "finished": done}
    await transport.send(leader, CTL, Frame(meta=accept))
    install(transport, spec, leader=leader)  # no await since the send: nothing slips in between
    meta = await _recv_cmd(transport, leader, ("start", "abort"))
    if meta["cmd"] == "abort":
        reasons = [str(r) for r in meta.get("reasons", [])]
        raise NegotiationError(
            "the leader aborted: another party refused the spec:\n  " + "\n  ".join(reasons),
            {"leader": reasons},
        )
    step = int(meta.get("step", 0))
    if step and step not in saved:
        await ready(transport, leader, error=f"no checkpoint at step {step}")
        raise NegotiationError(
            f"the leader chose checkpoint {step}, which {transport.name!r} "
            f"does not hold (it holds {saved})"
        )
    if meta.get("finished") is True and step not in done:
        await ready(transport, leader, error=f"checkpoint {step} is not a finished one here")
        raise NegotiationError(
            f"the leader takes checkpoint {step} as finished, but {transport.name!r}'s is not "
            f"(its finished ones: {done}); restart every party"
        )
    return spec, Agreement(step, bool(step and meta.get("finished") is True))


async def ready(transport: Transport, leader: str, *, error: str | None = None) -> None:
    """Follower: tell the leader it loaded the agreed checkpoint (or why it could not)."""
    meta = {"cmd": "ready"} if error is None else {"cmd": "error", "reason": error}
    await transport.send(leader, CTL, Frame(meta=meta))


__all__ = [
    "Agreement",
    "NegotiationError",
    "abort",
    "answer",
    "answer_agreement",
    "gather",
    "install",
    "propose",
    "propose_agreement",
    "ready",
    "spec_validator",
]
