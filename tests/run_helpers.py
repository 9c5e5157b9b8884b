"""Running a benchmark the way a user does, for the tests of the benchmarks: ``python -m
bench.NAME ...`` in the repository root, with this environment, and its JSON line parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_bench(
    module: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Run ``python -m bench.<module> *args`` (in ``env``, default this process's); it must
    exit 0. Returns the last line of its stdout parsed as JSON, and every non-empty stdout
    line (a benchmark prints results only)."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    lines = [line for line in done.stdout.decode().splitlines() if line.strip()]
    assert lines, done.stderr.decode()[-3000:]
    return json.loads(lines[-1]), lines


def bench_refuses(module: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``python -m bench.<module> *args`` (in ``env``, default this process's), which must
    fail before printing anything on stdout; returns its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode != 0 and done.stdout == "", done
    return done.stderr
