"""Two-party private set intersection over any `tandem.transports.base.Transport`.

`align` runs the symmetric ECDH-PSI of `ecdh` with one peer and returns `AlignedIds`: the
intersection in an agreed canonical order (sorted canonical ids), the local row of each, its
size and a commitment. Both parties order their rows by it, so micro-batch ``m`` holds the
same samples on both sides.

Messages, all on channels ``psi/*`` (what each party receives from the other):

1. ``psi/hello``: scheme, version, role, the number of distinct ids, the record width;
2. ``psi/blinded``: the peer's ``b*H(y)`` in a secret random order, in chunks of
   ``chunk_size`` points (bounded frames), each frame a ``uint8 [k, 32]`` array;
3. ``psi/double``: ``b*a*H(x)`` for our own blinded points, in the order we sent them,
   truncated to ``width`` bytes;
4. ``psi/done``: the peer's intersection size and commitment, checked against ours.

Nothing else crosses: no raw id, no plain hash, no row index. Under DDH, blinded values of ids
outside the intersection look random to the receiver; the shuffle hides which row they came
from. The set sizes are revealed (as in every PSI of this kind).

Curve work runs off the event loop: in a process pool (``spawn``; workers receive only plain
bytes: the 32-byte scalar and lists of canonical ids or point blobs) for large sets, else in
one worker thread. At most ``window`` chunks per stream are in flight, so memory stays bounded
by the transport's buffers plus ``2 * window`` chunks. Every task lives in a TaskGroup; on
error or cancellation the pool is shut down and pending chunks are dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tandem.transports.base import Frame, Transport

from . import ecdh
from .errors import AlignmentConfigError, AlignmentMismatchError, ProtocolError

VERSION = 1
ROLES = ("leader", "follower")
CH_HELLO, CH_BLINDED, CH_DOUBLE, CH_DONE = "psi/hello", "psi/blinded", "psi/double", "psi/done"


@dataclasses.dataclass(frozen=True)
class AlignedIds:
    """The result of `align`, identical in ``size``, ``commitment`` and order on both sides.

    Attributes:
      ids: the local id values of the intersection, in the agreed order (sorted by canonical
        encoding; see `ecdh.canonical`).
      rows: ``int64`` row index into the local data of each id (its first occurrence);
        ``data[rows]`` is the aligned data.
      size: number of ids in the intersection.
      commitment: hex SHA-256 over the agreed canonical intersection (`ecdh.commitment`), for
        the task spec.
      local_count, peer_count: distinct ids on each side; duplicates: local rows dropped
        because their id occurred earlier.
    """

    ids: tuple[Any, ...]
    rows: np.ndarray
    size: int
    commitment: str
    local_count: int
    peer_count: int
    duplicates: int

    def spec_fields(self) -> dict[str, Any]:
        """What the task spec records about the alignment."""
        return {"intersection_size": self.size, "intersection_commitment": self.commitment}

    def verify(self, spec: Mapping[str, Any]) -> None:
        """Raise `AlignmentMismatchError` unless ``spec`` records this alignment."""
        size, commit = spec.get("intersection_size"), spec.get("intersection_commitment")
        if size != self.size or commit != self.commitment:
            raise AlignmentMismatchError(
                f"the task spec records an intersection of {size} ids (commitment {commit}) but "
                f"this party aligned {self.size} ids (commitment {self.commitment}); training "
                "refuses to start: re-run `align` on both parties with the same id columns"
            )


async def align(
    transport: Transport,
    peer: str,
    ids: Sequence[Any],
    *,
    role: str,
    rng: np.random.Generator | None,
    chunk_size: int = 32768,
    width: int = 16,
    workers: int | None = None,
    window: int = 2,
    parallel_threshold: int = 65536,
    max_peer_ids: int = 50_000_000,
) -> AlignedIds:
    """Privately intersect ``ids`` with ``peer``'s ids; both sides learn only the intersection.

    Args:
      transport: this party's transport; ``peer`` must be one of its peers.
      ids: str or int ids, one per local row; duplicates keep their first row.
      role: ``"leader"`` or ``"follower"``; the two parties must take different roles.
      rng: source of the secret scalar and the shuffle. ``None`` (recommended) draws them from
        the OS CSPRNG; a seeded generator makes runs reproducible (tests) and is only private
        if its seed is secret.
      chunk_size: points per frame (bounds frame size: ``32 * chunk_size`` bytes).
      width: bytes kept of each doubly blinded value (16 = 128 bits; both sides must agree).
      workers: processes for the curve work; ``None`` = one per CPU when the larger of the two
        sets has at least ``parallel_threshold`` ids, else a single worker thread; ``0`` or
        ``1`` = always the single thread.
      window: chunks in flight per stream.
      max_peer_ids: refuse a peer announcing more distinct ids than this (bounds the memory a
        peer can make us spend: ``width`` bytes per announced id).

    Raises `IdError` (bad id), `ProtocolError` (peer misbehaves), `AlignmentMismatchError`
    (the two sides disagree), and transport errors.
    """
    if role not in ROLES:
        raise AlignmentConfigError(f"role must be one of {ROLES}, got {role!r}")
    if chunk_size < 1 or not 1 <= width <= ecdh.POINT_BYTES or window < 1:
        raise AlignmentConfigError(
            f"need chunk_size >= 1, 1 <= width <= 32, window >= 1; got chunk_size={chunk_size}, "
            f"width={width}, window={window}"
        )
    keys, rows, duplicates = await asyncio.to_thread(ecdh.canonicalise, ids)
    secret, perm = _draw_secret(rng, len(keys))
    peer_count = await _hello(transport, peer, role, len(keys), width, max_peer_ids)
    n_workers = _pool_size(workers, max(len(keys), peer_count), parallel_threshold)
    own_doubles, peer_doubles = await _exchange(
        transport, peer, keys, perm, secret, peer_count, n_workers, chunk_size, width, window
    )
    chosen, commit = await asyncio.to_thread(
        _intersection, own_doubles, peer_doubles, width, perm, keys
    )
    await _agree(transport, peer, len(chosen), commit)
    aligned_rows = np.asarray(rows, dtype=np.int64)[np.asarray(chosen, dtype=np.int64)]
    local_ids = await asyncio.to_thread(lambda: tuple(ids[int(r)] for r in aligned_rows))
    return AlignedIds(
        ids=local_ids,
        rows=aligned_rows,
        size=len(chosen),
        commitment=commit,
        local_count=len(keys),
        peer_count=peer_count,
        duplicates=duplicates,
    )


def _draw_secret(rng: np.random.Generator | None, n: int) -> tuple[bytes, np.ndarray]:
    """This party's secret scalar and the shuffle of its ``n`` ids (OS CSPRNG without
    ``rng``)."""
    if rng is None:
        return secrets.token_bytes(32), np.random.default_rng(secrets.randbits(128)).permutation(n)
    return rng.bytes(32), rng.permutation(n)


async def _hello(
    transport: Transport, peer: str, role: str, count: int, width: int, max_peer_ids: int
) -> int:
    """Exchange the hello (scheme, version, role, id count, width); returns the peer's count."""
    await transport.send(
        peer,
        CH_HELLO,
        Frame(
            meta={
                "scheme": ecdh.SCHEME,
                "version": VERSION,
                "role": role,
                "count": count,
                "width": width,
            }
        ),
    )
    hello = await transport.recv(peer, CH_HELLO)
    peer_count = _check_hello(hello.meta, role, width)
    if peer_count > max_peer_ids:
        raise ProtocolError(
            f"peer announced {peer_count} ids, more than max_peer_ids={max_peer_ids}; raise "
            "max_peer_ids if that many is expected"
        )
    return peer_count


