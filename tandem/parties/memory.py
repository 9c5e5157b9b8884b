"""What a party reports about its own memory."""

from __future__ import annotations

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
