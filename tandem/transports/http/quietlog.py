"""`QuietLog`: one line per refused or malformed request, rate-limited, never a traceback.

A party facing a hostile network must not let whoever sends garbage fill its log (a traceback
is ~500 bytes per request) or drown what matters. `QuietLog` wraps a logger: every record
becomes one line (an exception is summarised as ``Type: message``, cut at `MAX_LINE`
characters), and at most ``burst`` lines go out per ``interval`` seconds; the lines dropped
meanwhile are counted and reported by the next line that goes out; ``ceiling`` caps the level
(what a stranger's garbage causes is at most a warning). It is handed to aiohttp as its
server logger too, so the parser's "Error handling request" lines follow the same rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

MAX_LINE = 300  # characters of one logged line


class QuietLog(logging.LoggerAdapter):
    """A logger adapter that logs at most ``burst`` one-line records per ``interval`` s."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        interval: float = 10.0,
        ceiling: int = logging.CRITICAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(logger, {})
        self.burst, self.interval, self.ceiling, self._clock = burst, interval, ceiling, clock
        self._window_start = float("-inf")
        self._sent = 0
        self.suppressed = 0  # lines dropped since the last one that went out

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        level = min(level, self.ceiling)
        if not self.isEnabledFor(level):
            return
        now = self._clock()
        if now - self._window_start >= self.interval:
            self._window_start, self._sent = now, 0
        if self._sent >= self.burst:
            self.suppressed += 1
            return
        self._sent += 1
        exc = kwargs.pop("exc_info", None)
        kwargs.pop("stack_info", None)
        try:
            line = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):
            line = f"{msg} {args!r}"
        summary = _summary(exc)
        if summary:
            line = f"{line}: {summary}"
        if self.suppressed:
            line += f" ({self.suppressed} similar lines suppressed)"
            self.suppressed = 0
        line = line.replace("\n", " ").replace("\r", " ")
        if len(line) > MAX_LINE:
            line = line[: MAX_LINE - 3] + "..."
        self.logger.log(level, "%s", line, stacklevel=2)


def _summary(exc: Any) -> str:
    """``Type: message`` of the exception ``exc_info`` refers to ("" for none)."""
    if exc is True:
        import sys

        exc = sys.exc_info()[1]
    elif isinstance(exc, tuple):
        exc = exc[1]
    if not isinstance(exc, BaseException):
        return ""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