async def _exchange(
    transport: Transport,
    peer: str,
    keys: list[bytes],
    perm: np.ndarray,
    secret: bytes,
    peer_count: int,
    n_workers: int,
    chunk_size: int,
    width: int,
    window: int,
) -> tuple[bytes, bytes]:
    """Blind our ids and send them, blind the peer's a second time and return them, receive
    ours doubly blinded; returns (our doubles, the peer's doubles). The curve work runs on
    ``n_workers`` processes (or one thread), shut down whatever happens."""
    pool = _make_pool(n_workers)
    loop = asyncio.get_running_loop()

    def run(fn: Callable[..., bytes], *args: Any) -> asyncio.Future[bytes]:
        return loop.run_in_executor(pool, functools.partial(fn, secret, *args))

    own_doubles = bytearray()
    peer_doubles = bytearray()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_send_own(transport, peer, keys, perm, chunk_size, window, run))
            tg.create_task(
                _serve_peer(transport, peer, peer_count, width, window, run, peer_doubles)
            )
            tg.create_task(_recv_doubles(transport, peer, len(keys), width, own_doubles))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(pool.shutdown, wait=True)
    return bytes(own_doubles), bytes(peer_doubles)


async def _agree(transport: Transport, peer: str, size: int, commit: str) -> None:
    """Both sides confirm the intersection's size and commitment (`AlignmentMismatchError`)."""
    await transport.send(peer, CH_DONE, Frame(meta={"size": size, "commitment": commit}))
    done = (await transport.recv(peer, CH_DONE)).meta
    if done.get("size") != size or done.get("commitment") != commit:
        raise AlignmentMismatchError(
            f"{peer!r} found an intersection of {done.get('size')} ids (commitment "
            f"{done.get('commitment')}) but this party found {size} ({commit}); the "
            "parties ran different id sets concurrently or one side is faulty: re-run both"
        )


