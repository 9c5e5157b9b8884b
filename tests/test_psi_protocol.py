"""`align` end to end over the memory transport: correctness, privacy of the frames, errors."""

import asyncio
import hashlib
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.parties.alignment import (
    AlignedIds,
    AlignmentConfigError,
    AlignmentMismatchError,
    ProtocolError,
    align,
    ecdh,
)
from tandem.transports import codec
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork


class Recording:
    """Wraps a transport and keeps every frame it receives (what the party gets to see)."""

    def __init__(self, inner):
        self.inner = inner
        self.received: list[Frame] = []

    name = property(lambda self: self.inner.name)
    peers = property(lambda self: self.inner.peers)

    async def send(self, peer, channel, frame):
        await self.inner.send(peer, channel, frame)

    async def recv(self, peer, channel):
        frame = await self.inner.recv(peer, channel)
        self.received.append(frame)
        return frame

    def sent_stats(self, peer):
        return self.inner.sent_stats(peer)

    def received_stats(self, peer):
        return self.inner.received_stats(peer)

    async def aclose(self):
        await self.inner.aclose()


async def run_pair(ids_a, ids_b, *, seed=0, capacity=4, **kw):
    net = MemoryNetwork(capacity=capacity)
    a, b = Recording(net.endpoint("a")), Recording(net.endpoint("b"))
    async with asyncio.TaskGroup() as tg:
        ta = tg.create_task(
            align(a, "b", ids_a, role="leader", rng=np.random.default_rng(seed), **kw)
        )
        tb = tg.create_task(
            align(b, "a", ids_b, role="follower", rng=np.random.default_rng(seed + 1), **kw)
        )
    return ta.result(), tb.result(), a, b


def expected(ids_a, ids_b):
    ka = {ecdh.canonical(x) for x in ids_a}
    kb = {ecdh.canonical(x) for x in ids_b}
    return sorted(ka & kb)


def check(res: AlignedIds, ids, want):
    assert res.size == len(want)
    assert [ecdh.canonical(x) for x in res.ids] == want
    assert res.rows.dtype == np.int64
    # rows point at the first occurrence of each id in the local data
    for x, r in zip(res.ids, res.rows, strict=True):
        assert ecdh.canonical(ids[r]) == ecdh.canonical(x)
        assert all(ecdh.canonical(ids[i]) != ecdh.canonical(x) for i in range(r))
    assert res.commitment == ecdh.commitment(want)


ids_strategy = st.lists(st.one_of(st.integers(-50, 50), st.text(max_size=3)), max_size=25)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids_a=ids_strategy, ids_b=ids_strategy, chunk=st.integers(1, 8))
def test_align_matches_plain_intersection(ids_a, ids_b, chunk):
    ra, rb, _, _ = asyncio.run(run_pair(ids_a, ids_b, chunk_size=chunk))
    want = expected(ids_a, ids_b)
    check(ra, ids_a, want)
    check(rb, ids_b, want)
    assert ra.commitment == rb.commitment
    assert ra.local_count == rb.peer_count == len(set(map(ecdh.canonical, ids_a)))
    assert ra.duplicates == len(ids_a) - ra.local_count


@pytest.mark.parametrize(
    "ids_a,ids_b",
    [
        ([], []),
        ([], ["x", 1]),
        ([1, 2, 3], []),  # empty
        (["a", "b"], ["c", "d"]),  # disjoint
        ([7, 7, "7", 8], ["7", "7", 9]),  # duplicates, int == its decimal str
    ],
)
async def test_align_edge_cases(ids_a, ids_b):
    ra, rb, _, _ = await run_pair(ids_a, ids_b, chunk_size=2)
    want = expected(ids_a, ids_b)
    check(ra, ids_a, want)
    check(rb, ids_b, want)


async def test_rows_line_up_across_parties():
    rng = np.random.default_rng(5)
    common = [f"c{i}" for i in range(40)]
    ids_a = common + [f"a{i}" for i in range(30)]
    ids_b = [f"b{i}" for i in range(20)] + common
    rng.shuffle(ids_a)
    rng.shuffle(ids_b)
    ra, rb, _, _ = await run_pair(ids_a, ids_b, chunk_size=16)
    assert ra.size == 40
    assert [ids_a[r] for r in ra.rows] == [ids_b[r] for r in rb.rows]
    assert ra.spec_fields() == rb.spec_fields()
    rb.verify(ra.spec_fields())
    with pytest.raises(AlignmentMismatchError, match="refuses to start"):
        rb.verify({"intersection_size": 39, "intersection_commitment": ra.commitment})


async def test_frames_reveal_no_non_intersecting_id():
    secret_a = [f"alice-only-{i}" for i in range(30)] + [10_000 + i for i in range(30)]
    secret_b = [f"bob-only-{i}" for i in range(30)]
    common = [f"shared-{i}" for i in range(20)]
    ra, rb, a, b = await run_pair(secret_a + common, common + secret_b, chunk_size=8)
    assert ra.size == rb.size == 20
    for receiver, others in ((b, secret_a), (a, secret_b)):
        wire = b"".join(codec.encode(f) for f in receiver.received)
        assert receiver.received and len(wire) > 1000
        for x in others:
            key = ecdh.canonical(x)
            for needle in (
                key,
                hashlib.sha256(key).digest(),
                hashlib.sha256(key).hexdigest().encode(),
                ecdh.hash_to_u(key),
                ecdh.hash_to_u(key)[:16],
            ):
                assert needle not in wire, (x, needle)
        # the only header fields are protocol bookkeeping
        for f in receiver.received:
            assert set(f.meta) <= {
                "scheme",
                "version",
                "role",
                "count",
                "width",
                "offset",
                "size",
                "commitment",
            }


