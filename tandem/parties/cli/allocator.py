"""Process allocator settings (glibc's malloc): buffers recycled in-process, not faulted in anew.

Two kinds of buffers come and go many times a second in a party. Receiving a large tensor over a
stream socket allocates and frees many short-lived buffers of a few hundred KiB: uvloop hands
each 256 KiB read to the protocol as a new ``bytes`` object, and aiohttp's parser slices the
body into more of them. And every batch, XLA allocates and frees buffers of the size of the
model's larger arrays: a fresh gradient accumulator, the new parameters and optimizer moments
(an embedding table of 100k rows of 16 floats is 6.4 MB). Under glibc's defaults both sit at
the edge of the heap: freed ones are given back to the kernel (heap trimming, or munmap of
blocks above the dynamic mmap threshold) and the next allocation faults fresh zeroed pages in
again. That page churn, not the copying, is the largest cost of the HTTP receiver on a small
machine (``bench.transport`` measures the receive path; docs/transports.md, "Benchmark"), and
it cost a 1M-row ``bench.scale`` party 8-14 % of its training speed with a 4 MiB threshold.

`tune_allocator` sets three ``mallopt`` parameters so these buffers are recycled in-process:

* ``M_MMAP_THRESHOLD`` = ``mmap_threshold`` (32 MiB, glibc's largest on 64-bit): smaller
  blocks come from the heap; larger ones are still mapped and unmapped on their own, so their
  memory returns to the system when the array dies;
* ``M_TRIM_THRESHOLD`` = ``trim_threshold`` (128 MiB): the heap is shrunk only when that much
  is free at its top — the process keeps up to that much idle memory in exchange;
* ``M_ARENA_MAX`` = ``arena_max`` (2): at most that many heaps. glibc's default (eight per
  core) gives each thread that frees and allocates (the event loop, the compute lane, XLA's
  workers, `asyncio.to_thread`) a heap of its own, and each keeps its own idle memory under the
  trim threshold above; two heaps hold one party's buffers with little lock contention (it has
  one loop and one compute lane) and keep its resident set near what it uses.

It is process-wide, so the library never calls it by itself: the ``tandem`` command line calls
it before starting its event loop (`tandem.parties.cli.run_async`), and an application embedding the
engine may call it once at start-up. A parameter the user already set through glibc's
environment variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_ARENA_MAX``) is left alone.
Elsewhere (musl, macOS, Windows) it does nothing and returns an empty dict.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["tune_allocator"]

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

_ENV = {
    M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_",
    M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_",
    M_ARENA_MAX: "MALLOC_ARENA_MAX",
}


def _mallopt():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


def tune_allocator(
    mmap_threshold: int = 32 << 20, trim_threshold: int = 128 << 20, arena_max: int = 2
) -> dict[str, int]:
    """Set glibc's mmap and trim thresholds and its number of heaps (see the module
    docstring); idempotent. Call it before the process starts threads: a heap made already
    stays.

    Returns the settings applied, by environment-variable name (empty where none could be:
    not glibc, or every one already set in the environment). Raises ValueError for a
    threshold glibc would refuse (mmap_threshold above 32 MiB on 64-bit, or negative).
    """
    if not 0 <= mmap_threshold <= 32 << 20:
        raise ValueError(
            f"mmap_threshold must be in [0, 32 MiB] (glibc's limit on 64-bit), got {mmap_threshold}"
        )
    if not 0 <= trim_threshold < 1 << 31:
        raise ValueError(f"trim_threshold must be in [0, 2 GiB), got {trim_threshold}")
    if arena_max < 1:
        raise ValueError(f"arena_max must be at least 1 heap, got {arena_max}")
    mallopt = _mallopt()
    if mallopt is None:
        return {}
    applied = {}
    settings = (
        (M_MMAP_THRESHOLD, mmap_threshold),
        (M_TRIM_THRESHOLD, trim_threshold),
        (M_ARENA_MAX, arena_max),
    )
    for param, value in settings:
        name = _ENV[param]
        if name in os.environ:
            continue  # the user's explicit setting wins
        if mallopt(param, value) != 1:
            raise OSError(f"mallopt({name.rstrip('_')}, {value}) was refused by the C library")
        applied[name] = value
    return applied
