"""Running a benchmark the way a user does, for the tests of the benchmarks: ``python -m
bench.NAME ...`` in the repository root, with this environment, and its JSON line parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _fast_compile_flags() -> str:
    """XLA's CPU code generation without its MLIR fusion emitters (the elemental emitters
    instead): the benchmarks' kernels compile in about half the CPU time. jaxlib 0.6 has the
    flag (0.5.0 has not, and XLA stops at an unknown flag); older ones get no flag and compile
    as usual."""
    try:
        major, minor = (int(p) for p in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return ""
    return "--xla_cpu_use_fusion_emitters=false" if (major, minor) >= (0, 6) else ""


#: the XLA flag the whole session compiles with (tests/conftest.py puts it in ``XLA_FLAGS``,
#: which every process the tests start inherits): kernels compile in about half the CPU time.
#: The tests read results, invariants and relations that hold whatever the compiler emits
#: (every side of a comparison compiled alike), never a speed; the benchmarks users run keep
#: XLA's defaults, under which the kernels run faster (`bench.scale` at 1M rows trained about
#: a fifth slower with this flag)
FAST_COMPILE_XLA_FLAGS = _fast_compile_flags()


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