async def test_process_pool_path_agrees_with_thread_path():
    ids_a = list(range(0, 300))
    ids_b = [str(i) for i in range(150, 450)]
    ra, rb, _, _ = await run_pair(ids_a, ids_b, chunk_size=64, workers=2, window=3)
    assert ra.size == 150
    check(ra, ids_a, expected(ids_a, ids_b))
    assert ra.commitment == rb.commitment


async def test_same_role_is_refused():
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    with pytest.raises(ExceptionGroup) as info:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(align(a, "b", [1], role="leader", rng=np.random.default_rng(0)))
            tg.create_task(align(b, "a", [1], role="leader", rng=np.random.default_rng(1)))
    assert info.group_contains(ProtocolError, match="'leader' and the other as 'follower'")


async def test_bad_arguments():
    net = MemoryNetwork()
    a, _ = net.endpoint("a"), net.endpoint("b")
    with pytest.raises(AlignmentConfigError, match="role must be one of"):
        await align(a, "b", [1], role="boss", rng=None)
    with pytest.raises(AlignmentConfigError, match="width"):
        await align(a, "b", [1], role="leader", rng=None, width=40)


async def fake_peer_then(frames_after_hello, *, count=3):
    """A peer that says hello properly then sends ``frames_after_hello`` on psi/blinded."""
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    await b.send(
        "a",
        "psi/hello",
        Frame(
            meta={
                "scheme": ecdh.SCHEME,
                "version": 1,
                "role": "follower",
                "count": count,
                "width": 16,
            }
        ),
    )
    for f in frames_after_hello:
        await b.send("a", "psi/blinded", f)
    with pytest.raises(ExceptionGroup) as info:
        await align(a, "b", ["x", "y"], role="leader", rng=np.random.default_rng(0))
    # the transport still serves after the failed alignment
    await b.send("a", "ping", Frame(meta={"ok": 1}))
    assert (await a.recv("b", "ping")).meta == {"ok": 1}
    return info


@pytest.mark.parametrize(
    "frame,message",
    [
        (Frame(meta={"offset": 0}, arrays=(np.zeros((2, 32), np.float32),)), "expected uint8"),
        (Frame(meta={"offset": 5}, arrays=(np.ones((2, 32), np.uint8),)), "expected 0"),
        (Frame(meta={"offset": 0}, arrays=(np.ones((9, 32), np.uint8),)), "more than the 3"),
        (Frame(meta={"offset": 0}, arrays=(np.zeros((2, 32), np.uint8),)), "not a valid blinded"),
    ],
)
async def test_malformed_peer_frames_raise_protocol_error(frame, message):
    info = await fake_peer_then([frame])
    assert info.group_contains(ProtocolError, match=message)


async def test_wrong_scheme_is_refused():
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    await b.send("a", "psi/hello", Frame(meta={"scheme": "p256", "version": 1}))
    with pytest.raises(ProtocolError, match="upgrade the older side"):
        await align(a, "b", [1], role="leader", rng=None)


async def test_cancellation_mid_exchange_leaves_nothing_running():
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    await b.send(
        "a",
        "psi/hello",
        Frame(
            meta={"scheme": ecdh.SCHEME, "version": 1, "role": "follower", "count": 0, "width": 16}
        ),
    )
    before = asyncio.all_tasks()
    task = asyncio.create_task(
        align(a, "b", list(range(50)), role="leader", rng=None, chunk_size=10)
    )
    for _ in range(200):  # wait (without timing assumptions) until our blinded points went out
        if a.sent_stats("b").frames >= 6:
            break
        await asyncio.sleep(0.01)
    assert a.sent_stats("b").frames >= 6
    task.cancel()  # now waiting for doubles the fake peer never sends
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("tandem-psi")]


async def test_align_over_http_loopback():
    from tandem.transports.http import HttpConfig, HttpTransport

    ids_a = [f"u{i}" for i in range(0, 120)]
    ids_b = list(range(60, 200)) + [f"u{i}" for i in range(100, 130)]
    async with (
        HttpTransport(HttpConfig(name="A", secret=b"s3cret")) as a,
        HttpTransport(HttpConfig(name="B", secret=b"s3cret")) as b,
    ):
        a.add_peer("B", b.url)
        b.add_peer("A", a.url)
        async with asyncio.TaskGroup() as tg:
            ta = tg.create_task(align(a, "B", ids_a, role="leader", rng=None, chunk_size=32))
            tb = tg.create_task(align(b, "A", ids_b, role="follower", rng=None, chunk_size=32))
        assert a.sent_stats("B").frames >= 4  # hello + 4 blinded chunks + doubles + done
    want = expected(ids_a, ids_b)
    assert len(want) == 20
    check(ta.result(), ids_a, want)
    check(tb.result(), ids_b, want)


async def test_oversized_peer_announcement_is_refused():
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    await b.send(
        "a",
        "psi/hello",
        Frame(
            meta={
                "scheme": ecdh.SCHEME,
                "version": 1,
                "role": "follower",
                "count": 10**9,
                "width": 16,
            }
        ),
    )
    with pytest.raises(ProtocolError, match="max_peer_ids"):
        await align(a, "b", [1], role="leader", rng=None, max_peer_ids=1000)
