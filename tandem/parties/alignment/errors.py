"""Errors of private sample alignment. All derive from `tandem.errors.TandemError`."""

from __future__ import annotations

from tandem.errors import TandemError


class AlignmentError(TandemError):
    """Root of alignment errors."""


class IdError(AlignmentError, ValueError):
    """An id has a type or value that cannot be encoded canonically (the message names it)."""


class ProtocolError(AlignmentError):
    """The peer sent a frame that does not follow the PSI protocol (wrong shape, order, count,
    version, or a point that is not on the curve). The alignment is aborted; the transport is
    left serving."""


class AlignmentMismatchError(AlignmentError):
    """The two parties ended with different intersections (size or commitment), or a task spec
    records an alignment that differs from the local one. Re-run the alignment on both sides."""


class AlignmentConfigError(AlignmentError, ValueError):
    """An argument of `align` is out of range (the message names it and the accepted values)."""
