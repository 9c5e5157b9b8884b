"""The commands' progress bars and results: bars (rich) always on stderr, so stdout carries
only results (each command's final JSON line, `emit_result`) and ``tandem demo | jq`` works
whether or not stderr is a terminal."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported by the commands that draw a bar, not by the others
    from rich.progress import Progress, ProgressColumn


def progress_bar(*columns: str | ProgressColumn, enabled: bool = True) -> Progress:
    """A `rich.progress.Progress` drawing on stderr; a no-op display when not ``enabled``.
    ``columns`` as for ``Progress`` (none: rich's default columns)."""
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(stderr=True), disable=not enabled)


def emit_result(result: Any) -> None:
    """Print a command's result, one JSON line on stdout, in one write: parties started from
    one shell with a shared stdout then never interleave inside each other's lines."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
