"""Alignment of a leader with K followers through the leader (`tandem.parties.alignment.multi`):
pairwise PSIs, then each follower gets its positions of the ids every party holds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tandem.parties.alignment import multi
from tandem.parties.alignment.errors import AlignmentMismatchError, ProtocolError
from tandem.parties.data.canonical_ids import canonical, commitment
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork


def _ids(rng, members: set[int], extra: str) -> list[str]:
    """The party's ids (``c<i>`` for its members, plus ids only it holds), shuffled."""
    own = [f"c{i}" for i in sorted(members)] + [f"{extra}{j}" for j in range(5)]
    return [own[k] for k in rng.permutation(len(own))]


async def test_three_followers_end_with_the_ids_every_party_holds():
    rng = np.random.default_rng(0)
    held = {
        "bank": set(range(0, 100)),
        "shop": set(range(10, 100)),
        "telco": set(range(0, 90)),
        "media": set(range(5, 95)) - {50, 51},
    }
    ids = {p: _ids(rng, members, p) for p, members in held.items()}
    net = MemoryNetwork()
    ends = {p: net.endpoint(p) for p in held}
    followers = ["shop", "telco", "media"]
    async with asyncio.TaskGroup() as tg:
        lead = tg.create_task(
            multi.align_leader(ends["bank"], followers, ids["bank"], rng=np.random.default_rng(1))
        )
        fol = {
            f: tg.create_task(
                multi.align_follower(ends[f], "bank", ids[f], rng=np.random.default_rng(2))
            )
            for f in followers
        }
    common = set.intersection(*held.values())
    want = sorted((f"c{i}" for i in common), key=canonical)
    results = {"bank": lead.result(), **{f: t.result() for f, t in fol.items()}}
    for party, res in results.items():
        assert list(res.ids) == want, party
        assert [ids[party][r] for r in res.rows] == want  # rows of the party's own file
        assert res.size == len(want) == 78
        assert res.commitment == commitment(canonical(i) for i in want)
    assert results["bank"].pairwise == {"shop": 90, "telco": 90, "media": 88}
    assert results["shop"].pairwise == {"bank": 90}


async def test_one_follower_gives_the_two_party_alignment():
    net = MemoryNetwork()
    a, b = net.endpoint("A"), net.endpoint("B")
    ids_a, ids_b = [f"x{i}" for i in range(20)], [f"x{i}" for i in range(30, 5, -1)]
    async with asyncio.TaskGroup() as tg:
        ra = tg.create_task(multi.align_leader(a, ["B"], ids_a, rng=np.random.default_rng(1)))
        rb = tg.create_task(multi.align_follower(b, "A", ids_b, rng=np.random.default_rng(2)))
    assert (
        list(ra.result().ids)
        == list(rb.result().ids)
        == sorted((f"x{i}" for i in range(6, 20)), key=canonical)
    )


@pytest.mark.parametrize(
    ("positions", "meta", "error"),
    [
        (np.array([2, 1], np.int64), {}, ProtocolError),
        (np.array([0, 99], np.int64), {}, ProtocolError),
        (np.array([0, 1], np.int32), {}, ProtocolError),
        (np.array([0, 1], np.int64), {"size": 2, "commitment": "0" * 64}, AlignmentMismatchError),
    ],
)
async def test_a_follower_refuses_bad_final_positions(positions, meta, error):
    """A leader that sends positions out of order or range, or a commitment the positions do
    not give, is refused (the follower never trains on rows it cannot vouch for)."""
    net = MemoryNetwork()
    a, b = net.endpoint("A"), net.endpoint("B")
    ids = [f"x{i}" for i in range(10)]

    async def bad_leader():
        from tandem.parties.alignment.psi import align

        await align(a, "B", ids, role="leader", rng=np.random.default_rng(1))
        await a.send("B", multi.CH_FINAL, Frame(meta=meta, arrays=(positions,)))

    with pytest.raises(ExceptionGroup) as info:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bad_leader())
            tg.create_task(multi.align_follower(b, "A", ids, rng=np.random.default_rng(2)))
    assert info.group_contains(error)
