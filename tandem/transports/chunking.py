"""Split an encoded frame (a list of buffers) into bounded chunks, without copying. Pure.

A message larger than ``chunk_bytes`` travels as several HTTP requests; each carries its chunk
index, the chunk count, its byte offset and the message's total size, and the receiver writes it
into one preallocated buffer at that offset (see `tandem.transports.http.server`). Sizes are
Python ints, so messages above 2 GiB work.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

Buffer = bytes | memoryview


def split(parts: Sequence[Buffer], chunk_bytes: int) -> list[tuple[int, list[memoryview]]]:
    """``[(offset, views), ...]`` covering ``parts`` in order, each at most ``chunk_bytes``.

    Always returns at least one chunk (possibly of zero bytes)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    views = []
    total = 0
    for part in parts:  # byte views of the nonempty parts, and their total, in one pass
        mv = memoryview(part)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if n := len(mv):
            views.append(mv)
            total += n
    if total <= chunk_bytes:  # one chunk: the parts as they are
        return [(0, views)]
    chunks: list[tuple[int, list[memoryview]]] = []
    cur: list[memoryview] = []
    cur_len = 0
    offset = 0
    for mv in views:
        while len(mv):
            take = min(len(mv), chunk_bytes - cur_len)
            cur.append(mv[:take])
            mv = mv[take:]
            cur_len += take
            if cur_len == chunk_bytes:
                chunks.append((offset, cur))
                offset += cur_len
                cur, cur_len = [], 0
    if cur or not chunks:
        chunks.append((offset, cur))
    return chunks


def pieces(views: Sequence[memoryview], piece_bytes: int) -> Iterator[memoryview]:
    """Yield slices of ``views`` of at most ``piece_bytes`` (bounded socket writes)."""
    for mv in views:
        for start in range(0, len(mv), piece_bytes):
            yield mv[start : start + piece_bytes]


def total_size(views: Sequence[memoryview]) -> int:
    total = 0
    for v in views:  # a loop: cheaper than sum() over a generator for the few views a frame has
        total += len(v)
    return total
