"""The commands' progress bars: rich, always on stderr, so stdout carries only results (each
command's final JSON line) and ``tandem demo | jq`` works whether or not stderr is a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, ProgressColumn


def progress_bar(*columns: str | ProgressColumn, enabled: bool = True) -> Progress:
    """A `rich.progress.Progress` drawing on stderr; a no-op display when not ``enabled``.
    ``columns`` as for ``Progress`` (none: rich's default columns)."""
    return Progress(*columns, console=Console(stderr=True), disable=not enabled)
