"""Split-learning sub-commands (filled in by the split-learning roles)."""

from __future__ import annotations


def register(sub) -> None:  # replaced when the split parties land
    pass
