"""Named parameters: any pytree of arrays as nested dicts with str keys, and back.

An export (`tandem.parties.export`) stores dicts with str keys, lists, tuples and arrays;
the engine's optimizers and accumulators need only a pytree. A Flax or Equinox model's
parameters are other pytrees (nnx ``State`` of ``Param`` variables, Equinox modules), so the
adapters hand the engine `NamedTree.named` dicts, keyed by each leaf's path (``{"layers": {"0":
{"weight": ...}}}``), and rebuild the library's pytree with `NamedTree.restore` inside ``apply``.

Invariant: ``restore(named(tree))`` has ``tree``'s structure and leaves, and every path maps to
one leaf (no two leaves share a name, no name is a prefix of another).
"""

from __future__ import annotations

from typing import Any

import jax

from tandem.errors import ConfigError


class NamedTree:
    """The naming of one pytree structure's leaves (see the module docstring).

    ``strip`` drops a path's last component when it equals ``strip`` (``"value"``: the field
    that holds a Flax nnx variable's array), so names read like the module's attributes.
    """

    def __init__(self, tree: Any, *, what: str, strip: str | None = None) -> None:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.treedef: Any = treedef
        paths = []
        for keys, _ in flat:
            path = tuple(_component(k) for k in keys)
            if strip is not None and len(path) > 1 and path[-1] == strip:
                path = path[:-1]
            paths.append(path or ("leaf",))
        ordered = sorted(paths)
        for a, b in zip(ordered, ordered[1:], strict=False):
            if b[: len(a)] == a:
                raise ConfigError(
                    f"{what}: parameters {'/'.join(a)!r} and {'/'.join(b)!r} get clashing "
                    "names (keys that differ only in type, e.g. 1 and '1'); rename one"
                )
        self.paths: tuple[tuple[str, ...], ...] = tuple(paths)
        self.what = what

    def named(self, tree: Any) -> dict[str, Any]:
        """``tree`` (of this structure) as nested dicts keyed by path."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ConfigError(
                f"{self.what}: the parameters changed structure ({treedef} instead of "
                f"{self.treedef}); build a new adapter for the new module"
            )
        out: dict[str, Any] = {}
        for path, leaf in zip(self.paths, leaves, strict=True):
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = leaf
        return out

    def restore(self, named: Any) -> Any:
        """The library's pytree from `named`'s dicts (jit-safe: only indexing and unflatten)."""
        leaves = []
        for path in self.paths:
            node = named
            for key in path:
                node = node[key]
            leaves.append(node)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _component(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        name = str(key.key)
    elif isinstance(key, jax.tree_util.GetAttrKey):
        name = key.name
    elif isinstance(key, jax.tree_util.SequenceKey):
        name = str(key.idx)
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
        name = str(key.key)
    else:
        name = str(key)
    # "/" separates path components in an export's tensor names
    return name.replace("/", ".") or "_"
