"""Which topology a split party's configuration names, and the topology itself.

`topology_ref` reads the reference from the configuration (a built-in's name and arguments, or a
JSON file's path resolved against the configuration's folder); `topology_of` builds it;
`talks_to` says which parties a given party exchanges frames with.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from tandem.engine.topology import BUILTIN, FEATURES, Stage, Topology

from .config import PartyConfig, PartyConfigError


@dataclasses.dataclass(frozen=True)
class TopologyRef:
    """Which topology: a built-in ``name`` with its arguments, or a JSON file's path."""

    topology: str
    topology_args: tuple[str | int, ...] = ()
    topology_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def topology_of(model: TopologyRef, path: str) -> Topology:
    """The `Topology` ``model`` names; `PartyConfigError` (naming ``path``) when its
    arguments do not fit or its file does not hold one."""
    from tandem.errors import TopologyError

    if model.topology in BUILTIN:
        kwargs = dict(model.topology_kwargs)
        try:
            if model.topology == "star":
                return _star(list(model.topology_args), kwargs)
            return BUILTIN[model.topology](*model.topology_args, **kwargs)
        except (TypeError, TopologyError) as exc:
            given = list(model.topology_args) or kwargs
            raise PartyConfigError(
                f"{path}: the arguments {given} do not fit the built-in topology "
                f"{model.topology!r}: {exc}"
            ) from None
    import json

    try:
        with open(model.topology, encoding="utf-8") as f:
            return Topology.from_dict(json.load(f))
    except (ValueError, TopologyError) as exc:
        raise PartyConfigError(f"{path}: model.topology file {model.topology!r}: {exc}") from None


def _star(args: list[Any], kwargs: dict[str, Any]) -> Topology:
    """A star: ``followers`` a count (parties ``follower0``... as `tandem.engine.topology.star`)
    or a list of names (stages ``bottom_<name>``), one leader with the top (and, with
    ``leader_bottom``, ``bottom_<leader>``)."""
    from tandem.engine.topology import star
    from tandem.errors import TopologyError

    followers = kwargs.pop("followers", args.pop(0) if args else None)
    leader = kwargs.pop("leader", args.pop(0) if args else "leader")
    if args or set(kwargs) - {"leader_bottom"}:
        raise TypeError(f"star takes followers, leader, leader_bottom; got extra {args or kwargs}")
    if isinstance(followers, int) and not isinstance(followers, bool):
        return star(followers, leader, **kwargs)
    if not isinstance(followers, list) or not followers:
        raise TopologyError(f"followers must be a count or a list of names, got {followers!r}")
    names = [str(f) for f in followers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice or leader in names:
        raise TopologyError(
            f"party names must differ: {twice or [leader]} given twice (the leader is {leader!r})"
        )
    stages = [Stage(f"bottom_{n}", n, (FEATURES,)) for n in names]
    if kwargs.get("leader_bottom"):
        stages.append(Stage(f"bottom_{leader}", leader, (FEATURES,)))
    stages.append(Stage("top", leader, tuple(s.name for s in stages), loss=True))
    return Topology(tuple(stages))


def talks_to(topo: Topology, name: str) -> list[str]:
    """The parties ``name`` exchanges frames with: every other party for the leader (it
    drives them all); a follower: the leader and the parties across its cut edges."""
    if topo.label_owner == name:
        return [p for p in topo.parties if p != name]
    peers = {topo.label_owner}
    for e in topo.edges():
        if name in (e.src_party, e.dst_party):
            peers.update((e.src_party, e.dst_party))
    peers.discard(name)
    return sorted(peers)


def topology_ref(c: PartyConfig) -> TopologyRef:
    """Which topology the configuration ``c`` names (``[topology]`` or ``model.topology``);
    a file's path resolved against the configuration's folder."""
    if c.topology is not None:
        if c.topology.file is not None:
            return TopologyRef(c.topology.file)
        return TopologyRef(str(c.topology.kind), (), c.topology.arguments())
    args = tuple(c.model.topology_args or ())
    name = c.model.topology or "leader_follower"
    if name not in BUILTIN:
        name = _file(c.path, name, "model.topology")
    return TopologyRef(name, args)


def _file(path: str, value: str, key: str) -> str:
    base = os.path.dirname(os.path.abspath(path))
    full = value if os.path.isabs(value) else os.path.join(base, value)
    if not os.path.exists(full):
        raise PartyConfigError(
            f"{path}: {key} = {value!r}: no such file ({full}); fix the path "
            "(relative paths start at the config file's folder)"
        )
    return full


__all__ = ["TopologyRef", "talks_to", "topology_of", "topology_ref"]
