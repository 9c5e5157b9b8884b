"""The `tandem` command line. The only place in Tandem that creates an event loop.

Each feature registers its sub-commands through a ``register(subparsers)`` function that sets
``func`` (an ``async def`` taking the parsed args and returning an exit code) on its parsers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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

#: The top-level commands each of `COMMAND_MODULES` registers (tests check the two agree).
#: A command line naming one of them imports only its module: a command module may import
#: its system's stack (JAX, optax, pydantic models), and an FL client has no use for split
#: learning's or elastic training's.
COMMANDS = {
    "demo": "tandem.parties.split.process.cli",
    "party": "tandem.parties.split.process.cli",
    "predict": "tandem.parties.split.process.cli",
    "elastic": "tandem.parties.elastic.cli",
    "fl": "tandem.parties.fl.cli",
    "align": "tandem.parties.alignment.cli",
    "config": "tandem.parties.cli.config_cmd",
    "keys": "tandem.parties.cli.keys_cmd",
}


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


def command_modules(argv: Sequence[str] | None) -> list[str]:
    """The modules to register for ``argv``: the one whose command ``argv`` names (its first
    word that is not an option), else all of them (no command, ``--help``, or a word that is
    no command: argparse then lists every command)."""
    first = next((a for a in argv or () if not a.startswith("-")), None)
    return [COMMANDS[first]] if first in COMMANDS else COMMAND_MODULES


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``tandem`` parser: every command, or with ``argv`` only the one it names (its
    module alone is imported, see `COMMANDS`)."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Train one model across parties that do not share their data.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES if argv is None else command_modules(argv):
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
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


def entry() -> int:
    """The process's entry point (the ``tandem`` script, ``python -m tandem``): `main`, then
    `gc.freeze` before the interpreter exits.

    At exit the interpreter runs a full garbage collection over every object still alive
    (JAX's, XLA's and numpy's, every imported module's) only to free memory the OS takes back
    anyway: about 0.3 CPU-s of a short ``tandem party`` run, some 15 % of its CPU time. Frozen
    objects are left out of that collection. Atexit handlers still run and the standard
    streams are still flushed; what is skipped is finalizing objects still alive at exit,
    which Python does not promise anyway. Only here: `main` is also called in a running
    process (tests, embedding applications), whose garbage must stay collectable."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(entry())
