"""What a party reports about its own memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import resource
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (``VmHWM`` of /proc/self/status).

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that over an ``exec`` from the process
    that forked it, so a party started by a large parent would report the parent's peak.
    Where /proc is missing, ``ru_maxrss`` (kB on Linux, bytes on macOS) is the best there is."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def release_free_memory() -> None:
    """Give the memory the process has freed but its allocators keep back to the system:
    pyarrow's pool (``release_unused``) and glibc's heap (``malloc_trim(0)``; the ``tandem``
    command line raises glibc's trim threshold for the receive path, so after a load most of
    the freed temporaries would otherwise stay mapped). Call it after a large transient, such
    as loading a party's data; elsewhere than glibc the heap part does nothing."""
    if "pyarrow" in sys.modules:
        sys.modules["pyarrow"].default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
    return fn