def _intersection(
    own_doubles: bytes, peer_doubles: bytes, width: int, perm: np.ndarray, keys: list[bytes]
) -> tuple[list[int], str]:
    """Indices into ``keys`` of the common ids, in the agreed (canonical) order, and the
    commitment to them. Runs off the loop (sorting a large intersection takes a while)."""
    hits = ecdh.match(own_doubles, peer_doubles, width)
    chosen = sorted((int(perm[j]) for j in hits), key=keys.__getitem__)
    return chosen, ecdh.commitment(keys[i] for i in chosen)


def _check_hello(meta: Mapping[str, Any], role: str, width: int) -> int:
    if meta.get("scheme") != ecdh.SCHEME or meta.get("version") != VERSION:
        raise ProtocolError(
            f"peer runs PSI scheme {meta.get('scheme')!r} version {meta.get('version')!r}; this "
            f"party runs {ecdh.SCHEME!r} version {VERSION}: upgrade the older side"
        )
    if meta.get("role") == role or meta.get("role") not in ROLES:
        raise ProtocolError(
            f"both parties (or an unknown one) claim role {meta.get('role')!r}; start one as "
            "'leader' and the other as 'follower'"
        )
    if meta.get("width") != width:
        raise ProtocolError(
            f"peer keeps {meta.get('width')!r} bytes of each doubly blinded value, this party "
            f"{width}: pass the same width on both sides"
        )
    count = meta.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ProtocolError(f"peer announced an invalid id count {count!r}")
    return count


def _pool_size(workers: int | None, n: int, threshold: int) -> int:
    if workers is None:
        return (os.cpu_count() or 1) if n >= threshold else 1
    if workers < 0:
        raise AlignmentConfigError(f"workers must be >= 0 or None, got {workers}")
    return max(1, workers)


def _make_pool(n_workers: int) -> concurrent.futures.Executor:
    if n_workers <= 1:
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-psi")
    return concurrent.futures.ProcessPoolExecutor(
        n_workers, mp_context=multiprocessing.get_context("spawn")
    )


