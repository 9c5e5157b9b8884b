"""Topologies: which party owns which stage, and what each stage consumes. Pure data.

A `Topology` is a set of named `Stage`s. A stage's inputs are:

* ``FEATURES`` -- the raw features held by the stage's owner;
* the name of another stage -- that stage's output, possibly another party's (a cut edge).

Exactly one stage is the *loss stage*: its output, with the labels held by its owner, gives the
loss. Every other stage's output must be consumed by some stage.

Invariants checked by `Topology.__post_init__` (violations raise `TopologyError` naming the
stage): unique names; every stage has an owner and at least one input; every input exists; the
stage graph is acyclic; exactly one loss stage, consumed by nobody; every other stage consumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from tandem.errors import TopologyError

FEATURES = "features"
#: dtypes a cut edge may carry (a stage's output read by another party's stage, and its
#: gradient): `tandem.engine.kernels.StageModel.out_dtype`.
CUT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    """One piece of the model, owned by one party."""

    name: str
    owner: str
    inputs: tuple[str, ...]
    loss: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))


@dataclasses.dataclass(frozen=True, slots=True)
class Edge:
    """A cut edge: ``src``'s output consumed by ``dst`` on another party."""

    src: str
    dst: str
    src_party: str
    dst_party: str

    @property
    def act_channel(self) -> str:
        return f"act/{self.src}->{self.dst}"

    @property
    def grad_channel(self) -> str:
        return f"grad/{self.src}->{self.dst}"


