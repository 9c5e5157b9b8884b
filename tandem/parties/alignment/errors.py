"""Errors of private sample alignment. All derive from `tandem.errors.TandemError`.

`IdError` (an id that has no canonical encoding) is the data layer's, a
`tandem.parties.data.DataError`: the PSI raises it, so it is offered here too.
"""

from __future__ import annotations

from tandem.errors import TandemError
from tandem.parties.data.errors import IdError


class AlignmentError(TandemError):
    """Root of alignment errors."""


class ProtocolError(AlignmentError):
    """The peer sent a frame that does not follow the PSI protocol (wrong shape, order, count,
    version, or a point that is not on the curve). The alignment is aborted; the transport is
    left serving."""


class AlignmentMismatchError(AlignmentError):
    """The two parties ended with different intersections (size or commitment), or a task spec
    records an alignment that differs from the local one. Re-run the alignment on both sides."""


class AlignmentConfigError(AlignmentError, ValueError):
    """An argument of `align` is out of range (the message names it and the accepted values)."""


__all__ = [
    "AlignmentConfigError",
    "AlignmentError",
    "AlignmentMismatchError",
    "IdError",
    "ProtocolError",
]
