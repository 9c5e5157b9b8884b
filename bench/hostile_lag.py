"""Where a party process's latency goes under attack (`bench.hostile`): how late its event loop
wakes up, and why.

`LoopLag` runs a task on the parties' loop that sleeps `TICK` seconds again and again and
records how late each wake-up is. Over the late wake-ups (more than `LATE` late) it adds up the
loop thread's own scheduler statistics (``/proc/thread-self/schedstat``: time on a CPU, time
waiting in the run queue for one), so that each late millisecond is put down to one of:

* ``on_cpu``: the loop thread ran: code on the loop (a callback that takes long);
* ``runqueue``: it was runnable but had no CPU: other processes (the attacker's, on a small
  machine) held both cores;
* ``blocked``: neither: it waited for the GIL (another thread of the process held it) or in a
  blocking system call.

With ``stacks``, a watchdog thread also records, each time the loop has not woken for more than
`STACK_AFTER`, where the loop thread is (its innermost frames), counted by place: a
poor man's sampling profiler for what blocks the loop.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter
from typing import Any

TICK = 0.005  # s between wake-ups
LATE = 0.010  # s late: a wake-up counted as late
STACK_AFTER = 0.020  # s without a wake-up: the watchdog records the loop thread's stack


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns waiting in the run queue) of the calling thread; zeros where the
    kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


class LoopLag:
    """Measures the lateness of the running loop's wake-ups; `run` as a task, `summary` after."""

    def __init__(self, *, stacks: bool = False) -> None:
        self.late_ms: list[float] = []
        self.ticks = 0
        self.on_cpu = self.runqueue = self.blocked = 0.0  # ms, over late wake-ups
        self.stacks: Counter[str] = Counter()
        self._want_stacks = stacks
        self._last = time.monotonic()
        self._stop = threading.Event()

    async def run(self, until: asyncio.Event) -> None:
        loop_thread = threading.get_ident()
        dog = None
        if self._want_stacks:
            dog = threading.Thread(target=self._watch, args=(loop_thread,), daemon=True)
            dog.start()
        try:
            while not until.is_set():
                t0, (r0, w0) = time.monotonic(), _schedstat()
                await asyncio.sleep(TICK)
                t1, (r1, w1) = time.monotonic(), _schedstat()
                self._last = t1
                self.ticks += 1
                late = t1 - t0 - TICK
                if late > LATE:
                    self.late_ms.append(late * 1e3)
                    cpu, queue = (r1 - r0) / 1e6, (w1 - w0) / 1e6
                    self.on_cpu += cpu
                    self.runqueue += queue
                    # neither running nor runnable, beyond the sleep asked for
                    self.blocked += max(0.0, late * 1e3 - cpu - queue)
        finally:
            self._stop.set()
            if dog is not None:
                dog.join()

    def _watch(self, loop_thread: int) -> None:
        while not self._stop.wait(0.005):
            if time.monotonic() - self._last < STACK_AFTER:
                continue
            frame = sys._current_frames().get(loop_thread)
            where = []
            while frame is not None and len(where) < 6:
                code = frame.f_code
                name = code.co_filename.rsplit("/", 2)
                where.append(f"{'/'.join(name[-2:])}:{frame.f_lineno}:{code.co_name}")
                frame = frame.f_back
            self.stacks[" < ".join(where)] += 1

    def summary(self) -> dict[str, Any]:
        late = sorted(self.late_ms)
        out: dict[str, Any] = {
            "ticks": self.ticks,
            "late": len(late),
            "late_max_ms": round(late[-1], 1) if late else 0.0,
            "late_total_ms": round(sum(late), 1),
            "late_on_cpu_ms": round(self.on_cpu, 1),
            "late_runqueue_ms": round(self.runqueue, 1),
            "late_blocked_ms": round(self.blocked, 1),
        }
        if self._want_stacks:
            out["stacks"] = dict(self.stacks.most_common(12))
        return out