async def _pipeline(
    feed: Callable[[Callable[[asyncio.Future], Awaitable[None]]], Awaitable[None]],
    sink: Callable[[bytes], Awaitable[None]],
    window: int,
) -> None:
    """Run ``feed(put)``, which submits curve work and ``put``s its futures in order, while
    results are awaited in that order and passed to ``sink``.

    At most ``window`` futures wait in the queue (bounded memory); a failure in either side
    (a bad chunk, a transport error) cancels the other at once instead of waiting for more
    input. Futures left behind are cancelled or their exceptions consumed.
    """
    queue: asyncio.Queue[asyncio.Future | None] = asyncio.Queue(maxsize=window)

    async def put(fut: asyncio.Future) -> None:
        try:
            await queue.put(fut)
        except BaseException:
            _discard(fut)
            raise

    async def produce() -> None:
        await feed(put)
        await queue.put(None)

    async def consume() -> None:
        while (fut := await queue.get()) is not None:
            await sink(await fut)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(produce())
            tg.create_task(consume())
    finally:
        while not queue.empty():
            _discard(queue.get_nowait())


def _discard(fut: asyncio.Future | None) -> None:
    if fut is None:
        return
    if fut.done():
        if not fut.cancelled():
            fut.exception()  # mark retrieved: the error was already reported by its sibling
    else:
        fut.cancel()


async def _send_own(
    transport: Transport,
    peer: str,
    keys: list[bytes],
    perm: np.ndarray,
    chunk_size: int,
    window: int,
    run,
) -> None:
    """Hash, blind and send our ids in shuffled order."""
    offset = 0

    async def feed(put) -> None:
        for start in range(0, len(keys), chunk_size):
            chunk = [keys[int(i)] for i in perm[start : start + chunk_size]]
            await put(run(ecdh.hash_and_blind, chunk))

    async def sink(blob: bytes) -> None:
        nonlocal offset
        offset = await _send_points(transport, peer, CH_BLINDED, blob, ecdh.POINT_BYTES, offset)

    await _pipeline(feed, sink, window)


async def _serve_peer(
    transport: Transport,
    peer: str,
    count: int,
    width: int,
    window: int,
    run,
    peer_doubles: bytearray,
) -> None:
    """Blind the peer's points with our scalar, keep them and return them in order."""
    sent = 0

    async def feed(put) -> None:
        received = 0
        while received < count:
            points = _points_of(
                await transport.recv(peer, CH_BLINDED), ecdh.POINT_BYTES, received, count
            )
            received += len(points) // ecdh.POINT_BYTES
            await put(run(ecdh.blind_points, points, width))

    async def sink(blob: bytes) -> None:
        nonlocal sent
        peer_doubles.extend(blob)
        sent = await _send_points(transport, peer, CH_DOUBLE, blob, width, sent)

    await _pipeline(feed, sink, window)


async def _recv_doubles(
    transport: Transport, peer: str, count: int, width: int, out: bytearray
) -> None:
    received = 0
    while received < count:
        blob = _points_of(await transport.recv(peer, CH_DOUBLE), width, received, count)
        out += blob
        received += len(blob) // width


async def _send_points(
    transport: Transport, peer: str, channel: str, blob: bytes, width: int, offset: int
) -> int:
    n = len(blob) // width
    arr = np.frombuffer(blob, dtype=np.uint8).reshape(n, width)
    await transport.send(peer, channel, Frame(meta={"offset": offset}, arrays=(arr,)))
    return offset + n


def _points_of(frame: Frame, width: int, offset: int, count: int) -> bytes:
    """Validate one chunk frame and return its records as bytes."""
    ch = frame.channel
    if len(frame.arrays) != 1:
        raise ProtocolError(f"{ch} frame carries {len(frame.arrays)} arrays, expected 1")
    arr = frame.arrays[0]
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != width or arr.shape[0] == 0:
        raise ProtocolError(
            f"{ch} frame holds a {arr.dtype} array of shape {arr.shape}; expected uint8 [k, "
            f"{width}] with k >= 1"
        )
    if frame.meta.get("offset") != offset:
        raise ProtocolError(
            f"{ch} frame starts at record {frame.meta.get('offset')!r}, expected {offset} "
            "(chunks lost or reordered)"
        )
    if offset + arr.shape[0] > count:
        raise ProtocolError(
            f"{ch} frames carry more than the {count} records announced in the hello"
        )
    return arr.tobytes()
