"""Attackers in a process of their own (`bench.hostile`): an attacker that does heavy client work
(the ``memory`` and ``drained`` attacks push gigabytes, ``future_flood`` signs thousands of
requests) would, in the parties' process, stall the very event loop whose ``/healthz`` latency
the benchmark measures; apart, the latency measures only what the attack costs the party.

The parent runs `run_apart` as the attack: it starts ``python -m bench.hostile --apart NAME
URLS SECONDS`` and, when the job finishes or the attack's time is up, ends it with SIGTERM;
the child (`child`) prints ``ready`` once its SIGTERM handler is in place, runs the attack
against the party URLs it was given until then, and prints its verdict as the last line of
its stdout (JSON).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

READY_TIMEOUT = 120.0  # seconds a child may take to start (imports, on a busy machine)


class _Job:
    """The job as a child sees it: the parties' URLs only."""

    def __init__(self, urls: Mapping[str, str]) -> None:
        self.urls = dict(urls)

    def url(self, role: str) -> str:
        return self.urls[role]


class ApartCtx:
    """An attack's context in the child (as `bench.hostile.Ctx`): the URLs, the deadline, and
    the parent's SIGTERM as the job's end."""

    def __init__(self, urls: Mapping[str, str], seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self.job, self.spec = _Job(urls), ""
        self.finished = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, self.finished.set)
        self.deadline = loop.time() + seconds

    def going(self) -> bool:
        return not self.finished.is_set() and asyncio.get_running_loop().time() < self.deadline


async def run_apart(ctx: Any, name: str, roles: tuple[str, ...] = ("leader", "follower")) -> Any:
    """Run attack ``name`` in a child process against the job of ``ctx`` (a `Ctx`) until the
    job finishes or the time left to ``ctx.deadline`` has passed since the child was ready;
    its verdict (a dict), or an error verdict when the child
    printed none."""
    loop = asyncio.get_running_loop()
    left = max(1.0, ctx.deadline - loop.time())
    urls = json.dumps({r: ctx.job.url(r) for r in roles})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.hostile", "--apart", name, urls, f"{left:.1f}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        # the child's SIGTERM handler is in place once it says so (its imports take seconds
        # on a busy machine; a SIGTERM before then would kill it without a verdict)
        ready = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT)
        if ready.strip() != b"ready":
            raise RuntimeError(f"attacker process for {name!r} said {ready[:80]!r}")
        until = loop.time() + left  # the attack's full time, counted from its readiness
        while not ctx.finished.is_set() and loop.time() < until and proc.returncode is None:
            await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await proc.communicate()
    lines = out.decode().strip().splitlines()
    if not lines:
        return {"refused_ok": False, "error": f"attacker process exited {proc.returncode}"}
    verdict = json.loads(lines[-1])
    verdict["own_process"] = True
    return verdict


async def child(
    attack: Callable[[ApartCtx], Awaitable[dict[str, Any]]], urls: str, seconds: float
) -> dict[str, Any]:
    """The child's side: run ``attack`` against ``urls`` (JSON: role -> URL)."""
    ctx = ApartCtx(json.loads(urls), seconds)
    print("ready", flush=True)
    return await attack(ctx)
