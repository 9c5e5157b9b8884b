"""Alignment of one leader with K followers: pairwise PSIs through the leader, then one list.

The split-learning star has one leader and K followers, and each follower talks to the leader
only. The ids every party holds are found in two steps:

1. **Pairwise PSI.** The leader runs `psi.align` with each follower (concurrently, each on its
   own ``psi/*`` channels). Leader and follower ``f`` both learn ``I_f``, the ids they share,
   in the agreed (canonical) order, and nothing else about each other's ids.
2. **The final list.** The leader intersects: ``F = I_1 ∩ ... ∩ I_K``, in canonical order,
   and sends each follower, on ``psi/final``, the *positions* in ``I_f`` of the ids of ``F``
   (an int64 vector, ascending) with ``F``'s size and commitment. No id crosses the wire: the
   follower already holds ``I_f`` in the same order, so the positions pick its rows. It checks
   that the ids picked have the leader's commitment.

What each party learns: the leader, every ``I_f`` (as in K two-party alignments); follower
``f``, ``I_f`` and which of those ids every other party holds too (``F``, the rows it will
train on), but no id outside ``I_f`` and nothing about which follower lacks an id. Followers
never exchange frames. With one follower, ``F = I_1``: the same result as a two-party
alignment.

Needs the ``psi`` extra, as `psi` does. Every party ends with the ids of ``F`` in canonical
order, so row ``i`` of each party's aligned data is the same sample; the commitment equals
`ids.commitment` of that list.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.parties.data.canonical_ids import canonical, commitment
from tandem.transports.base import Frame, Transport

from .errors import AlignmentMismatchError, ProtocolError
from .psi import align

CH_FINAL = "psi/final"


@dataclasses.dataclass(frozen=True)
class FinalIds:
    """The ids every party holds, in canonical order: this party's ``ids`` and ``rows`` (its
    data row of each), their ``size`` and ``commitment``; ``pairwise`` maps each peer to the
    size of the intersection found with it, ``peer_counts`` to its distinct id count;
    ``local_count`` and ``duplicates`` as in `psi.AlignedIds`."""

    ids: tuple[Any, ...]
    rows: np.ndarray
    size: int
    commitment: str
    pairwise: dict[str, int]
    peer_counts: dict[str, int]
    local_count: int
    duplicates: int


async def align_leader(
    transport: Transport, followers: Sequence[str], ids: Sequence[Any], **psi: Any
) -> FinalIds:
    """Leader: align ``ids`` with every follower, intersect, send each follower its positions
    of the final list (see the module docstring). ``psi``: keyword arguments of `psi.align`
    (``rng`` required, as there)."""
    if len(set(followers)) != len(followers) or not followers:
        raise ProtocolError(f"followers must be distinct and at least one, got {list(followers)}")
    async with asyncio.TaskGroup() as tg:
        tasks = {
            f: tg.create_task(align(transport, f, ids, role="leader", **psi)) for f in followers
        }
    results = {f: t.result() for f, t in tasks.items()}
    keys = {f: [canonical(i) for i in r.ids] for f, r in results.items()}
    common = set.intersection(*(set(k) for k in keys.values()))
    first = results[followers[0]]
    keep = [j for j, k in enumerate(keys[followers[0]]) if k in common]
    final_keys = [keys[followers[0]][j] for j in keep]  # canonical order, as every I_f
    digest = commitment(final_keys)
    for f in followers:
        positions = np.array([j for j, k in enumerate(keys[f]) if k in common], np.int64)
        meta = {"size": len(final_keys), "commitment": digest}
        await transport.send(f, CH_FINAL, Frame(meta=meta, arrays=(positions,)))
    return FinalIds(
        ids=tuple(first.ids[j] for j in keep),
        rows=first.rows[np.asarray(keep, np.int64)],
        size=len(final_keys),
        commitment=digest,
        pairwise={f: r.size for f, r in results.items()},
        peer_counts={f: r.peer_count for f, r in results.items()},
        local_count=first.local_count,
        duplicates=first.duplicates,
    )


async def align_follower(
    transport: Transport, leader: str, ids: Sequence[Any], **psi: Any
) -> FinalIds:
    """Follower: align ``ids`` with the leader, then take the final list's positions it sends
    and check their commitment (see the module docstring)."""
    res = await align(transport, leader, ids, role="follower", **psi)
    frame = await transport.recv(leader, CH_FINAL)
    meta = frame.meta
    if len(frame.arrays) != 1:
        raise ProtocolError(f"{leader!r} sent {len(frame.arrays)} arrays on {CH_FINAL}; expected 1")
    positions = np.asarray(frame.arrays[0])
    if (
        positions.dtype != np.int64
        or positions.ndim != 1
        or (len(positions) and (positions.min() < 0 or positions.max() >= res.size))
        or np.any(np.diff(positions) <= 0)
    ):
        raise ProtocolError(
            f"{leader!r} sent final positions {positions.dtype}{list(positions.shape)} that are "
            f"not ascending indices below {res.size}"
        )
    picked = tuple(res.ids[int(j)] for j in positions)
    digest = commitment(canonical(i) for i in picked)
    if meta.get("size") != len(picked) or meta.get("commitment") != digest:
        raise AlignmentMismatchError(
            f"{leader!r} announced a final list of {meta.get('size')} ids (commitment "
            f"{meta.get('commitment')}) but the positions it sent pick {len(picked)} ids "
            f"({digest}); re-run the alignment on every party"
        )
    return FinalIds(
        ids=picked,
        rows=res.rows[positions],
        size=len(picked),
        commitment=digest,
        pairwise={leader: res.size},
        peer_counts={leader: res.peer_count},
        local_count=res.local_count,
        duplicates=res.duplicates,
    )


__all__ = ["CH_FINAL", "FinalIds", "align_follower", "align_leader"]
