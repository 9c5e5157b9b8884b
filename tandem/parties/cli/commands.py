"""The `tandem` command line. The only place in Tandem that creates an event loop.

Each feature registers its sub-commands through a ``register(subparsers)`` function that sets
``func`` (an ``async def`` taking the parsed args and returning an exit code) on its parsers.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from tandem import __version__
from tandem.errors import ConfigError

from .allocator import tune_allocator

#: Modules providing ``register(subparsers)``; each adds its own sub-commands.
COMMAND_MODULES = [
    "tandem.parties.split.process.cli",
    "tandem.parties.elastic.cli",
    "tandem.parties.fl.cli",
    "tandem.parties.alignment.cli",
    "tandem.parties.cli.config_cmd",
    "tandem.parties.cli.keys_cmd",
]


def run_async(
    main: Callable[[], Coroutine[Any, Any, int]], *, colocate_threads: bool = False
) -> int:
    """Run ``main()`` on a new event loop: uvloop when installed, asyncio otherwise.

    First tunes the C allocator for the receive path
    (`tandem.parties.cli.allocator.tune_allocator`) and, with ``colocate_threads`` (the commands
    that run the split-learning pipeline), pins the loop's thread and so the compute lanes it
    starts to one CPU (`tandem.parties.cli.affinity.colocate_python_threads`;
    ``TANDEM_PYTHON_CPU=off`` turns it off): this is the process's entry point, the one place a
    process-wide setting belongs."""
    tune_allocator()
    if colocate_threads:
        from .affinity import colocate_python_threads

        colocate_python_threads()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platform without uvloop
        return asyncio.run(main())
    return uvloop.run(main())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Train one model across parties that do not share their data.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run_async(
            lambda: args.func(args), colocate_threads=getattr(args, "colocate_threads", False)
        )
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:  # a process-wide setting refused before the command started
        print(f"tandem: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