@dataclasses.dataclass(frozen=True)
class Topology:
    """An acyclic graph of stages with a single loss stage. See the module docstring."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        _validate(self.stages)

    # -- queries ---------------------------------------------------------------------------
    @property
    def by_name(self) -> Mapping[str, Stage]:
        return {s.name: s for s in self.stages}

    @property
    def parties(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for s in self.stages:
            seen.setdefault(s.owner, None)
        return tuple(seen)

    @property
    def loss_stage(self) -> Stage:
        return next(s for s in self.stages if s.loss)

    @property
    def label_owner(self) -> str:
        return self.loss_stage.owner

    def stages_of(self, party: str) -> tuple[Stage, ...]:
        return tuple(s for s in self.topological_order() if s.owner == party)

    def feature_parties(self) -> tuple[str, ...]:
        return tuple(
            p
            for p in self.parties
            if any(FEATURES in s.inputs for s in self.stages if s.owner == p)
        )

    def consumers(self, name: str) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if name in s.inputs)

    def edges(self) -> tuple[Edge, ...]:
        """Every cut edge (output of one party's stage consumed by another party's stage)."""
        by = self.by_name
        out = []
        for s in self.stages:
            for i in s.inputs:
                if i != FEATURES and by[i].owner != s.owner:
                    out.append(Edge(i, s.name, by[i].owner, s.owner))
        return tuple(out)

    def topological_order(self) -> tuple[Stage, ...]:
        return _toposort(self.stages)

    # -- serialisation (JSON-able, no pickle) ------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "stages": [
                {"name": s.name, "owner": s.owner, "inputs": list(s.inputs), "loss": s.loss}
                for s in self.stages
            ]
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Topology:
        try:
            return cls(
                tuple(
                    Stage(d["name"], d["owner"], tuple(d["inputs"]), bool(d.get("loss", False)))
                    for d in data["stages"]
                )
            )
        except (KeyError, TypeError) as exc:
            raise TopologyError(
                f"topology description is malformed: missing or wrong field {exc}"
            ) from None

    def describe(self) -> str:
        lines = []
        for s in self.topological_order():
            tag = "  [loss]" if s.loss else ""
            lines.append(f"{s.name:>14} @ {s.owner:<10} <- {', '.join(s.inputs)}{tag}")
        return "\n".join(lines)


def _toposort(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    by = {s.name: s for s in stages}
    order: list[Stage] = []
    state: dict[str, int] = {}  # 1 = visiting, 2 = done

    def visit(name: str, path: list[str]) -> None:
        st = state.get(name)
        if st == 2:
            return
        if st == 1:
            cycle = path[path.index(name) :] + [name]
            raise TopologyError(
                f"topology has a cycle: {' -> '.join(cycle)}; a stage may not "
                "(indirectly) consume its own output"
            )
        state[name] = 1
        for i in by[name].inputs:
            if i != FEATURES:
                visit(i, path + [name])
        state[name] = 2
        order.append(by[name])

    for s in stages:
        visit(s.name, [])
    return tuple(order)


def _validate(stages: Sequence[Stage]) -> None:
    if not stages:
        raise TopologyError("topology has no stages; add at least a loss stage")
    names: set[str] = set()
    for s in stages:
        if not isinstance(s, Stage):
            raise TopologyError(f"topology entries must be Stage objects, got {type(s).__name__}")
        if not s.name or s.name == FEATURES:
            raise TopologyError(f"stage name {s.name!r} is not allowed (empty or reserved)")
        if s.name in names:
            raise TopologyError(f"stage name {s.name!r} is used twice; stage names must be unique")
        names.add(s.name)
        if not s.owner:
            raise TopologyError(
                f"stage {s.name!r} has no owner; set Stage(owner=...) to a party name"
            )
        if not s.inputs:
            raise TopologyError(
                f"stage {s.name!r} has no inputs; give it {FEATURES!r} or another stage"
            )
    for s in stages:
        for i in s.inputs:
            if i != FEATURES and i not in names:
                raise TopologyError(
                    f"stage {s.name!r} consumes {i!r}, which is not a stage of this topology "
                    f"(stages: {sorted(names)}; use {FEATURES!r} for the owner's raw features)"
                )
        if len(set(s.inputs)) != len(s.inputs):
            raise TopologyError(f"stage {s.name!r} lists an input twice: {list(s.inputs)}")
    losses = [s.name for s in stages if s.loss]
    if len(losses) != 1:
        raise TopologyError(
            f"topology must have exactly one loss stage, found {len(losses)}"
            + (f": {losses}" if losses else "; mark the stage that meets the labels with loss=True")
        )
    _toposort(stages)
    consumed = {i for s in stages for i in s.inputs}
    for s in stages:
        if s.loss and s.name in consumed:
            raise TopologyError(
                f"loss stage {s.name!r} is consumed by another stage; the loss "
                "stage must be the last stage"
            )
        if not s.loss and s.name not in consumed:
            raise TopologyError(
                f"stage {s.name!r} feeds nothing; connect it to a consumer or remove it"
            )


# -- built-in topologies ------------------------------------------------------------------------
def two_party(a: str = "A", b: str = "B") -> Topology:
    """(a) Bottom model on ``a`` (features), top model with the labels on ``b``."""
    return Topology((Stage("bottom", a, (FEATURES,)), Stage("top", b, ("bottom",), loss=True)))


def leader_follower(leader: str = "leader", follower: str = "follower") -> Topology:
    """(b) Leader holds a bottom, the top and the labels; follower holds a bottom."""
    return Topology(
        (
            Stage("bottom_leader", leader, (FEATURES,)),
            Stage("bottom_follower", follower, (FEATURES,)),
            Stage("top", leader, ("bottom_leader", "bottom_follower"), loss=True),
        )
    )


def u_shape(a: str = "A", b: str = "B") -> Topology:
    """(c) U-shape: ``a1`` on ``a`` -> ``b1`` on ``b`` -> ``a2`` on ``a`` with the labels."""
    return Topology(
        (
            Stage("a1", a, (FEATURES,)),
            Stage("b1", b, ("a1",)),
            Stage("a2", a, ("b1",), loss=True),
        )
    )


def star(k: int, leader: str = "leader", *, leader_bottom: bool = False) -> Topology:
    """(d) One leader with the top and labels, ``k`` followers each with a bottom model."""
    if not 1 <= k <= 64:
        raise TopologyError(f"star topology needs 1 <= k <= 64 followers, got {k}")
    stages = [Stage(f"bottom_{i}", f"follower{i}", (FEATURES,)) for i in range(k)]
    if leader_bottom:
        stages.append(Stage("bottom_leader", leader, (FEATURES,)))
    stages.append(Stage("top", leader, tuple(s.name for s in stages), loss=True))
    return Topology(tuple(stages))


BUILTIN: dict[str, Callable[..., Topology]] = {
    "two_party": two_party,
    "leader_follower": leader_follower,
    "u_shape": u_shape,
    "star": star,
}


def from_stages(stages: Iterable[Stage]) -> Topology:
    return Topology(tuple(stages))
