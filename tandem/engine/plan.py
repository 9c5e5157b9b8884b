"""Per-party plans derived from a topology: the ops of one batch and their dependencies. Pure.

For each micro-batch ``m`` a party's plan holds:

* ``F(stage, m)``  forward of a non-loss stage;
* ``L(stage, m)``  the loss stage's fused forward + backward (train) or its forward (eval);
* ``B(stage, m)``  backward of a non-loss stage (train only);
* ``S(channel, m)`` send of an activation (``act/...``) or a gradient (``grad/...``) to a peer;
* ``R(channel, m)`` arrival of a message from a peer (satisfied by the transport, never run);

and ``U(stage)`` once per batch, the optimizer update (train only).

**Chunks** (``chunks = c > 1``) make cross-party messages finer than compute: each of the
``n_groups`` groups travels as ``c`` messages (``S``/``R`` micro-batch ``m*c + i`` for group
``m``), and the party owning the loss stage computes per message (``n_groups * c`` compute
groups) while every other party computes per group, sending its output in ``c`` parts and
joining ``c`` arrivals before the op that consumes them. The gradient of a group then starts
back as soon as its first part went through the loss instead of after the whole group
(docs/design.md, "The bound").

**Priority** (`Plan.distance`) is derived, never hand-written: a compute op's *distance to a
send* is 0 when one of its successors is a send, ``1 + min`` over its compute successors
otherwise, and ``None`` (local-only) when no send is reachable. Lower distance runs first; ties
go to the lower micro-batch, then to a seeded random order (`Plan.key`).

Invariants (`Plan.check`): every op appears once; every dependency is an op of the plan; the
dependency graph is acyclic. `check_plans` also matches every send with the peer's receive.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Iterable, Mapping, Sequence

from tandem.errors import ConfigError, PlanError

from .topology import FEATURES, Topology

LOCAL_ONLY = 1 << 30  # distance used for ops that feed no send: they rank last


class Kind(enum.Enum):
    FORWARD = "F"
    LOSS = "L"
    BACKWARD = "B"
    SEND = "S"
    RECV = "R"
    UPDATE = "U"


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.LOSS, Kind.BACKWARD, Kind.UPDATE})


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One step of a plan. ``stage`` for compute ops; ``channel`` and ``peer`` for S/R."""

    kind: Kind
    mb: int
    stage: str = ""
    channel: str = ""
    peer: str = ""
    # the hash, computed once: ops are dict/set keys on the runtime's per-op path, and the
    # generated dataclass hash (a tuple holding an Enum, whose hash is Python code) cost more
    # than the rest of an op's bookkeeping
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_hash", hash((self.kind.value, self.mb, self.stage, self.channel, self.peer))
        )

    def __hash__(self) -> int:
        return self._hash

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        if self.kind is Kind.UPDATE:
            return f"U({self.stage})"
        target = self.stage or self.channel
        return f"{self.kind.value}({target},{self.mb})"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The ops one party runs for one batch, with dependencies and derived priorities."""

    party: str
    n_groups: int
    mode: str
    ops: tuple[Op, ...]
    deps: Mapping[Op, tuple[Op, ...]]
    seed: int = 0
    #: messages per group (see the module docstring); ``fine``: this party computes per message
    chunks: int = 1
    fine: bool = False

    def __post_init__(self) -> None:
        succ: dict[Op, list[Op]] = {op: [] for op in self.ops}
        for op, ds in self.deps.items():
            for d in ds:
                if d in succ:
                    succ[d].append(op)
        object.__setattr__(self, "successors", {k: tuple(v) for k, v in succ.items()})
        object.__setattr__(self, "distance", _distances(self.ops, self.successors))
        order = list(range(len(self.ops)))
        random.Random(self.seed).shuffle(order)
        tie = {op: order[i] for i, op in enumerate(self.ops)}
        object.__setattr__(
            self,
            "key",
            {op: (self.distance[op], op.mb, tie[op]) for op in self.ops if op.is_compute},
        )
        object.__setattr__(
            self,
            "fanout",
            {
                op: sum(1 for s in self.successors[op] if s.kind is Kind.SEND)
                for op in self.ops
                if op.is_compute
            },
        )
        object.__setattr__(self, "producers", frozenset(op for op, k in self.fanout.items() if k))
        object.__setattr__(self, "indegree", {op: len(self.deps.get(op, ())) for op in self.ops})
        object.__setattr__(self, "index", {op: i for i, op in enumerate(self.ops)})
        object.__setattr__(
            self,
            "recv_op",
            {(op.peer, op.channel, op.mb): op for op in self.ops if op.kind is Kind.RECV},
        )

    # populated in __post_init__ (declared for readers and type checkers)
    successors: Mapping[Op, tuple[Op, ...]] = dataclasses.field(init=False, repr=False)
    distance: Mapping[Op, int] = dataclasses.field(init=False, repr=False)
    key: Mapping[Op, tuple[int, int, int]] = dataclasses.field(init=False, repr=False)
    fanout: Mapping[Op, int] = dataclasses.field(init=False, repr=False)
    #: the compute ops with a send among their successors (``fanout`` above 0)
    producers: frozenset[Op] = dataclasses.field(init=False, repr=False)
    #: number of dependencies of each op (the runtime copies it per batch)
    indegree: Mapping[Op, int] = dataclasses.field(init=False, repr=False)
    #: the position of each op in ``ops`` (plan order; the FIFO policy's key)
    index: Mapping[Op, int] = dataclasses.field(init=False, repr=False)
    #: the receive op of each ``(peer, channel, micro-batch)``
    recv_op: Mapping[tuple[str, str, int], Op] = dataclasses.field(init=False, repr=False)

    @property
    def compute_groups(self) -> int:
        """How many groups this party's compute ops cover (``n_groups``, times ``chunks`` for
        the party computing per message); compute ops' ``mb`` counts these."""
        return self.n_groups * self.chunks if self.fine else self.n_groups

    @property
    def compute_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.is_compute)

    @property
    def sends(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind is Kind.SEND)

    @property
    def recvs(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind is Kind.RECV)

    def is_local_only(self, op: Op) -> bool:
        return self.distance[op] == LOCAL_ONLY

    @property
    def max_fanout(self) -> int:
        return max(self.fanout.values(), default=0)

    def check(self) -> None:
        """Raise `PlanError` if an op is duplicated, a dependency is unknown, or deps cycle."""
        if len(set(self.ops)) != len(self.ops):
            dup = [str(o) for o in self.ops if self.ops.count(o) > 1]
            raise PlanError(f"plan of {self.party!r} lists ops twice: {sorted(set(dup))}")
        known = set(self.ops)
        for op, ds in self.deps.items():
            for d in ds:
                if d not in known:
                    raise PlanError(f"plan of {self.party!r}: {op} depends on {d}, not in the plan")
        indeg = {op: len(self.deps.get(op, ())) for op in self.ops}
        frontier = [op for op, k in indeg.items() if k == 0]
        seen = 0
        while frontier:
            op = frontier.pop()
            seen += 1
            for s in self.successors[op]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    frontier.append(s)
        if seen != len(self.ops):
            stuck = sorted(str(op) for op, k in indeg.items() if k > 0)[:8]
            raise PlanError(f"plan of {self.party!r} has a dependency cycle through {stuck}")

    def format(self) -> str:
        """A grid: one row per micro-batch, ops with their priority distance in brackets."""
        c = f", chunks={self.chunks}" if self.chunks > 1 else ""
        rows = [f"plan for {self.party} ({self.mode}, n={self.n_groups}{c})"]
        coarse = self.chunks if not self.fine else 1  # messages per row of this grid
        for m in range(self.compute_groups):
            cells = []
            for op in self.ops:
                if op.kind is Kind.UPDATE:
                    continue
                if (op.mb // coarse if op.kind in (Kind.SEND, Kind.RECV) else op.mb) != m:
                    continue
                d = self.distance.get(op)
                tag = "" if d is None else ("[local]" if d == LOCAL_ONLY else f"[{d}]")
                cells.append(f"{op}{tag}")
            rows.append(f"  mb {m:>3}: " + "  ".join(cells))
        ups = [str(op) for op in self.ops if op.kind is Kind.UPDATE]
        if ups:
            rows.append("  batch : " + "  ".join(ups))
        return "\n".join(rows)


def _distances(ops: Sequence[Op], succ: Mapping[Op, tuple[Op, ...]]) -> dict[Op, int]:
    dist: dict[Op, int] = {}
    # reverse topological walk over compute ops: successors first
    order: list[Op] = []
    state: dict[Op, int] = {}

    def visit(op: Op) -> None:
        if state.get(op) == 2:
            return
        state[op] = 1
        for s in succ[op]:
            if state.get(s) != 1:
                visit(s)
        state[op] = 2
        order.append(op)

    for op in ops:
        visit(op)
    for op in order:  # successors are finished before op
        if not op.is_compute:
            continue
        best = LOCAL_ONLY
        for s in succ[op]:
            if s.kind is Kind.SEND:
                best = 0
                break
            if s.is_compute and dist.get(s, LOCAL_ONLY) != LOCAL_ONLY:
                best = min(best, dist[s] + 1)
        dist[op] = best
    return dist


def computes_per_message(topology: Topology, party: str, chunks: int) -> bool:
    """Whether ``party`` runs its ops per message (the loss party, when ``chunks > 1``) rather
    than per group: the one rule both the plans and `tandem.parties.split.stages.StageHandler`
    follow."""
    return chunks > 1 and party == topology.label_owner


def make_plan(
    topology: Topology,
    party: str,
    n_groups: int,
    *,
    mode: str = "train",
    seed: int = 0,
    chunks: int = 1,
) -> Plan:
    """Derive ``party``'s plan for one batch of ``n_groups`` micro-batches.

    ``mode`` is ``"train"`` (forward, backward, sends both ways, update) or ``"eval"``
    (forward only; the loss stage produces predictions). ``chunks`` splits each group's
    messages in that many parts (module docstring); every party must use the same value.
    """
    _check_plan_args(topology, party, n_groups, mode, chunks)
    train = mode == "train"
    fine = computes_per_message(topology, party, chunks)
    groups = n_groups * chunks if fine else n_groups
    b = _PlanBuilder(topology, party, per_op=1 if fine else chunks)
    for m in range(groups):
        b.forward(m)
        if train:
            b.backward(m)
    if train:
        b.updates(groups)
    plan = Plan(party, n_groups, mode, tuple(b.ops), b.deps, seed, chunks, fine)
    plan.check()
    return plan


def _check_plan_args(topology: Topology, party: str, n_groups: int, mode: str, chunks: int) -> None:
    if mode not in ("train", "eval"):
        raise ConfigError(f"plan mode must be 'train' or 'eval', got {mode!r}")
    if not isinstance(n_groups, int) or n_groups < 1:
        raise ConfigError(f"n_groups must be a positive int, got {n_groups!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks must be a positive int, got {chunks!r}")
    if party not in topology.parties:
        raise ConfigError(
            f"party {party!r} owns no stage of this topology; parties: {list(topology.parties)}"
        )


class _PlanBuilder:
    """`make_plan`'s ops and dependencies for ``party``, appended group by group in the order
    the plan lists them (its ``index``). ``per_op``: messages per compute op, each way."""

    def __init__(self, topology: Topology, party: str, per_op: int) -> None:
        self.topology, self.party, self.per_op = topology, party, per_op
        self.mine = topology.stages_of(party)
        self.ops: list[Op] = []
        self.deps: dict[Op, tuple[Op, ...]] = {}
        self.fwd: dict[tuple[str, int], Op] = {}
        self.bwd: dict[tuple[str, int], Op] = {}

    def add(self, op: Op, ds: Iterable[Op]) -> Op:
        self.ops.append(op)
        self.deps[op] = tuple(ds)
        return op

    def recvs(self, m: int, channel: str, peer: str) -> list[Op]:
        return [
            self.add(Op(Kind.RECV, k, channel=channel, peer=peer), ())
            for k in range(m * self.per_op, (m + 1) * self.per_op)
        ]

    def sends(self, m: int, channel: str, peer: str, src: Op) -> None:
        for k in range(m * self.per_op, (m + 1) * self.per_op):
            self.add(Op(Kind.SEND, k, channel=channel, peer=peer), (src,))

    def forward(self, m: int) -> None:
        """Group ``m``'s forward (or fused loss) ops, their inbound activations and sends."""
        by, party = self.topology.by_name, self.party
        for s in self.mine:
            ins = []
            for i in s.inputs:
                if i == FEATURES:
                    continue
                src = by[i]
                if src.owner == party:
                    ins.append(self.fwd[(i, m)])
                else:
                    ins += self.recvs(m, f"act/{i}->{s.name}", src.owner)
            kind = Kind.LOSS if s.loss else Kind.FORWARD
            self.fwd[(s.name, m)] = op = self.add(Op(kind, m, stage=s.name), ins)
            if s.loss:
                self.bwd[(s.name, m)] = op
            for c in self.topology.consumers(s.name):
                if c.owner != party:
                    self.sends(m, f"act/{s.name}->{c.name}", c.owner, op)

    def backward(self, m: int) -> None:
        """Group ``m``'s backward ops (stages in reverse), inbound gradients and sends."""
        by, party = self.topology.by_name, self.party
        for s in reversed(self.mine):
            if not s.loss:
                ds = [self.fwd[(s.name, m)]]
                for c in self.topology.consumers(s.name):
                    if c.owner == party:
                        ds.append(self.bwd[(c.name, m)])
                    else:
                        ds += self.recvs(m, f"grad/{s.name}->{c.name}", c.owner)
                self.bwd[(s.name, m)] = self.add(Op(Kind.BACKWARD, m, stage=s.name), ds)
            for i in s.inputs:
                if i != FEATURES and by[i].owner != party:
                    self.sends(m, f"grad/{i}->{s.name}", by[i].owner, self.bwd[(s.name, m)])

    def updates(self, groups: int) -> None:
        """One update per stage, after every group's backward."""
        for s in self.mine:
            self.add(
                Op(Kind.UPDATE, groups, stage=s.name),
                tuple(self.bwd[(s.name, m)] for m in range(groups)),
            )


def make_plans(
    topology: Topology, n_groups: int, *, mode: str = "train", seed: int = 0, chunks: int = 1
) -> dict[str, Plan]:
    plans = {
        p: make_plan(topology, p, n_groups, mode=mode, seed=seed, chunks=chunks)
        for p in topology.parties
    }
    check_plans(plans)
    return plans


def check_plans(plans: Mapping[str, Plan]) -> None:
    """Every send has exactly one matching receive at its peer, and vice versa."""
    sends = {(p, op.peer, op.channel, op.mb) for p, pl in plans.items() for op in pl.sends}
    recvs = {(op.peer, p, op.channel, op.mb) for p, pl in plans.items() for op in pl.recvs}
    if sends != recvs:
        missing = sorted(sends ^ recvs)[:5]
        raise PlanError(f"plans disagree on messages (sender, receiver, channel, mb): {missing}")
