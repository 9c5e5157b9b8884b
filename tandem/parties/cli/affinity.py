"""Co-locating a party process's Python threads on one CPU.

A party process runs its event loop and one compute lane per party as threads of one
interpreter. Their Python work takes turns on the GIL, so it never runs on two CPUs at once
anyway; the kernels themselves run in XLA's own worker threads. What spreading those Python
threads over CPUs does add is the cost of each hand-off between them: a lane handing a send to
the loop, the loop waking a lane for an arrival. When the woken thread's CPU is idle, that wake
is an inter-processor interrupt, and on a virtual machine whose idle vCPUs halt (the 2-core
benchmark machine) each one is a VM exit of tens of microseconds — paid several times per
micro-batch. Pinned to one CPU, a hand-off is an ordinary context switch on that CPU.

`colocate_python_threads` pins the **calling thread** to one CPU. Threads it starts afterwards
(the compute lanes of `tandem.engine.lanes.ThreadLane`, asyncio's default executor) inherit the pin.
XLA's worker pools are started first (the JAX backend is initialised before pinning), so they
keep every CPU the process may use and the kernels stay parallel. `bench.pipeline` reports the
engine's overhead per op both pinned and unpinned in one run (``overhead_us_per_op``,
``overhead_unpinned_us_per_op``).

It is process-wide, so the library never calls it by itself: the ``tandem`` commands that run
the split-learning pipeline call it before starting their event loop (`tandem.parties.cli`), as does
`bench.pipeline`; an application embedding the engine may call it once on its loop's thread
before entering any ``ThreadLane``. Threads or processes started later from a pinned thread
share its CPU: do not call it in a process that runs CPU-heavy Python-side work in a thread or
process pool.

The environment variable ``TANDEM_PYTHON_CPU`` overrides it: ``off`` leaves
the affinity alone; ``auto`` (the default) picks the CPU the calling thread is running on (a
process just started is placed on an idle CPU, so parties started together tend to get
different ones); a number picks that CPU. Only Linux supports it; elsewhere, and where the
process may use only one CPU, nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tandem.errors import ConfigError

__all__ = ["ENV", "colocate_python_threads", "thread_cpus"]

#: the environment variable that overrides `colocate_python_threads`
ENV = "TANDEM_PYTHON_CPU"
_OFF = {"off", "no", "false", "none"}


def _current_cpu() -> int | None:
    """The CPU the calling thread runs on (Linux /proc), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 of proc(5), counted from field 3 ("state")
    except (OSError, IndexError, ValueError):
        return None


def thread_cpus() -> set[int]:
    """The CPUs the calling thread may run on (all of them where affinity is unsupported)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _init_jax() -> None:
    """Start the JAX backend and its worker threads while the process's CPU mask still applies
    (threads inherit the mask of the thread that starts them)."""
    import jax
    import jax.numpy as jnp

    jax.devices()
    jnp.zeros(1).block_until_ready()


def colocate_python_threads(
    cpu: int | str | None = None, *, environ: Mapping[str, str] = os.environ
) -> int | None:
    """Pin the calling thread (and the threads it starts later) to one CPU.

    Args:
      cpu: the CPU; ``None`` reads ``TANDEM_PYTHON_CPU`` (default ``auto``: the CPU the thread
        is running on). ``"off"`` changes nothing.
      environ: where ``TANDEM_PYTHON_CPU`` is read (tests pass their own).

    Returns the CPU the thread is pinned to, or None where nothing was changed (turned off, not
    Linux, or only one CPU allowed). Raises `ConfigError` for a CPU the process may not use.
    """
    choice = environ.get(ENV, "auto") if cpu is None else cpu
    choice = str(choice).strip().lower()
    if choice in _OFF:
        return None
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = thread_cpus()
    if choice == "auto":
        target = _current_cpu()
        if target not in allowed:
            target = min(allowed)
    else:
        try:
            target = int(choice)
        except ValueError:
            raise ConfigError(
                f"{ENV}={choice!r} is not understood: use 'auto', 'off' or a CPU "
                f"number from {sorted(allowed)}"
            ) from None
        if target not in allowed:
            raise ConfigError(
                f"{ENV}={target} names a CPU this process may not use; allowed: "
                f"{sorted(allowed)} (or 'auto', 'off')"
            )
    if len(allowed) < 2:
        return None
    _init_jax()
    os.sched_setaffinity(0, {target})
    return target
