"""How the split-learning commands (``tandem party``, ``tandem predict``) report a failure:
one line on stderr and an exit code that says whose fault it was."""

from __future__ import annotations

import json
import sys

from tandem.errors import ConfigError, TandemError


def _first(exc: BaseException) -> BaseException:
    """``exc``, or the first leaf exception of a (nested) exception group."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def report_error(prefix: str, exc: BaseException) -> int:
    """Print a command's failure as ``prefix: message`` on stderr and return its exit code:
    2 for a configuration error (the user must fix an input), 1 for any other Tandem or OS
    error. Anything else (a bug) is re-raised, as are exception groups holding one."""
    err = _first(exc)
    if not isinstance(err, (TandemError, OSError)):
        raise exc
    print(f"{prefix}: {err}", file=sys.stderr)
    return 2 if isinstance(err, ConfigError) else 1


def report_error_json(exc: BaseException, code: int, *, party: str | None) -> None:
    """The machine-readable twin of `report_error`: one JSON line on stderr,
    ``{"status": "error", "party", "reason", "exit_code"}`` (stdout carries results only)."""
    line = {"status": "error", "party": party, "reason": str(_first(exc)), "exit_code": code}
    print(json.dumps(line), file=sys.stderr, flush=True)
